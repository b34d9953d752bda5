"""`--device`: the auto rule, exact fp32 (no TF32) around ckpt's CUDA math with the caller's setting given
back, the Caster's branch-free device path (checked on the CPU, where its ops run the same), and the
CUDA pipeline against the CPU one (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpt.cast as cast
from ckpt.cast import Caster
from ckpt.devices import TF32_OVERRIDE, exact_fp32, resolve_device
from ckpt.errors import CkptError
from ckpt.io.write_stages import Slot
from ckpt.report import Report

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ------------------------------------------------------------------------------------------- auto rule


def test_auto_is_cpu_without_cuda_or_without_math(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(CkptError, match="no CUDA device"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto", heavy=False) == torch.device("cpu")
    assert resolve_device("auto", heavy=True) == torch.device("cuda")


def test_tf32_override_is_refused_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(TF32_OVERRIDE, "1")
    with pytest.raises(CkptError, match=TF32_OVERRIDE):
        resolve_device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


def test_convert_auto_asks_for_a_gpu_only_for_decoding(tmp_path, monkeypatch, run_ckpt):
    import ckpt.convert.command as command

    asked = []
    real = command.resolve_device

    def spy(name, heavy=True):
        asked.append((name, heavy))
        return real(name, heavy)

    monkeypatch.setattr(command, "resolve_device", spy)
    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.randn(4, 4).bfloat16()}, plain)
    scaled = tmp_path / "scaled.safetensors"
    save_file({"w.weight": torch.randn(4, 4).to(torch.float8_e4m3fn), "w.scale_weight": torch.tensor(0.5),
               "scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, scaled)
    for src, heavy in ((plain, False), (scaled, True)):
        asked.clear()
        code, _, err = run_ckpt("convert", src, "--to", "fp16", "--device", "auto", "-q")
        assert code == 0, err
        # a plain cast stays on the CPU without asking (a plan of byte copies needs no torch to ask with)
        assert asked == ([("auto", True)] if heavy else []), src.name


AUTO_CASES = [  # (argv after the command, module that resolves the device, does the run do GPU-worthy math)
    (["dequant", "{f}", "-o", "{o}"], "ckpt.dequant.command", True),
    (["merge-lora", "{b}", "{f}", "-o", "{o}"], "ckpt.merge_lora.command", True),  # asked after planning: a base
    (["lora", "extract", "{f}", "{f}", "--rank", "4", "-o", "{o}"], "ckpt.lora.extract", True),
    (["lora", "resize", "{f}", "--rank", "4", "-o", "{o}"], "ckpt.lora.resize", True),
    (["lora", "merge", "{f}", "{f}", "--svd", "--rank", "4", "-o", "{o}"], "ckpt.lora.merge", True),
    (["lora", "merge", "{f}", "{f}", "--concat", "-o", "{o}"], "ckpt.lora.merge", False),
    (["lora", "convert", "{f}", "--format", "kohya", "-o", "{o}"], "ckpt.lora.convert", False),
    (["lora", "convert", "{f}", "--format", "kohya", "--to-lora", "4", "-o", "{o}"], "ckpt.lora.convert", True),
]


@pytest.mark.parametrize("argv,module,heavy", AUTO_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_every_command_resolves_auto_with_its_own_heaviness(tmp_path, monkeypatch, run_ckpt, argv, module, heavy):
    """One rule, `resolve_device(name, heavy)`, in every command: SVDs, decodes and merges may go to a GPU,
    renames and factor stacking stay on the CPU. The spy stops the command right there (exit 2)."""
    import importlib

    asked = []

    def spy(name, heavy=True):
        asked.append((name, heavy))
        raise CkptError("stopped by the test")

    monkeypatch.setattr(importlib.import_module(module), "resolve_device", spy)
    monkeypatch.setattr("ckpt.devices.torch_has_gpu_backend", lambda: True)  # else auto is the CPU unasked on a CPU build
    f = tmp_path / "in.safetensors"
    save_file({"x.lora_down.weight": torch.zeros(2, 4), "x.lora_up.weight": torch.zeros(4, 2)}, f)
    save_file({"x.weight": torch.zeros(4, 4)}, tmp_path / "base.safetensors")
    code, _, err = run_ckpt(*[a.format(f=f, b=tmp_path / "base.safetensors", o=tmp_path / "out.safetensors")
                              for a in argv], "--device", "auto", "-q")
    assert code == 2 and "stopped by the test" in err, err
    assert asked == [("auto", heavy)]
    assert not (tmp_path / "out.safetensors").exists()


def test_device_is_defined_once():
    """`resolve_device` and `exact_fp32` live in ckpt.devices only (run.py and svd.py had their own)."""
    import ckpt.lora.svd
    import ckpt.run

    assert not hasattr(ckpt.run, "resolve_device") and not hasattr(ckpt.lora.svd, "exact_fp32")


# ------------------------------------------------------------------------------------------- exact fp32


def flags():
    return torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()


@pytest.mark.parametrize("caller", ["default", "legacy-tf32", "high", "new-api-tf32", "mixed"])
def test_exact_fp32_turns_tf32_off_and_gives_the_callers_setting_back(caller):
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn
    before = (m.fp32_precision, c.conv.fp32_precision, c.allow_tf32)
    try:
        if caller == "legacy-tf32":
            m.allow_tf32 = True
        elif caller == "high":
            torch.set_float32_matmul_precision("high")
        elif caller == "new-api-tf32":
            m.fp32_precision = "tf32"
        elif caller == "mixed":
            m.allow_tf32 = False
            m.fp32_precision = "tf32"  # the legacy getters now raise
        state = (m.fp32_precision, c.conv.fp32_precision)
        with exact_fp32():
            assert flags() == (False, "highest") and m.fp32_precision == "ieee"
            assert not c.allow_tf32
        assert (m.fp32_precision, c.conv.fp32_precision) == state
    finally:
        torch.set_float32_matmul_precision("highest")
        m.fp32_precision, c.conv.fp32_precision = before[0], before[1]
        c.allow_tf32 = before[2]


# ----------------------------------------------------------------------------- the Caster's device path


def all_patterns(dtype) -> torch.Tensor:
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("clamp", [False, True])
@pytest.mark.parametrize("src,dst", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16),
                                     (torch.float32, torch.float16), (torch.float64, torch.bfloat16),
                                     (torch.float16, torch.float32)], ids=str)
def test_branch_free_device_path_equals_the_cpu_path(src, dst, clamp):
    """`_cast_on_device` is what CUDA runs (masks instead of host branches, counts deferred); its ops give
    the same results on the CPU, so it is checked here against the CPU path, bytes and counts."""
    if src.itemsize == 2:
        x = all_patterns(src)
    else:
        g = torch.Generator().manual_seed(0)
        x = torch.cat([torch.randn(3000, generator=g) * 1e5, torch.tensor([float("nan"), float("inf"), -1e39])]).to(src)
    want_report, got_report = Report(), Report()
    want = Caster(dst, want_report, clamp=clamp)(x, "w")
    slot = Slot()
    got = Caster(dst, got_report, clamp=clamp)._cast_on_device(x, "w", slot)
    int_t = {2: torch.int16, 4: torch.int32}[dst.itemsize]
    assert torch.equal(got.view(int_t), want.view(int_t))
    assert got_report.counts == want_report.counts and sum(map(len, want_report.counts.values()))


def test_counts_left_on_a_device_are_reported_when_the_band_is_back():
    report = Report()
    slot = Slot()
    cast._later(slot, lambda c: report.count("overflow", "w", int(c[1])), torch.tensor([0, 3]))
    assert report.counts["overflow"] == {"w": 3}  # a CPU value: reported at once
    cast._later(None, lambda c: report.count("overflow", "w", int(c[1])), torch.tensor([0, 2]))
    assert report.counts["overflow"] == {"w": 5}


# ------------------------------------------------------------------------------------ the CUDA pipeline


def tricky(tmp_path):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(257, 33, generator=g) * 40000
    x[5, 5], x[7, 1], x[100, 0] = float("nan"), float("inf"), -float("inf")
    t = {"big": x, "small": torch.randn(7, generator=g), "ids": torch.arange(12).reshape(3, 4),
         "bf": torch.randn(64, 16, generator=g).bfloat16(), "scalar": torch.tensor(2.5)}
    src = tmp_path / "m.safetensors"
    save_file(t, src)
    return src


@cuda
@pytest.mark.parametrize("to", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("clamp", [False, True])
def test_cuda_convert_is_byte_identical_to_cpu(tmp_path, monkeypatch, run_ckpt, to, clamp):
    monkeypatch.setattr("ckpt.io.output.BAND_ELEMS", 256)
    src = tricky(tmp_path)
    outs, errs = [], []
    for device in ("cpu", "cuda"):
        out = tmp_path / f"{device}.safetensors"
        code, _, err = run_ckpt("convert", src, "--to", to, "-o", out, "--device", device, *(["--clamp"] * clamp))
        assert code == 0, err
        outs.append(load_file(out))
        errs.append(sorted(line for line in err.splitlines() if line.startswith("warning")))
    for k in outs[0]:
        a, b = outs[0][k], outs[1][k]
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), k
    assert errs[0] == errs[1]


@cuda
def test_cuda_merge_is_within_one_ulp_and_gives_tf32_back(tmp_path, monkeypatch, run_ckpt):
    monkeypatch.setattr("ckpt.io.output.BAND_ELEMS", 512)
    g = torch.Generator().manual_seed(4)
    base = tmp_path / "b.safetensors"
    save_file({"l.weight": torch.randn(300, 64, generator=g).bfloat16()}, base)
    lora = tmp_path / "l.safetensors"
    save_file({"l.lora_down.weight": torch.randn(8, 64, generator=g), "l.lora_up.weight": torch.randn(300, 8, generator=g)},
              lora)
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        outs = []
        for device in ("cpu", "cuda"):
            out = tmp_path / f"{device}.safetensors"
            code, _, err = run_ckpt("merge-lora", base, lora, "-o", out, "--device", device, "-q")
            assert code == 0, err
            outs.append(load_file(out)["l.weight"])
        assert torch.backends.cuda.matmul.allow_tf32  # the caller's setting is back
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    steps = (outs[0].view(torch.int16).int() - outs[1].view(torch.int16).int()).abs()
    assert int(steps.max()) <= 1


@cuda
def test_cuda_decode_of_scaled_fp8_is_byte_identical_to_cpu(tmp_path, monkeypatch, run_ckpt):
    monkeypatch.setattr("ckpt.io.output.BAND_ELEMS", 300)
    g = torch.Generator().manual_seed(3)
    src = tmp_path / "s.safetensors"

    def codes():  # every fp8 pattern, NaNs (0x7F, 0xFF) among them: CUDA's own cast and multiply lose their bytes
        c = (torch.randn(64, 48, generator=g) * 100).to(torch.float8_e4m3fn)
        c.view(-1)[:256] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
        return c

    save_file({"a.weight": codes(), "a.scale_weight": torch.tensor(0.0123), "b.weight": codes(),
               "b.scale_weight": torch.rand(64, 1, generator=g), "scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)},
              src)
    outs = []
    for device in ("cpu", "cuda"):
        for to in ("bf16", "fp32"):
            out = tmp_path / f"{device}-{to}.safetensors"
            code, _, err = run_ckpt("convert", src, "--to", to, "-o", out, "--device", device, "-q")
            assert code == 0, err
            outs.append(load_file(out))
    for cpu, gpu in zip(outs[:2], outs[2:]):
        for k in ("a.weight", "b.weight"):
            assert torch.equal(cpu[k].view(torch.uint8), gpu[k].view(torch.uint8)), k


@cuda
def test_cuda_pinned_buffers_are_a_fixed_set_reused_band_after_band(tmp_path, monkeypatch, run_ckpt):
    """Bands move through each slot's own pinned buffers ("raw" in, "d2h" out): however many bands a run
    moves, it holds at most DEPTH x 2 of them (plus torch's small cached blocks for counts)."""
    from ckpt.io.buffers import Buffers
    from ckpt.io.write_stages import DEPTH

    monkeypatch.setattr("ckpt.io.output.BAND_ELEMS", 1024)
    src = tmp_path / "m.safetensors"
    save_file({"a": torch.randn(400, 64).bfloat16(), "b": torch.randn(300, 32).bfloat16()}, src)
    seen, real = [], Buffers.pinned

    def spy(self, role, nbytes):
        buf = real(self, role, nbytes)
        seen.append((role, buf.data_ptr()))
        return buf

    monkeypatch.setattr(Buffers, "pinned", spy)
    code, _, err = run_ckpt("convert", src, "--to", "fp16", "-o", tmp_path / "o.safetensors", "--device", "cuda", "-q")
    assert code == 0, err
    bands = -(-400 // (1024 // 64)) + -(-300 // (1024 // 32))  # bands are whole rows: 16 and 32 rows
    assert sum(role == "raw" for role, _ in seen) == bands and sum(role == "d2h" for role, _ in seen) == bands
    assert len({p for _, p in seen}) <= 2 * DEPTH
    want = load_file(src)
    got = load_file(tmp_path / "o.safetensors")
    assert all(torch.equal(got[k], want[k].half()) for k in want)


@cuda
def test_cuda_reads_that_reuse_one_pinned_buffer_wait_for_its_copy(tmp_path):
    """A band stacked from several pieces (RowConcat) preads every piece into the same pinned buffer; each
    pread must wait for the previous piece's asynchronous copy (Buffers.fence), or the device gets the
    next piece's bytes."""
    from ckpt.io.buffers import Buffers
    from ckpt.io.checkpoint import open_checkpoint
    from ckpt.io.tensors import RowConcat
    from ckpt.quant.view import logical_view

    g = torch.Generator().manual_seed(1)
    src = tmp_path / "p.safetensors"
    save_file({f"p{i}": torch.randn(2048, 512, generator=g) for i in range(4)}, src)
    with open_checkpoint(str(src)) as ck:
        parts = logical_view(ck.components[0]).tensors
        cat = RowConcat("cat", [parts[f"p{i}"] for i in (0, 1, 2, 3, 0)])
        scratch = Buffers()
        for _ in range(3):
            got = cat.read(0, cat.rows, torch.device("cuda"), scratch).cpu()
            assert torch.equal(got, cat.read(0, cat.rows, torch.device("cpu")))


@cuda
def test_cuda_dequant_qint8_is_byte_identical_to_cpu(tmp_path, monkeypatch, run_ckpt):
    from optimum.quanto import freeze, qint8, quantization_map, quantize

    import json

    monkeypatch.setattr("ckpt.io.output.BAND_ELEMS", 256)
    torch.manual_seed(2)
    m = torch.nn.Sequential(torch.nn.Linear(256, 48), torch.nn.Linear(48, 20)).to(torch.bfloat16)
    quantize(m, weights=qint8)
    freeze(m)
    folder = tmp_path / "q"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, folder / "model.safetensors")
    (folder / "quanto_qmap.json").write_text(json.dumps(quantization_map(m)))
    outs = []
    for device in ("cpu", "cuda"):
        out = tmp_path / device  # a folder: the quanto save is one with its quantization map
        code, _, err = run_ckpt("dequant", folder, "-o", out, "--device", device, "-q")
        assert code == 0, err
        outs.append(load_file(out / "model.safetensors"))
    assert outs[0].keys() == outs[1].keys()
    for k, a in outs[0].items():
        b = outs[1][k]
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), k


