"""`ckpt convert` end to end: every value checked against torch's own cast, overflow and NaN/Inf
reporting checked against counts computed here from that cast, and the options' effects."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

F16_MAX = torch.finfo(torch.float16).max


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, name=""):
    assert got.dtype == want.dtype and got.shape == want.shape, name
    if want.numel():
        assert torch.equal(bits(got), bits(want)), name


def overflow_count(x: torch.Tensor, dst: torch.dtype) -> int:
    """Finite inputs that torch's cast turns into inf: the definition of an overflow."""
    return int((torch.isinf(x.to(dst)) & torch.isfinite(x)).sum())


def warning_count(err: str, kind_words: str, name: str) -> int | None:
    line = next((ln for ln in err.splitlines() if ln.startswith("warning:") and kind_words in ln), None)
    if line is None:
        return None
    m = re.search(re.escape(name) + r" \((\d+)\)", line)
    return int(m.group(1)) if m else None


@pytest.fixture
def overflowing(tmp_path):
    g = torch.Generator().manual_seed(0)
    hot = torch.randn(64, 8, generator=g) * 30000  # some beyond fp16's range
    hot[0, :4] = torch.tensor([65504.0, 65519.0, 65520.0, -70000.0])  # 65519 rounds to 65504: not an overflow
    hot_bf16 = (torch.randn(16, 4, generator=g) * 1e5).to(torch.bfloat16)
    cool = torch.randn(10, 10, generator=g)
    src = tmp_path / "m.safetensors"
    tensors = {"hot.weight": hot, "hot_bf16.weight": hot_bf16, "cool.weight": cool,
               "step": torch.tensor(7), "flags": torch.tensor([True, False])}
    save_file(tensors, src)
    return src, tensors


def test_fp16_overflow_is_counted_per_tensor_and_matches_torch(overflowing, run_ckpt):
    src, tensors = overflowing
    code, out, err = run_ckpt("convert", src, "--to", "fp16", "-q")
    assert code == 0, err
    got = load_file(src.with_name("m-fp16.safetensors"))
    for k, v in tensors.items():
        assert_bits_equal(got[k], v.to(torch.float16) if v.is_floating_point() else v, k)
    for k in ("hot.weight", "hot_bf16.weight"):
        n = overflow_count(tensors[k], torch.float16)
        assert n > 0 and warning_count(err, "overflowed to inf", k) == n
    assert "cool.weight" not in err
    assert "--clamp" in err  # the warning says how to avoid it


def test_clamp_saturates_exactly_the_overflows(overflowing, run_ckpt):
    src, tensors = overflowing
    code, out, err = run_ckpt("convert", src, "--to", "fp16", "--clamp", "-q", "-o", src.with_name("c.safetensors"))
    assert code == 0, err
    got = load_file(src.with_name("c.safetensors"))
    for k in ("hot.weight", "hot_bf16.weight"):
        x = tensors[k]
        y = x.to(torch.float16)
        over = torch.isinf(y) & torch.isfinite(x)
        want = torch.where(over, torch.where(x > 0, F16_MAX, -F16_MAX).to(torch.float16), y)
        assert_bits_equal(got[k], want, k)
        assert warning_count(err, "clamped", k) == int(over.sum())
    assert "overflowed" not in err


def test_nan_and_inf_in_the_input_are_reported_and_kept(tmp_path, run_ckpt):
    x = torch.randn(20, 5)
    x[3, 1], x[7, 2], x[9, 0] = float("nan"), float("inf"), float("-inf")
    same_dtype = torch.tensor([1.0, float("nan")], dtype=torch.float16)
    src = tmp_path / "n.safetensors"
    save_file({"x": x, "h": same_dtype}, src)
    code, out, err = run_ckpt("convert", src, "--to", "fp16", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "n-fp16.safetensors")
    assert_bits_equal(got["x"], x.half())
    assert_bits_equal(got["h"], same_dtype)
    assert warning_count(err, "NaN/Inf values were already in the input", "x") == 3
    # "h" is already fp16: its bytes are copied by the kernel unread (ckpt.io.byte_copy), which the note says
    assert "h (" not in err and "note: 1 tensor (4 bytes) was copied byte for byte" in run_ckpt(
        "convert", src, "--to", "fp16", "-o", tmp_path / "again.safetensors")[2]
    assert "overflowed" not in err  # inf that was already there is not an overflow


