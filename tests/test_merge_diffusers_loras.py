"""merge-lora of a diffusers-format LoRA (PEFT adapter saved by the pipeline's `save_lora_weights`) onto
each family's original-layout base, as one table driving one test.

Each case: (tiny diffusers model, seed, the converter that is the oracle of the original layout, pipeline,
LoRA target modules, ratio, the base file's key prefix, the expected count of changed diffusers tensors:
exact, or a floor where the count depends on how diffusers spreads a module). The base is the original
layout made from the family's pairs, checked by the converter (it gives the model's state dict back bit for
bit; HunyuanVideo 1.5 has no diffusers converter, so its pairs stand in, checked in
tests/test_families_hunyuan15.py); the oracle is diffusers' own `lora_state_dict` + `load_lora_adapter` +
`fuse_lora(lora_scale=ratio)` on a fresh model. Checked on every case: the merged file holds the base's
keys, merge-lora reports the number of original tensors it changed, and the merged weights through the
converter equal diffusers' fused ones (fp32: rtol 1e-5, atol 1e-6, only the summation order differs).
The other directions (original-named LoRAs onto diffusers folders) stay in the family modules' own tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

import families_util as fu
from helpers.merge_compare import compare, diffusers_fused, peft_lora_file
from ckpt import families

diffusers = pytest.importorskip("diffusers")
PREFIX = "model.diffusion_model."


def _sfu(name: str, constants: dict | None = None) -> Callable[[], Callable]:
    """diffusers' single-file converter NAME (with a release's hard-coded widths replaced by the tiny model's)."""
    def make():
        from diffusers.loaders import single_file_utils

        fn = getattr(single_file_utils, name)
        return fu.with_constants(fn, constants) if constants else fn

    return make


def _pairs_back(family_id: str) -> Callable[[], Callable]:
    return lambda: (lambda sd: fu.diffusers_from_pairs(families.get(family_id), sd))


@dataclass
class Case:
    family_id: str
    make: Callable
    seed: int
    converter: Callable[[], Callable]  # -> original state dict to the diffusers one
    pipeline: str
    targets: list | str
    ratio: float
    prefix: str = PREFIX
    exact: int | None = None  # changed diffusers tensors, exactly
    at_least: int | None = None  # ... or at least this many
    checked: bool = True  # the converter gives the model's state dict back from the original layout
    keys: tuple = ()  # original names the pairs must give (the issue's own case, for Wan)


