"""What the commands say: --quiet everywhere, consistent counts and plurals in inspect, messages that tell
which LoRA does not fit which base (and swapped arguments), and `--report FILE.json` for scripts."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import save_file


def write(path, tensors, metadata=None):
    save_file(tensors, path, metadata=metadata)
    return path


# ---------------------------------------------------------------------------------------- --quiet


def test_inspect_quiet_drops_notes_and_keeps_warnings(tmp_path, run_ckpt):
    p = tmp_path / "m.ckpt"  # a note (the nested state_dict) and a warning (mixed dtypes)
    torch.save({"state_dict": {"x.weight": torch.ones(2, 2), "y.weight": torch.ones(2, 2).half()}, "epoch": 1}, p)
    code, out, err = run_ckpt("inspect", p)
    assert code == 0 and "warning: mixed floating dtypes" in out
    assert "note:" in out
    code, quiet, err = run_ckpt("inspect", p, "-q")
    assert code == 0 and "warning: mixed floating dtypes" in quiet
    assert [line for line in quiet.splitlines() if line.strip()] == [
        line for line in out.splitlines() if line.strip() and "note:" not in line]


def test_dequant_quiet_with_nothing_to_dequantize_prints_one_line(tmp_path, run_ckpt):
    p = write(tmp_path / "plain.safetensors", {"w": torch.ones(2)})
    code, out, err = run_ckpt("dequant", p, "-q")
    assert code == 0 and err == "" and out == "nothing to dequantize; nothing written\n"
    code, out, err = run_ckpt("dequant", p)
    assert code == 0 and "note:" in err  # without -q it says what the file holds


# ------------------------------------------------------------------------------- inspect wording


def test_fp8_warning_counts_like_the_dtype_table(tmp_path, run_ckpt):
    w = torch.randn(8, 8)
    p = write(tmp_path / "scaled.safetensors", {
        "l1.weight": w.to(torch.float8_e4m3fn), "l1.scale_weight": torch.tensor(0.5),
        "l2.weight": w.to(torch.float8_e4m3fn), "l2.scale_weight": torch.tensor(0.5),
        "scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn), "norm.weight": torch.ones(8)})
    code, out, err = run_ckpt("inspect", p)
    assert code == 0, err
    table = next(line for line in out.splitlines() if "fp8_e4m3fn" in line and "params" in line)
    assert "3 tensors" in table
    assert ("2 tensors stored as fp8_e4m3fn (the dtype table's 3 also count 1 scale/marker tensor: scaled_fp8)"
            in out), out


@pytest.mark.parametrize("kind,tensors,rank", [
    ("LoHa", {"lora_unet_a.hada_w1_a": (8, 4), "lora_unet_a.hada_w1_b": (4, 8), "lora_unet_a.hada_w2_a": (8, 4),
              "lora_unet_a.hada_w2_b": (4, 8)}, "rank 4"),
    ("LoKr", {"lora_unet_a.lokr_w1": (2, 2), "lora_unet_a.lokr_w2_a": (4, 3), "lora_unet_a.lokr_w2_b": (3, 4)}, "rank 3"),
])
def test_lycoris_ranks_are_shown(tmp_path, run_ckpt, kind, tensors, rank):
    p = write(tmp_path / "l.safetensors", {k: torch.randn(s) for k, s in tensors.items()} | {"lora_unet_a.alpha": torch.tensor(2.0)})
    code, out, err = run_ckpt("inspect", p)
    assert code == 0 and f"LyCORIS {kind}; 1 module, {rank}, 1 alpha key" in out, out


def test_litgpt_lora_rank_and_prefix(tmp_path, run_ckpt):
    ft = tmp_path / "ft"
    ft.mkdir()
    torch.save({"model": {"transformer.h.0.attn.qkv.lora_A": torch.randn(4, 8),  # q and v: two rank-2 pairs
                          "transformer.h.0.attn.qkv.lora_B": torch.randn(12, 2),
                          "transformer.h.0.mlp.fc.lora_A": torch.randn(2, 8),
                          "transformer.h.0.mlp.fc.lora_B": torch.randn(16, 2)}}, ft / "lit_model.pth.lora")
    code, out, err = run_ckpt("inspect", ft / "lit_model.pth.lora")
    assert code == 0 and "LitGPT LoRA; 2 modules, rank 2," in out, out  # not "rank 2, 4"
    assert "[LitGPT]" in out and "[diffusers]" not in out
    (ft / "hyperparameters.yaml").write_text(yaml.safe_dump({"lora_r": 2}))
    code, out, err = run_ckpt("inspect", ft)
    assert code == 0 and "rank 2," in out


def test_counts_of_one_are_singular(tmp_path, run_ckpt):
    p = write(tmp_path / "m.safetensors", {"x": torch.tensor([1e6, 1.0])})
    code, out, err = run_ckpt("convert", p, "--to", "fp16")
    assert code == 0
    assert "warning: 1 value overflowed to inf in the target dtype (convert --to fp16|bf16 --clamp saturates them instead) in 1 tensor: x (1)" in err
    base = write(tmp_path / "b.safetensors", {"a.weight": torch.zeros(4, 4)})
    lora = write(tmp_path / "l.safetensors", {"a.lora_down.weight": torch.zeros(1, 4),
                                              "a.lora_up.weight": torch.zeros(4, 1)})
    code, out, err = run_ckpt("merge-lora", base, lora, lora, "--ratio", "1")
    assert code == 2 and "--ratio given 1 time for 2 LoRAs" in err
    code, out, err = run_ckpt("merge-lora", base, lora, "--dry-run")
    assert code == 0 and "1 LoRA module matched" in out and "1 module carries no alpha" in err


def test_component_notes_do_not_name_the_top_folder_dot(tmp_path, run_ckpt):
    d = tmp_path / "q"
    d.mkdir()
    write(d / "model.safetensors", {"a.weight._data": torch.ones(4, 2, dtype=torch.int8),
                                    "a.weight._scale": torch.ones(4, 1)})
    code, out, err = run_ckpt("dequant", d, "--dry-run")
    assert code == 0, err
    assert "note: optimum-quanto: dequantized 1 qint8" in err and "note: .:" not in err


# --------------------------------------------------------------------------- merge-lora messages


def test_swapped_base_and_lora_get_a_hint(tmp_path, run_ckpt):
    base = write(tmp_path / "model.safetensors", {"a.weight": torch.zeros(4, 4), "b.weight": torch.zeros(4, 4)})
    lora = write(tmp_path / "lora.safetensors", {"a.lora_down.weight": torch.zeros(1, 4),
                                                 "a.lora_up.weight": torch.zeros(4, 1), "a.alpha": torch.tensor(1.0)})
    code, out, err = run_ckpt("merge-lora", lora, base, "-o", tmp_path / "o.safetensors")
    assert code == 2 and err.count("\n") == 1
    assert f"BASE {lora} is itself a LoRA: swapped? the order is `ckpt merge-lora BASE LORA...`" in err, err
    assert not (tmp_path / "o.safetensors").exists()
    code, out, err = run_ckpt("merge-lora", lora, lora, "-o", tmp_path / "o.safetensors")  # two LoRAs
    assert code == 2 and "is itself a LoRA: swapped?" in err, err


def test_text_encoder_keys_the_base_lacks_are_named(tmp_path, run_ckpt):
    base = write(tmp_path / "unet.safetensors", {"a.weight": torch.zeros(4, 4)})
    lora = {"lora_unet_a.lora_down.weight": torch.zeros(1, 4), "lora_unet_a.lora_up.weight": torch.zeros(4, 1)}
    for te in ("lora_te1_text_model_encoder_layers_0_mlp_fc1", "lora_te2_text_model_encoder_layers_0_mlp_fc1"):
        lora |= {f"{te}.lora_down.weight": torch.zeros(1, 4), f"{te}.lora_up.weight": torch.zeros(4, 1)}
    p = write(tmp_path / "sdxl_lora.safetensors", lora)
    code, out, err = run_ckpt("merge-lora", base, p, "-o", tmp_path / "o.safetensors")
    assert code == 2 and "4 LoRA keys match no base tensor" in err
    assert "with te1/te2 keys" in err and "with no text encoder" in err, err


def test_long_unmatched_lists_are_cut_and_the_report_has_every_key(tmp_path, run_ckpt):
    base = write(tmp_path / "b.safetensors", {"a.weight": torch.zeros(4, 4)})
    lora = {"a.lora_down.weight": torch.zeros(1, 4), "a.lora_up.weight": torch.zeros(4, 1)}
    for i in range(15):
        lora |= {f"gone{i}.lora_down.weight": torch.zeros(1, 4), f"gone{i}.lora_up.weight": torch.zeros(4, 1)}
    p = write(tmp_path / "l.safetensors", lora)
    rep = tmp_path / "report.json"
    code, out, err = run_ckpt("merge-lora", base, p, "-o", tmp_path / "o.safetensors", "--report", rep)
    assert code == 2 and "30 LoRA keys match no base tensor" in err
    line = next(line for line in out.splitlines() if "unmatched LoRA keys" in line)
    assert line.count(".lora_") == 10 and "(20 more; --report FILE.json lists them all)" in line
    data = json.loads(rep.read_text())
    assert data["status"] == "error" and data["exit_code"] == 2 and data["error"] == err.strip()[len("error: "):]
    assert data["command"] == "merge-lora" and data["output"] is None
    assert sorted(data["unmatched"][str(p)]) == sorted(k for k in lora if k.startswith("gone"))
    assert data["matched"] == {str(p): 1}
    assert not (tmp_path / "o.safetensors").exists()


# ------------------------------------------------------------------------------------- --report


def test_report_of_a_convert(tmp_path, run_ckpt):
    p = write(tmp_path / "m.safetensors", {"x": torch.tensor([1e6, 1.0]), "y": torch.ones(3)})
    rep = tmp_path / "r.json"
    code, out, err = run_ckpt("convert", p, "--to", "fp16", "-q", "--report", rep)
    assert code == 0, err
    data = json.loads(rep.read_text())
    assert data["ckpt_report"] == 1 and data["command"] == "convert" and data["status"] == "ok"
    assert data["inputs"] == [str(p)] and data["output"] == str(tmp_path / "m-fp16.safetensors")
    assert data["counts"] == {"overflow": {"x": 1}} and data["exit_code"] == 0 and data["error"] is None
    assert data["warnings"] == [err.strip()]
    assert data["argv"][:2] == ["convert", str(p)]
    assert not list(tmp_path.glob(".*ckpt-tmp*"))


def test_report_of_inspect_dequant_and_lora_commands(tmp_path, run_ckpt):
    p = write(tmp_path / "m.safetensors", {"x": torch.ones(3)})
    code, out, err = run_ckpt("inspect", p, "--report", tmp_path / "i.json")
    assert code == 0
    data = json.loads((tmp_path / "i.json").read_text())
    assert data["command"] == "inspect" and data["inspect"]["components"][0]["tensors"] == 1
    code, out, err = run_ckpt("dequant", p, "--report", tmp_path / "d.json")
    assert code == 0
    assert json.loads((tmp_path / "d.json").read_text())["status"] == "nothing-to-do"
    code, out, err = run_ckpt("convert", p, "--to", "bf16", "--dry-run", "--report", tmp_path / "c.json")
    assert code == 0 and json.loads((tmp_path / "c.json").read_text())["status"] == "dry-run"
    lora = write(tmp_path / "l.safetensors", {"a.lora_down.weight": torch.randn(4, 8), "a.lora_up.weight": torch.randn(8, 4)})
    code, out, err = run_ckpt("lora", "resize", lora, "--rank", "2", "--report", tmp_path / "r.json", "-q")
    assert code == 0, err
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["command"] == "lora resize" and data["summary"] and data["output"]


def test_report_in_a_missing_folder_is_refused_before_running(tmp_path, run_ckpt):
    p = write(tmp_path / "m.safetensors", {"x": torch.ones(3)})
    code, out, err = run_ckpt("convert", p, "--to", "fp16", "--report", tmp_path / "no" / "r.json")
    assert code == 2 and err.count("\n") == 1 and "--report" in err and "does not exist" in err
    assert not (tmp_path / "m-fp16.safetensors").exists()


def test_inspect_names_the_top_folder_not_dot(tmp_path, run_ckpt):
    d = tmp_path / "pipe"
    (d / "vae").mkdir(parents=True)
    write(d / "model.safetensors", {"a.weight": torch.ones(4, 4).to(torch.float8_e4m3fn)})
    write(d / "vae" / "model.safetensors", {"b.weight": torch.ones(4, 4).to(torch.float8_e4m3fn)})
    code, out, err = run_ckpt("inspect", d, "--json")
    warnings = json.loads(out)["warnings"]
    assert code == 0 and warnings[0].startswith("top folder: 1 tensor stored as fp8_e4m3fn")
    assert warnings[1].startswith("vae: 1 tensor stored") and not any(w.startswith(".:") for w in warnings)


def test_plural_is_the_one_wording_of_counts():
    """report.plural: the singular for exactly one, thousands separated, a consonant + "y" as "ies"
    (pickles' non-tensor entries) while a vowel + "y" keeps its "s" (keys)."""
    from ckpt.report import plural

    assert [plural(n, "tensor") for n in (0, 1, 2, 1024)] == ["0 tensors", "1 tensor", "2 tensors", "1,024 tensors"]
    assert (plural(1, "entry"), plural(3, "non-tensor entry")) == ("1 entry", "3 non-tensor entries")
    assert (plural(1, "stored key"), plural(2, "stored key")) == ("1 stored key", "2 stored keys")
