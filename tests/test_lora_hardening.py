"""Issue #20: the LoRA commands (`ckpt lora extract|resize|merge|convert`, `ckpt merge-lora`) on degenerate
inputs. Bad input is one `error:` line, exit 2, nothing written, inputs unchanged (`lora_helpers.refused`);
what is accepted is said (warnings in stderr and in `--report FILE.json`) and its math checked against
torch.linalg (best rank-k truncation), PEFT's `merge_and_unload` and `ckpt convert`'s own NaN/Inf counts.

1. NaN/Inf in what must be decomposed: refused naming the tensor, or left out and counted (--skip-nonfinite).
2. Empty weights (extract: skipped with a note) and rank-0 / empty LoRA modules (left out with a warning;
   merge-lora: a zero delta, said in the summary).
3. Every numeric option finite and in range before any work.
4. NaN/Inf copied as stored are counted as `ckpt convert` counts them.
5. An alpha no file gives is assumed with a warning naming --alpha, which sets it.
6. A LoRA whose deltas are all zero is a no-op, said so.
7. LitGPT: merge-lora counts stored modules as inspect does (q/k/v pieces of one attn.qkv are one).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file

from gguf_helpers import quantized, write_gguf
from lora_helpers import close, kohya_modules, refused, rnd, truncated

NAN, INF = float("nan"), float("inf")


def kohya(path, modules: dict, alpha=2.0):
    """modules: name -> (up, down) tensors; kohya keys with an `.alpha` each (None: no alpha key)."""
    sd = {}
    for name, (up, down) in modules.items():
        sd[f"{name}.lora_up.weight"], sd[f"{name}.lora_down.weight"] = up, down
        if alpha is not None:
            sd[f"{name}.alpha"] = torch.tensor(alpha)
    save_file(sd, path)
    return path


def plain(rank=4):
    return {"lora_unet_a": (rnd(32, rank, scale=0.3), rnd(rank, 16, scale=0.3)),
            "lora_unet_b": (rnd(24, rank, scale=0.3), rnd(rank, 16, scale=0.3))}


def base(path):
    save_file({"a.weight": rnd(32, 16), "b.weight": rnd(24, 16)}, path)
    return path


def report(path) -> dict:
    return json.loads(path.read_text())


# ---------------------------------------------------------------------- 1. NaN/Inf where an SVD must run


@pytest.mark.parametrize("side", ["tuned", "base"])
@pytest.mark.parametrize("value", [NAN, INF])
def test_extract_nonfinite_weight_is_refused_naming_it(tmp_path, run_ckpt, side, value):
    b = base(tmp_path / "b.safetensors")
    sd = load_file(b)
    t = {k: v + 0.01 for k, v in sd.items()}
    save_file(t, tmp_path / "t.safetensors")
    bad = tmp_path / ("t.safetensors" if side == "tuned" else "b.safetensors")
    x = load_file(bad)
    x["a.weight"][3, 5] = value
    save_file(x, bad)
    refused(run_ckpt, tmp_path, ["lora", "extract", b, tmp_path / "t.safetensors", "--rank", 2, "-o",
                                 tmp_path / "o.safetensors"], f"{bad}: a.weight", "1 NaN/Inf value")


def test_extract_skip_nonfinite_leaves_the_weight_out_and_counts_it(tmp_path, run_ckpt):
    b = base(tmp_path / "b.safetensors")
    sd = load_file(b)
    delta_b = rnd(24, 3) @ rnd(3, 16) * 0.1
    t = {"a.weight": sd["a.weight"].clone(), "b.weight": sd["b.weight"] + delta_b}
    t["a.weight"][0, :2] = torch.tensor([NAN, -INF])
    save_file(t, tmp_path / "t.safetensors")
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    code, stdout, err = run_ckpt("lora", "extract", b, tmp_path / "t.safetensors", "--rank", 2, "-o", out,
                                 "--skip-nonfinite", "--report", rep)
    assert code == 0, err
    want = ("warning: 2 NaN/Inf values were in modules left out of the output (--skip-nonfinite) in 1 tensor: "
            "a.weight (2)")
    assert want in err and want in report(rep)["warnings"]
    assert report(rep)["counts"] == {"nonfinite_skipped": {"a.weight": 2}}
    assert "1 module left out for NaN/Inf values (--skip-nonfinite): a.weight" in stdout
    got = kohya_modules(out)
    assert set(got) == {"lora_unet_b"}
    up, down, scale = got["lora_unet_b"]
    assert close(scale * up @ down, truncated(t["b.weight"] - sd["b.weight"], 2))


@pytest.mark.parametrize("where", ["lora_unet_a.lora_up.weight", "lora_unet_a.lora_down.weight", "lora_unet_a.alpha"])
def test_resize_nonfinite_factor_or_alpha_is_refused_naming_it(tmp_path, run_ckpt, where):
    lora = kohya(tmp_path / "l.safetensors", plain())
    sd = load_file(lora)
    sd[where].view(-1)[0] = INF if "up" in where else NAN
    save_file(sd, lora)
    refused(run_ckpt, tmp_path, ["lora", "resize", lora, "--rank", 2, "-o", tmp_path / "o.safetensors"],
            f"{lora}: {where}", "1 NaN/Inf value")
    # stacking with another LoRA computes with it too
    other = kohya(tmp_path / "m.safetensors", plain())
    refused(run_ckpt, tmp_path, ["lora", "merge", lora, other, "-o", tmp_path / "o.safetensors"],
            f"{lora}: {where}", "--skip-nonfinite")


def test_resize_skip_nonfinite_keeps_the_rest_exact(tmp_path, run_ckpt):
    mods = plain()
    mods["lora_unet_a"][0][1, 1] = NAN
    lora = kohya(tmp_path / "l.safetensors", mods)
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    code, stdout, err = run_ckpt("lora", "resize", lora, "--rank", 2, "-o", out, "--skip-nonfinite", "--report", rep)
    assert code == 0, err
    assert report(rep)["counts"] == {"nonfinite_skipped": {"lora_unet_a.lora_up.weight": 1}}
    got = kohya_modules(out)
    assert set(got) == {"lora_unet_b"}
    up, down, scale = got["lora_unet_b"]
    u, d = mods["lora_unet_b"]
    assert close(scale * up @ down, truncated(0.5 * u @ d, 2))


# ------------------------------------------------------------------- 2. empty weights, rank-0 modules


def test_extract_empty_weight_is_skipped_with_a_note(tmp_path, run_ckpt):
    sd = {"a.weight": rnd(32, 16), "e.weight": torch.zeros(32, 0)}
    save_file(sd, tmp_path / "b.safetensors")
    delta = rnd(32, 2) @ rnd(2, 16)
    save_file({"a.weight": sd["a.weight"] + delta, "e.weight": torch.zeros(32, 0)}, tmp_path / "t.safetensors")
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    code, _, err = run_ckpt("lora", "extract", tmp_path / "b.safetensors", tmp_path / "t.safetensors", "--rank", 2,
                            "-o", out, "--report", rep)
    assert code == 0, err
    note = "1 weight with no elements has no delta to extract (skipped): e.weight"
    assert f"note: {note}" in err and note in report(rep)["notes"]
    up, down, scale = kohya_modules(out)["lora_unet_a"]
    assert close(scale * up @ down, truncated(delta, 2))


RANK0 = {"rank 0": (torch.zeros(32, 0), torch.zeros(0, 16)), "no rows": (torch.zeros(0, 4), rnd(4, 16))}
LORA_COMMANDS = {
    "resize": lambda lo, b, o: ["lora", "resize", lo, "--rank", 2, "-o", o],
    "merge": lambda lo, b, o: ["lora", "merge", lo,  # with a LoRA that has lora_unet_b only
                               kohya(lo.parent / "m.safetensors", {"lora_unet_b": plain()["lora_unet_b"]}), "-o", o],
    "convert peft": lambda lo, b, o: ["lora", "convert", lo, "--format", "peft", "--base", b, "-o", o],
    "convert comfy": lambda lo, b, o: ["lora", "convert", lo, "--format", "comfy", "--base", b, "-o", o],
}


@pytest.mark.parametrize("command", LORA_COMMANDS)
@pytest.mark.parametrize("kind", RANK0)
def test_rank0_module_is_left_out_with_a_warning(tmp_path, run_ckpt, command, kind):
    mods = plain()
    mods["lora_unet_a"] = RANK0[kind]
    lora = kohya(tmp_path / "l.safetensors", mods)
    b = base(tmp_path / "b.safetensors")
    out, rep = tmp_path / "out", tmp_path / "r.json"
    code, stdout, err = run_ckpt(*LORA_COMMANDS[command](lora, b, out), "--report", rep)
    assert code == 0, err
    want = ("warning: 1 module of rank 0 or with an empty factor changes nothing and was left out "
            "(loaders divide by the rank): lora_unet_a")
    assert want in err and any(w.startswith(want) for w in report(rep)["warnings"])
    weights = out / "adapter_model.safetensors" if out.is_dir() else out
    keys = load_file(weights)
    assert not any("lora_unet_a" in k or ".a." in k or k.startswith("a.") for k in keys), sorted(keys)
    assert any("b" in k for k in keys)


def _bfl(tmp_path, qkv):
    """A Flux (BFL names) base and a kohya LoRA on its fused img_attn.qkv (`qkv` = (up, down)) and proj."""
    H = 8
    save_file({"double_blocks.0.img_attn.proj.weight": rnd(H, H), "double_blocks.0.img_attn.qkv.weight": rnd(3 * H, H)},
              tmp_path / "bfl.safetensors")
    lora = kohya(tmp_path / "l.safetensors", {"lora_unet_double_blocks_0_img_attn_qkv": qkv,
                                              "lora_unet_double_blocks_0_img_attn_proj": (rnd(H, 2), rnd(2, H))})
    return tmp_path / "bfl.safetensors", lora


def test_convert_to_diffusers_leaves_a_rank0_module_out(tmp_path, run_ckpt):
    b, lora = _bfl(tmp_path, (torch.zeros(24, 0), torch.zeros(0, 8)))
    out, rep = tmp_path / "d.safetensors", tmp_path / "r.json"
    code, _, err = run_ckpt("lora", "convert", lora, "--format", "diffusers", "--base", b, "-o", out, "--report", rep)
    assert code == 0, err
    assert "1 module of rank 0 or with an empty factor changes nothing and was left out" in err
    assert any("lora_unet_double_blocks_0_img_attn_qkv" in w for w in report(rep)["warnings"])
    keys = load_file(out)
    assert keys and not any("to_q" in k or "to_k" in k or "to_v" in k for k in keys), sorted(keys)


def test_convert_split_of_a_nonfinite_module_is_refused_or_left_out(tmp_path, run_ckpt):
    up = rnd(24, 2)
    up[20, 1] = NAN  # rows of v: splitting to to_q / to_k / to_v recuts the factors
    b, lora = _bfl(tmp_path, (up, rnd(2, 8)))
    refused(run_ckpt, tmp_path, ["lora", "convert", lora, "--format", "diffusers", "--base", b, "-o",
                                 tmp_path / "d.safetensors"],
            f"{lora}: lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight", "1 NaN/Inf value")
    out, rep = tmp_path / "d.safetensors", tmp_path / "r.json"
    code, stdout, err = run_ckpt("lora", "convert", lora, "--format", "diffusers", "--base", b, "-o", out,
                                 "--report", rep, "--skip-nonfinite")
    assert code == 0, err
    assert report(rep)["counts"]["nonfinite_skipped"] == {"lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": 1}
    keys = load_file(out)
    assert not any("to_q" in k or "to_k" in k or "to_v" in k for k in keys), sorted(keys)
    assert all(torch.isfinite(v).all() for v in keys.values())


@pytest.mark.parametrize("keep_format", [False, True])
def test_merge_lora_rank0_module_is_a_zero_delta(tmp_path, run_ckpt, keep_format):
    if keep_format:  # a GGUF base, re-encoded tensors only where a delta lands: here none
        x = (np.random.default_rng(3).standard_normal((8, 32)) * 0.1).astype(np.float32)
        write_gguf(tmp_path / "m.gguf", "wan", {"blocks.0.ffn.0.weight": (quantized(x, T.Q8_0)[0], T.Q8_0)})
        b, out = tmp_path / "m.gguf", tmp_path / "o.gguf"
        lora = kohya(tmp_path / "l.safetensors", {"lora_unet_blocks_0_ffn_0": (torch.zeros(8, 0), torch.zeros(0, 32))})
    else:
        b, out = base(tmp_path / "b.safetensors"), tmp_path / "o.safetensors"
        mods = plain()
        mods["lora_unet_a"] = RANK0["rank 0"]
        lora = kohya(tmp_path / "l.safetensors", mods)
    rep = tmp_path / "r.json"
    code, stdout, err = run_ckpt("merge-lora", b, lora, "-o", out, "--report", rep,
                                 *(["--keep-format"] if keep_format else ["--to", "fp32"]))
    assert code == 0, err
    name = "lora_unet_blocks_0_ffn_0" if keep_format else "lora_unet_a"
    line = (f"{lora}: 1 module has a zero delta (rank 0 or an all-zero factor, e.g. an untrained lora_B) and "
            f"changes nothing: ")
    assert line in stdout and line in "\n".join(report(rep)["summary"])
    assert report(rep)["zero_delta"] == {str(lora): [name]}
    if keep_format:
        assert "the merge is a no-op" in stdout and report(rep)["changed"] == []
        return
    got, sd, lo = load_file(out), load_file(b), load_file(lora)
    assert torch.equal(got["a.weight"], sd["a.weight"])
    u, d = lo["lora_unet_b.lora_up.weight"], lo["lora_unet_b.lora_down.weight"]
    torch.testing.assert_close(got["b.weight"], sd["b.weight"] + 0.5 * u @ d, rtol=1e-5, atol=1e-6)
    assert report(rep)["changed"] == ["b.weight"]


def test_merge_lora_empty_module_does_not_fit(tmp_path, run_ckpt):
    mods = plain()
    mods["lora_unet_a"] = RANK0["no rows"]
    lora = kohya(tmp_path / "l.safetensors", mods)
    refused(run_ckpt, tmp_path, ["merge-lora", base(tmp_path / "b.safetensors"), lora, "-o",
                                 tmp_path / "o.safetensors"], f"{lora}: module 'lora_unet_a' does not fit", "[0, 16]")


# ------------------------------------------------------------------------------- 3. numeric options


def _files(tmp_path):
    b = base(tmp_path / "B.safetensors")
    t = tmp_path / "T.safetensors"
    save_file({k: v + 0.1 for k, v in load_file(b).items()}, t)
    lora = kohya(tmp_path / "L.safetensors", plain())
    return {"B": b, "T": t, "L": lora}


OPTIONS = [
    (["merge-lora", "B", "L", "--ratio", "nan"], "--ratio nan"),
    (["merge-lora", "B", "L", "--ratio", "inf"], "--ratio inf"),
    (["merge-lora", "B", "L", "L", "--ratio", "1", "--ratio", "-inf"], "--ratio -inf"),
    (["merge-lora", "B", "L", "--alpha", "nan"], "--alpha nan"),
    (["merge-lora", "B", "L", "--alpha", "0"], "--alpha 0"),
    (["merge-lora", "B", "L", "L", "L", "--alpha", "1", "--alpha", "2"], "--alpha given 2 times for 3 LoRAs"),
    (["lora", "merge", "L", "L", "--ratio", "nan", "--ratio", "1"], "--ratio nan"),
    (["lora", "merge", "L", "L", "--alpha", "-4"], "--alpha -4"),
    (["lora", "merge", "L", "L", "--svd", "--rank", "2", "--clamp-quantile", "nan"], "--clamp-quantile nan"),
    (["lora", "resize", "L", "--rank", "2", "--dynamic", "sv_ratio", "--threshold", "inf"], "--threshold inf"),
    (["lora", "resize", "L", "--dynamic", "sv_fro", "--threshold", "nan"], "--threshold nan"),
    (["lora", "resize", "L", "--rank", "2", "--alpha", "inf"], "--alpha inf"),
    (["lora", "resize", "L", "--rank", "2", "--format", "peft", "--base", "B", "--alpha", "nan"], "--alpha nan"),
    (["lora", "convert", "L", "--format", "peft", "--alpha", "nan"], "--alpha nan"),
    (["lora", "extract", "B", "T", "--rank", "2", "--min-diff", "nan"], "--min-diff nan"),
    (["lora", "extract", "B", "T", "--rank", "2", "--min-diff", "inf"], "--min-diff inf"),
    (["lora", "extract", "B", "T", "--dynamic", "sv_cumulative", "--threshold", "-inf"], "--threshold -inf"),
]


@pytest.mark.parametrize("args,says", OPTIONS, ids=[" ".join(a[:2] + a[-2:]) for a, _ in OPTIONS])
def test_numeric_options_are_checked_before_any_work(tmp_path, run_ckpt, args, says):
    files = _files(tmp_path)
    argv = [files.get(a, a) for a in args] + ["-o", tmp_path / "out.safetensors"]
    refused(run_ckpt, tmp_path, argv, says, says)


def test_nan_ratio_on_a_gguf_base_with_keep_format_is_refused(tmp_path, run_ckpt):
    x = (np.random.default_rng(4).standard_normal((8, 32)) * 0.1).astype(np.float32)
    write_gguf(tmp_path / "m.gguf", "wan", {"blocks.0.ffn.0.weight": (quantized(x, T.Q8_0)[0], T.Q8_0)})
    lora = kohya(tmp_path / "l.safetensors", {"lora_unet_blocks_0_ffn_0": (rnd(8, 2), rnd(2, 32))})
    refused(run_ckpt, tmp_path, ["merge-lora", tmp_path / "m.gguf", lora, "--keep-format", "--ratio", "nan",
                                 "-o", tmp_path / "o.gguf"], "--ratio nan", "not a finite number")


# --------------------------------------------------------------- 4. NaN/Inf kept as stored are counted


def test_nonfinite_values_passed_through_are_counted_as_convert_counts_them(tmp_path, run_ckpt):
    mods = plain()
    mods["lora_unet_a"][0][0, :3] = torch.tensor([NAN, INF, NAN])
    lora = kohya(tmp_path / "l.safetensors", mods)
    sd = load_file(lora)
    sd["lora_unet_b.alpha"] = torch.tensor(NAN)
    save_file(sd, lora)
    # a convert that casts every tensor (one to the dtype they have would copy them unread, uncounted)
    code, _, err = run_ckpt("convert", lora, "--to", "bf16", "-o", tmp_path / "c.safetensors",
                            "--report", tmp_path / "c.json")
    assert code == 0, err
    oracle = report(tmp_path / "c.json")["counts"]
    assert oracle == {"nonfinite_input": {"lora_unet_a.lora_up.weight": 3, "lora_unet_b.alpha": 1}}
    # resize to a rank no module exceeds: every module passes through as stored
    code, _, err = run_ckpt("lora", "resize", lora, "--rank", 8, "-o", tmp_path / "r.safetensors",
                            "--report", tmp_path / "r.json")
    assert code == 0, err
    assert report(tmp_path / "r.json")["counts"] == oracle
    assert "warning: 4 NaN/Inf values were already in the input (kept as they are) in 2 tensors" in err
    got = load_file(tmp_path / "r.safetensors")
    assert torch.equal(got["lora_unet_a.lora_up.weight"].isnan(), sd["lora_unet_a.lora_up.weight"].isnan())
    # a merge of LoRAs with no module in common passes every module through as well
    other = kohya(tmp_path / "m.safetensors", {"lora_unet_c": (rnd(8, 2), rnd(2, 8))})
    code, _, err = run_ckpt("lora", "merge", lora, other, "-o", tmp_path / "g.safetensors",
                            "--report", tmp_path / "g.json")
    assert code == 0, err
    assert report(tmp_path / "g.json")["counts"] == oracle
    # a rename to the PEFT naming: the same values under the new names (the alpha goes into adapter_config.json)
    code, _, err = run_ckpt("lora", "convert", lora, "--format", "peft", "--base", base(tmp_path / "b.safetensors"),
                            "-o", tmp_path / "p", "--report", tmp_path / "p.json")
    assert code == 0, err
    assert report(tmp_path / "p.json")["counts"] == {"nonfinite_input": {"base_model.model.a.lora_B.weight": 3,
                                                                         "base_model.model.b.alpha": 1}}


# ------------------------------------------------------------------------------ 5. an assumed alpha


def _peft_pair(tmp_path, r=8, alpha=16, init_zero=False):
    """A tiny torch model saved as safetensors, a PEFT LoRA of it (r, alpha) saved with save_pretrained,
    and PEFT's own merge_and_unload of it (the oracle)."""
    peft = pytest.importorskip("peft")

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 24, bias=False)
            self.out = torch.nn.Linear(24, 12, bias=False)

    torch.manual_seed(0)
    model = Tiny()
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, tmp_path / "base.safetensors")
    pm = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=["proj", "out"]))
    if not init_zero:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(tmp_path / "adapter")
    want = {k: v.detach().clone() for k, v in pm.merge_and_unload().state_dict().items()}
    return tmp_path / "base.safetensors", tmp_path / "adapter", want


