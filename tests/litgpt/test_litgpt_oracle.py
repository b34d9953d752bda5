"""LitGPT LoRA merges against litgpt itself (runs in the LitGPT test venv: `make test` builds it).

Tiny GPTs (GQA, MHA and MQA with an explicit head_size) with LoRA on q/k/v (all or some), projection,
MLP and head are saved the way `litgpt finetune lora` does (`save_lora_checkpoint`, `copy_config_files`,
`save_hyperparameters` from a real command line) and merged by `litgpt merge_lora` (the reference) and by
`ckpt merge-lora`. fp32: the results agree to fp32 rounding (rtol 1e-5, atol 1e-6; ckpt adds
`scale * (B @ A)` in one addmm, litgpt rounds the product and the scaled product apart). bf16: ckpt merges
in fp32 and rounds once, litgpt rounds three times in bf16, so ckpt is compared with litgpt's merge done
in fp32 on the same bf16 tensors, rounded to bf16 (within one bf16 rounding), and with litgpt's own bf16
file loosely.
"""

from __future__ import annotations

import shutil
import sys
import zipfile

import pytest
import torch

litgpt = pytest.importorskip("litgpt")
L = pytest.importorskip("lightning")

from litgpt.config import Config  # noqa: E402
from litgpt.finetune.lora import save_lora_checkpoint, setup  # noqa: E402
from litgpt.lora import GPT as LoraGPT, Config as LoraConfig, lora_filter, merge_lora_weights  # noqa: E402
from litgpt.model import GPT  # noqa: E402
from litgpt.parser_config import save_hyperparameters  # noqa: E402
from litgpt.scripts.merge_lora import merge_lora as litgpt_merge_lora  # noqa: E402
from litgpt.utils import copy_config_files, load_checkpoint, save_config  # noqa: E402

TINY = dict(block_size=16, vocab_size=50, padded_vocab_size=64, n_layer=2, n_embd=32, rotary_percentage=1.0)
CASES = {
    # name: (model config, (lora_query, lora_key, lora_value), precision)
    "gqa-llama": (dict(n_head=4, n_query_groups=2, mlp_class_name="LLaMAMLP", intermediate_size=48,
                       norm_class_name="RMSNorm", bias=False, parallel_residual=False), (True, True, True), "32-true"),
    "mha-neox": (dict(n_head=4, n_query_groups=4, mlp_class_name="GptNeoxMLP", intermediate_size=64, bias=True),
                 (True, False, True), "32-true"),
    "mqa-bf16": (dict(n_head=4, n_query_groups=1, head_size=16, mlp_class_name="LLaMAMLP", intermediate_size=48,
                      norm_class_name="RMSNorm", bias=False, parallel_residual=False), (False, True, True),
                 "bf16-true"),
}
R, ALPHA = 4, 8
TOL32 = dict(rtol=1e-5, atol=1e-6)


def make_finetune(root, case):
    """A base folder (lit_model.pth, model_config.yaml, tokenizer files) and a LoRA finetune folder next
    to it, written with litgpt's own save functions. Returns (base dir, finetune dir, Config, dtype)."""
    model_kw, (q, k, v), precision = CASES[case]
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    base, ft = root / "base", root / "ft"
    base.mkdir()
    ft.mkdir()
    cfg = Config(name=f"tiny-{case}", **TINY, **model_kw)
    torch.manual_seed(0)
    torch.save(GPT(cfg).to(dtype).state_dict(), base / "lit_model.pth")
    save_config(cfg, base)
    (base / "tokenizer.json").write_text("{}")
    (base / "tokenizer_config.json").write_text("{}")

    lora_kw = dict(lora_r=R, lora_alpha=ALPHA, lora_query=q, lora_key=k, lora_value=v, lora_projection=True,
                   lora_mlp=True, lora_head=True)
    model = LoraGPT(LoraConfig(name=cfg.name, **TINY, **model_kw, **lora_kw))
    model.load_state_dict(torch.load(base / "lit_model.pth"), strict=False)
    with torch.no_grad():  # trained LoRA factors: lora_B starts at zero, which would merge to nothing
        for n, p in model.named_parameters():
            if lora_filter(n, p):
                p.copy_(torch.randn_like(p) * 0.2)
    model = model.to(dtype)
    fabric = L.Fabric(devices=1, accelerator="cpu", precision=precision)
    save_lora_checkpoint(fabric, model, ft / "lit_model.pth.lora")
    copy_config_files(base, ft)
    argv = ["litgpt", "finetune_lora", str(base), "--precision", precision]
    argv += [a for key, val in lora_kw.items() for a in (f"--{key}", str(val).lower())]
    old, sys.argv = sys.argv, argv
    try:
        save_hyperparameters(setup, ft)
    finally:
        sys.argv = old
    return base, ft, cfg, dtype


