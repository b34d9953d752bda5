"""Bad input: one clear line naming the file and the problem, exit code 2, and nothing written.

Each case builds a broken file by hand from the safetensors layout (u64 little-endian header length,
JSON header, data) and runs the real CLI on it.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file


def st_bytes(header, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def one_tensor(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"w": {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}}


def _valid(tmp, name="m.safetensors"):
    save_file({"a": torch.ones(4), "b": torch.zeros(2, 2)}, tmp / name)
    return tmp / name


def case_truncated(tmp):
    p = _valid(tmp)
    p.write_bytes(p.read_bytes()[:-5])
    return p, p, "truncated"


def case_header_past_eof(tmp):
    p = tmp / "m.safetensors"
    p.write_bytes(st_bytes(b'{"a":1}', length=1000))
    return p, p, "runs past the end of the file"


def case_header_over_100mb(tmp):
    p = tmp / "m.safetensors"
    p.write_bytes(st_bytes(b"{}", length=200_000_000))
    return p, p, "exceeds the 100 MB limit"


def case_invalid_json(tmp):
    p = tmp / "m.safetensors"
    p.write_bytes(st_bytes(b'{"w": {"dtype": "F32",'))
    return p, p, "not valid JSON"


def case_header_not_object(tmp):
    p = tmp / "m.safetensors"
    p.write_bytes(st_bytes(b"[1, 2]"))
    return p, p, "not a JSON object"


def case_overlapping_offsets(tmp):
    p = tmp / "m.safetensors"
    h = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    p.write_bytes(st_bytes(h, bytes(12)))
    return p, p, "overlaps"


def case_gapped_offsets(tmp):
    p = tmp / "m.safetensors"
    h = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}
    p.write_bytes(st_bytes(h, bytes(24)))
    return p, p, "gap"


def case_trailing_bytes(tmp):
    p = tmp / "m.safetensors"
    p.write_bytes(st_bytes(one_tensor(), bytes(8 + 3)))
    return p, p, "trailing bytes"


def case_offsets_wrong_size(tmp):
    p = tmp / "m.safetensors"
    p.write_bytes(st_bytes(one_tensor(shape=(3,)), bytes(8)))
    return p, p, "needs 12"


def case_duplicate_key_in_header(tmp):
    p = tmp / "m.safetensors"
    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    p.write_bytes(st_bytes(f'{{"w": {entry}, "w": {entry}}}'.encode(), bytes(4)))
    return p, p, "names 'w' twice"


def case_unknown_dtype(tmp):
    p = tmp / "m.safetensors"
    p.write_bytes(st_bytes(one_tensor(dtype="F8_E4M3FN"), bytes(8)))
    return p, p, "unknown dtype 'F8_E4M3FN'"


def case_unsupported_dtype(tmp):
    p = tmp / "m.safetensors"
    p.write_bytes(st_bytes(one_tensor(dtype="F4", shape=(4,), offsets=(0, 2)), bytes(2)))
    return p, p, "F4"


def case_bad_shape(tmp):
    p = tmp / "m.safetensors"
    p.write_bytes(st_bytes(one_tensor(shape=(-1,)), bytes(8)))
    return p, p, "invalid shape"


def case_bad_metadata(tmp):
    p = tmp / "m.safetensors"
    p.write_bytes(st_bytes({"__metadata__": {"n": 3}, **one_tensor()}, bytes(8)))
    return p, p, "__metadata__"


def case_empty_file(tmp):
    p = tmp / "m.safetensors"
    p.write_bytes(b"")
    return p, p, "empty file"


def case_shorter_than_length(tmp):
    p = tmp / "m.safetensors"
    p.write_bytes(b"\x01\x02\x03")
    return p, p, "shorter than the 8-byte header length"


def _sharded(tmp):
    d = tmp / "model"
    d.mkdir()
    save_file({"a": torch.ones(4)}, d / "model-00001-of-00002.safetensors")
    save_file({"b": torch.ones(4)}, d / "model-00002-of-00002.safetensors")
    index = {"metadata": {"total_size": 32},
             "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    return d, index


def case_index_missing_shard(tmp):
    d, index = _sharded(tmp)
    index["weight_map"]["b"] = "model-00003-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d, d / "model.safetensors.index.json", "model-00003-of-00002.safetensors', which does not exist"


def case_index_missing_key(tmp):
    d, index = _sharded(tmp)
    index["weight_map"]["c"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d, d / "model.safetensors.index.json", "maps 'c'"


def case_index_unlisted_key(tmp):
    d, index = _sharded(tmp)
    del index["weight_map"]["b"]
    index["weight_map"]["a"] = "model-00001-of-00002.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(4)}, d / "model-00001-of-00002.safetensors")
    (d / "model-00002-of-00002.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d, d / "model.safetensors.index.json", "does not list"


def case_index_invalid_json(tmp):
    d, _ = _sharded(tmp)
    (d / "model.safetensors.index.json").write_text("{not json")
    return d, d / "model.safetensors.index.json", "is not valid JSON"


def case_index_escapes_folder(tmp):
    d, index = _sharded(tmp)
    save_file({"b": torch.ones(4)}, tmp / "outside.safetensors")
    index["weight_map"]["b"] = "../outside.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d, d / "model.safetensors.index.json", "not a file name in its folder"


def case_bad_shard_inside_index(tmp):
    d, index = _sharded(tmp)
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "model-00002-of-00002.safetensors").write_bytes(b"\x00" * 3)
    return d, d / "model-00002-of-00002.safetensors", "shorter than the 8-byte header length"


def case_no_weights_in_folder(tmp):
    d = tmp / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "README.md").write_text("hi")
    return d, d, "no weights found"


def case_duplicate_tensor_across_files(tmp):
    d = tmp / "loras"
    d.mkdir()
    save_file({"w": torch.ones(2)}, d / "a.safetensors")
    save_file({"w": torch.ones(2)}, d / "b.safetensors")
    return d, d / "b.safetensors", "also appears in a.safetensors"


def case_invalid_config_json(tmp):
    d = tmp / "model"
    d.mkdir()
    save_file({"w": torch.ones(2)}, d / "model.safetensors")
    (d / "config.json").write_text("{oops")
    return d, d / "config.json", "is not valid JSON"


def case_garbage_pickle(tmp):
    p = tmp / "model.ckpt"
    p.write_bytes(os.urandom(64))
    return p, p, "not a loadable torch pickle"


def case_truncated_zip_pickle(tmp):
    p = tmp / "model.pt"
    torch.save({"w": torch.ones(100)}, p)
    p.write_bytes(p.read_bytes()[:200])
    return p, p, "not a loadable torch pickle"


def case_pickle_not_a_dict(tmp):
    p = tmp / "model.pth"
    torch.save([torch.ones(2)], p)
    return p, p, "holds a list"


def case_unsupported_extension(tmp):
    p = tmp / "model.onnx"
    p.write_bytes(b"ONNX....")
    return p, p, "unsupported file type '.onnx'"


def case_missing_path(tmp):
    p = tmp / "nope.safetensors"
    return p, p, "no such file or directory"


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, case, run_ckpt):
    src, culprit, problem = CASES[case](tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, out, err = run_ckpt("convert", src, "--to", "fp16")
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: {culprit}:"), lines[0]
    assert problem in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no output, no temp file
    assert out == ""


def test_header_with_space_padding_is_valid(tmp_path, run_ckpt):
    """safetensors pads headers with spaces; that must not be mistaken for damage."""
    p = tmp_path / "m.safetensors"
    p.write_bytes(st_bytes(json.dumps(one_tensor()).encode() + b"     ", torch.ones(2).numpy().tobytes()))
    code, out, err = run_ckpt("convert", p, "--to", "fp16", "-q")
    assert code == 0, err
