"""Reading the small files that come beside the weights: merge configs and recipes (YAML), config.json and its
siblings, tokenizer files, quantization maps, index files.

Such a file is read whole, so it must be a regular file of a sane size, checked before a byte is read: a path
that is (or links to) a FIFO, a character device such as /dev/zero or /dev/urandom, a socket or a folder would
otherwise block or be read without end. The open itself never blocks (O_NONBLOCK: a FIFO swapped in after the
check is not waited on), and at most `limit` + 1 bytes are read whatever the file claims, so a file that grows
while it is read is refused too. Symbolic links to regular files are followed (the Hugging Face cache links
every file to a blob).

Every problem is one `CkptError` line naming the file: never an OSError, a UnicodeDecodeError or a JSON
traceback.
"""

from __future__ import annotations

import errno
import json
import os
import stat

from ckpt.errors import CkptError

MIB = 1 << 20
# Side files are configs: the largest real ones are tokenizer.json files (Qwen's and Gemma's are 11-33 MB) and
# sharded index files of trillion-parameter models (a few MB). A merge config or recipe is text a person writes.
LIMIT = 256 * MIB
CONFIG_LIMIT = 4 * MIB

_READ = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _why(e: OSError) -> str:
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return "does not exist"
    if e.errno == errno.ELOOP:
        return "is a loop of symbolic links"
    if e.errno == errno.ENAMETOOLONG:
        return "name too long"
    return e.strerror or str(e)


def _label(path, label: str | None) -> str:
    return label or str(path).replace("\0", "\\0")


def check_regular(path, label: str | None = None) -> os.stat_result:
    """The stat of `path` (links followed) if it is a regular file, else one line saying what it is."""
    label = _label(path, label)
    try:
        st = os.stat(path)
    except (OSError, ValueError) as e:  # ValueError: an embedded NUL
        raise CkptError(f"{label}: {_why(e) if isinstance(e, OSError) else 'not a valid path'}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CkptError(f"{label}: is {_kind(st.st_mode)}, not a file ckpt can read")
    return st


def read_small(path, label: str | None = None, limit: int = LIMIT) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (see the module docstring)."""
    label = _label(path, label)
    st = check_regular(path, label)
    if st.st_size > limit:
        raise CkptError(f"{label}: {st.st_size / MIB:.1f} MiB is more than such a file can be "
                        f"(at most {limit // MIB} MiB)")
    try:
        fd = os.open(path, _READ)
    except OSError as e:
        raise CkptError(f"{label}: cannot read it ({_why(e)})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped for something else since the check
            raise CkptError(f"{label}: is {_kind(os.fstat(fd).st_mode)}, not a file ckpt can read")
        chunks, size = [], 0
        while size <= limit:
            b = os.read(fd, min(limit + 1 - size, 16 * MIB))
            if not b:
                break
            chunks.append(b)
            size += len(b)
    except OSError as e:
        raise CkptError(f"{label}: cannot read it ({_why(e)})") from None
    finally:
        os.close(fd)
    if size > limit:
        raise CkptError(f"{label}: grew past {limit // MIB} MiB while it was read")
    return b"".join(chunks)


def read_text(path, label: str | None = None, limit: int = LIMIT) -> str:
    """A small file's text, UTF-8 (a BOM is dropped)."""
    label = _label(path, label)
    data = read_small(path, label, limit)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise CkptError(f"{label}: is not UTF-8 text (byte {e.start})") from None


def load_json(path, label: str | None = None, limit: int = LIMIT):
    """A small JSON file's value; bad JSON is one line with the line and column."""
    label = _label(path, label)
    text = read_text(path, label, limit)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CkptError(f"{label}: is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise CkptError(f"{label}: is not valid JSON (nested too deeply)") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise CkptError(f"{label}: is not valid JSON ({' '.join(str(e).split())[:80]})") from None


def load_json_object(path, label: str | None = None, limit: int = LIMIT) -> dict:
    """A small JSON file that must hold an object (config.json, tokenizer_config.json, index files)."""
    label = _label(path, label)
    value = load_json(path, label, limit)
    if not isinstance(value, dict):
        raise CkptError(f"{label}: holds a JSON {json_kind(value)}, not an object")
    return value


def json_kind(value) -> str:
    """What a JSON value is, in JSON's words (a list, a string, a number, a boolean, null)."""
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")


__all__ = ["CONFIG_LIMIT", "LIMIT", "check_regular", "json_kind", "load_json", "load_json_object", "read_small",
           "read_text"]