def test_peft_folder_without_config_warns_and_alpha_sets_it(tmp_path, run_ckpt):
    b, ad, want = _peft_pair(tmp_path, r=8, alpha=16)
    (ad / "adapter_config.json").unlink()
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    code, stdout, err = run_ckpt("merge-lora", b, ad, "-o", out, "--report", rep)
    assert code == 0, err
    warning = (f"warning: {ad}: 2 modules carry no alpha (no alpha key, adapter_config.json or "
               "lora_adapter_metadata): assumed alpha = rank (scale 1); pass --alpha A to set the alpha it was "
               "trained with")
    assert warning in err and warning in report(rep)["warnings"]
    got, stored = load_file(out), load_file(b)
    for k in got:  # the assumption: half the trained strength
        torch.testing.assert_close(got[k] - stored[k], (want[k] - stored[k]) / 2, rtol=1e-4, atol=1e-6)
    code, stdout, err = run_ckpt("merge-lora", b, ad, "-o", out, "--overwrite", "--alpha", 16, "--report", rep)
    assert code == 0, err
    assert "warning" not in err and report(rep)["warnings"] == []
    assert f"{ad}: 2 modules without an alpha of their own: alpha 16 (--alpha)" in report(rep)["notes"]
    got = load_file(out)
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_diffusers_file_without_metadata_warns_in_lora_commands_too(tmp_path, run_ckpt):
    b, ad, want = _peft_pair(tmp_path, r=8, alpha=16)
    sd = load_file(ad / "adapter_model.safetensors")
    lora = tmp_path / "d.safetensors"
    save_file({k.replace("base_model.model.", "transformer."): v for k, v in sd.items()}, lora)
    rep = tmp_path / "r.json"
    code, _, err = run_ckpt("lora", "resize", lora, "--rank", 4, "-o", tmp_path / "o.safetensors", "--report", rep)
    assert code == 0, err
    assert "2 modules carry no alpha" in err and "--alpha A" in err
    assert any("2 modules carry no alpha" in w for w in report(rep)["warnings"])
    # with --alpha, the resized file (no alpha slot: scale folded into up) is the best rank-4 cut of alpha/r B A
    out = tmp_path / "o2.safetensors"
    code, _, err = run_ckpt("lora", "resize", lora, "--rank", 4, "-o", out, "--alpha", 16)
    assert code == 0 and "warning" not in err, err
    got = load_file(out)
    for name in ("proj", "out"):
        B, A = sd[f"base_model.model.{name}.lora_B.weight"], sd[f"base_model.model.{name}.lora_A.weight"]
        up, down = got[f"transformer.{name}.lora_B.weight"], got[f"transformer.{name}.lora_A.weight"]
        assert close(up @ down, truncated(2.0 * B @ A, 4))


