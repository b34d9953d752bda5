"""Split GGUF files (llama.cpp's gguf-split layout, `ckpt.io.gguf_split`): any part reads as the whole model in
every command; `convert --to gguf-* --max-shard-size` writes the parts gguf's own split writer writes, byte for
byte, which llama.cpp loads; the parts appear as a set or not at all; a broken set is a one-line error."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from safetensors.torch import load_file, save_file

from gguf_helpers import quantized
from helpers.flux_names import tiny_flux
from helpers.refusals import assert_refused

RNG = np.random.default_rng(7)
KV = {"general.architecture": ("flux", V.STRING), "general.quantization_version": (2, V.UINT32),
      "general.name": ("tiny", V.STRING)}


def flux_tensors() -> dict:
    """name -> (stored data, GGML type): Q8_0, F16 and F32 tensors of a Flux-named model."""
    out = {}
    for i in range(3):
        x = (RNG.standard_normal((64, 96)) * 0.1).astype(np.float32)
        out[f"double_blocks.{i}.img_attn.qkv.weight"] = (quantized(x, T.Q8_0)[0], T.Q8_0)
        out[f"double_blocks.{i}.img_attn.qkv.bias"] = (RNG.standard_normal(64).astype(np.float32), T.F32)
    out["img_in.weight"] = (RNG.standard_normal((64, 48)).astype(np.float16), T.F16)
    out["final_layer.linear.weight"] = (RNG.standard_normal((64, 64)).astype(np.float16), T.F16)
    return out


def write_part(path: Path, tensors: dict, kv: dict, arch: str | None = "flux", **writer):
    """One GGUF file by gguf's own writer: `kv` key -> (value, GGUFValueType) in order; `arch` None: no
    general.architecture (gguf-split's later parts hold only the split keys)."""
    w = gguf.GGUFWriter(str(path), arch=arch or "x", **writer)
    if arch is None:
        w.kv_data[0].pop("general.architecture")
    for key, (value, vtype) in kv.items():
        if key != "general.architecture":
            w.add_key_value(key, value, vtype)
    for name, (data, t) in tensors.items():
        w.add_tensor(name, data, raw_dtype=t if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def split_keys(no: int, count: int, total: int) -> dict:
    return {"split.no": (no, V.UINT16), "split.count": (count, V.UINT16), "split.tensors.count": (total, V.INT32)}


def hand_split(folder: Path, tensors: dict, groups: list[int], prefix: str = "m", kv=KV, **edit) -> list[Path]:
    """A split set as gguf-split.cpp writes it, one gguf.GGUFWriter per part: the first holds all metadata and
    then the split keys, the others only the split keys; `groups` tensors per part. `edit[i]` changes part i's
    split keys, tensors or architecture (bad sets)."""
    names, paths, at = list(tensors), [], 0
    for i, n in enumerate(groups):
        part = {k: tensors[k] for k in names[at:at + n]}
        at += n
        keys = {**(kv if i == 0 else {}), **split_keys(i, len(groups), len(tensors))}
        arch = kv["general.architecture"][0] if i == 0 else None
        keys, part, arch = edit.get(f"p{i}", lambda k, p, a: (k, p, a))(keys, part, arch)
        path = folder / f"{prefix}-{i + 1:05d}-of-{len(groups):05d}.gguf"
        write_part(path, part, keys, arch)
        paths.append(path)
    return paths


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def to_fp32(run_ckpt, src: Path, out: Path) -> dict:
    code, _, err = run_ckpt("convert", src, "--to", "fp32", "-q", "-o", out)
    assert code == 0, err
    return load_file(out)


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---- reading ------------------------------------------------------------------------------------


def test_a_gguf_py_split_set_reads_as_one_model_from_any_part(tmp_path, run_ckpt):
    """gguf's own GGUFWriter(split_max_size=...) (what convert_hf_to_gguf.py --split-max-size runs): inspect counts
    every tensor once and --scan reads them all; converting any part equals converting the unsplit file."""
    import json

    tensors = flux_tensors()
    write_part(tmp_path / "whole.gguf", tensors, KV)
    write_part(tmp_path / "m.gguf", tensors, KV, split_max_size=14000)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) == 3 and not (tmp_path / "m.gguf").exists()
    want = to_fp32(run_ckpt, tmp_path / "whole.gguf", tmp_path / "whole.safetensors")
    ref = json.loads(run_ckpt("inspect", "--json", tmp_path / "whole.gguf")[1])["components"][0]
    for part in parts:
        code, out, err = run_ckpt("inspect", "--json", "--scan", part)
        assert code == 0, err
        comp = json.loads(out)["components"][0]
        assert (comp["tensors"], comp["bytes"], comp["encodings"]) == (len(tensors), ref["bytes"], ref["encodings"])
        assert comp["metadata"] == ref["metadata"]  # the first part's, without split.*
        assert any("split GGUF of 3 parts, read as one model" in n for n in comp["notes"])
        assert_same(to_fp32(run_ckpt, part, tmp_path / f"{part.stem}.safetensors"), want)


def test_a_hand_made_gguf_split_set_dequantizes_and_merges_from_any_part(tmp_path, run_ckpt):
    """Parts written one GGUFWriter each, as gguf-split.cpp lays them out (metadata in the first part only);
    dequant of the last part gives the unsplit file's tensors; a folder holding only the set reads as it."""
    tensors = flux_tensors()
    write_part(tmp_path / "whole.gguf", tensors, KV)
    (tmp_path / "set").mkdir()
    parts = hand_split(tmp_path / "set", tensors, [3, 1, 4])
    code, _, err = run_ckpt("dequant", tmp_path / "whole.gguf", "-q", "-o", tmp_path / "a.safetensors")
    assert code == 0, err
    code, _, err = run_ckpt("dequant", parts[2], "-q", "-o", tmp_path / "b.safetensors")
    assert code == 0, err
    assert_same(load_file(tmp_path / "b.safetensors"), load_file(tmp_path / "a.safetensors"))
    code, _, err = run_ckpt("convert", tmp_path / "set", "--to", "fp32", "-q", "-o", tmp_path / "c")
    assert code == 0, err
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["model.safetensors"]
    assert_same(load_file(tmp_path / "c" / "model.safetensors"),
                to_fp32(run_ckpt, tmp_path / "whole.gguf", tmp_path / "w.safetensors"))
    # a model merge of the split set with its unsplit twin: the same model, so the same tensors
    code, _, err = run_ckpt("merge", parts[1], tmp_path / "whole.gguf", "--alpha", "0.5", "--to", "fp32", "-q",
                            "-o", tmp_path / "d.safetensors")
    assert code == 0, err
    assert_same(load_file(tmp_path / "d.safetensors"), load_file(tmp_path / "w.safetensors"))


def test_split_count_one_is_just_a_file(tmp_path, run_ckpt):
    tensors = flux_tensors()
    write_part(tmp_path / "whole.gguf", tensors, KV)
    write_part(tmp_path / "one.gguf", tensors, {**KV, **split_keys(0, 1, len(tensors))})
    assert_same(to_fp32(run_ckpt, tmp_path / "one.gguf", tmp_path / "a.safetensors"),
                to_fp32(run_ckpt, tmp_path / "whole.gguf", tmp_path / "b.safetensors"))


def test_merge_lora_keep_format_on_a_split_base_writes_one_gguf(tmp_path, run_ckpt):
    """--keep-format keeps the base's encoding, not its split: one GGUF file, the first part's metadata without
    split.*, every tensor, as the same merge into the unsplit base writes it (a note says so)."""
    x = (RNG.standard_normal((64, 96)) * 0.05).astype(np.float32)
    tensors = {f"blocks.{i}.ffn.0.weight": (quantized(x + i, T.Q8_0)[0], T.Q8_0) for i in range(3)}
    kv = {"general.architecture": ("wan", V.STRING)}
    write_part(tmp_path / "whole.gguf", tensors, kv, arch="wan")
    parts = hand_split(tmp_path, tensors, [1, 2], kv=kv)
    g = torch.Generator().manual_seed(0)
    k = "lora_unet_blocks_1_ffn_0"
    save_file({f"{k}.lora_down.weight": torch.randn(4, 96, generator=g) * 0.1,
               f"{k}.lora_up.weight": torch.randn(64, 4, generator=g) * 0.1, f"{k}.alpha": torch.tensor(2.0)},
              tmp_path / "l.safetensors")
    code, _, err = run_ckpt("merge-lora", tmp_path / "whole.gguf", tmp_path / "l.safetensors", "--keep-format",
                            "-o", tmp_path / "a.gguf")
    assert code == 0, err
    code, _, err = run_ckpt("merge-lora", parts[1], tmp_path / "l.safetensors", "--keep-format",
                            "-o", tmp_path / "b.gguf")
    assert code == 0, err
    assert "split GGUF input is written as one GGUF file" in err
    a, b = gguf.GGUFReader(tmp_path / "a.gguf"), gguf.GGUFReader(tmp_path / "b.gguf")
    assert not any(key.startswith("split.") for key in b.fields)
    assert [t.name for t in b.tensors] == [t.name for t in a.tensors] == list(tensors)
    for ta, tb in zip(a.tensors, b.tensors):
        assert np.array_equal(ta.data, tb.data), ta.name


# ---- bad sets -----------------------------------------------------------------------------------


def _arch(a):
    return lambda k, p, _: (k, p, a)


def _keys(**kw):
    return lambda k, p, a: ({**k, **{key.replace("_", "."): v for key, v in kw.items()}}, p, a)


BAD = {
    "missing part": (None, "part m-00002-of-00003.gguf of this split GGUF (3 parts) is missing"),
    "split.count differs": ({"p1": _keys(split_count=(4, V.UINT16))},
                            "part of another split set: split.count is 4, m-00001-of-00003.gguf says 3"),
    "split.no differs": ({"p2": _keys(split_no=(1, V.UINT16))}, "split.no is 1, but its name says part 00003 of 3"),
    "architecture differs": ({"p1": _arch("wan")},
                             "part of another model: general.architecture is 'wan', m-00001-of-00003.gguf says 'flux'"),
    "tensor count": ({"p0": _keys(split_tensors_count=(9, V.INT32)),
                      "p1": _keys(split_tensors_count=(9, V.INT32)), "p2": _keys(split_tensors_count=(9, V.INT32))},
                     "split GGUF of 3 parts holds 8 tensors, but split.tensors.count says 9"),
    "tensors.count differs": ({"p2": _keys(split_tensors_count=(7, V.INT32))},
                              "part of another split set: split.tensors.count is 7, m-00001-of-00003.gguf says 8"),
    "duplicate tensor": ({"p2": lambda k, p, a: (k, {**p, "double_blocks.0.img_attn.qkv.bias":
                                                      (np.zeros(64, np.float32), T.F32)}, a)},
                         "tensor 'double_blocks.0.img_attn.qkv.bias' is also in m-00001-of-00003.gguf"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("given", [0, 2])
def test_a_broken_split_set_is_one_line_and_writes_nothing(tmp_path, run_ckpt, case, given):
    edit, problem = BAD[case]
    tensors = flux_tensors()
    if case == "duplicate tensor":  # one tensor too many in all: split.tensors.count follows
        edit = {**edit, **{f"p{i}": _chain(edit.get(f"p{i}"), _keys(split_tensors_count=(9, V.INT32)))
                           for i in range(3)}}
    parts = hand_split(tmp_path, tensors, [3, 2, 3], **(edit or {}))
    if case == "missing part":
        parts[1].unlink()
    src = parts[given]
    before = {p: p.read_bytes() for p in parts if p.exists()}
    for args in (["convert", src, "--to", "bf16", "-o", tmp_path / "out.safetensors"], ["inspect", src],
                 ["convert", src, "--to", "gguf-q8_0", "--max-shard-size", "5kB", "-o", tmp_path / "o.gguf"]):
        assert_refused(run_ckpt, tmp_path, args, "", problem)
    assert {p: p.read_bytes() for p in before} == before


def _chain(f, g):
    return g if f is None else (lambda k, p, a: g(*f(k, p, a)))


@pytest.mark.parametrize("keys,problem", [
    ({"split.count": ("two", V.STRING)}, "metadata 'split.count' is 'two', not a count of parts"),
    ({"split.count": (2, V.UINT16)}, "split GGUF (split.count 2) without split.no"),
    ({"split.count": (2, V.UINT16), "split.no": (2, V.UINT16)}, "split GGUF part split.no 2, but split.count is 2"),
])
def test_split_keys_that_are_not_a_part_are_refused(tmp_path, run_ckpt, keys, problem):
    src = tmp_path / "m-00001-of-00002.gguf"
    write_part(src, flux_tensors(), {**KV, **keys})
    before = src.read_bytes()
    assert_refused(run_ckpt, tmp_path, ["convert", src, "--to", "bf16"], f"{src}: ", problem)
    assert src.read_bytes() == before


def test_a_part_named_unlike_its_split_keys_is_refused(tmp_path, run_ckpt):
    parts = hand_split(tmp_path, flux_tensors(), [4, 4])
    renamed = parts[0].rename(tmp_path / "model.gguf")
    assert_refused(run_ckpt, tmp_path, ["inspect", renamed], f"{renamed}: ",
                   "split GGUF part 1 of 2, but its name is not PREFIX-00001-of-00002.gguf")
    parts[1].rename(tmp_path / "m-00002-of-00003.gguf")  # numbered for a set of 3
    assert_refused(run_ckpt, tmp_path, ["inspect", tmp_path / "m-00002-of-00003.gguf"], "",
                   "split GGUF part 2 of 2, but its name is not PREFIX-00002-of-00002.gguf")


# ---- writing ------------------------------------------------------------------------------------


def gguf_py_split(unsplit: Path, out: Path, max_size: int) -> list[Path]:
    """The same tensors and key-values as the unsplit GGUF, written by gguf's GGUFWriter(split_max_size)."""
    r = gguf.GGUFReader(unsplit)
    w = gguf.GGUFWriter(str(out), arch=r.fields["general.architecture"].contents(), split_max_size=max_size)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if f.types[0] == V.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(out)


@pytest.mark.parametrize("size,n_parts", [("20kB", 5), ("60kB", 2)])
def test_max_shard_size_writes_the_parts_gguf_writes(tmp_path, run_ckpt, size, n_parts):
    """`convert --to gguf-q8_0 --max-shard-size` writes, byte for byte, the parts gguf's own split writer writes
    for the tensors and key-values of the unsplit output (tiny_flux's tensors are whole multiples of 32 bytes,
    where gguf-py's rule and gguf-split.cpp's padded one agree); read back, they are the unsplit model."""
    from ckpt.io.plan import parse_size

    save_file(tiny_flux(), tmp_path / "flux.safetensors")
    code, _, err = run_ckpt("convert", tmp_path / "flux.safetensors", "--to", "gguf-q8_0", "-q", "-o", tmp_path / "u.gguf")
    assert code == 0, err
    before = listing(tmp_path)
    code, out, err = run_ckpt("convert", tmp_path / "flux.safetensors", "--to", "gguf-q8_0", "--max-shard-size", size,
                              "-o", tmp_path / "m.gguf")
    assert code == 0, err
    names = [f"m-{i + 1:05d}-of-{n_parts:05d}.gguf" for i in range(n_parts)]
    assert listing(tmp_path) == sorted(before + names)  # the parts beside each other, no m.gguf, no temp file
    assert out.strip() == f"wrote {tmp_path / names[0]}"
    assert f"split GGUF of {n_parts} parts beside each other: {names[0]}" in err
    (tmp_path / "ref").mkdir()
    refs = gguf_py_split(tmp_path / "u.gguf", tmp_path / "ref" / "m.gguf", parse_size(size))
    assert [p.name for p in refs] == names
    for name in names:
        assert (tmp_path / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
    first = gguf.GGUFReader(tmp_path / names[0])
    assert list(first.fields)[-3:] == ["split.no", "split.count", "split.tensors.count"]
    assert [list(first.fields[k].types) for k in list(first.fields)[-3:]] == [[V.UINT16], [V.UINT16], [V.INT32]]
    assert_same(to_fp32(run_ckpt, tmp_path / names[-1], tmp_path / "a.safetensors"),
                to_fp32(run_ckpt, tmp_path / "u.gguf", tmp_path / "b.safetensors"))


def test_parts_follow_gguf_splits_size_rule():
    """gguf-split.cpp's should_split: a new part when the part's tensor data, each padded to 32 bytes, would pass
    the size with the next tensor; a tensor larger than the size gets a part of its own (also the first:
    gguf-split fails there, with an empty first part); one part is the plain plan (gguf-py: no split keys)."""
    from ckpt.io.gguf_split import split_gguf_plan
    from ckpt.io.plan import OutFile, OutTensor, Plan

    def plan(sizes):
        outs = [OutTensor(f"t{i}", torch.uint8, (n,), None, None, gguf_type=None)
                for i, n in enumerate(sizes)]
        return Plan(single_file=True, files=[OutFile("", {}, outs, "gguf")])

    def reference(sizes, max_bytes):  # gguf-split.cpp, transcribed
        groups, cur = [[]], 0
        for i, n in enumerate(sizes):
            n = -(-n // 32) * 32
            if cur + n > max_bytes and groups[-1]:
                groups.append([])
                cur = n
            else:
                cur += n
            groups[-1].append(f"t{i}")
        return groups

    for sizes, max_bytes in [([40, 40, 40, 40], 100), ([10] * 7, 64), ([500, 10, 10], 100), ([10, 500, 10, 10], 100),
                             ([33, 31, 64], 96), ([64, 64], 128)]:
        got = split_gguf_plan(plan(sizes), max_bytes)
        want = reference(sizes, max_bytes)
        assert [[t.name for t in f.tensors] for f in got.files] == want, (sizes, max_bytes)
        if len(want) == 1:
            assert type(got) is Plan and not any(f.key.startswith("split.") for f in got.files[0].fields)
        else:
            assert [[(f.key, f.value) for f in p.fields] for p in got.files] == [
                [("split.no", i), ("split.count", len(want)), ("split.tensors.count", len(sizes))]
                for i in range(len(want))]


def test_default_name_dry_run_and_one_part(tmp_path, run_ckpt):
    save_file(tiny_flux(), tmp_path / "flux.safetensors")
    before = listing(tmp_path)
    code, out, err = run_ckpt("convert", tmp_path / "flux.safetensors", "--to", "gguf-q8_0", "--max-shard-size",
                              "30kB", "--dry-run")
    assert code == 0 and listing(tmp_path) == before, err
    assert out.strip() == f"would write {tmp_path / 'flux-Q8_0-00001-of-00004.gguf'}"
    assert "split GGUF of 4 parts beside each other: flux-Q8_0-00001-of-00004.gguf, flux-Q8_0-00002-of-00004.gguf, " \
           "flux-Q8_0-00003-of-00004.gguf, ..." in err and "would write 4 gguf files" in err
    code, out, err = run_ckpt("convert", tmp_path / "flux.safetensors", "--to", "gguf-q8_0", "--max-shard-size", "30kB",
                              "-q")
    assert code == 0, err
    parts = [tmp_path / f"flux-Q8_0-{i:05d}-of-00004.gguf" for i in (1, 2, 3, 4)]
    assert all(p.is_file() for p in parts)
    # the output of a split input is named after its set: flux-Q8_0-Q4_0-00001-of-0000N.gguf
    code, out, err = run_ckpt("convert", parts[1], "--to", "gguf-q4_0", "--max-shard-size", "30kB", "-q")
    assert code == 0, err
    assert out.strip().startswith(f"wrote {tmp_path / 'flux-Q8_0-Q4_0-00001-of-0000'}")
    # everything in one part: the plain file, without split keys (gguf-py's writer does the same)
    code, out, err = run_ckpt("convert", tmp_path / "flux.safetensors", "--to", "gguf-q8_0", "--max-shard-size", "1GB",
                              "-q", "-o", tmp_path / "one.gguf")
    assert code == 0 and out.strip() == f"wrote {tmp_path / 'one.gguf'}", err
    assert not any(k.startswith("split.") for k in gguf.GGUFReader(tmp_path / "one.gguf").fields)
    assert_refused(run_ckpt, tmp_path, ["convert", tmp_path / "flux.safetensors", "--to", "gguf-q8_0",
                                        "--max-shard-size", "5"], "--max-shard-size 5: no unit", "")


# ---- llama.cpp ----------------------------------------------------------------------------------


def tiny_llama_gguf(path: Path, split_max_size: int = 0):
    """A tiny random llama in F32 with a placeholder SentencePiece vocabulary: llama.cpp loads and runs it."""
    V_, D, F, L, H = 64, 32, 64, 2, 4
    r = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch="llama", split_max_size=split_max_size)
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(H)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(D // H)
    w.add_file_type(0)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(V_)])
    w.add_token_scores([0.0] * V_)
    w.add_token_types([1] * V_)

    def t(*s):
        return (r.standard_normal(s) * 0.2 + (1 if len(s) == 1 else 0)).astype(np.float32)

    w.add_tensor("token_embd.weight", t(V_, D))
    for b in range(L):
        for n, s in [("attn_norm", (D,)), ("attn_q", (D, D)), ("attn_k", (D, D)), ("attn_v", (D, D)),
                     ("attn_output", (D, D)), ("ffn_norm", (D,)), ("ffn_gate", (F, D)), ("ffn_up", (F, D)),
                     ("ffn_down", (D, F))]:
            w.add_tensor(f"blk.{b}.{n}.weight", t(*s))
    w.add_tensor("output_norm.weight", t(D))
    w.add_tensor("output.weight", t(V_, D))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(path)


def test_llama_cpp_loads_ckpt_split_parts_and_ckpt_reads_its_split_llm(tmp_path, run_ckpt):
    """The split writer every GGUF planner goes through (`split_gguf_plan`, then the set publish) on a llama
    GGUF's own tensors and key-values: llama.cpp loads the parts (its loader checks split.no, duplicates and
    split.tensors.count) and computes the unsplit file's logits. And ckpt reads a gguf-py split LLM as the HF
    folder of the unsplit file."""
    from helpers.llama_ref import llama_cpp, logits

    llama_cpp()
    from ckpt.io.checkpoint import open_checkpoint
    from ckpt.io.gguf_split import split_gguf_plan
    from ckpt.io.gguf_writer import fields_from
    from ckpt.io.output import execute
    from ckpt.io.plan import OutFile, Plan
    from ckpt.quant.gguf import stored_output

    tiny_llama_gguf(tmp_path / "whole.gguf")
    with open_checkpoint(str(tmp_path / "whole.gguf")) as ck:
        f = ck.components[0].files[0]
        outs = [stored_output(t) for t in f.gguf.tensors.values()]
        plan = Plan(single_file=True, files=[OutFile("", {}, outs, "gguf", fields=fields_from(f.gguf))])
        split = split_gguf_plan(plan, 12000)
        assert len(split.files) >= 3
        execute(split, tmp_path / "c.gguf", inputs=ck.inputs)
    parts = sorted(tmp_path.glob("c-*.gguf"))
    assert len(parts) == len(split.files)
    ids = [1, 5, 7, 9, 3]
    want = logits(tmp_path / "whole.gguf", ids)
    assert np.array_equal(logits(parts[0], ids), want)

    (tmp_path / "py").mkdir()
    py_parts = tiny_llama_gguf(tmp_path / "py" / "s.gguf", split_max_size=12000)
    assert len(py_parts) >= 3
    for src, name in ((tmp_path / "whole.gguf", "a"), (py_parts[-1], "b"), (parts[1], "c")):
        code, _, err = run_ckpt("convert", src, "--to", "fp32", "-q", "-o", tmp_path / name)
        assert code == 0, err
    a = load_file(tmp_path / "a" / "model.safetensors")
    assert_same(load_file(tmp_path / "b" / "model.safetensors"), a)
    assert_same(load_file(tmp_path / "c" / "model.safetensors"), a)
    assert (tmp_path / "b" / "config.json").read_text() == (tmp_path / "a" / "config.json").read_text()


# ---- atomicity ----------------------------------------------------------------------------------


def _fail_on_nth_write(monkeypatch, n, exc):
    from ckpt.io.gguf_writer import GGUFFileWriter

    calls = {"n": 0}
    real = GGUFFileWriter.write

    def write(self, name, data):
        calls["n"] += 1
        if calls["n"] == n:
            raise exc
        return real(self, name, data)

    monkeypatch.setattr(GGUFFileWriter, "write", write)


@pytest.fixture
def flux_src(tmp_path):
    save_file(tiny_flux(), tmp_path / "flux.safetensors")
    return tmp_path / "flux.safetensors"


ARGS = ("--to", "gguf-q8_0", "--max-shard-size", "20kB")


@pytest.mark.parametrize("exc,code,says", [(KeyboardInterrupt(), 130, "interrupted: nothing was written"),
                                           (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), 2, "nothing written")])
def test_a_failure_in_a_later_part_leaves_no_part_and_no_temp(tmp_path, monkeypatch, run_ckpt, flux_src, exc, code, says):
    before = listing(tmp_path)
    _fail_on_nth_write(monkeypatch, 9, exc)  # in the fourth of five parts: three are written in full by then
    got, out, err = run_ckpt("convert", flux_src, *ARGS, "-o", tmp_path / "m.gguf")
    assert got == code and says in err and err.strip().count("\n") == 0, err
    assert listing(tmp_path) == before


def test_existing_part_blocks_without_overwrite_and_is_replaced_with_it(tmp_path, run_ckpt, flux_src):
    (tmp_path / "m-00003-of-00005.gguf").write_bytes(b"old part")
    (tmp_path / "m-00002-of-00002.gguf").write_bytes(b"a part of another split of m")
    assert_refused(run_ckpt, tmp_path, ["convert", flux_src, *ARGS, "-o", tmp_path / "m.gguf"],
                   f"{tmp_path / 'm-00003-of-00005.gguf'}: ", "already exists (pass --overwrite to replace it)")
    code, out, err = run_ckpt("convert", flux_src, *ARGS, "-o", tmp_path / "m.gguf", "--overwrite")
    assert code == 0, err
    assert "1 part of another split of this name stay beside the new ones (m-00002-of-00002.gguf)" in err
    assert gguf.GGUFReader(tmp_path / "m-00003-of-00005.gguf").fields["split.no"].contents() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["flux.safetensors", "m-00002-of-00002.gguf"] + [
        f"m-{i:05d}-of-00005.gguf" for i in (1, 2, 3, 4, 5)])


def test_a_part_appearing_during_the_publish_rolls_the_set_back(tmp_path, monkeypatch, run_ckpt, flux_src):
    """Without --overwrite each part is renamed only where nothing is (RENAME_NOREPLACE): a part that another
    run wrote meanwhile stops the publish, and the parts already renamed are taken back."""
    import ckpt.io.publish as publish

    real = publish.Staging.verify

    def verify(self):
        real(self)
        if self.out.name == "m-00005-of-00005.gguf":
            self.out.write_bytes(b"someone else's")

    monkeypatch.setattr(publish.Staging, "verify", verify)
    code, out, err = run_ckpt("convert", flux_src, *ARGS, "-o", tmp_path / "m.gguf")
    assert code == 2 and "m-00005-of-00005.gguf: already exists" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flux.safetensors", "m-00005-of-00005.gguf"]
    assert (tmp_path / "m-00005-of-00005.gguf").read_bytes() == b"someone else's"


def test_a_failed_overwrite_publish_puts_the_previous_set_back(tmp_path, monkeypatch, run_ckpt, flux_src):
    import ckpt.io.publish as publish

    code, _, err = run_ckpt("convert", flux_src, *ARGS, "-o", tmp_path / "m.gguf", "-q")
    assert code == 0, err
    old = {p.name: p.read_bytes() for p in tmp_path.glob("m-*.gguf")}
    real = os.rename

    def rename(src, dst, **kw):
        if str(src).startswith(".m-00003-of-00005.gguf.ckpt-tmp-") and dst == "m-00003-of-00005.gguf":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(src, dst, **kw)

    monkeypatch.setattr(publish.os, "rename", rename)
    code, out, err = run_ckpt("convert", flux_src, "--to", "gguf-q4_0", "--max-shard-size", "20kB", "-o",
                              tmp_path / "m.gguf", "--overwrite")
    assert code == 2 and "nothing written" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flux.safetensors", *sorted(old)]
    assert {p.name: p.read_bytes() for p in tmp_path.glob("m-*.gguf")} == old


def test_a_killed_runs_temp_parts_are_removed_by_the_next_run(tmp_path, run_ckpt, flux_src):
    """What a SIGKILL leaves (temp parts of a dead process) is removed by the next run writing that set."""
    stale = tmp_path / ".m-00002-of-00005.gguf.ckpt-tmp-999999999-0123abcd"
    stale.write_bytes(b"half a part")
    code, _, err = run_ckpt("convert", flux_src, *ARGS, "-o", tmp_path / "m.gguf", "-q")
    assert code == 0, err
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flux.safetensors"] + [
        f"m-{i:05d}-of-00005.gguf" for i in (1, 2, 3, 4, 5)]


