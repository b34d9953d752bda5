"""Seeded mutants of tiny real quantized checkpoints, for every quantized-format decoder.

Each checkpoint is made by the format's own library (bitsandbytes, comfy-kitchen, optimum-quanto) or,
for the FP8 scaled layouts no installed library writes (kohya fp8_scaled, HF block FP8, weight_scale FP8,
ComfyUI legacy scaled_fp8), from the layout definition in docs/format-facts.md. A mutant drops one stored key,
reshapes it (same values in another shape, one value less, the values twice), retypes it (a value cast, as
`.float()` would) or puts NaN/Inf into it. `ckpt convert --to fp32` of each mutant must either

- refuse it: exit 2, exactly one `error: <file>: ...` line, nothing written, the input unchanged; or
- decode it to the oracle's values (the library's own dequantize of the mutated tensors, or the layout's
  formula), bit for bit (NaN payloads and the sign of zero aside), with exactly the keys of the plain
  model, and every NaN/Inf the oracle gives counted in the run's NaN/Inf warning, as convert reports it.

A mutant the oracle itself cannot decode must be refused. CI runs `CASES` mutants per checkpoint (seeded:
the same cases every run); `CKPT_FUZZ_CASES=N` runs N per checkpoint, `CKPT_FUZZ_SEED=S` another sequence.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

CASES = int(os.environ.get("CKPT_FUZZ_CASES", "16"))
SEED = int(os.environ.get("CKPT_FUZZ_SEED", "20"))
E4 = torch.float8_e4m3fn


@dataclass
class Model:
    """A tiny quantized checkpoint and its oracle: `oracle(sd)` gives the fp32 values of the decoded
    weights of a (mutated) state dict, or raises when the format cannot give any."""

    sd: dict[str, torch.Tensor]
    weights: list[str]  # the decoded (logical) weight names
    oracle: Callable[[dict], dict[str, torch.Tensor]]
    plain: set[str] = field(default_factory=set)  # stored keys written as they are (biases)
    optional: set[str] = field(default_factory=set)  # keys whose absence changes no value (activation scales)
    metadata: dict | None = None
    config: dict | None = None  # written as config.json beside model.safetensors


def _rand(shape, seed, scale=0.05):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------------------------------------------
# checkpoints and oracles


def bnb_4bit(quant_type: str, nested: bool) -> Model:
    F = pytest.importorskip("bitsandbytes.functional")
    w = _rand((24, 64), 1 if nested else 2).bfloat16()
    q, st = F.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=nested)
    sd = {"m.weight": q} | {f"m.weight.{k}": v for k, v in st.as_dict(packed=True).items()}
    sd["m.bias"] = _rand((24,), 3).bfloat16()

    def oracle(sd):
        parts = {k[len("m.weight."):]: v for k, v in sd.items() if k.startswith("m.weight.")}
        parts.setdefault("quant_map", st.code)  # the format's fixed table: bitsandbytes writes it, needs it
        state = F.QuantState.from_dict(parts, device=torch.device("cpu"))
        state.dtype = torch.float32
        a = sd["m.weight"]
        return {"m.weight": F.dequantize_4bit(a if a.dtype == torch.uint8 else a.contiguous().view(torch.uint8), state)}

    return Model(sd, ["m.weight"], oracle, plain={"m.bias"})


def bnb_int8() -> Model:
    F = pytest.importorskip("bitsandbytes.functional")
    w = _rand((16, 32), 4)
    cb, scb, _ = F.int8_vectorwise_quant(w)
    sd = {"m.weight": cb, "m.SCB": scb, "m.weight_format": torch.tensor(0, dtype=torch.uint8),
          "m.bias": _rand((16,), 5)}

    def oracle(sd):
        assert sd["m.weight"].dtype == torch.int8 and sd["m.SCB"].dtype == torch.float32
        return {"m.weight": F.int8_vectorwise_dequant(sd["m.weight"], sd["m.SCB"])}

    return Model(sd, ["m.weight"], oracle, plain={"m.bias"}, optional={"m.weight_format"})


def comfy(fmt: str) -> Model:
    ck = pytest.importorskip("comfy_kitchen.tensor")
    shape = (32, 64)
    w = _rand(shape, 6)
    w[-1, -1] = 0.4
    conf = {"format": "int8_tensorwise" if fmt.startswith("int8") else fmt}
    if fmt == "float8_e4m3fn":
        q, p = ck.TensorCoreFP8Layout.quantize(w)
        saved = ck.TensorCoreFP8Layout.state_dict_tensors(q, p)
    else:
        from helpers.comfy_ref import ck_quantize

        _, _, saved = ck_quantize(conf["format"], w, rowwise=fmt == "int8_rowwise")
    sd = {f"m.weight{k}": v for k, v in saved.items()}
    sd["m.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    sd["m.input_scale"] = torch.tensor(1.0)
    sd["m.bias"] = _rand((32,), 7)

    def oracle(sd):
        w = sd["m.weight"]
        # the file says the shape only by its stored weight (no orig_shape here, nothing padded)
        stored = (w.shape[0], w.shape[1] * 2) if conf["format"] == "nvfp4" else tuple(w.shape)
        if fmt == "float8_e4m3fn":  # ComfyUI: a float8 layer without weight_scale has scale 1
            s = sd.get("m.weight_scale", torch.ones(()))
            assert w.dtype == E4 and s.dtype.is_floating_point and s.dtype.itemsize > 1
            params = ck.TensorCoreFP8Layout.Params(scale=s, orig_dtype=torch.float32, orig_shape=stored)
            return {"m.weight": ck.QuantizedTensor(w, "TensorCoreFP8Layout", params).dequantize()}
        from helpers.comfy_ref import STORAGE, comfy_load

        assert w.dtype == STORAGE[conf["format"]]
        s = sd["m.weight_scale"]
        if conf["format"] != "int8_tensorwise" and s.dim() == 1:  # ckpt reads flattened blocked scales too
            s = s.reshape(128, -1)
        return {"m.weight": comfy_load(sd | {"m.weight_scale": s}, "m", stored)}

    optional = {"m.input_scale"} | ({"m.comfy_quant"} if fmt == "float8_e4m3fn" else set())
    return Model(sd, ["m.weight"], oracle, plain={"m.bias"}, optional=optional)


def _fp8_codes(shape, seed):
    return (_rand(shape, seed, 40.0)).to(E4)


def _row_or_tensor(s: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A scale as the layouts define it: one value, or one per dim-0 row ([rows], [rows, 1], ...),
    shaped to broadcast over `w`."""
    if s.numel() == 1:
        return s.float().reshape(())
    rows = w.shape[0]
    assert s.shape[0] == rows and s.numel() == rows, s.shape
    return s.float().reshape(rows, *[1] * (w.dim() - 1))


