"""A convert whose computed tensors are all casts of stored fp32/fp16/bf16 bytes to another of the three runs without
torch (`ckpt.cast_cpu`'s kernels on numpy bands, `ckpt.io.output.host_casts`): in a fresh interpreter, torch is never
imported, and the output is byte for byte what torch's path writes (`save_file` of torch's cast with the NaN rule),
with the same warnings (NaN/Inf inputs, overflows, --clamp), beside kernel copies (early and streamed) of the tensors
that keep their dtype, one file or sharded. What the kernels do not cast (fp64, fp8) still goes through torch."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt.cast import nan_bits
from helpers.refusals import assert_refused
from helpers.torch_free import run_fresh

INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def model(dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    big = torch.randn(1100, 1024, generator=g) * 3000  # some values overflow fp16
    big[3, :7] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e38, -1e38, 65519.0, 65520.0])
    return {"big.weight": big.to(dtype),
            "small.weight": torch.randn(33, 17, generator=g).to(dtype),
            "kept_half": torch.randn(2100, 1024, generator=g).half(),  # same dtype as the target: copied (early)
            "ids": torch.arange(12, dtype=torch.int64)}


def torch_cast(sd: dict, dst: torch.dtype, clamp: bool = False) -> dict:
    """torch's cast of every floating tensor, NaNs by the rule, overflows clamped on request: the reference."""
    out = {}
    for k, x in sd.items():
        if not x.is_floating_point() or x.dtype == dst:
            out[k] = x
            continue
        y = x.to(dst)
        nan = torch.isnan(x)
        if nan.any():
            y.view(INT[dst])[nan] = nan_bits(x[nan], dst).view(INT[dst])
        if clamp:
            over = torch.isinf(y) & torch.isfinite(x)
            top = torch.finfo(dst).max
            y[over & (x > 0)], y[over & (x < 0)] = top, -top
        out[k] = y
    return out


def same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def warnings(err: str) -> list[str]:
    return sorted(line for line in err.splitlines() if line.startswith("warning:"))


@pytest.mark.parametrize("src,dst,clamp", [(torch.bfloat16, "fp16", False), (torch.float32, "fp16", True),
                                           (torch.float32, "bf16", False), (torch.float16, "fp32", False)], ids=str)
def test_convert_runs_without_torch_and_writes_torchs_bytes(tmp_path, run_ckpt, monkeypatch, src, dst, clamp):
    sd = model(src)
    save_file(sd, tmp_path / "m.safetensors")
    target = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dst]
    args = ["convert", tmp_path / "m.safetensors", "--to", dst, *(["--clamp"] if clamp else [])]
    verdict, err = run_fresh(*args, "-o", tmp_path / "fresh.safetensors")
    assert verdict == {"code": 0, "torch": False}, err
    assert same_bytes(load_file(tmp_path / "fresh.safetensors"), torch_cast(sd, target, clamp))
    # torch's pipeline (the kernels off): the same file and the same warnings
    import ckpt.cast_cpu as cast_cpu

    monkeypatch.setattr(cast_cpu, "_AVAILABLE", False)
    code, _, torch_err = run_ckpt(*args, "-o", tmp_path / "torch.safetensors")
    assert code == 0, torch_err
    assert (tmp_path / "torch.safetensors").read_bytes() == (tmp_path / "fresh.safetensors").read_bytes()
    assert warnings(err) == warnings(torch_err)
    if target == torch.float16:  # (bf16 holds every fp32 value here)
        assert any(("clamped" if clamp else "overflow") in w for w in warnings(err)), err


def test_sharded_output_and_early_copies_without_torch(tmp_path, monkeypatch):
    """A folder of shards, the copied tensor's interior written by the early copies' thread: bytes as torch's."""
    sd = model()
    save_file(sd, tmp_path / "m.safetensors")
    verdict, err = run_fresh("convert", tmp_path / "m.safetensors", "--to", "fp16", "--max-shard-size", "3MB",
                             "-o", tmp_path / "out")
    assert verdict == {"code": 0, "torch": False}, err
    got = {}
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        got.update(load_file(f))
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1
    assert same_bytes(got, torch_cast(sd, torch.float16))


def test_what_the_kernels_do_not_cast_goes_through_torch(tmp_path):
    sd = {"a": torch.randn(40, 8, dtype=torch.float64), "b": torch.randn(40, 8)}
    save_file(sd, tmp_path / "m.safetensors")
    verdict, err = run_fresh("convert", tmp_path / "m.safetensors", "--to", "fp16", "-o", tmp_path / "o.safetensors")
    assert verdict == {"code": 0, "torch": True}, err
    got = load_file(tmp_path / "o.safetensors")
    assert torch.equal(got["a"], sd["a"].half()) and torch.equal(got["b"], sd["b"].half())


def test_an_input_cut_short_while_casting_is_one_line_and_writes_nothing(tmp_path, run_ckpt, monkeypatch):
    """The file shrinks after planning (another program rewrote it): the band's read finds it short."""
    import os

    import ckpt.io.output as output

    src = tmp_path / "m.safetensors"
    save_file(model(), src)
    real = output.host_casts

    def cut_then_plan(*a):
        plan = real(*a)
        assert plan is not None  # the path without torch
        os.truncate(src, src.stat().st_size - 4096)
        return plan

    monkeypatch.setattr(output, "host_casts", cut_then_plan)
    assert_refused(run_ckpt, tmp_path, ["convert", src, "--to", "fp16", "-o", tmp_path / "o.safetensors"],
                   str(src), "unexpected end of file")