# -------------------------------------------------------------------------------- 6. an all-zero LoRA


def test_untrained_lora_is_a_no_op_said_so(tmp_path, run_ckpt):
    b, ad, _ = _peft_pair(tmp_path, init_zero=True)  # PEFT initialises lora_B to zeros
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    code, stdout, err = run_ckpt("merge-lora", b, ad, "-o", out, "--report", rep)
    assert code == 0, err
    assert "base tensors changed: 0 (the merge is a no-op: every matched module's delta is zero)" in stdout
    assert (f"{ad}: 2 modules have a zero delta (rank 0 or an all-zero factor, e.g. an untrained lora_B) and change "
            "nothing: all of them: base_model.model.out, base_model.model.proj") in stdout
    r = report(rep)
    assert r["changed"] == [] and r["zero_delta"] == {str(ad): ["base_model.model.out", "base_model.model.proj"]}
    assert "warning: the merge changes nothing" in err and any("changes nothing" in w for w in r["warnings"])
    got, stored = load_file(out), load_file(b)
    assert all(torch.equal(got[k], stored[k]) for k in stored)


# ------------------------------------------------------------------------- 7. LitGPT module counts


def test_litgpt_module_count_agrees_with_inspect(tmp_path, run_ckpt):
    base_dir, ft = tmp_path / "base", tmp_path / "ft"
    base_dir.mkdir()
    ft.mkdir()
    cfg = dict(name="tiny", n_embd=8, n_head=2, n_query_groups=1, head_size=4, n_layer=2)
    sd = {}
    for i in range(2):
        sd[f"transformer.h.{i}.attn.qkv.weight"] = rnd(16, 8)
        sd[f"transformer.h.{i}.attn.proj.weight"] = rnd(8, 8)
    torch.save(sd, base_dir / "lit_model.pth")
    (base_dir / "model_config.yaml").write_text(yaml.safe_dump(cfg))
    lora = {}
    for i in range(2):  # q and v enabled: one stored module, two pieces of attn.qkv
        lora[f"transformer.h.{i}.attn.qkv.lora_A"] = rnd(4, 8)
        lora[f"transformer.h.{i}.attn.qkv.lora_B"] = rnd(12, 2)
        lora[f"transformer.h.{i}.attn.proj.lora_A"] = rnd(2, 8)
        lora[f"transformer.h.{i}.attn.proj.lora_B"] = rnd(8, 2)
    torch.save({"model": lora}, ft / "lit_model.pth.lora")
    hp = dict(checkpoint_dir=str(base_dir), precision="32-true", lora_r=2, lora_alpha=4, lora_query=True,
              lora_key=False, lora_value=True, lora_projection=True, lora_mlp=False, lora_head=False)
    (ft / "hyperparameters.yaml").write_text(yaml.safe_dump(hp))
    (ft / "model_config.yaml").write_text(yaml.safe_dump(cfg))
    code, out, err = run_ckpt("inspect", ft / "lit_model.pth.lora")
    assert code == 0 and "LitGPT LoRA; 4 modules" in out, out
    code, out, err = run_ckpt("merge-lora", ft, "--dry-run", "--report", tmp_path / "r.json")
    assert code == 0, err
    assert "4 LoRA modules matched (ratio 1; lora 4)" in out, out
    assert report(tmp_path / "r.json")["matched"] == {str(ft / "lit_model.pth.lora"): 4}