CASES = {
    "chroma": Case("chroma", fu.tiny_chroma, 0,
                   _sfu("convert_chroma_transformer_checkpoint_to_diffusers", {3072: 16}), "ChromaPipeline",
                   ["to_q", "to_k", "to_v", "add_q_proj", "add_v_proj", "proj_mlp", "proj_out", "ff.net.0.proj",
                    "linear_1", "x_embedder", "context_embedder", "to_add_out"], 0.7,
                   exact=22),  # every target module of every block
    "z_image": Case("z_image", fu.tiny_z_image, 2, _sfu("convert_z_image_transformer_checkpoint_to_diffusers"),
                    "ZImagePipeline",
                    r".*(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.w[13]|(layers|noise_refiner)\.\d+\."
                    r"adaLN_modulation\.0|all_final_layer\.2-1\.linear|all_x_embedder\.2-1|cap_embedder\.1)", 0.8,
                    exact=4 * (4 + 2) + 3 + 3),  # 4 blocks, 3 modulated, 3 top-level
    "lumina2": Case("lumina2", fu.tiny_lumina2, 5, _sfu("convert_lumina2_to_diffusers", {2304: 32, 768: 16}),
                    "Lumina2Pipeline",
                    r".*(attn\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.linear_[12]|norm1\.linear|norm_out\.linear_[12]"
                    r"|x_embedder|caption_embedder\.1|timestep_embedder\.linear_1)", 1.3,
                    exact=6 * (4 + 2) + 4 + 5),  # 6 blocks, 4 modulated, 5 top-level
    "wan": Case("wan", lambda: fu.tiny_wan("i2v"), 0, _sfu("convert_wan_transformer_to_diffusers"), "WanPipeline",
                ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ffn.net.0.proj", "ffn.net.2",
                 "proj_out", "time_proj"], 0.7, at_least=2 * 10 + 2,
                keys=("blocks.0.self_attn.q.weight", "blocks.0.norm3.weight")),
    "wan-bare": Case("wan", lambda: fu.tiny_wan("i2v"), 0, _sfu("convert_wan_transformer_to_diffusers"),
                     "WanPipeline", ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ffn.net.0.proj",
                                     "ffn.net.2", "proj_out", "time_proj"], 0.7, prefix="", at_least=2 * 10 + 2),
    "flux2": Case("flux2", fu.tiny_flux2, 2, _sfu("convert_flux2_transformer_checkpoint_to_diffusers"),
                  "Flux2Pipeline",
                  ["to_q", "to_k", "to_v", "add_q_proj", "add_v_proj", "to_qkv_mlp_proj", "ff.linear_in",
                   "ff_context.linear_out", "to_out.0", "norm_out.linear", "proj_out", "single_stream_modulation.linear"],
                  0.5, at_least=12),
    "hunyuan_video15": Case("hunyuan_video15", fu.tiny_hunyuan_video15, 5, _pairs_back("hunyuan_video15"),
                            "HunyuanVideoPipeline",
                            ["to_q", "to_k", "add_v_proj", "to_out.0", "ff.net.0.proj", "norm1_context.linear",
                             "norm_out.linear", "context_embedder_2.linear_1", "image_embedder.linear_2",
                             "time_embed.timestep_embedder.linear_1"], 0.8, at_least=20, checked=False),
    "ltx_video": Case("ltx_video", fu.tiny_ltx_video, 8, _sfu("convert_ltx_transformer_checkpoint_to_diffusers"),
                      "LTXPipeline", ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "proj_in",
                                      "time_embed.linear", "caption_projection.linear_1"], 0.9, at_least=8),
    "ltx2": Case("ltx2", fu.tiny_ltx2, 8, _sfu("convert_ltx2_transformer_to_diffusers"), "LTX2Pipeline",
                 ["to_q", "to_v", "to_out.0", "ff.net.0.proj", "audio_ff.net.2", "proj_in", "audio_proj_in",
                  "time_embed.linear", "av_cross_attn_video_scale_shift.linear", "audio_caption_projection.linear_1"],
                 0.9, at_least=10),
}


@pytest.mark.parametrize("case_id", list(CASES))
def test_diffusers_lora_onto_original_base(tmp_path, run_ckpt, case_id):
    case = CASES[case_id]
    convert = case.converter()
    torch.manual_seed(case.seed)
    model = case.make()
    base_sd = fu.state_dict(model)
    original = fu.original_from_pairs(families.get(case.family_id), base_sd)
    assert all(k in original for k in case.keys)
    if case.checked:
        back = convert({k: v.clone() for k, v in original.items()})
        assert set(back) == set(base_sd) and all(torch.equal(back[k], base_sd[k]) for k in base_sd)
    save_file({case.prefix + k: v for k, v in original.items()}, tmp_path / "base.safetensors")
    pipeline = getattr(diffusers, case.pipeline)
    lora = peft_lora_file(model, case.targets, tmp_path / "lora", pipeline)
    want = diffusers_fused(case.make, base_sd, lora, pipeline, case.ratio)

    out = tmp_path / "out.safetensors"
    code, stdout, err = run_ckpt("merge-lora", tmp_path / "base.safetensors", lora, "--ratio", str(case.ratio),
                                 "-o", out, "-q")
    assert code == 0, err
    merged = {k[len(case.prefix):]: v for k, v in load_file(out).items()}
    assert set(merged) == set(original)
    changed_original = sum(not torch.equal(merged[k], original[k]) for k in original)
    assert f"base tensors changed: {changed_original}" in stdout, stdout
    changed = compare(convert(merged), want, base_sd)
    if case.exact is not None:
        assert changed == case.exact
    else:
        assert changed >= case.at_least