def litgpt_reference(base, ft, tmp_path):
    """`litgpt merge_lora` on a copy of the finetune folder: its lit_model.pth."""
    ref_dir = tmp_path / "ref"
    shutil.copytree(ft, ref_dir)
    litgpt_merge_lora(checkpoint_dir=ref_dir, pretrained_checkpoint_dir=base)
    return torch.load(ref_dir / "lit_model.pth", weights_only=True)


def fp32_reference(base, ft, case):
    """litgpt's merge done in fp32 on the (bf16) tensors as stored."""
    model_kw, (q, k, v), _ = CASES[case]
    model = LoraGPT(LoraConfig(name="ref", **TINY, **model_kw, lora_r=R, lora_alpha=ALPHA, lora_query=q, lora_key=k,
                               lora_value=v, lora_projection=True, lora_mlp=True, lora_head=True))
    sd = {k: t.float() for k, t in torch.load(base / "lit_model.pth").items()}
    sd.update({k: t.float() for k, t in torch.load(ft / "lit_model.pth.lora")["model"].items()})
    model.load_state_dict(sd)
    merge_lora_weights(model)
    return {k.replace("linear.", ""): t for k, t in model.state_dict().items() if not lora_filter(k, t)}


@pytest.mark.parametrize("case", list(CASES))
def test_finetune_folder_merges_like_litgpt(tmp_path, run_ckpt, case):
    base, ft, cfg, dtype = make_finetune(tmp_path, case)
    code, out, err = run_ckpt("merge-lora", ft, "-q")
    assert code == 0, err
    merged = tmp_path / "ft-merged"
    assert f"wrote {merged}" in out
    # A LitGPT checkpoint folder: the weights in torch's zip format plus the finetune folder's files.
    assert sorted(p.name for p in merged.iterdir()) == sorted(
        ["lit_model.pth"] + [p.name for p in ft.iterdir() if p.name != "lit_model.pth.lora"])
    assert zipfile.is_zipfile(merged / "lit_model.pth")
    got = torch.load(merged / "lit_model.pth", weights_only=True, mmap=True)
    ref = litgpt_reference(base, ft, tmp_path)
    stored = torch.load(base / "lit_model.pth", weights_only=True)

    assert list(got) == list(stored) and set(got) == set(ref)
    changed = [k for k in ref if not torch.equal(ref[k], stored[k])]
    n_lora = len(torch.load(ft / "lit_model.pth.lora")["model"]) // 2
    assert len(changed) == n_lora  # every LoRA layer changed its weight, and nothing else changed
    for k in ref:
        assert got[k].dtype == ref[k].dtype == dtype, k
        if dtype == torch.float32:
            torch.testing.assert_close(got[k], ref[k], **TOL32, msg=k)
        else:
            torch.testing.assert_close(got[k], ref[k], rtol=0.05, atol=0.02, msg=k)  # litgpt: 3 bf16 roundings
    if dtype == torch.bfloat16:
        exact = fp32_reference(base, ft, case)
        for k in exact:  # one rounding of (fp32 merge) vs ckpt's one rounding: within one bf16 step
            torch.testing.assert_close(got[k].float(), exact[k].bfloat16().float(), rtol=2 ** -7, atol=1e-6, msg=k)

    # litgpt's own loader takes the file (strict), and the model computes what the reference computes.
    fabric = L.Fabric(devices=1, accelerator="cpu", precision="32-true")
    mine, theirs = GPT(cfg), GPT(cfg)
    load_checkpoint(fabric, mine, merged / "lit_model.pth", strict=True)
    theirs.load_state_dict(ref)
    x = torch.randint(0, cfg.vocab_size, (1, 8))
    torch.testing.assert_close(mine(x), theirs(x).to(mine(x).dtype), rtol=0.05 if dtype != torch.float32 else 1e-4,
                               atol=0.05 if dtype != torch.float32 else 1e-4)


