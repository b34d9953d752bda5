"""Model knowledge lives in `ckpt.families` (issue #21 item 5): ComfyUI-GGUF's storage rule of every
architecture it writes is a family module's `gguf` field (no table of its own in the GGUF writer), the
llama.cpp LLM architecture facts are `ckpt.families.llm`, the SD pipelines' parts `ckpt.families.pipelines`,
and the family loader needs no list of modules to skip."""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest

import ckpt.families as families_pkg
from ckpt import families
from ckpt.targets.planners import gguf_out
from ckpt.errors import CkptError
from ckpt.families.spec import Family

COMFYUI_GGUF_ARCHS = {"flux", "sd3", "wan", "sd1", "sdxl", "lumina2", "hidream", "qwen_image", "aura", "cosmos",
                      "ltxv", "hyvid"}


def test_loader_reads_every_family_module_and_passes_over_helpers():
    """Every top-level module with a FAMILY is registered; helpers (no FAMILY) import and are passed over;
    subpackages hold knowledge that is no Family."""
    registered = {id(f) for f in families.all_families()}
    for info in pkgutil.iter_modules(families_pkg.__path__):
        mod = importlib.import_module(f"ckpt.families.{info.name}")
        fam = getattr(mod, "FAMILY", None)
        if info.ispkg:
            assert fam is None, info.name
        elif isinstance(fam, Family):
            assert id(fam) in registered, info.name
    assert families.get("auraflow") is not None and families.get("cosmos") is not None


def test_every_comfyui_gguf_architecture_is_a_family_modules():
    assert set(gguf_out.known_archs()) == COMFYUI_GGUF_ARCHS
    assert not hasattr(gguf_out, "PENDING")


def _aura():
    keys = ["init_x_linear.weight", "positional_encoding", "register_tokens", "cond_seq_linear.weight",
            "t_embedder.mlp.0.weight", "modF.1.weight", "final_linear.weight"]
    for b in range(4):
        keys += [f"double_layers.{b}.{m}.weight" for m in ("modC.1", "modX.1", "attn.w1q", "mlpX.c_fc1")]
    keys += [f"single_layers.0.{m}.weight" for m in ("modCX.1", "attn.w1q", "mlp.c_fc1")]
    return keys


def _cosmos():
    keys = ["x_embedder.proj.1.weight", "t_embedder.1.linear_1.weight", "t_embedding_norm.weight",
            "pos_embedder.seq", "accum_video_sample_counter", "final_layer.linear.weight"]
    for b in range(2):
        keys += [f"blocks.{b}.{m}" for m in ("self_attn.q_proj.weight", "cross_attn.k_proj.weight", "mlp.layer1.weight",
                                              "mlp.layer2.weight", "layer_norm_self_attn._extra_state",
                                              "adaln_modulation_cross_attn.1.weight", "adaln_modulation_mlp.1.weight")]
    return keys


def _ltx():
    keys = ["patchify_proj.weight", "adaln_single.linear.weight", "adaln_single.emb.timestep_embedder.linear_2.weight",
            "caption_projection.linear_2.weight", "proj_out.weight", "scale_shift_table"]
    for b in range(2):
        keys += [f"transformer_blocks.{b}.{m}" for m in ("attn1.to_q.weight", "attn1.q_norm.weight",
                                                          "attn2.to_k.weight", "ff.net.0.proj.weight",
                                                          "scale_shift_table")]
    return keys


def _hyvid():
    keys = ["img_in.proj.weight", "txt_in.input_embedder.weight", "time_in.mlp.0.weight", "final_layer.linear.weight",
            "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight"]
    keys += [f"double_blocks.0.{m}.weight" for m in ("img_attn_qkv", "img_attn_proj", "img_mod.linear", "img_mlp.fc1",
                                                      "img_attn_q_norm")]
    keys += [f"single_blocks.0.{m}.weight" for m in ("linear1", "linear2", "modulation.linear")]
    return keys


# (keys, arch, F32 names, names kept unquantized, names left out, names quantized): ComfyUI-GGUF's rules
CASES = {
    "auraflow": (_aura, "aura", (), ("init_x_linear.weight", "t_embedder.mlp.0.weight", "modF.1.weight",
                                 "cond_seq_linear.weight", "final_linear.weight"), (),
             ("double_layers.0.modX.1.weight", "single_layers.0.attn.w1q.weight")),
    "cosmos": (_cosmos, "cosmos", ("pos_embedder.seq",),
               ("x_embedder.proj.1.weight", "t_embedder.1.linear_1.weight", "final_layer.linear.weight"),
               ("accum_video_sample_counter", "blocks.0.layer_norm_self_attn._extra_state",
                "blocks.1.layer_norm_self_attn._extra_state"),
               ("blocks.0.mlp.layer1.weight", "blocks.1.adaln_modulation_cross_attn.1.weight")),
    "ltx_video": (_ltx, "ltxv",
                  ("scale_shift_table", "transformer_blocks.0.scale_shift_table", "transformer_blocks.1.scale_shift_table"),
                  ("patchify_proj.weight", "adaln_single.linear.weight", "caption_projection.linear_2.weight",
                   "proj_out.weight"), (),
                  ("transformer_blocks.0.attn1.to_q.weight", "transformer_blocks.1.ff.net.0.proj.weight")),
    "hunyuan_video": (_hyvid, "hyvid", (), ("img_in.proj.weight", "txt_in.input_embedder.weight",
                                            "time_in.mlp.0.weight", "final_layer.linear.weight",
                                            "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight"), (),
                      ("double_blocks.0.img_attn_qkv.weight", "single_blocks.0.linear1.weight")),
}


@pytest.mark.parametrize("family_id", list(CASES))
def test_gguf_rule_of_the_former_table_families(family_id):
    make, arch, f32, keep, ignore, quantized = CASES[family_id]
    keys = make()
    assert families.detect(keys, {}).family_id == family_id
    rules = gguf_out.rules_for(keys, {})
    assert rules.arch == arch and not rules.reshape
    assert rules.where == f"the {family_id} family module (ckpt/families)"
    def m(name, patterns):  # the writer's test of a name against a rule (searched regexes)
        return any(re.search(p, name) for p in patterns)

    for k in keys:
        assert m(k, rules.f32) == (k in f32), k
        assert m(k, rules.ignore) == (k in ignore), k
        if k in keep:
            assert m(k, rules.keep), k
        if k in quantized:
            assert not m(k, rules.keep) and not m(k, rules.f32), k


def test_unknown_model_names_every_architecture():
    with pytest.raises(CkptError, match="not a diffusion model ComfyUI-GGUF knows") as e:
        gguf_out.rules_for(["foo.weight"], {})
    for arch in COMFYUI_GGUF_ARCHS:
        assert arch in str(e.value)


def test_llm_architecture_facts_are_the_families():
    from ckpt.families.llm import architectures as llm
    from ckpt.quant import gguf_llm

    assert gguf_llm.ARCHS is llm.ARCHS and gguf_llm.SUPPORTED == ", ".join(n for n, a in llm.ALL.items() if a.readable)
    assert llm.ARCHS["llama"].rope_permute and not llm.ARCHS["qwen2"].rope_permute


def test_pipeline_parts_name_registered_families():
    from ckpt.layout import pipeline
    from ckpt.families.pipelines import PIPELINES

    assert pipeline.PIPELINES is PIPELINES
    for kind, (_, parts) in PIPELINES.items():
        for part in parts:
            assert families.get(part.family) is not None, (kind, part)