def test_an_hf_llm_converted_with_max_shard_size_runs_in_llama_cpp(tmp_path, run_ckpt):
    """The LLM exporter's plan goes through the same split: `convert HF_FOLDER --to gguf-f16 --max-shard-size`
    writes the parts gguf's split writer writes for the unsplit export, and llama.cpp's logits from them are
    the unsplit file's."""
    import importlib.util

    from helpers.llama_ref import llama_cpp, logits

    llama_cpp()
    if importlib.util.find_spec("ckpt.targets.planners.gguf_llm_out") is None:
        pytest.skip("no LLM GGUF exporter (ckpt.targets.planners.gguf_llm_out) in this tree")
    from helpers.hf_llm import model_folder

    hf = model_folder(tmp_path / "hf", "llama")
    code, _, err = run_ckpt("convert", hf, "--to", "gguf-f16", "-q", "-o", tmp_path / "u.gguf")
    assert code == 0, err
    code, out, err = run_ckpt("convert", hf, "--to", "gguf-f16", "-q", "--max-shard-size", "600kB",
                              "-o", tmp_path / "s.gguf")
    assert code == 0, err
    parts = sorted(tmp_path.glob("s-*-of-*.gguf"))
    assert len(parts) > 2 and out.strip() == f"wrote {parts[0]}"
    (tmp_path / "ref").mkdir()
    refs = gguf_py_split(tmp_path / "u.gguf", tmp_path / "ref" / "s.gguf", 600_000)
    assert [p.name for p in refs] == [p.name for p in parts]
    for p, r in zip(parts, refs):
        assert p.read_bytes() == r.read_bytes(), p.name
    ids = [1, 5, 7, 9, 30]
    assert np.array_equal(logits(parts[0], ids), logits(tmp_path / "u.gguf", ids))


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_real_signal_mid_set_publishes_no_part(tmp_path, sig):
    """A real `ckpt convert --max-shard-size` process signalled while it writes its second part: SIGTERM (Ctrl-C
    takes the same path) leaves nothing; SIGKILL cannot clean up, but leaves only hidden temp files, never a
    part, and the next run of that set removes them."""
    import signal
    import subprocess
    import sys
    import time

    save_file({f"double_blocks.{i}.img_attn.qkv.weight": torch.randn(512, 1024) for i in range(12)},
              tmp_path / "flux.safetensors")
    args = [sys.executable, "-m", "ckpt.cli", "convert", str(tmp_path / "flux.safetensors"), "--to", "gguf-q8_0",
            "--max-shard-size", "1MB", "-q", "-o", str(tmp_path / "m.gguf")]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not any(n.startswith(".m-00002-of-00012.gguf.ckpt-tmp-") for n in os.listdir(tmp_path)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "convert never started its second part"
            time.sleep(0.002)
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = sorted(os.listdir(tmp_path))
    assert not any(n.startswith("m-") for n in left), left
    if sig == "SIGTERM":
        assert proc.returncode == 130 and b"interrupted: nothing was written" in err, err
        assert left == ["flux.safetensors"]
        return
    assert all(n == "flux.safetensors" or ".ckpt-tmp-" in n for n in left) and len(left) > 1, left
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["flux.safetensors"] + [f"m-{i:05d}-of-00012.gguf" for i in range(1, 13)]


# ---------------------------------------------------- a set a killed run published in part (issue 31, item 6)

# The CLI, its publish slowed down (each part it renames is followed by a pause), so that a SIGKILL lands in it.
SLOW_PUBLISH = """
import sys, time
import ckpt.io.publish as publish
real = publish.Staging._rename_noreplace
def slow(self):
    real(self)
    time.sleep(0.3)
publish.Staging._rename_noreplace = slow
from ckpt.cli.main import main
sys.argv = ["ckpt", *sys.argv[1:]]
main()
"""


def not_ours(folder: Path) -> dict:
    """Files beside the output that no ckpt run wrote, which no cleanup may touch: name -> bytes (None: a folder)."""
    before = set(os.listdir(folder))
    hand_split(folder, flux_tensors(), [7], prefix="m")  # m-00001-of-00001.gguf: gguf's writer, no ckpt mark
    hand_split(folder, flux_tensors(), [3, 4], prefix="o")  # another model's set
    (folder / "m-notes.txt").write_text("mine")
    (folder / ".m-00011-of-00012.gguf.ckpt-tmp-1-not-hex!").write_text("not ckpt's name")
    (folder / f".m-00012-of-00012.gguf.ckpt-tmp-{os.getpid()}-aaaaaaaa").write_text("a live process's")
    (folder / "m-00002-of-00003.gguf").mkdir()  # a folder named like a part
    return {p.name: (p.read_bytes() if p.is_file() else None) for p in folder.iterdir() if p.name not in before}


def still_there(folder: Path, kept: dict) -> None:
    for name, data in kept.items():
        p = folder / name
        assert (p.is_dir() if data is None else p.read_bytes() == data), name


def test_a_set_a_sigkilled_run_published_in_part_is_recognised_cleaned_and_replaced(tmp_path, run_ckpt):
    """A real `ckpt convert --max-shard-size` killed (SIGKILL) during its publish leaves some parts published and a
    temp file for each of the others. The next run with the same -o is refused without --overwrite (the partial set
    is an existing output, named as such; nothing is touched); with --overwrite (here another --max-shard-size, so
    other part names) it removes the temps and the partial set, says both, and leaves every file not ckpt's."""
    import signal
    import subprocess
    import sys
    import time

    save_file({f"double_blocks.{i}.img_attn.qkv.weight": torch.randn(512, 1024) for i in range(12)},
              tmp_path / "flux.safetensors")
    args = ["convert", str(tmp_path / "flux.safetensors"), "--to", "gguf-q8_0", "--max-shard-size", "1MB", "-q",
            "-o", str(tmp_path / "m.gguf")]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_PUBLISH, *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "m-00004-of-00012.gguf").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "convert never published its fourth part"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    published = sorted(p.name for p in tmp_path.glob("m-*-of-00012.gguf"))
    temps = sorted(p.name for p in tmp_path.glob(".m-*-of-00012.gguf.ckpt-tmp-*"))
    assert 4 <= len(published) < 12 and len(published) + len(temps) == 12, (published, temps)
    assert published == [f"m-{i:05d}-of-00012.gguf" for i in range(1, len(published) + 1)]  # in order
    kept = not_ours(tmp_path)

    first = tmp_path / "m-00001-of-00012.gguf"
    assert_refused(run_ckpt, tmp_path, args, f"{first}: already exists: part of a split GGUF that a stopped ckpt run "
                   f"published incompletely ({len(published)} of its 12 parts are here)", "pass --overwrite")
    from ckpt.errors import CkptError

    missing = f"part m-{len(published) + 1:05d}-of-00012.gguf of this split GGUF \\(12 parts\\) is missing"
    with pytest.raises(CkptError, match=missing):  # a reader refuses the partial set, as it should
        gguf_split_header(first)

    code, out, err = run_ckpt("convert", tmp_path / "flux.safetensors", "--to", "gguf-q8_0", "--max-shard-size", "2MB",
                              "-o", tmp_path / "m.gguf", "--overwrite")
    assert code == 0, err
    assert f"removed {len(temps)} temporary output{'s' if len(temps) > 1 else ''} that a stopped ckpt run left " \
        f"beside the output ({temps[0]}" in err, err
    assert f"removed {len(published)} parts of a split GGUF of this name that a stopped ckpt run published " \
        f"incompletely ({published[0]}, {published[1]}, {published[2]}" in err, err
    stay = next(line for line in err.splitlines() if "of another split of this name stay beside" in line)
    assert "-of-00012" not in stay, stay  # the partial set does not stay: it was replaced
    new = [f"m-{i:05d}-of-00004.gguf" for i in range(1, 5)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["flux.safetensors", *new, *kept]), \
        sorted(p.name for p in tmp_path.iterdir())
    still_there(tmp_path, kept)
    assert gguf.GGUFReader(tmp_path / new[0]).fields["split.count"].contents() == 4


