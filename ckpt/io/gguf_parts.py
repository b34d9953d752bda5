"""The names and split keys of llama.cpp's split GGUF sets (`gguf-split`: `PREFIX-00001-of-0000N.gguf` ..., each part
holding `split.no`, `split.count`, `split.tensors.count`; see `ckpt.io.gguf_split`). Plain facts about file names,
in a module of their own because the reader (`ckpt.io.gguf`), the writer's planner (`ckpt.io.gguf_split`), the
publish (`ckpt.io.publish`) and the checkpoint opener all need them and none of those may import the others."""

from __future__ import annotations

import re
from pathlib import Path

KEY_NO, KEY_COUNT, KEY_TENSORS = "split.no", "split.count", "split.tensors.count"
SPLIT_KEYS = (KEY_NO, KEY_COUNT, KEY_TENSORS)
PART_RE = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")


def part_name(prefix: str, no: int, count: int) -> str:
    """llama_split_path: part `no` (from 0) of `count`."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def set_prefix(name: str) -> str | None:
    """`m-00002-of-00003.gguf` -> `m`; None for a name that is not a part's."""
    m = PART_RE.fullmatch(name)
    return m["prefix"] if m else None


def set_stem(out: Path) -> str:
    """The PREFIX of the set an output named `out` is (`m.gguf` and `m-00001-of-00002.gguf` -> `m`)."""
    name = Path(out).name
    stem = name[: -len(".gguf")] if name.endswith(".gguf") else name
    return set_prefix(stem + ".gguf") or stem


def part_paths(out: Path, count: int) -> list[Path]:
    """The parts of a set named OUT (`m.gguf`; a part's own name `m-00001-of-00002.gguf` names its set too)."""
    out = Path(out)
    return [out.with_name(part_name(set_stem(out), i, count)) for i in range(count)]


def set_member(out: Path):
    """A test on file names: the parts of any split set of the GGUF output named `out` (`m-NNNNN-of-MMMMM.gguf`
    for `m.gguf`); None for an output that is not a GGUF file name."""
    if not Path(out).name.endswith(".gguf"):
        return None
    stem = set_stem(out)

    def member(name: str) -> bool:
        m = PART_RE.fullmatch(name)
        return m is not None and m["prefix"] == stem

    return member
