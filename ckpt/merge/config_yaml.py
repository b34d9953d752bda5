"""A merge config's YAML, read within bounds.

The file is read through `ckpt.io.small_inputs` (a regular file of at most CONFIG_LIMIT bytes, checked before a
byte is read: a FIFO or /dev/urandom named as the config is one line, not a read without end).

YAML's anchors and aliases let a few hundred bytes stand for a document of 10^9 values (the "billion laughs"):
PyYAML builds it cheaply (an alias is the same Python object again), but everything that walks the recipe
afterwards walks it expanded: the parameter checks, the per-tensor look-ups, the resolved recipe printed by
--print-config and written into the output's metadata, an error line naming a value. Nesting is the other
bound: PyYAML's composer recurses once per level, so a weight nested 1,000 lists deep is a RecursionError in
the composer itself, and an alias may sit deeper than the node it names.

So the document is measured while it is composed, before anything is built from it: its depth (MAX_DEPTH), the
values it holds once every alias is expanded (MAX_NODES) and the characters of its scalars expanded likewise
(MAX_TEXT), each alias adding what it names where it stands; an alias inside the node it names (a document
that holds itself) is refused. The bounds are far above any real config: a 100-slice mergekit config with
per-layer gradients has a few thousand values, 8 levels deep.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import yaml

from ckpt.errors import CkptError
from ckpt.io.small_inputs import CONFIG_LIMIT, MIB, read_text

MAX_DEPTH = 32
MAX_NODES = 100_000
MAX_TEXT = CONFIG_LIMIT
CUT = 80  # characters of a YAML problem (which may quote the document) an error line shows


def _cut(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= CUT else text[:CUT] + "..."


def _at(event) -> str:
    mark = getattr(event, "start_mark", None)
    return f" at line {mark.line + 1}" if mark is not None else ""


class _Bounded(yaml.SafeLoader):
    """PyYAML's safe loader, measuring the document as it composes it (see the module docstring)."""

    def __init__(self, stream, label: str):
        super().__init__(stream)
        self.label = label
        self.depth = 0  # levels open above the node being composed
        self.nodes = 0  # values so far, aliases expanded
        self.text = 0  # scalar characters so far, aliases expanded
        self.open: set[str] = set()  # anchors of the nodes being composed
        self.sizes: dict[int, tuple[int, int, int]] = {}  # id(node) -> (values, characters, depth), expanded

    def _refuse(self, problem: str, event) -> None:
        raise CkptError(f"{self.label}: {problem}{_at(event)}")

    def _size(self, node) -> tuple[int, int, int]:
        """A finished node's values, scalar characters and depth, every alias under it expanded (memoized: an
        alias is the node it names, measured once)."""
        key = id(node)
        if key not in self.sizes:
            if isinstance(node, yaml.ScalarNode):
                self.sizes[key] = (1, len(node.value), 1)
            else:
                children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) \
                    else node.value
                n, t, d = 1, 0, 0
                for c in children:
                    cn, ct, cd = self._size(c)
                    n, t, d = n + cn, t + ct, max(d, cd)
                self.sizes[key] = (n, t, d + 1)
        return self.sizes[key]

    def _count(self, nodes: int, text: int, depth: int, event) -> None:
        self.nodes += nodes
        self.text += text
        if self.depth + depth > MAX_DEPTH:
            self._refuse(f"nested more than {MAX_DEPTH} levels deep (a merge config is a few levels deep)", event)
        if self.nodes > MAX_NODES:
            self._refuse(f"holds more than {MAX_NODES:,} values once its aliases are expanded", event)
        if self.text > MAX_TEXT:
            self._refuse(f"holds more than {MAX_TEXT // MIB} MiB of text once its aliases are expanded", event)

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self.open:
                self._refuse(f"the alias *{_cut(event.anchor)} is inside the node it names (a config that holds "
                             "itself)", event)
            node = super().compose_node(parent, index)  # (an undefined alias: PyYAML's ComposerError)
            self._count(*self._size(node), event)
            return node
        anchor = getattr(event, "anchor", None)
        self._count(0, 0, 1, event)  # this level, before the composer recurses into it
        self.depth += 1
        if anchor is not None:
            self.open.add(anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
            self.open.discard(anchor)
        self._count(1, len(node.value) if isinstance(node, yaml.ScalarNode) else 0, 0, event)
        return node


def load_config(path) -> object:
    """The data of the merge config at `path` (one-line errors naming it)."""
    label = str(path)
    try:
        p = Path(path).expanduser()
        st = os.stat(p)
    except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: ~user that does not exist
        if isinstance(e, OSError) and e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise CkptError(f"{label}: no such file") from None
        st = None
    if st is not None and os.path.isdir(p):
        raise CkptError(f"{label}: is a folder; give the merge config (YAML)")
    text = read_text(path if st is None else p, label, CONFIG_LIMIT)
    loader = None
    try:
        loader = _Bounded(text, label)  # (refuses a control character at once: a ReaderError)
        return loader.get_single_data()
    except yaml.reader.ReaderError as e:
        char = e.character if isinstance(e.character, int) else ord(e.character or "\0")
        raise CkptError(f"{label}: not valid YAML (character #x{char:04x} at position {e.position}: {e.reason})") \
            from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise CkptError(f"{label}: not valid YAML{at} ({_cut(getattr(e, 'problem', None) or 'parse error')})") from None
    except (ValueError, TypeError, OverflowError) as e:  # a value PyYAML cannot build: a 5,000-digit int, 2001-02-30
        raise CkptError(f"{label}: not valid YAML (a value it cannot hold: {_cut(e)})") from None
    except RecursionError:  # a chain of `<<:` merge keys
        raise CkptError(f"{label}: not valid YAML (nested too deeply)") from None
    finally:
        if loader is not None:
            loader.dispose()