def test_two_files_and_safetensors_output(tmp_path, run_ckpt):
    from safetensors.torch import load_file

    base, ft, cfg, _ = make_finetune(tmp_path, "gqa-llama")
    ref = litgpt_reference(base, ft, tmp_path)
    code, out, err = run_ckpt("merge-lora", base / "lit_model.pth", ft / "lit_model.pth.lora", "-q")
    assert code == 0, err
    single = base / "lit_model-merged.pth"  # the base's own format, beside it
    got = torch.load(single, weights_only=True)
    code, out, err = run_ckpt("merge-lora", base / "lit_model.pth", ft, "-o", tmp_path / "m.safetensors", "-q")
    assert code == 0, err
    st = load_file(tmp_path / "m.safetensors")
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], **TOL32, msg=k)
        assert torch.equal(st[k], got[k]), k


def test_convert_writes_lit_model_pth_litgpt_loads(tmp_path, run_ckpt):
    base, ft, cfg, _ = make_finetune(tmp_path, "mha-neox")
    code, out, err = run_ckpt("convert", base / "lit_model.pth", "--to", "bf16", "-o", tmp_path / "bf16.pth", "-q")
    assert code == 0, err
    stored = torch.load(base / "lit_model.pth", weights_only=True)
    fabric = L.Fabric(devices=1, accelerator="cpu", precision="bf16-true")
    model = GPT(cfg).to(torch.bfloat16)
    load_checkpoint(fabric, model, tmp_path / "bf16.pth", strict=True)
    for k, t in model.state_dict().items():
        if k in stored:
            assert torch.equal(t, stored[k].to(torch.bfloat16)), k


def interleave(qkv: torch.Tensor, cfg) -> torch.Tensor:
    """Older LitGPT's `attn.attn` layout of a `attn.qkv` tensor: per query group, its q heads, k, v."""
    q_per_kv, hs = cfg.n_head // cfg.n_query_groups, cfg.head_size
    q, k, v = qkv.split([cfg.n_head * hs, cfg.n_query_groups * hs, cfg.n_query_groups * hs])
    groups = [torch.cat([q[g * q_per_kv * hs:(g + 1) * q_per_kv * hs], k[g * hs:(g + 1) * hs], v[g * hs:(g + 1) * hs]])
              for g in range(cfg.n_query_groups)]
    return torch.cat(groups)


@pytest.mark.parametrize("case", ["gqa-llama", "mha-neox"])
def test_older_attn_attn_base_merges_as_litgpt_loads_it(tmp_path, run_ckpt, case):
    base, ft, cfg, _ = make_finetune(tmp_path, case)
    stored = torch.load(base / "lit_model.pth", weights_only=True)
    legacy = {(k.replace(".attn.qkv.", ".attn.attn.") if ".attn.qkv." in k else k):
              (interleave(t, cfg) if ".attn.qkv." in k else t) for k, t in stored.items()}
    check = GPT(cfg)  # litgpt's own loader regroups the old layout: our interleave is its inverse
    check.load_state_dict(legacy)
    assert all(torch.equal(check.state_dict()[k], t) for k, t in stored.items())
    old = tmp_path / "old"
    old.mkdir()
    torch.save(legacy, old / "lit_model.pth")

    code, out, err = run_ckpt("merge-lora", old / "lit_model.pth", ft, "-o", tmp_path / "m.pth")
    assert code == 0, err
    assert "attn.attn tensors written as attn.qkv" in err
    got = torch.load(tmp_path / "m.pth", weights_only=True)
    ref = litgpt_reference(base, ft, tmp_path)
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], **TOL32, msg=k)