def test_bf16_target_and_fp32_upcast_are_torch_casts(overflowing, run_ckpt, tmp_path):
    src, tensors = overflowing
    big = torch.tensor([3.39e38, 3.4e38, -3.4e38, 1.0])  # near fp32 max: beyond bf16's largest finite
    save_file({"big": big, **tensors}, tmp_path / "b.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "b.safetensors", "--to", "bf16", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "b-bf16.safetensors")
    assert_bits_equal(got["big"], big.to(torch.bfloat16))
    n = overflow_count(big, torch.bfloat16)
    assert n and warning_count(err, "overflowed", "big") == n
    code, _, err = run_ckpt("convert", tmp_path / "b-bf16.safetensors", "--to", "fp32", "-q")
    got32 = load_file(tmp_path / "b-bf16-fp32.safetensors")
    for k, v in got.items():
        assert_bits_equal(got32[k], v.float() if v.is_floating_point() else v, k)


def test_keep_patterns_and_non_float_tensors(tmp_path, run_ckpt):
    g = torch.Generator().manual_seed(1)
    tensors = {
        "model.norm.weight": torch.randn(8, generator=g),
        "model.layers.0.norm.weight": torch.randn(8, generator=g),
        "model.layers.0.mlp.weight": torch.randn(8, 8, generator=g),
        "lm_head.weight": torch.randn(4, 8, generator=g),
        "position_ids": torch.arange(8),
        "mask": torch.tensor([True, False]),
        "codes": torch.randint(0, 255, (5,), dtype=torch.uint8, generator=g),
    }
    src = tmp_path / "k.safetensors"
    save_file(tensors, src)
    code, out, err = run_ckpt("convert", src, "--to", "bf16", "--keep", "*norm*", "--keep", "lm_head.*", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "k-bf16.safetensors")
    for k, v in tensors.items():
        kept = "norm" in k or k.startswith("lm_head.") or not v.is_floating_point()
        assert_bits_equal(got[k], v if kept else v.to(torch.bfloat16), k)


def test_fp8_inputs_upcast_exactly_for_all_256_patterns(tmp_path, run_ckpt):
    pats = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    tensors = {str(dt).split(".")[-1]: pats.clone().view(dt) for dt in (torch.float8_e4m3fn, torch.float8_e5m2)}
    tensors["odd"] = pats[:255].clone().view(torch.float8_e4m3fn)  # odd length: the pair table's tail path
    save_file(tensors, tmp_path / "f8.safetensors")
    for to, dst in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)):
        code, _, err = run_ckpt("convert", tmp_path / "f8.safetensors", "--to", to, "-q", "--overwrite")
        assert code == 0, err
        got = load_file(tmp_path / f"f8-{to}.safetensors")
        for k, v in tensors.items():
            assert_bits_equal(got[k], v.to(dst), f"{k}->{to}")


def test_default_output_names(tmp_path, run_ckpt):
    save_file({"w": torch.ones(2)}, tmp_path / "a.safetensors")
    torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, tmp_path / "b.ckpt")
    folder = tmp_path / "c"
    folder.mkdir()
    save_file({"w": torch.ones(2)}, folder / "model.safetensors")
    sharded = tmp_path / "d"
    sharded.mkdir()
    save_file({"w": torch.ones(2)}, sharded / "model-00001-of-00001.safetensors")
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    for src, out in [("a.safetensors", "a-bf16.safetensors"), ("b.ckpt", "b-bf16.safetensors"), ("c", "c-bf16"),
                     ("d/model.safetensors.index.json", "d-bf16")]:
        code, stdout, err = run_ckpt("convert", tmp_path / src, "--to", "bf16", "-q")
        assert code == 0, err
        assert stdout.strip() == f"wrote {tmp_path / out}"
    assert load_file(tmp_path / "b-bf16.safetensors")["w"].dtype == torch.bfloat16
    assert (tmp_path / "c-bf16" / "model.safetensors").is_file()
    assert (tmp_path / "d-bf16" / "model.safetensors.index.json").is_file()


