"""`ckpt.io.small_inputs`: the small files beside the weights are regular files of a bounded size, checked before
a byte is read; everything else is one `CkptError` line naming the file (never a hang on a FIFO, an endless read
of a device, or a decode/JSON traceback)."""

from __future__ import annotations

import os

import pytest

from ckpt.errors import CkptError
from ckpt.io.small_inputs import load_json, load_json_object, read_small, read_text


def refused(fn, path, *args, **kw) -> str:
    with pytest.raises(CkptError) as e:
        fn(path, *args, **kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)), msg
    return msg


def test_regular_files_and_links_to_them_are_read(tmp_path):
    (tmp_path / "c.json").write_text('{"a": 1}')
    os.symlink(tmp_path / "c.json", tmp_path / "link.json")  # the Hugging Face cache links files to blobs
    assert load_json_object(tmp_path / "link.json") == {"a": 1}
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfhello")
    assert read_text(tmp_path / "bom.txt") == "hello"


@pytest.mark.parametrize("make, kind", [
    (lambda p: os.mkfifo(p), "a FIFO"),
    (lambda p: os.symlink("/dev/zero", p), "a character device"),
    (lambda p: os.symlink("/dev/urandom", p), "a character device"),
    (lambda p: p.mkdir(), "a folder"),
])
def test_what_is_not_a_regular_file_is_refused_before_reading(tmp_path, make, kind):
    p = tmp_path / "c.yaml"
    make(p)
    assert f"is {kind}" in refused(read_small, p)


def test_size_encoding_and_json_problems_are_one_line(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"x" * 5000)
    assert "more than such a file can be" in refused(read_small, big, limit=4096)
    assert read_small(big, limit=5000) == b"x" * 5000
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9")
    assert "not UTF-8 text (byte 3)" in refused(read_text, tmp_path / "latin.txt")
    (tmp_path / "bad.json").write_text('{"a": 1,\n "b": }')
    assert "not valid JSON" in refused(load_json, tmp_path / "bad.json") and "line 2" in str(
        pytest.raises(CkptError, load_json, tmp_path / "bad.json").value)
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    assert "not valid JSON" in refused(load_json, tmp_path / "deep.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    assert "holds a JSON list, not an object" in refused(load_json_object, tmp_path / "list.json")
    assert "does not exist" in refused(read_small, tmp_path / "missing.json")
    assert "not a valid path" in str(pytest.raises(CkptError, read_small, "a\0b").value)
