"""`ckpt inspect`: detection on real tiny models (diffusers, transformers, PEFT, optimum-quanto) and on
key sets written from the format definitions (LDM/BFL layouts, LyCORIS); counts checked against the
tensors the test saved; NaN/Inf against torch.isnan/isinf."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

G = torch.Generator().manual_seed(0)


def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=G).to(dtype)


def inspect_json(run_ckpt, src, *extra):
    code, out, err = run_ckpt("inspect", src, "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def one(report):
    assert len(report["components"]) == 1
    return report["components"][0]


def save(tmp_path, name, tensors, metadata=None):
    p = tmp_path / name
    save_file(tensors, p, metadata=metadata)
    return p


# ---------------------------------------------------------------- counts, dtypes, metadata, text output


def test_counts_dtypes_and_metadata_match_saved_tensors(tmp_path, run_ckpt):
    tensors = {"a.weight": rnd(6, 5, dtype=torch.float16), "a.bias": rnd(6, dtype=torch.float16),
               "steps": torch.arange(7), "s": torch.tensor(2.0)}
    p = save(tmp_path, "m.safetensors", tensors, {"modelspec.title": "tiny", "ss_tag_frequency": "x" * 500})
    rep = inspect_json(run_ckpt, p)
    c = one(rep)
    assert rep["kind"] == "file" and c["container"] == "safetensors" and c["files"] == ["m.safetensors"]
    assert c["tensors"] == len(tensors)
    assert c["parameters"] == sum(t.numel() for t in tensors.values())
    assert c["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    want = {}
    for t in tensors.values():
        k = {torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64"}[t.dtype]
        d = want.setdefault(k, {"tensors": 0, "parameters": 0, "bytes": 0})
        d["tensors"] += 1
        d["parameters"] += t.numel()
        d["bytes"] += t.numel() * t.element_size()
    assert c["dtypes"] == want
    assert c["metadata"] == {"modelspec.title": "tiny", "ss_tag_frequency": "x" * 500}
    assert c["encodings"] == ["plain"] and c["scan"] is None
    assert rep["warnings"] == []  # the one fp32 tensor is a scalar: not a mixed-dtype hazard
    assert set(rep) == {"source", "path", "kind", "pipeline", "training_checkpoint", "components", "totals",
                        "warnings", "notes"}
    code, out, err = run_ckpt("inspect", p)
    assert code == 0, err
    assert "modelspec.title = tiny" in out and "x" * 100 not in out  # long values cut in text
    assert "fp16" in out and "warning" not in out


def test_mixed_half_and_float_warns(tmp_path, run_ckpt):
    p = save(tmp_path, "m.safetensors", {"a.weight": rnd(4, 4, dtype=torch.float16), "b.weight": rnd(4, 4, dtype=torch.float16),
                                         "norm.weight": rnd(4)})
    rep = inspect_json(run_ckpt, p)
    (w,) = rep["warnings"]
    assert "mixed floating dtypes" in w and "norm.weight" in w and "--to fp16" in w


# ---------------------------------------------------------------- --scan


def test_scan_counts_nan_inf_per_tensor_band_by_band(tmp_path, run_ckpt, monkeypatch):
    a = rnd(50, 3)
    a[3, 1] = a[40, 0] = float("nan")
    a[7, 2] = float("inf")
    b = rnd(9, 2, dtype=torch.bfloat16)
    b[0, 0] = -float("inf")
    c = rnd(20, 4).to(torch.float8_e5m2)
    c[5, 1] = float("inf")
    c[6, 1] = float("nan")
    tensors = {"a": a, "b": b, "c": c, "i": torch.arange(4), "s": torch.tensor(float("nan"))}
    p = save(tmp_path, "m.safetensors", tensors)
    import ckpt.io.output as output
    from ckpt.io.output import bands as real_bands

    seen = []

    def small_bands(t, band_elems=8):  # a few rows per band: the scan must still see every row
        out = list(real_bands(t, band_elems))
        seen.append((t.name, len(out)))
        return iter(out)

    monkeypatch.setattr(output, "bands", small_bands)  # the scan imports the band planner when it runs
    c_ = one(inspect_json(run_ckpt, p, "--scan"))
    assert dict(seen)["a"] > 1
    want_nan = {k: int(torch.isnan(v.float()).sum()) for k, v in tensors.items() if v.is_floating_point()}
    want_inf = {k: int(torch.isinf(v.float()).sum()) for k, v in tensors.items() if v.is_floating_point()}
    assert c_["scan"] == {"tensors": 4, "nan": {k: v for k, v in want_nan.items() if v},
                          "inf": {k: v for k, v in want_inf.items() if v}}
    assert any("NaN values" in w for w in c_["warnings"]) and any("Inf values" in w for w in c_["warnings"])
    code, out, err = run_ckpt("inspect", p, "--scan")
    assert code == 0 and "4 floating tensors read: 4 NaN, 3 Inf" in out
    assert "warning: 4 NaN values in 3 tensors" in out


# ---------------------------------------------------------------- real diffusers / transformers models


def _tiny_unet(sdxl: bool):
    from diffusers import UNet2DConditionModel

    if sdxl:
        return UNet2DConditionModel(
            block_out_channels=(8, 16), layers_per_block=1, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=2048, attention_head_dim=2,
            norm_num_groups=4, sample_size=8, addition_embed_type="text_time", addition_time_embed_dim=4,
            projection_class_embeddings_input_dim=4 * 6 + 2048)
    return UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=768, attention_head_dim=2,
        norm_num_groups=4, sample_size=8)


def test_diffusers_pipeline_folder_per_component(tmp_path, run_ckpt):
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    root = tmp_path / "pipe"
    _tiny_unet(sdxl=False).save_pretrained(root / "unet")
    AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4).save_pretrained(root / "vae")
    CLIPTextModel(CLIPTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=8, bos_token_id=0, eos_token_id=1)
                  ).save_pretrained(root / "text_encoder")
    (root / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    rep = inspect_json(run_ckpt, root)
    assert rep["kind"] == "pipeline" and rep["pipeline"] == "StableDiffusionPipeline"
    comps = {c["name"]: c for c in rep["components"]}
    assert comps["unet"]["family"] == "SD1 UNet (diffusers UNet2DConditionModel)"
    assert comps["unet"]["config_class"] == "UNet2DConditionModel"
    assert comps["vae"]["family"] == "VAE (diffusers AutoencoderKL, 4-channel latents)"
    assert comps["text_encoder"]["family"].startswith("CLIP text encoder (HF CLIPTextModel)")
    assert all(c["kind"] == "model" and c["encodings"] == ["plain"] for c in comps.values())
    assert rep["totals"]["tensors"] == sum(c["tensors"] for c in comps.values())
    code, out, err = run_ckpt("inspect", root)
    assert code == 0 and "[unet]" in out and "StableDiffusionPipeline" in out


def test_diffusers_sdxl_unet(tmp_path, run_ckpt):
    _tiny_unet(sdxl=True).save_pretrained(tmp_path / "unet")
    assert one(inspect_json(run_ckpt, tmp_path / "unet"))["family"] == "SDXL UNet (diffusers UNet2DConditionModel)"


def test_diffusers_flux_and_sd3_transformers(tmp_path, run_ckpt):
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
                           num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8,
                           guidance_embeds=True, axes_dims_rope=(2, 2, 4)).save_pretrained(tmp_path / "flux")
    SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                          num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                          pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16).save_pretrained(tmp_path / "sd3")
    assert one(inspect_json(run_ckpt, tmp_path / "flux"))["family"] == \
        "Flux (dev: guidance embedding) transformer (diffusers FluxTransformer2DModel)"
    assert one(inspect_json(run_ckpt, tmp_path / "sd3"))["family"] == "SD3 transformer (diffusers SD3Transformer2DModel)"


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))


def test_sharded_causal_lm_folder(tmp_path, run_ckpt):
    from safetensors import safe_open

    m = _tiny_llama()
    m.save_pretrained(tmp_path / "llm", max_shard_size="20KB")
    files = sorted(p.name for p in (tmp_path / "llm").glob("*.safetensors"))
    assert len(files) > 1
    c = one(inspect_json(run_ckpt, tmp_path / "llm"))
    assert c["index"] == "model.safetensors.index.json" and sorted(c["files"]) == files
    assert c["family"] == "HF causal LM (Llama-style decoder)" and c["config_class"] == "LlamaForCausalLM"
    saved = {}
    for f in files:
        with safe_open(tmp_path / "llm" / f, "pt") as h:
            saved.update({k: h.get_tensor(k) for k in h.keys()})
    assert c["tensors"] == len(saved) and c["parameters"] == sum(v.numel() for v in saved.values())
    assert c["parameters"] == sum(p.numel() for p in m.state_dict().values())


@pytest.mark.parametrize("wrap", ["", "model."])
def test_causal_lm_keys_under_model_are_no_bundle_prefix(tmp_path, run_ckpt, wrap):
    """An HF causal LM's keys start with `model.` (`model.layers.N...`), and a wrapper (PyTorch Lightning's
    `self.model`) makes them `model.model.layers.N...`: ComfyUI's `model.model.` diffusion-model prefix
    counts only for a diffusion family, so the file stays one unprefixed HF causal LM, no prefix warning."""
    sd = {wrap + k: v.contiguous() for k, v in _tiny_llama().state_dict().items()}
    assert any(k.startswith("model.model.") for k in sd) == bool(wrap)
    rep = inspect_json(run_ckpt, save(tmp_path, "llm.safetensors", sd))
    c = one(rep)
    assert [(p["prefix"], p["family_id"], p["tensors"]) for p in c["parts"]] == [("", "hf_causal_lm", len(sd))]
    assert rep["warnings"] == [] and not [n for n in c["notes"] if "prefix" in n]

    from ckpt.adapters.keymap import build_keymap

    km = build_keymap({k: tuple(v.shape) for k, v in sd.items()})  # PEFT names the wrapped module in full
    t = km.lookup(f"base_model.model.{wrap}model.layers.0.self_attn.q_proj")
    assert t is not None and t.key == f"{wrap}model.layers.0.self_attn.q_proj.weight"


# ---------------------------------------------------------------- LDM / BFL single files (keys from the layouts)


def _ldm_unet(ctx, sdxl=False, prefix="model.diffusion_model."):
    t = {
        "input_blocks.0.0.weight": rnd(4, 4, 3, 3, dtype=torch.float16),
        "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": rnd(4, ctx, dtype=torch.float16),
        "middle_block.1.proj_in.weight": rnd(4, 4, dtype=torch.float16),
        "output_blocks.2.1.transformer_blocks.0.attn2.to_k.weight": rnd(4, ctx, dtype=torch.float16),
        "out.2.weight": rnd(4, 4, 3, 3, dtype=torch.float16),
    }
    if sdxl:
        t["label_emb.0.0.weight"] = rnd(4, 8, dtype=torch.float16)
    return {prefix + k: v for k, v in t.items()}


@pytest.mark.parametrize("ctx,sdxl,label,fid", [(768, False, "SD1 UNet (LDM)", "sd1"),
                                                (1024, False, "SD2 UNet (LDM)", "sd2"),
                                                (2048, True, "SDXL UNet (LDM)", "sdxl"),
                                                (1280, True, "SDXL refiner UNet (LDM)", "sdxl")])
def test_ldm_unet_families(tmp_path, run_ckpt, ctx, sdxl, label, fid):
    p = save(tmp_path, "u.safetensors", _ldm_unet(ctx, sdxl, prefix=""))
    c = one(inspect_json(run_ckpt, p))
    assert c["family"] == label and c["family_id"] == fid and c["layout"] == "original"
    assert c["parts"] == [{"prefix": "", "role": "", "tensors": 5 + sdxl, "family": label, "family_id": fid,
                           "layout": "original"}]
    assert c["warnings"] == []


def test_all_in_one_reports_prefixes_and_meta_tensor_hazard(tmp_path, run_ckpt):
    t = _ldm_unet(2048, sdxl=True)
    t["first_stage_model.encoder.down.0.block.0.conv1.weight"] = rnd(4, 4, 3, 3, dtype=torch.float16)
    t["first_stage_model.encoder.conv_out.weight"] = rnd(8, 4, 3, 3, dtype=torch.float16)
    t["conditioner.embedders.0.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"] = rnd(768, 768, dtype=torch.float16)
    t["conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight"] = rnd(12, 4, dtype=torch.float16)
    t["conditioner.embedders.1.model.token_embedding.weight"] = rnd(3, 1280, dtype=torch.float16)
    rep = inspect_json(run_ckpt, save(tmp_path, "sdxl.safetensors", t))
    c = one(rep)
    parts = {p["prefix"]: p for p in c["parts"]}
    assert parts["model.diffusion_model."]["family"] == "SDXL UNet (LDM)" and parts["model.diffusion_model."]["tensors"] == 6
    assert parts["first_stage_model."]["family"] == "VAE (LDM, 4-channel latents)"
    assert parts["conditioner.embedders.0."]["family"] == "CLIP-L text encoder (HF CLIPTextModel)"
    assert parts["conditioner.embedders.1."]["family"] == "OpenCLIP-bigG text encoder (OpenCLIP)"
    assert c["family"].startswith("all-in-one: SDXL UNet (LDM) + ")
    # the classic SD single file is what SD trainers read: a note, not a warning
    assert rep["warnings"] == []
    (n,) = [n for n in c["notes"] if "prefixes" in n]
    assert "LDM single-file prefixes model.diffusion_model. (6), first_stage_model. (2)" in n
    # a Flux model under the same prefix is the kohya #1498 failure: a warning
    flux = {"model.diffusion_model.double_blocks.0.img_attn.qkv.weight": rnd(12, 4, dtype=torch.bfloat16),
            "model.diffusion_model.single_blocks.0.linear1.weight": rnd(12, 4, dtype=torch.bfloat16)}
    rep = inspect_json(run_ckpt, save(tmp_path, "flux.safetensors", flux))
    (w,) = rep["warnings"]
    assert "bundle prefixes model.diffusion_model. (2)" in w and "Cannot copy out of meta tensor" in w


def test_comfy_bundle_text_encoders_and_vae(tmp_path, run_ckpt):
    t = {"model.diffusion_model.double_blocks.0.img_attn.qkv.weight": rnd(12, 4, dtype=torch.bfloat16),
         "model.diffusion_model.single_blocks.0.linear1.weight": rnd(12, 4, dtype=torch.bfloat16),
         "text_encoders.clip_l.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight": rnd(4, 4, dtype=torch.bfloat16),
         "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight": rnd(4, 4, dtype=torch.bfloat16),
         "vae.decoder.up.0.block.0.conv1.weight": rnd(4, 4, 3, 3, dtype=torch.bfloat16)}
    c = one(inspect_json(run_ckpt, save(tmp_path, "flux_aio.safetensors", t)))
    fam = {p["prefix"]: p["family"] for p in c["parts"]}
    assert fam == {"model.diffusion_model.": "Flux transformer (BFL)", "text_encoders.clip_l.": "CLIP text encoder (HF CLIPTextModel)",
                   "text_encoders.t5xxl.": "T5 encoder", "vae.": "VAE (LDM)"}
    assert any("text_encoders.t5xxl. (1)" in w for w in c["warnings"])


def test_bfl_flux_dev_schnell_and_sd3(tmp_path, run_ckpt):
    flux = {"double_blocks.0.img_attn.qkv.weight": rnd(12, 4), "double_blocks.0.txt_mlp.0.weight": rnd(8, 4),
            "single_blocks.0.linear1.weight": rnd(20, 4), "img_in.weight": rnd(4, 4)}
    c = one(inspect_json(run_ckpt, save(tmp_path, "schnell.safetensors", flux)))
    assert c["family"] == "Flux transformer (BFL)" and c["warnings"] == []
    flux["guidance_in.in_layer.weight"] = rnd(4, 4)
    assert one(inspect_json(run_ckpt, save(tmp_path, "dev.safetensors", flux)))["family"] == "Flux (dev: guidance embedding) transformer (BFL)"
    sd3 = {"joint_blocks.0.context_block.attn.qkv.weight": rnd(12, 4), "joint_blocks.0.x_block.attn.qkv.weight": rnd(12, 4),
           "x_embedder.proj.weight": rnd(4, 4, 2, 2)}
    assert one(inspect_json(run_ckpt, save(tmp_path, "sd3.safetensors", sd3)))["family"] == "SD3 MMDiT (BFL/SAI)"


# ---------------------------------------------------------------- LoRA families


def test_kohya_lora_sd1_and_locon(tmp_path, run_ckpt):
    base = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k"
    t = {f"{base}.lora_down.weight": rnd(4, 768, dtype=torch.float16), f"{base}.lora_up.weight": rnd(320, 4, dtype=torch.float16),
         f"{base}.alpha": torch.tensor(4.0, dtype=torch.float16),
         "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": rnd(4, 768, dtype=torch.float16),
         "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": rnd(768, 4, dtype=torch.float16),
         "lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha": torch.tensor(4.0, dtype=torch.float16)}
    c = one(inspect_json(run_ckpt, save(tmp_path, "l.safetensors", t, {"ss_network_module": "networks.lora"})))
    assert c["kind"] == "lora" and c["lora"]["types"] == ["kohya LoRA"]
    assert c["lora"]["modules"] == 2 and c["lora"]["ranks"] == [4] and c["lora"]["alpha_keys"] == 2
    assert c["lora"]["targets"] == ["CLIP-L text encoder (HF CLIPTextModel)", "SD1 UNet (diffusers UNet2DConditionModel)"]
    assert c["family"].startswith("LoRA for SD1 UNet (diffusers UNet2DConditionModel)")
    assert c["warnings"] == []  # kohya LoRA prefixes are not bundle prefixes
    conv = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k"
    t2 = {f"{conv}.lora_down.weight": rnd(8, 2048), f"{conv}.lora_up.weight": rnd(640, 8),
          "lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight": rnd(8, 320, 3, 3),
          "lora_unet_input_blocks_1_0_in_layers_2.lora_up.weight": rnd(320, 8, 1, 1),
          "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": rnd(8, 1280),
          "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": rnd(5120, 8)}
    c = one(inspect_json(run_ckpt, save(tmp_path, "locon.safetensors", t2)))
    assert c["lora"]["types"] == ["kohya LoCon"] and c["lora"]["ranks"] == [8]
    assert "SDXL UNet (LDM)" in c["lora"]["targets"] and "OpenCLIP-bigG text encoder (HF CLIPTextModel)" in c["lora"]["targets"]


def test_peft_lora_dora_and_ia3_from_real_peft(tmp_path, run_ckpt):
    from peft import IA3Config, LoraConfig, get_peft_model, get_peft_model_state_dict

    for name, cfg, kinds in [
        ("lora", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), ["PEFT/diffusers LoRA"]),
        ("dora", LoraConfig(r=2, target_modules=["q_proj"], use_dora=True), ["DoRA", "PEFT/diffusers LoRA"]),
        ("ia3", IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]), ["(IA)^3"]),
    ]:
        pm = get_peft_model(_tiny_llama(), cfg)
        pm.save_pretrained(tmp_path / name)
        c = one(inspect_json(run_ckpt, tmp_path / name))
        assert c["kind"] == "lora" and c["lora"]["types"] == kinds, name
        n_sd = len(get_peft_model_state_dict(pm))
        assert c["tensors"] == n_sd
        assert c["lora"]["targets"] == ["HF causal LM (Llama-style decoder)"], name
        assert [p["prefix"] for p in c["parts"]] == ["base_model.model."]
        if name == "lora":
            assert c["lora"]["ranks"] == [4] and c["lora"]["adapter_config"]["lora_alpha"] == 8


def test_diffusers_unet_lora_from_peft(tmp_path, run_ckpt):
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    unet = _tiny_unet(sdxl=True)
    unet.add_adapter(LoraConfig(r=2, target_modules=["to_q", "to_k", "to_v"]))
    sd = {"unet." + k: v.contiguous() for k, v in get_peft_model_state_dict(unet).items()}
    c = one(inspect_json(run_ckpt, save(tmp_path, "pytorch_lora_weights.safetensors", sd)))
    assert c["lora"]["types"] == ["PEFT/diffusers LoRA"] and c["lora"]["ranks"] == [2]
    assert c["lora"]["targets"] == ["SDXL UNet (diffusers UNet2DConditionModel)"]
    assert c["parts"][0]["prefix"] == "unet."


def test_lycoris_and_xlabs_key_sets(tmp_path, run_ckpt):
    m = "lora_unet_double_blocks_0_img_attn_qkv"
    cases = {
        "LyCORIS LoHa": {f"{m}.hada_w1_a": rnd(12, 2), f"{m}.hada_w1_b": rnd(2, 4), f"{m}.hada_w2_a": rnd(12, 2),
                         f"{m}.hada_w2_b": rnd(2, 4), f"{m}.alpha": torch.tensor(2.0)},
        "LyCORIS LoKr": {f"{m}.lokr_w1": rnd(2, 2), f"{m}.lokr_w2_a": rnd(6, 2), f"{m}.lokr_w2_b": rnd(2, 2),
                         f"{m}.alpha": torch.tensor(2.0)},
        "LyCORIS full diff": {f"{m}.diff": rnd(12, 4), f"{m}.diff_b": rnd(12)},
        "XLabs Flux LoRA": {"double_blocks.0.processor.qkv_lora1.down.weight": rnd(4, 8),
                            "double_blocks.0.processor.qkv_lora1.up.weight": rnd(24, 4),
                            "double_blocks.0.processor.proj_lora2.down.weight": rnd(4, 8),
                            "double_blocks.0.processor.proj_lora2.up.weight": rnd(8, 4)},
    }
    for kind, t in cases.items():
        c = one(inspect_json(run_ckpt, save(tmp_path, f"{kind.split()[-1]}.safetensors", t)))
        assert c["kind"] == "lora" and c["lora"]["types"] == [kind], kind
        assert c["lora"]["targets"] == ["Flux transformer (BFL)"], kind
    dora = {f"{m}.lora_down.weight": rnd(2, 4), f"{m}.lora_up.weight": rnd(12, 2), f"{m}.dora_scale": rnd(12, 1)}
    c = one(inspect_json(run_ckpt, save(tmp_path, "dora.safetensors", dora)))
    assert c["lora"]["types"] == ["DoRA", "kohya LoRA"]


# ---------------------------------------------------------------- FP8 and quantized weights


def test_fp8_plain_and_comfy_scaled(tmp_path, run_ckpt):
    w = rnd(8, 4).to(torch.float8_e4m3fn)
    c = one(inspect_json(run_ckpt, save(tmp_path, "p.safetensors", {"a.weight": w, "a.bias": rnd(8, dtype=torch.bfloat16)})))
    assert c["encodings"] == ["fp8_e4m3fn (plain, no scales)"]
    assert any("1 tensor stored as fp8_e4m3fn" in x for x in c["warnings"])
    scaled = {"scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn), "a.weight": w, "a.scale_weight": torch.tensor(0.5),
              "b.weight": w.clone(), "b.scale_weight": torch.tensor(2.0), "b.bias": rnd(8, dtype=torch.bfloat16)}
    c = one(inspect_json(run_ckpt, save(tmp_path, "s.safetensors", scaled)))
    assert "comfy-scaled-fp8" in c["encodings"] and c["dtypes"]["fp8_e4m3fn"]["tensors"] == 3
    assert not any("mixed" in x for x in c["warnings"])  # fp32 scales are part of the layout


def test_fp8_layouts_named_by_the_decoders(tmp_path, run_ckpt):
    w = rnd(8, 4).to(torch.float8_e4m3fn)
    kohya = {"a.weight": w, "a.scale_weight": rnd(8, 1, dtype=torch.bfloat16), "a.bias": rnd(8, dtype=torch.bfloat16),
             "n.weight": rnd(8, dtype=torch.bfloat16)}
    c = one(inspect_json(run_ckpt, save(tmp_path, "k.safetensors", kohya)))
    assert c["encodings"][0] == "kohya-fp8-scaled" and "fp8_e4m3fn" in c["encodings"]
    folder = tmp_path / "hf"
    folder.mkdir()
    save(folder, "model.safetensors", {"model.layers.0.mlp.up_proj.weight": rnd(200, 130).to(torch.float8_e4m3fn),
                                       "model.layers.0.mlp.up_proj.weight_scale_inv": rnd(2, 2).abs(),
                                       "model.embed_tokens.weight": rnd(4, 130, dtype=torch.bfloat16),
                                       "model.norm.weight": rnd(130, dtype=torch.bfloat16)})
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}}))
    c = one(inspect_json(run_ckpt, folder))
    assert c["encodings"] == ["hf-block-fp8", "fp8_e4m3fn", "config.json quantization_config: fp8, weight_block_size [128, 128]"]
    assert c["family"] == "HF causal LM (Llama-style decoder)" and c["config_class"] == "Qwen3ForCausalLM"
    assert [x.split(":")[0] for x in c["warnings"]] == ["1 tensor stored as fp8_e4m3fn"]  # fp32 block scales: layout


def test_quanto_weights_from_real_optimum_quanto(tmp_path, run_ckpt):
    from optimum.quanto import freeze, qfloat8, qint4, qint8, quantize

    for name, qtype, label in [("q8", qint8, "optimum-quanto qint8"), ("f8", qfloat8, "optimum-quanto qfloat8"),
                               ("q4", qint4, "optimum-quanto qint4/qint2 (packed)")]:
        m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16))
        quantize(m, weights=qtype)
        freeze(m)
        sd = {k: v.contiguous() for k, v in m.state_dict().items()}
        c = one(inspect_json(run_ckpt, save(tmp_path, f"{name}.safetensors", sd)))
        assert label in c["encodings"], (name, c["encodings"])
        (w,) = [x for x in c["warnings"] if "quantized weights" in x]
        assert w.startswith(f"2 quantized weights ({label})") and "0.2.5" in w and "ckpt dequant" in w
        assert c["tensors"] == len(sd)
        assert not any("stored as fp8" in x or "mixed" in x for x in c["warnings"])  # qfloat8 codes are quanto's


def test_old_installed_quanto_is_named(tmp_path, run_ckpt, monkeypatch):
    import ckpt.inspect.summary as summary

    monkeypatch.setattr(summary, "_installed_quanto", lambda: "0.2.4")
    sd = {"l.weight._data": torch.zeros(4, 4, dtype=torch.int8), "l.weight._scale": rnd(4, 1), "l.bias": rnd(4),
          "l.input_scale": torch.tensor(1.0), "l.output_scale": torch.tensor(1.0)}
    rep = inspect_json(run_ckpt, save(tmp_path, "q.safetensors", sd))
    (note,) = rep["notes"]
    assert note.startswith("installed optimum-quanto 0.2.4 is older than 0.2.5") and "KeyError" in note
    monkeypatch.setattr(summary, "_installed_quanto", lambda: "0.2.7")
    assert inspect_json(run_ckpt, tmp_path / "q.safetensors")["notes"] == []


def test_bitsandbytes_and_gptq_key_sets_reported_not_crashing(tmp_path, run_ckpt):
    from bitsandbytes.functional import quantize_4bit

    q, st = quantize_4bit(rnd(4, 64), blocksize=64, quant_type="nf4")
    bnb = {"l.weight": q, **{f"l.weight.{k}": v for k, v in st.as_dict(packed=True).items()}, "l.bias": rnd(4)}
    c = one(inspect_json(run_ckpt, save(tmp_path, "bnb.safetensors", bnb)))
    assert "bitsandbytes nf4" in c["encodings"]
    assert any(x.startswith("1 quantized weight (bitsandbytes nf4)") and "ckpt dequant" in x for x in c["warnings"])
    assert not any("cannot be decoded" in x for x in c["warnings"])
    # a broken quant state: the decoder refuses it, inspect reports that instead of failing
    bnb["l.weight.quant_state.bitsandbytes__nf4"] = torch.zeros(8, dtype=torch.uint8)
    c = one(inspect_json(run_ckpt, save(tmp_path, "bnb2.safetensors", bnb)))
    assert "bitsandbytes nf4" in c["encodings"] and "not decodable by ckpt (see warnings)" in c["encodings"]
    assert any(x.startswith("cannot be decoded by ckpt:") and "quant state" in x for x in c["warnings"])
    folder = tmp_path / "gptq"
    folder.mkdir()
    save(folder, "model.safetensors", {"model.layers.0.self_attn.q_proj.qweight": torch.zeros(2, 8, dtype=torch.int32),
                                       "model.layers.0.self_attn.q_proj.qzeros": torch.zeros(1, 1, dtype=torch.int32),
                                       "model.layers.0.self_attn.q_proj.scales": rnd(1, 8, dtype=torch.float16),
                                       "model.layers.0.self_attn.q_proj.g_idx": torch.zeros(16, dtype=torch.int32),
                                       "model.embed_tokens.weight": rnd(4, 16)})
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                    "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    c = one(inspect_json(run_ckpt, folder))
    assert "GPTQ int packs" in c["encodings"] and "config.json quantization_config: gptq" in c["encodings"]
    assert c["family"] == "HF causal LM (Llama-style decoder)"
    assert not any("mixed" in x for x in c["warnings"])  # GPTQ fp16 scales are layout, not a dtype mix


# ---------------------------------------------------------------- training checkpoints, pickles, errors


def test_simpletuner_lora_checkpoint_explains_quanto_keyerror(tmp_path, run_ckpt):
    ck = tmp_path / "checkpoint-500"
    ck.mkdir()
    m = "transformer.single_transformer_blocks.0.attn.to_q"
    save(ck, "pytorch_lora_weights.safetensors", {f"{m}.lora_A.weight": rnd(4, 16), f"{m}.lora_B.weight": rnd(16, 4)})
    torch.save({"state": {}}, ck / "optimizer.bin")
    torch.save({"x": 1}, ck / "scheduler.bin")
    (ck / "random_states_0.pkl").write_bytes(b"\x80\x04N.")
    (ck / "training_state.json").write_text("{}")
    rep = inspect_json(run_ckpt, ck)
    c = one(rep)
    assert rep["training_checkpoint"] and c["kind"] == "lora" and c["files"] == ["pytorch_lora_weights.safetensors"]
    assert c["lora"]["targets"] == ["Flux transformer (diffusers FluxTransformer2DModel)"]
    assert c["encodings"] == ["plain"]
    (note,) = [n for n in rep["notes"] if "KeyError" in n]
    assert "nothing here is quantized" in note and "0.2.5" in note
    code, out, err = run_ckpt("inspect", ck)
    assert code == 0 and "0.2.5" in out


def test_pickle_checkpoint_with_nested_state_dict(tmp_path, run_ckpt):
    sd = _ldm_unet(768)
    p = tmp_path / "sd1.ckpt"
    torch.save({"state_dict": sd, "global_step": 10}, p)
    c = one(inspect_json(run_ckpt, p))
    assert c["container"] == "pickle" and c["family"] == "SD1 UNet (LDM)" and c["tensors"] == len(sd)
    assert any("nested 'state_dict'" in n for n in c["notes"])


def test_bad_inputs_one_line_error_exit_2(tmp_path, run_ckpt):
    code, out, err = run_ckpt("inspect", tmp_path / "missing.safetensors")
    assert code == 2 and "no such file" in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    code, out, err = run_ckpt("inspect", bad, "--json")
    assert code == 2 and str(bad) in err and "not valid JSON" in err and out == ""
    meta = tmp_path / "meta.pt"
    torch.save({"w": torch.empty(3, 3, device="meta")}, meta)
    code, out, err = run_ckpt("inspect", meta)
    assert code == 2 and "meta device" in err and str(meta) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors", "meta.pt"]  # nothing written


def test_hub_id_from_offline_cache(tmp_path, run_ckpt, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    base = cache / "models--owner--flux"
    snap = base / "snapshots" / ("c" * 40)
    snap.mkdir(parents=True)
    save_file({"double_blocks.0.img_attn.qkv.weight": rnd(12, 4, dtype=torch.bfloat16),
               "single_blocks.0.linear1.weight": rnd(20, 4, dtype=torch.bfloat16)}, snap / "flux1.safetensors")
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text("c" * 40)
    rep = inspect_json(run_ckpt, "owner/flux")
    assert rep["source"] == "owner/flux" and one(rep)["family"] == "Flux transformer (BFL)"
    code, out, err = run_ckpt("inspect", "owner/missing")
    assert code == 2 and "owner/missing" in err and len(err.strip().splitlines()) == 1
