"""Benchmark `ckpt dequant` against each format's own load-and-dequantize: quanto, GPTQ, AWQ, compressed-tensors.

Default (`--format quanto`): against the optimum-quanto way, on synthetic quanto checkpoints; `--format gptq`, `awq`
and `ct`: against each library's full-load dequantization, on a synthetic 4-bit Llama-shaped LLM of that format (below).

Cases: qint8 with bf16 scales, qint4 with fp16 scales (grouped by 128, float shifts). Each source is an
optimum-quanto save folder (`model.safetensors` + `quanto_qmap.json`) of a Flux-like model (benchlib's
`model_specs`; `--size-gb` is the model's size in bf16), written header-first in a subprocess with
valid quanto encodings (random codes, positive scales), without ckpt code.

Two commands write the same plain bf16/fp16 state dict, each timed as a subprocess with its peak RSS
(`os.wait4`, see benchlib.py):

- ckpt:   `ckpt dequant SRC -o OUT -q` (streams tensor by tensor, fsyncs its output);
- quanto: the optimum-quanto way: build the model on the meta device, `safetensors.torch.load_file`
          + `optimum.quanto.requantize` (what `QuantizedDiffusersModel.from_pretrained` does), then
          `.dequantize()` every quantized weight, `save_file` and fsync.

Each case also times `cp` + `sync` of ckpt's output (the yardstick: ckpt's wall time is printed as a
ratio of it) and checks ckpt's peak RSS against import baseline (`python -c "import torch"`, with a CUDA
context for `--device cuda`) + 2x the largest tensor + the pipeline's buffers + 300 MB. `--device`
runs ckpt on cpu or cuda; `--workdir` (alias `--work`) chooses tmpfs (/dev/shm) or a disk.

The outputs are compared bit for bit (exit 1 if they differ). fp16 scales for qint4 because on CPU
optimum-quanto re-packs bf16 qint4 weights for TinyGemm, whose bf16 shift round trip is lossy: the
quanto way would then not reproduce the stored values. The page cache is warmed by reading each source
once before timing (dropping it needs root). `--quanto-way SRC DST --size-gb X` is the internal entry
point of the baseline; `--generate` that of the generator. Only the standard library is imported here.

`--format gptq` (case gptq-4bit): a Llama-shaped HF folder (config.json with `quantization_config`: gptq, bits 4,
group_size 128, desc_act false, sym false, v1 zero points; fp16 embeddings, norms and lm_head; per linear `qweight`
[in/8, out] and `qzeros` [in/128, out/8] int32 words drawn from a pool of random words, fp16 `scales`, `g_idx`), written
header-first without ckpt code. Here `--size-gb` is the GPTQ checkpoint's own size (`--size-gb 4`: about
Llama-2-7B-GPTQ, 33 layers of width 4096, vocab 32000; the fp16 output is ~3.5x that). Baseline "autogptq-way": the
oracle's load-and-dequantize over the whole model, `safetensors.torch.load_file` of the checkpoint, then per layer
AutoGPTQ 0.7.1's torch dequantization (`qlinear_cuda_old`: fields unpacked with its shifts, v1 zero points
`(z + 1) & 15`, `scales[g] * (q - z[g])` in fp16; tests/test_dequant.py checks it against AutoGPTQ's `QuantLinear`
itself), `save_file` of the whole state dict and fsync (it holds the source and the fp16 output at once: ~4.5x
`--size-gb` of RAM). `--gptq-way SRC DST` is its internal entry point.

`--format awq` (case awq-4bit): the same Llama shape as AutoAWQ 0.2.9 saves it in GEMM layout (config.json
`quantization_config` as its `to_transformers_dict` writes it: awq, version gemm, bits 4, group_size 128, zero_point
true; per linear `qweight` [in, out/8] and `qzeros` [in/128, out/8] random int32 words, which every interleaved GEMM
nibble order reads as valid codes, fp16 `scales` [in/128, out]; fp16 embeddings, norms, lm_head). Baseline
"autoawq-way": `load_file` of the checkpoint, then per layer AutoAWQ's own `awq.utils.packing_utils.dequantize_gemm`
(what `WQLinear_GEMM.forward` runs on CPU without its kernels; its [in, out] result transposed to the Linear's
[out, in]), `save_file` and fsync. packing_utils.py is loaded from the installed package by its path: it imports only
torch, whereas `import awq` imports transformers and AutoAWQ's model zoo (~5 s on the 2-core VM), which is no part
of dequantizing (tests/helpers/awq_base.py loads it the same way). `--awq-way SRC DST`.

`--format ct` (case ct-w4a16): the same Llama shape as llm-compressor saves a W4A16 model with compressed-tensors 0.20
(`pack-quantized`, one config group targeting Linear, int 4-bit symmetric, group strategy 128, lm_head ignored;
config.json `quantization_config` as `ModelCompressor.update_config` writes it): per linear `weight_packed` [out, in/8]
random int32 words (eight offset codes per word, every nibble valid), bf16 `weight_scale` [out, in/128], int64
`weight_shape` [2]; bf16 embeddings, norms, lm_head (the model's dtype). Baseline "ct-way": the library's own
model-free folder dequantization, `compressed_tensors.entrypoints.convert.convert_checkpoint(SRC, DST,
CompressedTensorsDequantizer(SRC, dtype=bf16), device="cpu")`: per safetensors file it loads every tensor, runs
`PackedQuantizationCompressor.decompress` per module and `save_file`s the file (whole-model loads otherwise need the
model class: `ModelCompressor.decompress_model` works on an instantiated model); then fsync. Its time includes
`import compressed_tensors` (which imports transformers), as a user's run does. `--ct-way SRC DST`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

CASES = {"qint8-bf16": ("qint8", "bf16"), "qint4-fp16": ("qint4", "fp16")}
GPTQ_CASES = {"gptq-4bit": ("gptq4", "fp16")}
AWQ_CASES = {"awq-4bit": ("awq4", "fp16")}
CT_CASES = {"ct-w4a16": ("ct-w4a16", "bf16")}
FORMATS = {"quanto": CASES, "gptq": GPTQ_CASES, "awq": AWQ_CASES, "ct": CT_CASES}
BASELINE = {"quanto": "quanto", "gptq": "autogptq-way", "awq": "autoawq-way", "ct": "ct-way"}
LLM_QTYPES = {"gptq4": "gptq", "awq4": "awq", "ct-w4a16": "ct"}  # the synthetic LLM sources' --qtype, by format
ST = {"bf16": "BF16", "fp16": "F16", "I8": "I8", "U8": "U8", "I32": "I32"}
SIZE = {"BF16": 2, "F16": 2, "I8": 1, "U8": 1, "I32": 4, "I64": 8}
GPTQ_GROUP = 128
LLM_WIDTHS = (4096, 3072, 2048, 1536, 1024, 768, 512, 256, 128)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def params_for(size_gb: float) -> int:
    return int(size_gb * 1e9 / 2)


# ------------------------------------------------------------------------------- synthetic source

def quanto_entries(model, qtype: str, dt: str) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(name, safetensors dtype, shape, kind) of an optimum-quanto state dict (docs/format-facts.md)."""
    out = []
    for s in model.specs:
        if s.role != "linear":
            out.append((s.name, ST[dt], s.shape, "plain"))
            continue
        rows, cols = s.shape
        stem = s.name[: -len(".weight")]
        if qtype == "qint8":
            out += [(s.name + "._data", "I8", s.shape, "codes"), (s.name + "._scale", ST[dt], (rows, 1), "scale")]
        else:
            g = next((g for g in (128, 96, 64, 32) if cols > 128 and cols % g == 0), None)
            urows, inner = ((rows * cols // g), g) if g else (rows, cols)
            out += [(s.name + "._data._data", "U8", (-(-urows // 2), inner), "codes"),
                    (s.name + "._scale", ST[dt], (urows, 1), "scale"), (s.name + "._shift", ST[dt], (urows, 1), "shift")]
        out += [(stem + ".input_scale", ST[dt], (), "one"), (stem + ".output_scale", ST[dt], (), "one")]
    return out


def write_entries(path: str, entries, pools: dict, tdt: dict, special=None) -> None:
    """A safetensors file of `entries` (name, safetensors dtype, shape, kind), header first, then each tensor's
    bytes cut from its kind's pool (random codes, values; `special(name, kind, nbytes)` gives the bytes of kinds
    whose values are structure, e.g. GPTQ's g_idx). Largest items first, as the libraries' savers order them."""
    import torch

    raw = {}
    ordered = sorted(entries, key=lambda e: (-SIZE[e[1]], e[0]))
    header, pos = {"__metadata__": {"format": "pt", "generator": "ckpt scripts/bench_dequant.py"}}, 0
    for name, sdt, shape, kind in ordered:
        n = 1
        for d in shape:
            n *= d
        header[name] = {"dtype": sdt, "shape": list(shape), "data_offsets": [pos, pos + n * SIZE[sdt]]}
        pos += n * SIZE[sdt]
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * (-(8 + len(js)) % 8)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(js)) + js)
        for i, (name, sdt, shape, kind) in enumerate(ordered):
            size = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            if kind not in pools:
                f.write(special(name, kind, size))
                continue
            key = (kind, sdt)
            if key not in raw:
                v = pools[kind]
                v = v if not v.is_floating_point() else v.to(tdt[sdt])
                b = v.view(torch.uint8).numpy().tobytes()
                raw[key] = memoryview(b + b)
            pool = raw[key]
            plen = len(pool) // 2
            start = 0 if kind == "one" else (i * 104729 * SIZE[sdt]) % plen
            while size:
                take = min(size, plen)
                f.write(pool[start:start + take])
                start = (start + take) % plen
                size -= take


def write_source(folder: str, size_gb: float, qtype: str, dt: str) -> dict:
    import torch

    if qtype in LLM_QTYPES:
        return write_llm_source(folder, size_gb, LLM_QTYPES[qtype])
    model = bl.model_specs(params_for(size_gb))
    entries = quanto_entries(model, qtype, dt)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1 << 22, generator=g)
    pools = {
        "codes": (torch.randint(0, 256, (1 << 22,), generator=g, dtype=torch.uint8) if qtype == "qint4"
                  else torch.randint(-127, 128, (1 << 22,), generator=g, dtype=torch.int8).view(torch.uint8)),
        "plain": base * 0.02,
        "scale": base.abs() * 0.02 / 64 + 1e-5,
        "shift": base * 0.02,
        "one": torch.ones(1 << 22),
    }
    path = os.path.join(folder, "model.safetensors")
    write_entries(path, entries, pools, {"BF16": torch.bfloat16, "F16": torch.float16})
    qmap = {s.name[: -len(".weight")]: {"weights": qtype, "activations": "none"} for s in model.specs if s.role == "linear"}
    Path(folder, "quanto_qmap.json").write_text(json.dumps(qmap, indent=1))
    big = model.largest
    return {"bytes": os.path.getsize(path), "tensors": len(entries), "params": model.params,
            "largest": big.name, "largest_shape": list(big.shape), "largest_numel": big.numel}


# ---------------------------------------------------------- synthetic GPTQ / AWQ / compressed-tensors sources

# Stored bytes of one 4-bit Linear (n outputs, k inputs, groups of GPTQ_GROUP) in each format: codes, then the
# per-group scales (16-bit) and zero points (4-bit), then what each format adds (GPTQ's g_idx, ct's weight_shape).
LINEAR_BYTES = {
    "gptq": lambda n, k: n * k // 2 + k // GPTQ_GROUP * (n * 2 + n // 2) + k * 4,
    "awq": lambda n, k: n * k // 2 + k // GPTQ_GROUP * (n * 2 + n // 2),
    "ct": lambda n, k: n * k // 2 + k // GPTQ_GROUP * n * 2 + 16,
}


def llm_shape(nbytes: float, fmt: str = "gptq") -> dict:
    """A Llama-shaped model whose 4-bit checkpoint in `fmt` (LINEAR_BYTES) is about `nbytes`: the widest hidden
    size (4096 at most, head dim 128, MLP ~2.6875x as Llama-2's 11008 / 4096, rounded to the group size) that gives
    at least 4 layers, then as many layers as fit; vocab 32000 (4 x hidden below width 1024)."""
    linear_bytes = LINEAR_BYTES[fmt]

    def shape(h):
        inter = -(-h * 43 // 16 // GPTQ_GROUP) * GPTQ_GROUP
        vocab = 32000 if h >= 1024 else 4 * h
        linears = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, h), "self_attn.v_proj": (h, h),
                   "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                   "mlp.down_proj": (h, inter)}
        per_layer = sum(linear_bytes(n, k) for n, k in linears.values()) + 4 * h
        return {"hidden": h, "inter": inter, "vocab": vocab, "linears": linears, "layer_bytes": per_layer,
                "fixed_bytes": 2 * vocab * h * 2 + 2 * h}

    s = next((shape(h) for h in LLM_WIDTHS if 4 * shape(h)["layer_bytes"] + shape(h)["fixed_bytes"] <= nbytes),
             shape(LLM_WIDTHS[-1]))
    s["layers"] = max(1, round((nbytes - s["fixed_bytes"]) / s["layer_bytes"]))
    return s


def llm_plain(s: dict, dt: str) -> list[tuple[str, str, tuple[int, ...], str]]:
    """The unquantized tensors every format stores in the model's dtype `dt`: embeddings, lm_head, norms."""
    h = s["hidden"]
    out = [("model.embed_tokens.weight", dt, (s["vocab"], h), "plain"),
           ("lm_head.weight", dt, (s["vocab"], h), "plain"), ("model.norm.weight", dt, (h,), "one")]
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", dt, (h,), "one"),
                (p + "post_attention_layernorm.weight", dt, (h,), "one")]
    return out


def llm_linears(s: dict):
    """(prefix, n outputs, k inputs) of every Linear of every layer."""
    for i in range(s["layers"]):
        for lin, (n, k) in s["linears"].items():
            yield f"model.layers.{i}.{lin}", n, k


def gptq_entries(s: dict) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(name, safetensors dtype, shape, kind) of an AutoGPTQ-saved Llama (4-bit, group 128, g_idx saved)."""
    g = GPTQ_GROUP
    out = llm_plain(s, "F16")
    for p, n, k in llm_linears(s):
        out += [(p + ".qweight", "I32", (k // 8, n), "words"), (p + ".qzeros", "I32", (k // g, n // 8), "words"),
                (p + ".scales", "F16", (k // g, n), "scale"), (p + ".g_idx", "I32", (k,), "g_idx")]
    return out


def awq_entries(s: dict) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(name, safetensors dtype, shape, kind) of an AutoAWQ GEMM-saved Llama (4-bit, group 128, zero points): the
    buffers `WQLinear_GEMM(4, 128, k, n)` registers."""
    g = GPTQ_GROUP
    out = llm_plain(s, "F16")
    for p, n, k in llm_linears(s):
        out += [(p + ".qweight", "I32", (k, n // 8), "words"), (p + ".qzeros", "I32", (k // g, n // 8), "words"),
                (p + ".scales", "F16", (k // g, n), "scale")]
    return out


def ct_entries(s: dict) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(name, safetensors dtype, shape, kind) of an llm-compressor W4A16 pack-quantized Llama in bf16 (symmetric:
    no zero points; lm_head ignored, kept plain): what `PackedQuantizationCompressor.compress` stores."""
    g = GPTQ_GROUP
    out = llm_plain(s, "BF16")
    for p, n, k in llm_linears(s):
        out += [(p + ".weight_packed", "I32", (n, k // 8), "words"),
                (p + ".weight_scale", "BF16", (n, k // g), "scale"), (p + ".weight_shape", "I64", (2,), "shape")]
    return out


def llm_quantization_config(fmt: str) -> dict:
    """config.json `quantization_config` as each library writes it for the synthetic checkpoint: AutoGPTQ's, AutoAWQ
    0.2.9's `to_transformers_dict`, compressed-tensors 0.20's `update_config` of llm-compressor's W4A16 preset."""
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": GPTQ_GROUP, "desc_act": False, "sym": False,
                "checkpoint_format": "gptq"}
    if fmt == "awq":
        return {"quant_method": "awq", "zero_point": True, "group_size": GPTQ_GROUP, "bits": 4, "version": "gemm",
                "modules_to_not_convert": None}
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": GPTQ_GROUP, "strategy": "group",
               "dynamic": False}
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "format": "pack-quantized", "global_compression_ratio": None, "ignore": ["lm_head"],
            "kv_cache_scheme": None, "moe_sparsity_config": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}, "version": "0.20.0"}


LLM_ENTRIES = {"gptq": (gptq_entries, "F16"), "awq": (awq_entries, "F16"), "ct": (ct_entries, "BF16")}


def write_llm_source(folder: str, size_gb: float, fmt: str = "gptq") -> dict:
    """The 4-bit checkpoint folder of `fmt` (model.safetensors + config.json); codes and zero points are random
    int32 words (every 4-bit field any value), scales positive 16-bit, GPTQ's g_idx the in-order groups desc_act
    false saves, compressed-tensors' weight_shape each Linear's [out, in]."""
    import torch

    s = llm_shape(size_gb * 1e9, fmt)
    entries_of, dt = LLM_ENTRIES[fmt]
    entries = entries_of(s)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1 << 22, generator=g)
    pools = {"words": torch.randint(0, 256, (1 << 24,), generator=g, dtype=torch.uint8),
             "plain": base * 0.02, "scale": base.abs() * 0.002 + 1e-4, "one": torch.ones(1 << 22)}
    shapes = {p: (n, k) for p, n, k in llm_linears(s)}

    def special(name, kind, nbytes):
        if kind == "shape":  # compressed-tensors' weight_shape: torch.tensor(weight.shape), int64
            return struct.pack("<2q", *shapes[name[: -len(".weight_shape")]])
        return (torch.arange(nbytes // 4, dtype=torch.int32) // GPTQ_GROUP).numpy().tobytes()  # GPTQ's g_idx

    path = os.path.join(folder, "model.safetensors")
    write_entries(path, entries, pools, {"F16": torch.float16, "BF16": torch.bfloat16}, special)
    h = s["hidden"]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": s["inter"], "num_hidden_layers": s["layers"], "num_attention_heads": h // 128 or 1,
              "num_key_value_heads": h // 128 or 1, "head_dim": min(128, h), "vocab_size": s["vocab"],
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
              "torch_dtype": "float16" if dt == "F16" else "bfloat16",
              "quantization_config": llm_quantization_config(fmt)}
    Path(folder, "config.json").write_text(json.dumps(config, indent=1))
    mats = [(n, sh) for n, _, sh, _ in entries if n.endswith(".weight") and len(sh) == 2]
    mats += [(p + ".weight", (n, k)) for p, n, k in llm_linears(s)]
    name, shape = max(mats, key=lambda x: x[1][0] * x[1][1])
    norms = sum(sh[0] for n, _, sh, _ in entries if len(sh) == 1 and n.endswith("weight"))
    params = sum(a * b for _, (a, b) in mats) + norms
    return {"bytes": os.path.getsize(path), "tensors": len(entries), "params": params, "layers": s["layers"],
            "hidden": h, "vocab": s["vocab"], "largest": name, "largest_shape": list(shape),
            "largest_numel": shape[0] * shape[1]}


def gptq_way(src: str, dst: str) -> None:
    """The oracle's load-and-dequantize, whole model: `load_file`, AutoGPTQ 0.7.1's torch dequantization of every
    4-bit layer (qlinear_cuda_old.forward's: fields by its shifts, v1 zeros (z + 1) & 15, scales * (q - z) in the
    scales' fp16), `save_file`, fsync."""
    from safetensors.torch import load_file, save_file

    sd = load_file(os.path.join(src, "model.safetensors"))
    bits = json.loads(Path(src, "config.json").read_text())["quantization_config"]["bits"]
    out = {}
    for key in [k for k in sd if k.endswith(".qweight")]:
        p = key[: -len(".qweight")]
        out[p + ".weight"] = autogptq_torch_dequant(sd.pop(key), sd.pop(p + ".qzeros"), sd.pop(p + ".scales"),
                                                    sd.pop(p + ".g_idx"), bits)
    out.update(sd)
    os.makedirs(dst, exist_ok=True)
    path = os.path.join(dst, "model.safetensors")
    save_file(out, path, metadata={"format": "pt"})
    bl.fsync_path(path)


def autogptq_torch_dequant(qweight, qzeros, scales, g_idx, bits: int):
    """W [out, in] as AutoGPTQ 0.7.1's `qlinear_cuda_old` torch path computes it (2/4/8 bits)."""
    import torch

    wf = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    small = torch.int16 if bits == 8 else torch.int8
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, 32 // bits), wf.view(1, 1, -1)).to(small)
    zeros = torch.bitwise_and(zeros + 1, mask).reshape(scales.shape)
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, 32 // bits, -1), wf.view(1, -1, 1)).to(small)
    weight = torch.bitwise_and(weight, mask).reshape(-1, weight.shape[2])
    g = g_idx.long()
    return (scales[g] * (weight - zeros[g])).T.contiguous()


def awq_packing_utils():
    """AutoAWQ's installed `awq/utils/packing_utils.py` (its `dequantize_gemm`), loaded by path without running
    `awq/__init__.py` (which imports transformers and every AutoAWQ model: no part of dequantizing)."""
    import importlib.util

    spec = importlib.util.find_spec("awq")  # a top-level package is found without being imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("autoawq is not installed (pip install --no-deps autoawq==0.2.9)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "utils", "packing_utils.py")
    mod_spec = importlib.util.spec_from_file_location("awq_packing_utils", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def awq_way(src: str, dst: str) -> None:
    """AutoAWQ's load-and-dequantize, whole model: `load_file`, AutoAWQ 0.2.9's `dequantize_gemm` of every GEMM
    layer (its [in, out] result transposed to the Linear's [out, in]), `save_file`, fsync."""
    from safetensors.torch import load_file, save_file

    dequantize_gemm = awq_packing_utils().dequantize_gemm
    qc = json.loads(Path(src, "config.json").read_text())["quantization_config"]
    sd = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for key in [k for k in sd if k.endswith(".qweight")]:
        p = key[: -len(".qweight")]
        w = dequantize_gemm(sd.pop(key), sd.pop(p + ".qzeros"), sd.pop(p + ".scales"), qc["bits"], qc["group_size"])
        out[p + ".weight"] = w.T.contiguous()
    out.update(sd)
    os.makedirs(dst, exist_ok=True)
    path = os.path.join(dst, "model.safetensors")
    save_file(out, path, metadata={"format": "pt"})
    bl.fsync_path(path)


def ct_way(src: str, dst: str) -> None:
    """compressed-tensors 0.20's own model-free dequantization of a folder: `convert_checkpoint` with a
    `CompressedTensorsDequantizer` in the model's dtype (config.json `torch_dtype`), on CPU; then fsync."""
    import torch
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer, convert_checkpoint

    dtype = getattr(torch, json.loads(Path(src, "config.json").read_text()).get("torch_dtype", "bfloat16"))
    convert_checkpoint(src, dst, CompressedTensorsDequantizer(src, dtype=dtype), device="cpu")
    bl.fsync_path(os.path.join(dst, "model.safetensors"))


WAYS = {"gptq": gptq_way, "awq": awq_way, "ct": ct_way}  # the LLM formats' baselines, by --format


# ------------------------------------------------------------------------------ the quanto way

def quanto_way(src: str, dst: str, size_gb: float) -> None:
    import torch
    from optimum.quanto import QModuleMixin, requantize
    from safetensors.torch import load_file, save_file

    model_specs = bl.model_specs(params_for(size_gb))
    with torch.device("meta"):
        root = torch.nn.Module()
        for s in model_specs.specs:
            path, attr = s.name.rsplit(".", 1)
            parent = root
            parts = path.split(".")
            for i, part in enumerate(parts):
                if not hasattr(parent, part):
                    last = i == len(parts) - 1
                    if last and s.role == "linear":
                        parent.add_module(part, torch.nn.Linear(s.shape[1], s.shape[0]))
                    else:
                        parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            if not (s.role == "linear" or (s.role == "bias" and isinstance(parent, torch.nn.Linear))):
                parent.register_parameter(attr, torch.nn.Parameter(torch.empty(s.shape)))
    state_dict = load_file(os.path.join(src, "model.safetensors"))
    qmap = json.loads(Path(src, "quanto_qmap.json").read_text())
    dtype = next(v.dtype for k, v in state_dict.items() if k.endswith("._scale"))
    root.to(dtype)
    requantize(root, state_dict=state_dict, quantization_map=qmap, device=torch.device("cpu"))
    out = {}
    with torch.no_grad():
        for name, m in root.named_modules():
            if isinstance(m, QModuleMixin):
                out[name + ".weight"] = m.weight.dequantize().contiguous()
                out[name + ".bias"] = m.bias.detach()
        for name, p in root.named_parameters():
            if name not in out:
                out[name] = p.detach()
    os.makedirs(dst, exist_ok=True)
    path = os.path.join(dst, "model.safetensors")
    save_file(out, path, metadata={"format": "pt"})
    bl.fsync_path(path)


# ------------------------------------------------------------------------------------- driver

def warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass


def run_case(name: str, size_gb: float, work: Path, verify: bool, device: str = "cpu",
             baseline: bl.Measurement | None = None) -> tuple[list[list], dict]:
    fmt = next(f for f, cases in FORMATS.items() if name in cases)
    qtype, dt = FORMATS[fmt][name]
    other = BASELINE[fmt]
    src = work / f"{name}-src"
    log(f"[{name}] generating {size_gb} GB " + (f"{fmt.upper()} 4-bit source ..." if fmt in WAYS else
                                               f"(bf16-equivalent) quanto {qtype} source ..."))
    gen = bl.run_py(__file__, "--generate", src, "--size-gb", size_gb, "--qtype", qtype, "--dtype", dt)
    info = json.loads(gen.stdout.strip().splitlines()[-1])
    warm(src / "model.safetensors")
    rows, outs, verdict = [], {}, {}
    for variant in ("ckpt", other):
        dst = work / f"{name}-{variant}"
        argv = (bl.ckpt_argv("dequant", src, "-o", dst, "--device", device, "-q") if variant == "ckpt" else
                [sys.executable, __file__, "--quanto-way", src, dst, "--size-gb", size_gb] if fmt == "quanto" else
                [sys.executable, __file__, f"--{fmt}-way", src, dst])
        log(f"[{name}] {variant} ...")
        m = bl.measure(argv)
        outs[variant] = dst / "model.safetensors"
        out_bytes = outs[variant].stat().st_size
        rows.append([name, bl.fmt_gb(info["bytes"]), bl.fmt_gb(out_bytes), variant, f"{m.seconds:.1f}",
                     bl.fmt_mb(m.peak_rss), bl.gbps(out_bytes, m.seconds)])
        if variant == "ckpt":
            log(f"[{name}] cp + sync of the output ...")
            cp = bl.cp_baseline(outs[variant], work / f"{name}-cp.safetensors")
            rows.append([name, "-", bl.fmt_gb(out_bytes), "cp + sync", f"{cp.seconds:.1f}", bl.fmt_mb(cp.peak_rss),
                         bl.gbps(out_bytes, cp.seconds)])
            if baseline is not None:
                src_item = 1 if qtype == "qint8" else 0.5  # qint4, GPTQ, AWQ, ct 4-bit: half a byte per value
                lines, vals = bl.verdict_lines(name, m, cp, out_bytes, baseline, info["largest_numel"] * 2,
                                               int(bl.pipeline_bytes(src_item, 2)))
                verdict = {"lines": lines, **vals}
    same = bl.compare(outs["ckpt"], outs[other]) if verify else {"equal": None}
    for variant in ("ckpt", other):
        shutil.rmtree(work / f"{name}-{variant}", ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)
    return rows, {"case": name, "source": info, "identical": same, "verdict": verdict}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", choices=sorted(FORMATS), default="quanto",
                    help="quanto (default; cases qint8-bf16, qint4-fp16), gptq (case gptq-4bit), awq (case "
                         "awq-4bit) or ct (compressed-tensors, case ct-w4a16)")
    ap.add_argument("--size-gb", type=float, default=0.3,
                    help="quanto: model size in bf16; gptq, awq, ct: the 4-bit checkpoint's size (default 0.3)")
    ap.add_argument("--cases", help="comma-separated, from the --format's cases (default: all of them)")
    bl.add_run_args(ap, workdir_alias="--work")
    ap.add_argument("--no-verify", action="store_true", help="skip the bitwise comparison of the outputs")
    ap.add_argument("--json", help="also write the results as JSON here")
    ap.add_argument("--generate", metavar="FOLDER", help=argparse.SUPPRESS)
    ap.add_argument("--quanto-way", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    for fmt in WAYS:
        ap.add_argument(f"--{fmt}-way", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    ap.add_argument("--qtype", default="qint8", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bf16", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.generate:
        print(json.dumps(write_source(a.generate, a.size_gb, a.qtype, a.dtype)))
        return 0
    if a.quanto_way:
        quanto_way(a.quanto_way[0], a.quanto_way[1], a.size_gb)
        return 0
    for fmt, way in WAYS.items():
        if getattr(a, f"{fmt}_way"):
            way(*getattr(a, f"{fmt}_way"))
            return 0
    known = FORMATS[a.format]
    cases = [c.strip() for c in (a.cases or ",".join(known)).split(",") if c.strip()]
    unknown = [c for c in cases if c not in known]
    if unknown:
        ap.error(f"unknown case(s) {unknown} for --format {a.format}; choose from {', '.join(known)}")
    floor = bl.launcher_floor()
    baseline = bl.import_baseline(a.device)
    if a.workdir:  # a folder that does not exist yet is made, as bench_convert/bench_merge do
        Path(a.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        work = Path(tmp)
        rows, results = [], []
        for c in cases:
            r, res = run_case(c, a.size_gb, work, not a.no_verify, a.device, baseline)
            rows += r
            results.append(res)
    print("\n".join(bl.machine_lines()))
    print(f"device: {a.device}; files in {a.workdir or tempfile.gettempdir()} ({bl.where(a.workdir or tempfile.gettempdir())})")
    print(f"launcher RSS floor (every peak below includes it): {bl.fmt_mb(floor)} MB\n")
    print(bl.markdown_table(["case", "source GB", "output GB", "tool", "seconds", "peak RSS MB", "output GB/s"], rows))
    print()
    bad = False
    for res in results:
        same = res["identical"]["equal"]
        print(f"{res['case']}: largest tensor {res['source']['largest']} {res['source']['largest_shape']}; "
              f"outputs identical: {'not checked' if same is None else same}"
              + (f" ({res['identical']['problem']})" if same is False else ""))
        bad |= same is False
        for line in res["verdict"].get("lines", []):
            print(line)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "results": results, "floor": floor}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