def gguf_split_header(path: Path):
    from ckpt.io.gguf import read_gguf_header
    from ckpt.io.tensors import FileHandles

    return read_gguf_header(path, FileHandles(), path.name)


def stopped_run(tmp_path: Path, run_ckpt, flux_src, keep: int) -> tuple[list[str], list[str]]:
    """The exact state a run killed during its publish leaves: its first `keep` parts published, a temp file of a
    dead process for each of the others. Returns (parts, temps)."""
    code, _, err = run_ckpt("convert", flux_src, *ARGS, "-o", tmp_path / "m.gguf", "-q")
    assert code == 0, err
    parts = sorted(p.name for p in tmp_path.glob("m-*-of-00005.gguf"))
    temps = []
    for name in parts[keep:]:
        temps.append(f".{name}.ckpt-tmp-999999999-0123abcd")
        os.rename(tmp_path / name, tmp_path / temps[-1])
    return parts[:keep], temps


def test_the_same_set_again_replaces_a_partial_one_with_overwrite(tmp_path, run_ckpt, flux_src):
    parts, temps = stopped_run(tmp_path, run_ckpt, flux_src, 2)
    kept = not_ours(tmp_path)
    assert_refused(run_ckpt, tmp_path, ["convert", flux_src, *ARGS, "-o", tmp_path / "m.gguf"],
                   f"{tmp_path / parts[0]}: already exists: part of a split GGUF", "(2 of its 5 parts are here)")
    code, _, err = run_ckpt("convert", flux_src, *ARGS, "-o", tmp_path / "m.gguf", "-q", "--overwrite",
                            "--report", tmp_path / "r.json")
    assert code == 0, err
    notes = json.loads((tmp_path / "r.json").read_text())["notes"]
    assert [n for n in notes if n.startswith("removed")] == [  # the summary (-q: in --report only)
        f"removed 3 temporary outputs that a stopped ckpt run left beside the output ({', '.join(temps)})"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["flux.safetensors", "r.json", *[f"m-{i:05d}-of-00005.gguf" for i in range(1, 6)], *kept])
    still_there(tmp_path, kept)
    assert len(gguf_split_header(tmp_path / "m-00001-of-00005.gguf").tensors) == len(tiny_flux())