def kohya() -> Model:
    """musubi-tuner fp8_scaled: per-row [out, 1] scale; blocks of 64 along the input ([out, nb, 1]) with
    a second-level scalar `scale_weight_tensor`; the scales in the model's dtype (bf16)."""
    sd = {"a.weight": _fp8_codes((16, 32), 8), "a.scale_weight": (_rand((16, 1), 9).abs() + 0.01).bfloat16(),
          "b.weight": _fp8_codes((8, 128), 10), "b.scale_weight": (_rand((8, 2, 1), 11).abs() + 0.01).bfloat16(),
          "b.scale_weight_tensor": torch.tensor([0.5], dtype=torch.bfloat16), "a.bias": _rand((16,), 12).bfloat16()}

    def oracle(sd):
        out = {}
        for layer in ("a", "b"):
            w, s = sd[f"{layer}.weight"], sd[f"{layer}.scale_weight"]
            assert w.dtype == E4 and s.dtype.is_floating_point and s.dtype.itemsize > 1
            t = sd.get(f"{layer}.scale_weight_tensor")
            rows = w.shape[0]
            if s.numel() == 1 or s.numel() == rows and s.shape[0] == rows:  # one value, or one per row
                s = _row_or_tensor(s, w)
                tot = s if t is None else s * t.float().reshape(())
                out[f"{layer}.weight"] = w.float() * tot
            else:  # blocks along the input dimension of a Linear weight
                rows, cols = w.shape
                assert s.dim() in (2, 3) and s.shape[0] == rows and (s.dim() == 2 or s.shape[2] == 1), s.shape
                nb = s.shape[1]
                assert cols % nb == 0
                tot = s.float().reshape(rows, nb, 1) * (1.0 if t is None else t.float().reshape(()))
                out[f"{layer}.weight"] = (w.float().view(rows, nb, -1) * tot).view(rows, cols)
            if t is not None:
                assert t.numel() == 1 and t.dtype.is_floating_point and t.dtype.itemsize > 1
        return out

    return Model(sd, ["a.weight", "b.weight"], oracle, plain={"a.bias"})


