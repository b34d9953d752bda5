"""Benchmark GGUF both ways against the ComfyUI-GGUF / llama.cpp Python way, on a synthetic Flux model.

Source: a Flux-shaped model in the original (BFL) layout, bf16 (`double_blocks.N.img_attn.qkv`,
`single_blocks.N.linear1`, ... at Flux's width 3072 once the size allows it; `--size-gb` is its bf16
size), written header-first in a subprocess without ckpt code. Two cases, each run by two tools as
subprocesses timed with their peak RSS (`os.wait4`, see benchlib.py), all outputs fsynced:

- bf16 -> GGUF Q8_0
  ckpt:     `ckpt convert SRC --to gguf-q8_0 -o OUT -q` (tensor by tensor, band by band);
  baseline: what ComfyUI-GGUF's tools/convert.py and llama.cpp's convert_hf_to_gguf.py do in Python:
            `safetensors.torch.load_file` (whole model), `gguf.quants.quantize` per tensor with the same
            per-tensor types (Flux rules: 1-D and <= 1024 values F32, input/output layers BF16, rows
            not a multiple of 32 BF16, other 2-D weights Q8_0), `gguf.GGUFWriter` (holds every
            quantized tensor until it writes).
  check:    the two files hold the same tensors, types, shapes and bytes (gguf's reader).
- GGUF Q8_0 -> bf16 (the Q8_0 file ckpt just wrote)
  ckpt:     `ckpt convert SRC.gguf --to bf16 -o OUT.safetensors -q`;
  baseline: `gguf.GGUFReader` + `gguf.quants.dequantize` of every tensor into memory (how ComfyUI-GGUF
            and transformers load a GGUF), cast to bf16, `save_file`.
  check:    the two safetensors files are identical tensor by tensor.

- bf16 Flux -> GGUF Q4_K_M (`--cases flux-q4_k_m`)
  ckpt:     `ckpt convert SRC --to gguf-q4_k_m -o OUT` (one pass; K-quants by ckpt's torch encoders);
  baseline: ComfyUI-GGUF's two steps: tools/convert.py's work (whole model loaded, BF16/F32 GGUF written by
            `gguf.GGUFWriter`), then its patched `llama-quantize`. That patched binary cannot be built here (it
            patches llama.cpp at tag b3962), so step 2 runs llama.cpp's own quantizer functions
            (`quantize_q4_K` ... of ggml-quants.c, what llama-quantize calls; compiled by tests/helpers/ggml_ref)
            on 2 threads over the mmapped intermediate, with the patch's per-tensor types, and writes the file
            with `gguf.GGUFWriter`. Time and peak RSS: the two steps summed / the larger.
  check:    same tensors, types and bytes.
- bf16 Llama-shaped HF folder -> GGUF Q4_K_M (`--cases llm-q4_k_m`; sharded safetensors, config.json and a
  SentencePiece tokenizer)
  ckpt:     `ckpt convert DIR --to gguf-q4_k_m -o OUT`;
  baseline: llama.cpp's two steps from the same sdist (llama-cpp-python 0.3.36): `convert_hf_to_gguf.py DIR
            --outtype bf16` (its default keeps every tensor in memory until it writes), then
            `llama_model_quantize(..., Q4_K_M, nthread=cores)`, the function `llama-quantize` runs.
  check:    same tensors, types and bytes (only the `general.*` keys differ).
- the same Llama folder with an importance matrix (`--cases llm-q4_k_m,llm-q4_k_m-imatrix`; random statistics for
  every matrix, a GGUF imatrix as llama-imatrix writes it): `ckpt convert DIR --to gguf-q4_k_m --imatrix FILE`
  against `convert_hf_to_gguf.py --outtype bf16` + llama-quantize's function given the same importances and
  `quantize.imatrix.*` keys (issue 34's target: <= 1.0x). check: the same file.
- bf16 Mixtral-shaped HF folder -> GGUF Q4_K_M (`--cases moe-q4_k_m`; 16 experts of which 4 are used per token, a
  SentencePiece tokenizer): the same two tools as llm-q4_k_m. The reference stacks each layer's
  experts into one tensor before it writes; ckpt stacks them lazily (whole experts per band).
  check:    same tensors, types and bytes (only the `general.*` keys differ).

Each case also times `cp` + `sync` of ckpt's output (ckpt's wall time is printed as a ratio of it) and
checks ckpt's peak RSS against import baseline (`python -c "import torch"`, with a CUDA context for
`--device cuda`) + 2x the largest tensor + the pipeline's buffers + 300 MB. `--device` is passed to ckpt
(GGUF quantization itself runs on the CPU in either case); `--workdir` (alias `--work`) chooses tmpfs
(/dev/shm) or a disk.

Only the standard library is imported here (benchlib); `--generate`, `--to-gguf` and `--from-gguf` are
the internal entry points of the generator and the baselines.
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

KEEP = ("txt_in.", "img_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.")  # ComfyUI-GGUF, Flux


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- synthetic source

def flux_specs(size_gb: float) -> list[tuple[str, tuple[int, ...]]]:
    """Flux's tensor list (BFL names); double and single blocks in Flux's 19:38 ratio, as many as fit."""
    params = size_gb * 1e9 / 2
    h = next(w for w in (3072, 2048, 1536, 1024, 768, 512, 256) if 3 * 66 * w * w <= params or w == 256)
    hd = 128 if h >= 1024 else 64
    top = [("img_in.weight", (h, 64)), ("img_in.bias", (h,)), ("txt_in.weight", (h, 4096)), ("txt_in.bias", (h,)),
           ("time_in.in_layer.weight", (h, 256)), ("time_in.in_layer.bias", (h,)),
           ("time_in.out_layer.weight", (h, h)), ("time_in.out_layer.bias", (h,)),
           ("vector_in.in_layer.weight", (h, 768)), ("vector_in.in_layer.bias", (h,)),
           ("vector_in.out_layer.weight", (h, h)), ("vector_in.out_layer.bias", (h,)),
           ("guidance_in.in_layer.weight", (h, 256)), ("guidance_in.in_layer.bias", (h,)),
           ("guidance_in.out_layer.weight", (h, h)), ("guidance_in.out_layer.bias", (h,)),
           ("final_layer.adaLN_modulation.1.weight", (2 * h, h)), ("final_layer.adaLN_modulation.1.bias", (2 * h,)),
           ("final_layer.linear.weight", (64, h)), ("final_layer.linear.bias", (64,))]

    def double(i):
        p, out = f"double_blocks.{i}.", []
        for s in ("img", "txt"):
            for name, shape in ((f"{s}_mod.lin", (6 * h, h)), (f"{s}_attn.qkv", (3 * h, h)), (f"{s}_attn.proj", (h, h)),
                                (f"{s}_mlp.0", (4 * h, h)), (f"{s}_mlp.2", (h, 4 * h))):
                out += [(p + name + ".weight", shape), (p + name + ".bias", (shape[0],))]
            out += [(p + f"{s}_attn.norm.query_norm.scale", (hd,)), (p + f"{s}_attn.norm.key_norm.scale", (hd,))]
        return out

    def single(i):
        p = f"single_blocks.{i}."
        return [(p + "linear1.weight", (7 * h, h)), (p + "linear1.bias", (7 * h,)),
                (p + "linear2.weight", (h, 5 * h)), (p + "linear2.bias", (h,)),
                (p + "modulation.lin.weight", (3 * h, h)), (p + "modulation.lin.bias", (3 * h,)),
                (p + "norm.query_norm.scale", (hd,)), (p + "norm.key_norm.scale", (hd,))]

    per_pair = 36 * h * h + 2 * 15 * h * h  # one double block (36 h^2) + two single blocks (15 h^2 each), 19:38
    n = max(1, round((params - sum(_numel(s) for _, s in top)) / per_pair))
    specs = list(top)
    for i in range(n):
        specs += double(i)
    for i in range(2 * n):
        specs += single(i)
    return specs


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_source(path: str, size_gb: float) -> dict:
    import torch

    specs = flux_specs(size_gb)
    g = torch.Generator().manual_seed(0)
    raw = (torch.randn(1 << 22, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    pool = memoryview(raw + raw)
    plen = len(pool) // 2
    header, pos = {"__metadata__": {"format": "pt", "generator": "ckpt scripts/bench_gguf.py"}}, 0
    for name, shape in sorted(specs):
        size = 2 * _numel(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + size]}
        pos += size
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * (-(8 + len(js)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(js)) + js)
        for i, (name, shape) in enumerate(sorted(specs)):
            size, start = 2 * _numel(shape), (i * 104729 * 2) % plen
            while size:
                take = min(size, plen)
                f.write(pool[start:start + take])
                start = (start + take) % plen
                size -= take
    big = max(specs, key=lambda s: _numel(s[1]))
    return {"bytes": os.path.getsize(path), "tensors": len(specs), "params": sum(_numel(s) for _, s in specs),
            "largest": big[0], "largest_shape": list(big[1])}


# ------------------------------------------------------------------------------------ baselines

def baseline_type(name: str, shape) -> str:
    n = _numel(shape)
    if len(shape) == 1 or n <= 1024:
        t1 = "F32"
    else:
        t1 = "BF16"
    quantize = name.endswith("weight") and len(shape) == 2 and not any(k in name for k in KEEP) and shape[-1] % 32 == 0
    return "Q8_0" if quantize else t1


def to_gguf_baseline(src: str, dst: str) -> None:
    import gguf
    from safetensors.torch import load_file

    sd = load_file(src)  # the whole model, as convert.py does
    w = gguf.GGUFWriter(dst, arch="flux")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for name, t in sd.items():
        qt = gguf.GGMLQuantizationType[baseline_type(name, tuple(t.shape))]
        w.add_tensor(name, gguf.quants.quantize(t.float().numpy(), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    bl.fsync_path(dst)


def from_gguf_baseline(src: str, dst: str) -> None:
    import gguf
    import torch
    from safetensors.torch import save_file

    r = gguf.GGUFReader(src)
    out = {}
    for t in r.tensors:  # everything dequantized into memory, as a full load does
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out[t.name] = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)).to(torch.bfloat16)
    save_file(out, dst, metadata={"format": "pt"})
    bl.fsync_path(dst)


def compare_gguf(a: str, b: str) -> dict:
    import gguf
    import numpy as np

    ta = {t.name: t for t in gguf.GGUFReader(a).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(b).tensors}
    if set(ta) != set(tb):
        return {"equal": False, "problem": f"names differ: {sorted(set(ta) ^ set(tb))[:5]}"}
    for n in ta:
        x, y = ta[n], tb[n]
        if x.tensor_type != y.tensor_type or x.shape.tolist() != y.shape.tolist():
            return {"equal": False, "problem": f"{n}: {x.tensor_type.name}{x.shape.tolist()} vs "
                                               f"{y.tensor_type.name}{y.shape.tolist()}"}
        if not np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)):
            return {"equal": False, "problem": f"{n}: bytes differ"}
    return {"equal": True, "problem": None, "tensors": len(ta)}


# ----------------------------------------------------------------------------- K-quant cases

def _tests_on_path() -> None:
    here = Path(__file__).resolve().parents[1] / "tests"
    if str(here) not in sys.path:
        sys.path.insert(0, str(here))


def image_type(name: str, shape) -> str:
    """ComfyUI-GGUF's two steps for Flux at Q4_K_M (its convert.py, then img_tensor_get_type of its lcpp.patch),
    written here apart from ckpt's code: the intermediate's type, then the quantized one."""
    n = _numel(shape)
    if len(shape) == 1 or n <= 1024:
        return "F32"
    if not name.endswith("weight") or len(shape) != 2 or any(k in name for k in KEEP):
        return "BF16"
    t = "Q5_K" if "attn.qkv.weight" in name else "Q4_K"  # fused QKV gets more bits in Q4_K_M
    return t if shape[-1] % 256 == 0 else "F16"


def to_bf16_gguf(src: str, dst: str) -> None:
    """Step 1 of ComfyUI-GGUF: its convert.py's work (the whole model in memory; BF16, small/1-D tensors F32)."""
    import gguf
    from safetensors.torch import load_file

    sd = load_file(src)
    w = gguf.GGUFWriter(dst, arch="flux")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    for name, t in sd.items():
        if len(t.shape) == 1 or t.numel() <= 1024:
            w.add_tensor(name, t.float().numpy(), raw_dtype=gguf.GGMLQuantizationType.F32)
        else:
            w.add_tensor(name, t.view(__import__("torch").int16).numpy(), raw_shape=tuple(t.shape),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    bl.fsync_path(dst)


def quantize_c(src: str, dst: str, threads: int) -> None:
    """Step 2, as llama-quantize does it: each tensor read from the mmapped intermediate, widened to fp32 and
    quantized by ggml-quants.c's quantize_<type> on `threads` threads (row ranges), written by gguf.GGUFWriter."""
    from concurrent.futures import ThreadPoolExecutor

    import gguf
    import numpy as np

    _tests_on_path()
    from helpers import ggml_ref

    lib = ggml_ref.library()
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch="flux")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    ref = {"Q4_K": "q4_K", "Q5_K": "q5_K", "Q6_K": "q6_K"}
    with ThreadPoolExecutor(threads) as pool:
        for t in r.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            kind = image_type(t.name, shape)
            if kind in ("F32", "BF16") or t.tensor_type != gguf.GGMLQuantizationType.BF16:
                plain = np.float32 if t.tensor_type == gguf.GGMLQuantizationType.F32 else np.int16
                w.add_tensor(t.name, np.ascontiguousarray(t.data).view(plain).reshape(shape), raw_shape=shape,
                             raw_dtype=t.tensor_type)
                continue
            rows = shape[0]
            x = (np.ascontiguousarray(t.data).view(np.uint16).reshape(rows, -1).astype(np.uint32) << 16).view(np.float32)
            if kind == "F16":
                w.add_tensor(t.name, x.astype(np.float16), raw_dtype=gguf.GGMLQuantizationType.F16)
                continue
            blk, size = ggml_ref.BLOCKS[ref[kind]]
            out = np.empty((rows, shape[-1] // blk * size), dtype=np.uint8)
            fn = getattr(lib, f"quantize_{ref[kind]}")
            step = -(-rows // threads)

            def part(a, x=x, out=out, fn=fn, n=shape[-1], rows=rows, step=step):
                b = min(rows, a + step)
                xa = np.ascontiguousarray(x[a:b])
                fn(xa.ctypes.data, out[a:b].ctypes.data, b - a, n, None)

            list(pool.map(part, range(0, rows, step)))
            w.add_tensor(t.name, out, raw_shape=out.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    bl.fsync_path(dst)


def llm_specs(size_gb: float, kind: str = "llama") -> tuple[dict, list[tuple[str, tuple[int, ...]]]]:
    """A Llama-shaped model of about `size_gb` in bf16: width 2048, 16 heads (4 KV heads), FFN 5632, vocab 32000,
    as many layers as fit (below 1 GB, for the test of this script: width 256, FFN 768, vocab 4096). `kind`
    "mixtral": a Mixtral of width 1024 (256 below 1 GB), 16 experts of FFN 512 (128), 4 used per token."""
    if kind == "mixtral":
        return _moe_specs(size_gb)
    h, ffn, vocab = (2048, 5632, 32000) if size_gb >= 1 else (256, 768, 4096)
    kv = h // 4
    per_layer = 2 * h * h + 2 * kv * h + 3 * h * ffn + 2 * h
    layers = max(2, round((size_gb * 1e9 / 2 - 2 * vocab * h) / per_layer))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": ffn,
           "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": vocab,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    specs = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                  (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                  (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                  (p + "mlp.gate_proj.weight", (ffn, h)), (p + "mlp.up_proj.weight", (ffn, h)),
                  (p + "mlp.down_proj.weight", (h, ffn))]
    specs += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return cfg, specs


def _moe_specs(size_gb: float) -> tuple[dict, list[tuple[str, tuple[int, ...]]]]:
    h, ffn, vocab, experts = (1024, 512, 32000, 16) if size_gb >= 1 else (256, 128, 4096, 16)
    kv = h // 4
    per_layer = 2 * h * h + 2 * kv * h + 3 * experts * h * ffn + experts * h + 2 * h
    layers = max(2, round((size_gb * 1e9 / 2 - 2 * vocab * h) / per_layer))
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": h, "intermediate_size": ffn,
           "num_local_experts": experts, "num_experts_per_tok": 4, "num_hidden_layers": layers,
           "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": vocab, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    specs = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                  (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                  (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                  (p + "block_sparse_moe.gate.weight", (experts, h))]
        for x in range(experts):
            e = f"{p}block_sparse_moe.experts.{x}."
            specs += [(e + "w1.weight", (ffn, h)), (e + "w2.weight", (h, ffn)), (e + "w3.weight", (ffn, h))]
    specs += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return cfg, specs


def write_llm(folder: str, size_gb: float, kind: str = "llama") -> dict:
    """The HF folder: config.json, a trained SentencePiece tokenizer (tests/helpers/hf_llm), safetensors shards of
    at most 2 GB and their index, written header-first from a pool of random bf16 values."""
    import torch

    _tests_on_path()
    from helpers.hf_llm import spm_tokenizer

    d = Path(folder)
    spm_tokenizer(d)
    cfg, specs = llm_specs(size_gb, kind)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(0)
    raw = (torch.randn(1 << 22, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    pool = memoryview(raw + raw)
    plen = len(pool) // 2
    shards, cur, size = [], [], 0
    for name, shape in specs:
        if cur and size + 2 * _numel(shape) > 2e9:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += 2 * _numel(shape)
    shards.append(cur)
    index, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, pos = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in shard:
            n = 2 * _numel(shape)
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + n]}
            pos += n
            index[name] = fname
        js = json.dumps(header, separators=(",", ":")).encode()
        js += b" " * (-(8 + len(js)) % 8)
        with open(d / fname, "wb") as f:
            f.write(struct.pack("<Q", len(js)) + js)
            for i, (name, shape) in enumerate(shard):
                n, start = 2 * _numel(shape), (i * 104729 * 2) % plen
                while n:
                    take = min(n, plen)
                    f.write(pool[start:start + take])
                    start = (start + take) % plen
                    n -= take
        total += pos
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": index}))
    big = max(specs, key=lambda s: _numel(s[1]))
    return {"bytes": total, "tensors": len(specs), "params": sum(_numel(s) for _, s in specs), "largest": big[0],
            "largest_shape": list(big[1]), "layers": cfg["num_hidden_layers"]}


def llama_two_steps(folder: str, mid: str, dst: str, threads: int, imatrix: str = "") -> None:
    """llama.cpp's way: convert_hf_to_gguf.py --outtype bf16 (a subprocess with its own gguf-py), then the
    function llama-quantize runs, Q4_K_M; with `imatrix`, given its importances as llama-quantize's main() gives
    them (read by ckpt's reader, whose values tests/test_imatrix_read.py proves equal to llama.cpp's loader)."""
    import subprocess

    _tests_on_path()
    from helpers.ggml_ref import llama_cpp_tree

    tree = llama_cpp_tree()
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py"), "NO_LOCAL_GGUF": "1"}
    subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), folder, "--outtype", "bf16", "--outfile",
                    mid], check=True, env=env, cwd=str(tree), stdout=subprocess.DEVNULL)
    from helpers import llama_ref

    kw = {}
    if imatrix:
        from ckpt.io.imatrix import load_imatrix

        im = load_imatrix(imatrix)
        kw["imatrix"] = {n: im.importance(n).reshape(-1) for n in im.names()}
        kw["kv_overrides"] = {"quantize.imatrix.file": imatrix[:127],
                              **({"quantize.imatrix.dataset": im.datasets[0]} if im.datasets else {}),
                              "quantize.imatrix.entries_count": im.entries_count,
                              **({"quantize.imatrix.chunks_count": im.chunk_count} if im.chunk_count > 0 else {})}
    llama_ref.quantize_gguf(Path(mid), Path(dst), "MOSTLY_Q4_K_M", nthread=threads, **kw)
    os.unlink(mid)
    bl.fsync_path(dst)


def write_imatrix(ref: str, dst: str) -> None:
    """A GGUF imatrix (llama-imatrix's layout) with random statistics for every matrix of the GGUF `ref`."""
    _tests_on_path()
    import gguf
    from helpers import imatrix_files

    shapes = {}
    for t in gguf.GGUFReader(ref).tensors:
        ne = [int(d) for d in t.shape]
        if len(ne) >= 2 and t.name.endswith(".weight"):
            shapes[t.name] = (ne[2] if len(ne) >= 3 else 1, ne[0])
    imatrix_files.write_gguf(dst, imatrix_files.random_stats(shapes, seed=0))


# ------------------------------------------------------------------------------------- driver

def warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=0.3, help="model size in bf16 (default 0.3)")
    bl.add_run_args(ap, workdir_alias="--work")
    ap.add_argument("--no-verify", action="store_true", help="skip comparing the outputs")
    ap.add_argument("--json", help="also write the results as JSON here")
    ap.add_argument("--generate", metavar="PATH", help=argparse.SUPPRESS)
    ap.add_argument("--to-gguf", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    ap.add_argument("--from-gguf", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    ap.add_argument("--cases", default="q8_0,flux-q4_k_m,llm-q4_k_m,llm-q4_k_m-imatrix,moe-q4_k_m",
                    help="comma-separated: q8_0 (both ways), flux-q4_k_m, llm-q4_k_m, llm-q4_k_m-imatrix (needs "
                         "llm-q4_k_m), moe-q4_k_m (default: all)")
    ap.add_argument("--compare-gguf", nargs=2, metavar=("A", "B"), help=argparse.SUPPRESS)
    ap.add_argument("--to-bf16-gguf", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    ap.add_argument("--quantize-c", nargs=3, metavar=("SRC", "DST", "THREADS"), help=argparse.SUPPRESS)
    ap.add_argument("--generate-llm", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--llm-kind", default="llama", help=argparse.SUPPRESS)
    ap.add_argument("--llama-two-steps", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    ap.add_argument("--write-imatrix", nargs=2, metavar=("REF", "DST"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.to_bf16_gguf:
        to_bf16_gguf(*a.to_bf16_gguf)
        return 0
    if a.quantize_c:
        quantize_c(a.quantize_c[0], a.quantize_c[1], int(a.quantize_c[2]))
        return 0
    if a.generate_llm:
        print(json.dumps(write_llm(a.generate_llm, a.size_gb, a.llm_kind)))
        return 0
    if a.llama_two_steps:
        d, mid, dst, n, *im = a.llama_two_steps
        llama_two_steps(d, mid, dst, int(n), *im)
        return 0
    if a.write_imatrix:
        write_imatrix(*a.write_imatrix)
        return 0
    if a.generate:
        print(json.dumps(write_source(a.generate, a.size_gb)))
        return 0
    if a.to_gguf:
        to_gguf_baseline(*a.to_gguf)
        return 0
    if a.from_gguf:
        from_gguf_baseline(*a.from_gguf)
        return 0
    if a.compare_gguf:
        print(json.dumps(compare_gguf(*a.compare_gguf)))
        return 0
    floor = bl.launcher_floor()
    baseline = bl.import_baseline(a.device)
    dev = ["--device", a.device]
    rows, checks, verdicts = [], {}, {}

    def yardstick(case: str, m, out: Path, largest_bytes: int) -> None:
        cp = bl.cp_baseline(out, out.with_name("cp-" + out.name))
        rows.append([case, "cp + sync", bl.fmt_gb(out.stat().st_size), f"{cp.seconds:.1f}", bl.fmt_mb(cp.peak_rss)])
        lines, vals = bl.verdict_lines(case, m, cp, out.stat().st_size, baseline, largest_bytes, bl.pipeline_bytes(2, 2))
        verdicts[case] = {"lines": lines, **vals}

    if a.workdir:  # a folder that does not exist yet is made, as bench_convert/bench_merge do
        Path(a.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        work = Path(tmp)
        cases = a.cases.split(",")
        threads = os.cpu_count() or 1
        info = llm = None
        sources: dict[str, dict] = {}
        if "q8_0" in cases or "flux-q4_k_m" in cases:
            src = work / "flux-bf16.safetensors"
            log(f"generating a {a.size_gb} GB bf16 Flux-shaped source ...")
            info = json.loads(bl.run_py(__file__, "--generate", src, "--size-gb", a.size_gb).stdout.strip().splitlines()[-1])
        if "flux-q4_k_m" in cases:
            warm(src)
            case = "bf16 Flux -> GGUF Q4_K_M"
            dst = work / "ckpt-Q4_K_M.gguf"
            log(f"{case}: ckpt ...")
            m = bl.measure(bl.ckpt_argv("convert", src, "--to", "gguf-q4_k_m", "-o", dst, *dev, "-q"))
            rows.append([case, "ckpt", bl.fmt_gb(dst.stat().st_size), f"{m.seconds:.1f}", bl.fmt_mb(m.peak_rss)])
            yardstick(case, m, dst, 2 * _numel(info["largest_shape"]))
            mid, ref = work / "mid-BF16.gguf", work / "ref-Q4_K_M.gguf"
            log(f"{case}: baseline (convert.py's step, then llama.cpp's quantizer) ...")
            m1 = bl.measure([sys.executable, __file__, "--to-bf16-gguf", src, mid])
            m2 = bl.measure([sys.executable, __file__, "--quantize-c", mid, ref, threads])
            rows.append([case, "baseline: convert.py step (BF16 GGUF)", bl.fmt_gb(mid.stat().st_size),
                         f"{m1.seconds:.1f}", bl.fmt_mb(m1.peak_rss)])
            rows.append([case, f"baseline: llama.cpp quantizer, {threads} threads", bl.fmt_gb(ref.stat().st_size),
                         f"{m2.seconds:.1f}", bl.fmt_mb(m2.peak_rss)])
            rows.append([case, "baseline: both steps", bl.fmt_gb(ref.stat().st_size),
                         f"{m1.seconds + m2.seconds:.1f}", bl.fmt_mb(max(m1.peak_rss, m2.peak_rss))])
            verdicts[case]["lines"].append(f"{case}: ckpt {m.seconds:.1f} s vs the two steps {m1.seconds + m2.seconds:.1f} s "
                                           f"(ratio {m.seconds / (m1.seconds + m2.seconds):.2f})")
            if not a.no_verify:
                checks["flux_q4_k_m"] = json.loads(bl.run_py(__file__, "--compare-gguf", dst, ref,
                                                             check=False).stdout.strip().splitlines()[-1])
            for f in (dst, mid, ref):
                f.unlink(missing_ok=True)
        def imatrix_case(folder: Path, ref: Path, made: dict) -> None:
            """The same folder with an importance matrix (random statistics for every matrix of the reference's
            file): ckpt with --imatrix against convert_hf_to_gguf.py + llama-quantize --imatrix."""
            case = "bf16 Llama HF folder -> GGUF Q4_K_M --imatrix"
            im = work / "imatrix.gguf"
            bl.run_py(__file__, "--write-imatrix", ref, im)
            dst = work / "ckpt-imatrix.gguf"
            log(f"{case}: ckpt ...")
            m = bl.measure(bl.ckpt_argv("convert", folder, "--to", "gguf-q4_k_m", "--imatrix", im, "-o", dst, *dev,
                                        "-q"))
            rows.append([case, "ckpt", bl.fmt_gb(dst.stat().st_size), f"{m.seconds:.1f}", bl.fmt_mb(m.peak_rss)])
            yardstick(case, m, dst, 2 * _numel(made["largest_shape"]))
            ref2 = work / "ref-imatrix.gguf"
            log(f"{case}: baseline (convert_hf_to_gguf.py --outtype bf16, then llama-quantize --imatrix) ...")
            mb = bl.measure([sys.executable, __file__, "--llama-two-steps", folder, work / "mid-imatrix-BF16.gguf",
                             ref2, threads, im])
            rows.append([case, f"baseline: convert_hf_to_gguf + llama-quantize --imatrix ({threads} threads)",
                         bl.fmt_gb(ref2.stat().st_size), f"{mb.seconds:.1f}", bl.fmt_mb(mb.peak_rss)])
            verdicts[case]["lines"].append(f"{case}: ckpt {m.seconds:.1f} s vs the two steps {mb.seconds:.1f} s "
                                           f"(ratio {m.seconds / mb.seconds:.2f}), peak RSS {bl.fmt_mb(m.peak_rss)} "
                                           f"vs {bl.fmt_mb(mb.peak_rss)} MB")
            if not a.no_verify:
                checks["llm_q4_k_m_imatrix"] = json.loads(bl.run_py(__file__, "--compare-gguf", dst, ref2,
                                                                    check=False).stdout.strip().splitlines()[-1])
            for f in (dst, ref2, im):
                f.unlink(missing_ok=True)

        for key, kind, label in (("llm-q4_k_m", "llama", "Llama"), ("moe-q4_k_m", "mixtral", "Mixtral")):
            if key not in cases:
                continue
            case = f"bf16 {label} HF folder -> GGUF Q4_K_M"
            folder = work / key
            log(f"generating a {a.size_gb} GB bf16 {label}-shaped HF folder ...")
            made = json.loads(bl.run_py(__file__, "--generate-llm", folder, "--size-gb", a.size_gb, "--llm-kind",
                                        kind).stdout.strip().splitlines()[-1])
            llm = made if key == "llm-q4_k_m" else llm
            info = info or made
            sources[label] = made
            for f in sorted(folder.glob("*.safetensors")):
                warm(f)
            dst = work / f"ckpt-{key}.gguf"
            log(f"{case}: ckpt ...")
            m = bl.measure(bl.ckpt_argv("convert", folder, "--to", "gguf-q4_k_m", "-o", dst, *dev, "-q"))
            rows.append([case, "ckpt", bl.fmt_gb(dst.stat().st_size), f"{m.seconds:.1f}", bl.fmt_mb(m.peak_rss)])
            yardstick(case, m, dst, 2 * _numel(made["largest_shape"]))
            ref = work / f"ref-{key}.gguf"
            log(f"{case}: baseline (convert_hf_to_gguf.py --outtype bf16, then llama-quantize's function) ...")
            mb = bl.measure([sys.executable, __file__, "--llama-two-steps", folder, work / f"mid-{key}-BF16.gguf",
                             ref, threads])
            rows.append([case, f"baseline: convert_hf_to_gguf + llama-quantize ({threads} threads)",
                         bl.fmt_gb(ref.stat().st_size), f"{mb.seconds:.1f}", bl.fmt_mb(mb.peak_rss)])
            verdicts[case]["lines"].append(f"{case}: ckpt {m.seconds:.1f} s vs the two steps {mb.seconds:.1f} s "
                                           f"(ratio {m.seconds / mb.seconds:.2f}), peak RSS {bl.fmt_mb(m.peak_rss)} "
                                           f"vs {bl.fmt_mb(mb.peak_rss)} MB; source {made['layers']} layers")
            if not a.no_verify:
                checks[key.replace("-", "_")] = json.loads(bl.run_py(__file__, "--compare-gguf", dst, ref,
                                                                     check=False).stdout.strip().splitlines()[-1])
            if key == "llm-q4_k_m" and "llm-q4_k_m-imatrix" in cases:
                imatrix_case(folder, ref, made)
            shutil.rmtree(folder, ignore_errors=True)
            for f in (dst, ref):
                f.unlink(missing_ok=True)
        if "q8_0" in cases:
            warm(src)
            outs = {}
            for tool in ("ckpt", "baseline"):
                dst = work / f"{tool}-Q8_0.gguf"
                argv = (bl.ckpt_argv("convert", src, "--to", "gguf-q8_0", "-o", dst, *dev, "-q") if tool == "ckpt"
                        else [sys.executable, __file__, "--to-gguf", src, dst])
                log(f"bf16 -> GGUF Q8_0: {tool} ...")
                m = bl.measure(argv)
                outs[tool] = dst
                rows.append(["bf16 -> GGUF Q8_0", tool, bl.fmt_gb(dst.stat().st_size), f"{m.seconds:.1f}",
                             bl.fmt_mb(m.peak_rss)])
                if tool == "ckpt":
                    yardstick("bf16 -> GGUF Q8_0", m, dst, 2 * _numel(info["largest_shape"]))
            if not a.no_verify:
                checks["to_gguf"] = json.loads(bl.run_py(__file__, "--compare-gguf", outs["ckpt"], outs["baseline"],
                                                         check=False).stdout.strip().splitlines()[-1])
            gguf_src = outs["ckpt"]
            outs["baseline"].unlink()
            warm(gguf_src)
            back = {}
            for tool in ("ckpt", "baseline"):
                dst = work / f"{tool}-bf16.safetensors"
                argv = (bl.ckpt_argv("convert", gguf_src, "--to", "bf16", "-o", dst, *dev, "-q") if tool == "ckpt"
                        else [sys.executable, __file__, "--from-gguf", gguf_src, dst])
                log(f"GGUF Q8_0 -> bf16: {tool} ...")
                m = bl.measure(argv)
                back[tool] = dst
                rows.append(["GGUF Q8_0 -> bf16", tool, bl.fmt_gb(dst.stat().st_size), f"{m.seconds:.1f}",
                             bl.fmt_mb(m.peak_rss)])
                if tool == "ckpt":
                    yardstick("GGUF Q8_0 -> bf16", m, dst, 2 * _numel(info["largest_shape"]))
            if not a.no_verify:
                checks["from_gguf"] = bl.compare(back["ckpt"], back["baseline"])
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(bl.machine_lines()))
    print(f"device: {a.device}; files in {a.workdir or tempfile.gettempdir()} ({bl.where(a.workdir or tempfile.gettempdir())})")
    print(f"launcher RSS floor (every peak below includes it): {bl.fmt_mb(floor)} MB")
    print(f"source: {bl.fmt_gb(info['bytes'])} GB bf16, {info['tensors']} tensors, {info['params'] / 1e9:.2f} G "
          f"parameters, largest {info['largest']} {info['largest_shape']}\n")
    for label, made in sources.items():
        if made is not info:
            print(f"{label} source: {bl.fmt_gb(made['bytes'])} GB bf16, {made['tensors']} tensors, {made['layers']} "
                  f"layers, largest {made['largest']} {made['largest_shape']}\n")
    print(bl.markdown_table(["case", "tool", "output GB", "seconds", "peak RSS MB"], rows))
    print()
    for v in verdicts.values():
        print("\n".join(v["lines"]))
    bad = False
    for case, res in checks.items():
        print(f"{case}: outputs identical: {res['equal']}" + (f" ({res['problem']})" if res.get("problem") else ""))
        bad |= not res["equal"]
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "checks": checks, "source": info, "floor": floor, "verdicts": verdicts}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