def test_dry_run_writes_nothing_but_checks_everything(tmp_path, run_ckpt):
    src = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(4)}, src)
    code, out, err = run_ckpt("convert", src, "--to", "fp16", "--dry-run")
    assert code == 0, err
    assert out.strip() == f"would write {tmp_path / 'm-fp16.safetensors'}"
    assert "dry run: would write 1 safetensors file" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
    # an existing output is reported, never refused: a dry run writes nothing
    (tmp_path / "m-fp16.safetensors").write_text("x")
    code, out, err = run_ckpt("convert", src, "--to", "fp16", "--dry-run")
    assert code == 0 and f"{tmp_path / 'm-fp16.safetensors'}: exists: needs --overwrite" in err, err
    code, out, err = run_ckpt("convert", src, "--to", "fp16", "--dry-run", "--overwrite")
    assert code == 0 and "m-fp16.safetensors: would overwrite it" in err, err
    assert (tmp_path / "m-fp16.safetensors").read_text() == "x"
    code, out, err = run_ckpt("convert", src, "--to", "fp16", "--dry-run", "-o", tmp_path / "new" / "sub" / "x.safetensors")
    assert code == 0 and f"would create folder {tmp_path / 'new'}" in err, err
    # what a real run would refuse for any other reason, a dry run refuses too
    code, out, err = run_ckpt("convert", src, "--to", "fp16", "--dry-run", "-o", src, "--overwrite")
    assert code == 2 and "refusing to write over an input" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-fp16.safetensors", "m.safetensors"]


def test_quiet_hides_notes_not_warnings(tmp_path, run_ckpt):
    torch.save({"state_dict": {"w": torch.tensor([1e6])}, "epoch": 1}, tmp_path / "l.ckpt")
    code, out, err = run_ckpt("convert", tmp_path / "l.ckpt", "--to", "fp16")
    assert code == 0 and "note: l.ckpt: using the nested 'state_dict'" in err and "overflowed" in err
    code, out, err = run_ckpt("convert", tmp_path / "l.ckpt", "--to", "fp16", "-q", "--overwrite")
    assert code == 0 and "note:" not in err and "overflowed" in err


def test_invalid_options_exit_2(tmp_path, run_ckpt):
    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    for args in (["--to", "fp12"], ["--to", "fp16", "--max-shard-size", "lots"], ["--to", "fp16", "--device", "tpu"]):
        code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", *args)
        assert code == 2, (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_device_auto_and_missing_cuda(tmp_path, run_ckpt):
    x = torch.randn(30, 3) * 40000
    save_file({"x": x}, tmp_path / "m.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "fp16", "--device", "auto", "-q")
    assert code == 0, err
    assert_bits_equal(load_file(tmp_path / "m-fp16.safetensors")["x"], x.half())
    if not torch.cuda.is_available():
        code, _, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "fp16", "--device", "cuda",
                                "-o", tmp_path / "g.safetensors")
        assert code == 2 and "no CUDA device" in err and not (tmp_path / "g.safetensors").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu_bit_for_bit(tmp_path, run_ckpt):
    g = torch.Generator().manual_seed(2)
    tensors = {"a": torch.randn(300, 70, generator=g) * 30000, "b": torch.randn(33, generator=g).to(torch.bfloat16),
               "c": torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn), "i": torch.arange(3)}
    tensors["a"][0, 0] = float("nan")
    save_file(tensors, tmp_path / "m.safetensors")
    for clamp in ([], ["--clamp"]):
        _, _, err_cpu = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "fp16", "-o", tmp_path / "cpu.safetensors",
                                 "--overwrite", *clamp)
        code, _, err_gpu = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "fp16", "--device", "cuda",
                                    "-o", tmp_path / "gpu.safetensors", "--overwrite", *clamp)
        assert code == 0, err_gpu
        assert (tmp_path / "cpu.safetensors").read_bytes() == (tmp_path / "gpu.safetensors").read_bytes()
        assert err_cpu == err_gpu


def test_hub_id_converts_from_offline_cache_into_cwd(tmp_path, monkeypatch, run_ckpt):
    cache = tmp_path / "hub"
    snap = cache / "models--owner--tiny" / "snapshots" / ("c" * 40)
    snap.mkdir(parents=True)
    (cache / "models--owner--tiny" / "refs").mkdir()
    (cache / "models--owner--tiny" / "refs" / "main").write_text("c" * 40)
    w = torch.randn(3, 3)
    save_file({"w": w}, snap / "model.safetensors")
    (snap / "config.json").write_text(json.dumps({"architectures": ["T"], "torch_dtype": "float32"}))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code, out, err = run_ckpt("convert", "owner/tiny", "--to", "fp16", "-q")
    assert code == 0, err
    assert out.strip() == f"wrote {work / 'tiny-fp16'}"
    assert_bits_equal(load_file(work / "tiny-fp16" / "model.safetensors")["w"], w.half())
    assert json.loads((work / "tiny-fp16" / "config.json").read_text())["torch_dtype"] == "float16"
    code, out, err = run_ckpt("convert", "owner/tiny/model.safetensors", "--to", "bf16", "-q")
    assert code == 0 and (work / "model-bf16.safetensors").is_file()
    with safe_open(work / "model-bf16.safetensors", "pt") as f:
        assert f.metadata()["ckpt_operation"] == "convert --to bf16"