def hf_block() -> Model:
    """HF fine-grained FP8: `weight_scale_inv` [ceil(out/128), ceil(in/128)] multiplies its 128x128 block."""
    sd = {"a.weight": _fp8_codes((200, 130), 13), "a.weight_scale_inv": _rand((2, 2), 14).abs() + 0.01,
          "b.weight": _fp8_codes((64, 64), 15), "b.weight_scale_inv": _rand((1, 1), 16).abs() + 0.01,
          "a.activation_scale": torch.tensor([1.0]), "norm.weight": _rand((64,), 17).bfloat16()}

    def oracle(sd):
        out = {}
        for layer in ("a", "b"):
            w, s = sd[f"{layer}.weight"], sd[f"{layer}.weight_scale_inv"]
            assert w.dtype == E4 and s.dtype.is_floating_point and s.dtype.itemsize > 1
            *lead, rows, cols = w.shape  # a matrix, or a bank of them (experts)
            if s.numel() == 1:
                out[f"{layer}.weight"] = w.float() * s.float().reshape(())
                continue
            assert tuple(s.shape) == (*lead, -(-rows // 128), -(-cols // 128)), s.shape
            full = s.float().repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :rows, :cols]
            out[f"{layer}.weight"] = w.float() * full
        return out

    return Model(sd, ["a.weight", "b.weight"], oracle, plain={"norm.weight"}, optional={"a.activation_scale"},
                 config={"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16",
                         "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})


def weight_scale() -> Model:
    """compressed-tensors / FBGEMM FP8: `weight_scale` per channel [out, 1] or per tensor, `input_scale`."""
    sd = {"a.weight": _fp8_codes((32, 64), 18), "a.weight_scale": _rand((32, 1), 19).abs() + 0.01,
          "a.input_scale": torch.tensor(0.5), "b.weight": _fp8_codes((16, 32), 20),
          "b.weight_scale": torch.tensor(0.02), "a.bias": _rand((32,), 21).bfloat16()}

    def oracle(sd):
        out = {}
        for layer in ("a", "b"):
            w, s = sd[f"{layer}.weight"], sd[f"{layer}.weight_scale"]
            assert w.dtype == E4 and s.dtype.is_floating_point and s.dtype.itemsize > 1
            out[f"{layer}.weight"] = w.float() * _row_or_tensor(s, w)
        return out

    return Model(sd, ["a.weight", "b.weight"], oracle, plain={"a.bias"}, optional={"a.input_scale"})


def comfy_legacy() -> Model:
    """ComfyUI legacy scaled fp8: `scaled_fp8` marker, fp32 scalar `scale_weight` (a dummy 1.0 on a
    high-precision layer), `scale_input`. Like ComfyUI, a layer without scale_weight has scale 1."""
    sd = {"scaled_fp8": torch.zeros(0, dtype=E4), "a.weight": _fp8_codes((16, 32), 22),
          "a.scale_weight": torch.tensor(0.003), "a.scale_input": torch.tensor(1.0),
          "b.weight": _rand((8, 16), 23).bfloat16(), "b.scale_weight": torch.tensor(1.0)}

    def oracle(sd):
        out = {}
        assert "scaled_fp8" in sd
        for layer in ("a", "b"):
            w, s = sd[f"{layer}.weight"], sd.get(f"{layer}.scale_weight", torch.ones(()))
            assert w.dtype.is_floating_point and s.dtype.is_floating_point and s.dtype.itemsize > 1
            out[f"{layer}.weight"] = w.float() * _row_or_tensor(s, w)
        return out

    return Model(sd, ["a.weight", "b.weight"], oracle, optional={"a.scale_input"})


def quanto(qtype: str) -> Model:
    oq = pytest.importorskip("optimum.quanto")

    def module(dtype=torch.float16, q=qtype):
        torch.manual_seed(24)
        m = torch.nn.ModuleDict({"lin": torch.nn.Linear(64, 32)}).to(dtype)
        oq.quantize(m, weights=oq.qtypes[q])
        oq.freeze(m)
        return m

    sd = {k: v.contiguous() for k, v in module().state_dict().items()}

    def oracle(sd):
        # 8-bit data says its qtype by its dtype (no quanto_qmap.json here): an int8 -> fp8 cast is a qfloat8 file
        d = sd.get("lin.weight._data")
        by_dtype = {torch.int8: "qint8", E4: "qfloat8_e4m3fn", torch.float8_e5m2: "qfloat8_e5m2"}
        m = module(q=by_dtype[d.dtype] if d is not None and qtype != "qint4" else qtype)
        # the weight's values: the bias and the activation scales are no part of them (the module's own)
        part = sd | {k: v for k, v in m.state_dict().items() if k in model.plain | model.optional}
        s, d = part.get("lin.weight._scale"), part.get("lin.weight._data")
        if s is not None and d is not None and s.dim() == 1 and s.numel() > 1 and d.dim() == 2:
            # ckpt reads a 1-D [rows] scale as one per row (tests/test_bad_quant_and_pickles.py pins it);
            # quanto's `scale * data` cannot broadcast it: given as the [rows, 1] it stands for
            part["lin.weight._scale"] = s.reshape(-1, 1)
        m.load_state_dict(part, strict=True)
        return {"lin.weight": m.lin.weight.dequantize()}

    model = Model(sd, ["lin.weight"], oracle, plain={"lin.bias"}, optional={"lin.input_scale", "lin.output_scale"})
    return model


MODELS = {
    "bnb-nf4-nested": lambda: bnb_4bit("nf4", True), "bnb-fp4": lambda: bnb_4bit("fp4", False), "bnb-int8": bnb_int8,
    "comfy-nvfp4": lambda: comfy("nvfp4"), "comfy-mxfp8": lambda: comfy("mxfp8"),
    "comfy-int8": lambda: comfy("int8_tensorwise"), "comfy-int8-rowwise": lambda: comfy("int8_rowwise"),
    "comfy-fp8": lambda: comfy("float8_e4m3fn"), "kohya-fp8-scaled": kohya, "hf-block-fp8": hf_block,
    "weight-scale-fp8": weight_scale, "comfy-legacy-fp8": comfy_legacy,
    "quanto-qint8": lambda: quanto("qint8"), "quanto-qfloat8": lambda: quanto("qfloat8_e4m3fn"),
    "quanto-qint4": lambda: quanto("qint4"),
}


# ---------------------------------------------------------------------------------------------------
# mutations

RETYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.int8, E4]


def _retype(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """A value cast, as a careless `.to(dtype)` / `.float()` writes it."""
    if dt == E4 or t.dtype in (E4, torch.float8_e5m2, torch.float8_e8m0fnu):
        return t.float().to(dt)
    return t.to(dt)


def _nonfinite(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    t = t.clone()
    flat = t.view(-1)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(flat.numel())
        if t.dtype == E4:
            flat.view(torch.uint8)[i] = 0x7F  # e4m3fn has NaN only
        elif t.dtype == torch.float8_e8m0fnu:
            flat.view(torch.uint8)[i] = 0xFF  # e8m0's NaN
        else:
            flat[i] = rng.choice([float("nan"), float("inf"), float("-inf")])
    return t


def _reshape(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    flat = t.reshape(-1)
    n = flat.numel()
    options = [("flat", lambda: flat.clone()), ("lead-1", lambda: t.reshape(1, *t.shape).clone()),
               ("twice", lambda: torch.cat([flat, flat])), ("trail-1", lambda: t.reshape(*t.shape, 1).clone())]
    if n > 1:
        options.append(("one-less", lambda: flat[:-1].clone()))
    if n % 2 == 0 and n > 2:
        options.append(("halves", lambda: flat.reshape(2, n // 2).clone()))
    _, make = rng.choice(options)
    return make()


def mutate(sd: dict, rng: random.Random) -> tuple[dict, str]:
    key = rng.choice(sorted(sd))
    t = sd[key]
    ops = ["drop", "reshape", "retype"] + (["nonfinite"] * 2 if (t.dtype.is_floating_point and t.numel()) else [])
    op = rng.choice(ops)
    out = dict(sd)
    if op == "drop":
        del out[key]
        return out, f"drop {key}"
    if op == "reshape":
        out[key] = _reshape(t, rng)
        return out, f"reshape {key} {list(t.shape)} -> {list(out[key].shape)}"
    if op == "retype":
        dt = rng.choice([d for d in RETYPES if d != t.dtype])
        out[key] = _retype(t, dt)
        return out, f"retype {key} {t.dtype} -> {dt}"
    out[key] = _nonfinite(t, rng)
    return out, f"NaN/Inf in {key}"


# ---------------------------------------------------------------------------------------------------
# the property


def _digest(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, NaN == NaN whatever its payload, +0 == -0 (bitsandbytes' CPU paths differ there)."""
    if got.shape != want.shape:
        return False
    g, w = got.float() + 0.0, want.float() + 0.0
    both_nan = torch.isnan(g) & torch.isnan(w)
    g, w = torch.where(both_nan, 0.0, g), torch.where(both_nan, 0.0, w)
    return bool(torch.equal(g.view(torch.int32), w.view(torch.int32)))


NONFINITE = re.compile(r"warning: ([\d,]+) NaN/Inf values? (?:was|were) already in the input")


def check_case(tmp_path, run_ckpt, m: Model, sd: dict, what: str) -> str:
    src_dir = tmp_path / "in"
    src_dir.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, src_dir / "model.safetensors", metadata=m.metadata)
    if m.config is not None:
        (src_dir / "config.json").write_text(json.dumps(m.config))
    src = src_dir if m.config is not None else src_dir / "model.safetensors"
    before = _digest(src_dir)
    out = tmp_path / "out.safetensors" if m.config is None else tmp_path / "out"
    code, stdout, err = run_ckpt("convert", src, "--to", "fp32", "-o", out)
    assert _digest(src_dir) == before, f"{what}: the input changed"
    try:
        want = m.oracle(sd)
    except Exception as e:  # the format (its library, its definition) gives no values for this mutant
        want, why = None, f"{type(e).__name__}: {e}"
    if code == 2:
        assert err.startswith(f"error: {src_dir}") and err.count("\n") == 1, f"{what}: {err!r}"
        assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in"], f"{what}: output written"
        return "refused"
    assert code == 0, f"{what}: exit {code}: {err}"
    assert want is not None, f"{what}: decoded with exit 0, but the oracle cannot decode it ({why}); {err}"
    got = load_file(out / "model.safetensors" if out.is_dir() else out)
    expected_keys = set(m.weights) | (m.plain & set(sd))
    assert set(got) == expected_keys, f"{what}: wrote {sorted(got)}, expected {sorted(expected_keys)}"
    for k in m.plain & set(sd):  # written as stored, cast exactly
        assert _same(got[k], sd[k]), f"{what}: {k} is not what was stored"
    bad = 0
    for k in m.weights:
        assert _same(got[k], want[k]), f"{what}: {k} differs from the oracle"
        bad += int((~torch.isfinite(want[k].float())).sum())
    # plain tensors already fp32 are copied unread by the kernel (ckpt.io.byte_copy), the others cast and counted
    bad += sum(int((~torch.isfinite(sd[k].float())).sum()) for k in m.plain & set(sd)
               if sd[k].dtype.is_floating_point and sd[k].dtype != torch.float32)
    reported = sum(int(n.replace(",", "")) for n in NONFINITE.findall(err))
    assert reported == bad, f"{what}: {bad} NaN/Inf decoded, {reported} reported: {err}"
    return "decoded"


def _cases(name: str, m: Model) -> list[tuple[dict, str]]:
    rng = random.Random(f"{SEED}-{name}")
    return [mutate(m.sd, rng) for _ in range(CASES)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_mutants_are_refused_or_decoded_to_the_oracle(tmp_path, run_ckpt, name):
    m = MODELS[name]()
    # the unmutated checkpoint decodes to the oracle's values: the oracle and the builder agree with ckpt
    (tmp_path / "orig").mkdir()
    assert check_case(tmp_path / "orig", run_ckpt, m, m.sd, f"{name} as made") == "decoded"
    for i, (sd, what) in enumerate(_cases(name, m)):
        case = tmp_path / f"case{i}"
        case.mkdir()
        check_case(case, run_ckpt, m, sd, f"{name} case {i} ({what})")