@cuda
@pytest.mark.parametrize("kind", ["loha", "lokr", "dora"])
def test_cuda_lycoris_and_dora_merges_are_within_one_ulp_of_cpu(tmp_path, run_ckpt, kind):
    g = torch.Generator().manual_seed(5)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    base = tmp_path / "b.safetensors"
    save_file({"l.weight": torch.randn(96, 64, generator=g).bfloat16()}, base)
    lora = {"loha": {"l.hada_w1_a": r(96, 4), "l.hada_w1_b": r(4, 64), "l.hada_w2_a": r(96, 4), "l.hada_w2_b": r(4, 64),
                     "l.alpha": torch.tensor(2.0)},
            "lokr": {"l.lokr_w1": r(8, 8), "l.lokr_w2_a": r(12, 4), "l.lokr_w2_b": r(4, 8), "l.alpha": torch.tensor(2.0)},
            "dora": {"l.lora_down.weight": r(4, 64), "l.lora_up.weight": r(96, 4), "l.dora_scale": r(96, 1).abs() + 1}}[kind]
    path = tmp_path / "l.safetensors"
    save_file(lora, path)
    outs = []
    for device in ("cpu", "cuda"):
        out = tmp_path / f"{device}.safetensors"
        code, _, err = run_ckpt("merge-lora", base, path, "-o", out, "--device", device, "-q")
        assert code == 0, err
        outs.append(load_file(out)["l.weight"])
    steps = (outs[0].view(torch.int16).int() - outs[1].view(torch.int16).int()).abs()
    assert int(steps.max()) <= 1