def test_tiny_bands_give_the_same_bytes(tmp_path, monkeypatch, run_ckpt):
    """Many bands per tensor (reused buffers, odd band lengths, fp8 pair table across band edges) must
    write exactly what torch's whole-tensor cast gives, and count the same overflows."""
    import ckpt.io.output as output

    g = torch.Generator().manual_seed(3)
    tensors = {"a": torch.randn(37, 5, generator=g) * 30000, "b": torch.randn(101, generator=g).to(torch.bfloat16),
               "c": torch.randn(29, 3, generator=g).to(torch.float8_e4m3fn), "d": torch.arange(50).reshape(25, 2)}
    save_file(tensors, tmp_path / "m.safetensors")
    monkeypatch.setattr(output, "BAND_ELEMS", 7)
    code, _, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "fp16", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "m-fp16.safetensors")
    for k, v in tensors.items():
        assert_bits_equal(got[k], v.to(torch.float16) if v.is_floating_point() else v, k)
    assert warning_count(err, "overflowed", "a") == overflow_count(tensors["a"], torch.float16)


def test_torch_format_output_is_what_torch_save_writes(tmp_path, run_ckpt):
    """-o x.pth writes torch's own zip format (streamed): torch.load gives torch's casts, and the bytes
    are those torch.save writes for the same dict (apart from its serialization id record)."""
    import zipfile

    torch.manual_seed(0)
    sd = {"b.weight": torch.randn(64, 33), "a.bias": torch.randn(7).to(torch.bfloat16),
          "steps": torch.tensor(5), "e": torch.randn(3).to(torch.float8_e4m3fn)}
    save_file(sd, tmp_path / "m.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "fp16", "-o", tmp_path / "m.pth", "-q")
    assert code == 0, err
    want = {k: (v.to(torch.float16) if v.is_floating_point() else v) for k, v in sd.items()}
    for mmap in (False, True):  # mmap=False reads through miniz, which checks every CRC32
        got = torch.load(tmp_path / "m.pth", weights_only=True, mmap=mmap)
        assert set(got) == set(sd)  # in the input file's order (safetensors' own header order)
        for k in want:
            assert_bits_equal(got[k], want[k], k)
    (tmp_path / "ref").mkdir()
    torch.save({k: want[k] for k in got}, tmp_path / "ref" / "m.pth")
    mine, ref = zipfile.ZipFile(tmp_path / "m.pth"), zipfile.ZipFile(tmp_path / "ref" / "m.pth")
    same = [(i.filename, i.header_offset, i.file_size, i.CRC) for i in mine.infolist() if "serialization_id" not in i.filename]
    assert same == [(i.filename, i.header_offset, i.file_size, i.CRC) for i in ref.infolist()
                    if "serialization_id" not in i.filename]

    # --format torch with the default name; a folder with --format torch keeps pickle names
    code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "bf16", "--format", "torch", "-q")
    assert code == 0 and (tmp_path / "m-bf16.pth").is_file(), err
    code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "bf16", "--format", "safetensors",
                              "-o", tmp_path / "x.pth")
    assert code == 2 and "names a torch file but --format is safetensors" in err


def test_torch_format_shards_like_transformers(tmp_path, run_ckpt):
    """A one-file input resharded in torch format: `m-0000x-of-0000y.bin` torch zips and their index."""
    sd = {"a": torch.randn(4, 4), "b": torch.randn(4, 4)}
    save_file(sd, tmp_path / "m.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", "fp16", "--format", "torch",
                              "--max-shard-size", "40B", "-o", tmp_path / "out", "-q")
    assert code == 0, err
    index = json.loads((tmp_path / "out" / "m.bin.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["m-00001-of-00002.bin", "m-00002-of-00002.bin"]
    assert index["metadata"]["total_size"] == 64
    for k, f in index["weight_map"].items():
        assert torch.equal(torch.load(tmp_path / "out" / f, weights_only=True)[k], sd[k].half())