def test_a_single_file_output_of_the_name_replaces_a_partial_set_too(tmp_path, run_ckpt, flux_src):
    """`-o m.gguf` names the set `m-*-of-*.gguf` as well: a one-file run with --overwrite replaces a partial set of
    that name (a dry run only says what it would do and touches nothing)."""
    parts, temps = stopped_run(tmp_path, run_ckpt, flux_src, 3)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = run_ckpt("convert", flux_src, "--to", "gguf-q8_0", "-o", tmp_path / "m.gguf", "--dry-run")
    assert code == 0 and sorted(p.name for p in tmp_path.iterdir()) == before, err
    assert_refused(run_ckpt, tmp_path, ["convert", flux_src, "--to", "gguf-q8_0", "-o", tmp_path / "m.gguf"],
                   f"{tmp_path / parts[0]}: already exists", "(3 of its 5 parts are here)")
    code, _, err = run_ckpt("convert", flux_src, "--to", "gguf-q8_0", "-o", tmp_path / "m.gguf", "--overwrite")
    assert code == 0, err
    assert "removed 2 temporary outputs" in err and "removed 3 parts of a split GGUF of this name" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flux.safetensors", "m.gguf"]


@pytest.mark.parametrize("how", ["first part not ckpt's", "a later part holds other keys", "a part is a link"])
def test_a_partial_set_that_is_not_ckpts_is_never_removed(tmp_path, run_ckpt, flux_src, how):
    """Only a set whose first part carries ckpt's mark and whose other parts hold just the split keys ckpt writes
    is a stopped run's; any other partial set of the name stays (said as parts of another split) and is not an
    existing output of another part count."""
    if how == "first part not ckpt's":
        hand_split(tmp_path, flux_tensors(), [2, 2, 3], prefix="m")
        (tmp_path / "m-00003-of-00003.gguf").unlink()
    else:
        parts, _ = stopped_run(tmp_path, run_ckpt, flux_src, 3)
        for p in tmp_path.glob(".m-*ckpt-tmp-*"):
            p.unlink()
        second = tmp_path / "m-00002-of-00005.gguf"
        if how == "a later part holds other keys":
            total = len(tiny_flux())  # the split keys of ckpt's second part, and one key more
            hand_split(tmp_path, flux_tensors(), [2, 5], prefix="x",
                       p1=lambda k, p, a: ({**split_keys(1, 5, total), "general.name": ("x", V.STRING)}, p, a))
            os.rename(tmp_path / "x-00002-of-00002.gguf", second)
            (tmp_path / "x-00001-of-00002.gguf").unlink()
        else:
            os.rename(second, tmp_path / "elsewhere.gguf")
            second.symlink_to("elsewhere.gguf")
    kept = {p.name: p.read_bytes() for p in tmp_path.glob("*.gguf")}
    code, _, err = run_ckpt("convert", flux_src, "--to", "gguf-q8_0", "--max-shard-size", "60kB", "-o",
                            tmp_path / "m.gguf", "--overwrite")
    assert code == 0, err
    assert "removed" not in err and "of another split of this name stay beside the new ones" in err, err
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.gguf") if p.name in kept} == kept


def test_overwrite_never_deletes_a_folder_swapped_in_at_a_parts_name(tmp_path, monkeypatch, run_ckpt, flux_src):
    """--overwrite moves each existing part aside before renaming the new one in: what was moved is checked to be
    the file that was there; a folder swapped in meanwhile is put back, never deleted, and the set rolled back."""
    import ckpt.io.publish as publish

    code, _, err = run_ckpt("convert", flux_src, *ARGS, "-o", tmp_path / "m.gguf", "-q")
    assert code == 0, err
    old = {p.name: p.read_bytes() for p in tmp_path.glob("m-*.gguf")}
    real, done = os.rename, []

    def rename(src, dst, **kw):
        if src == "m-00003-of-00005.gguf" and str(dst).startswith(".m-00003-of-00005.gguf.ckpt-old-") and not done:
            done.append((tmp_path / src).unlink())
            (tmp_path / src).mkdir()
            (tmp_path / src / "precious.txt").write_text("someone's")
        return real(src, dst, **kw)

    monkeypatch.setattr(publish.os, "rename", rename)
    code, _, err = run_ckpt("convert", flux_src, "--to", "gguf-q4_0", "--max-shard-size", "20kB", "-o",
                            tmp_path / "m.gguf", "--overwrite")
    assert code == 2 and err.count("\n") == 1, err
    assert "m-00003-of-00005.gguf: was replaced during the publish; it is left as it is, nothing written" in err, err
    assert (tmp_path / "m-00003-of-00005.gguf" / "precious.txt").read_text() == "someone's"
    del old["m-00003-of-00005.gguf"]
    assert {p.name: p.read_bytes() for p in tmp_path.glob("m-*.gguf") if p.is_file()} == old
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["flux.safetensors", "m-00003-of-00005.gguf", *old])
