"""One output written by several processes: its tensors cut into shares, the plan fingerprint, a share's writer.

`ckpt convert --executor ray` (`ckpt.convert.ray_shares`) writes one model with a whole cluster. The driver plans
the output as always and creates every temp file at its full size with its header (`ckpt.io.output.execute`
with `shares=`, `ckpt.io.output.stage_file`); each worker then writes the tensors of its share at their planned
offsets into those files (`write_share`) and the driver publishes the set only when every share succeeded.

Why shares are lists of output tensor names, and why a worker plans again instead of receiving the plan: a plan
holds open files, decoders and torch closures (no pickling across machines), while planning from the same input
and options is deterministic and reads headers only. So a worker re-plans, then checks that its plan is the
driver's (`fingerprint`: every file's format, size and each tensor's name, type, shape and byte region): a
worker that sees another input (a file changed meanwhile, another ckpt version) refuses rather than writing
bytes at someone else's offsets. A share is idempotent (the same bytes at the same offsets), so a share whose
worker died is simply written again.

Workers write through the page cache with pwrite (never O_DIRECT: direct I/O writes whole blocks, and a block at
a region's edge belongs to two shares), each fsyncing its own writes before it reports success.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ckpt.errors import CkptError
from ckpt.io.plan import COPY_FORMATS, OutFile, Plan
from ckpt.io.writer import BlockLayout, RegionWriter


def regions(f: OutFile, block: BlockLayout = BlockLayout()) -> dict[str, tuple[int, int]]:
    """Tensor name -> (start, end) in `f`'s file, as its writer lays it out (`block`: the safetensors header padding
    and data order the driver chose, `ckpt.io.output.stage_file`; the order is derived again from this plan's
    copies)."""
    entries = [t.entry for t in f.tensors]
    if f.format == "gguf":
        from ckpt.io.gguf_writer import layout as gguf_layout

        return gguf_layout(entries, f.fields)[1]
    from ckpt.io.writer import layout

    first = block.first(entries, f.byte_copies()) if block.by_source else ()
    return layout(entries, f.metadata, block.pad, first)[1]


def check_shareable(plan: Plan) -> None:
    """Refuse a plan whose files cannot be written by several processes: a torch zip keeps a running CRC32 of
    its tensors, in file order (`ckpt.io.torchzip`)."""
    bad = next((f for f in plan.files if f.format not in COPY_FORMATS), None)
    if bad is not None:
        raise CkptError(f"--executor ray: a {bad.format} file (--format {bad.format}) is written in order by one "
                        "process (its running CRC32); write safetensors or GGUF, or use --executor local")


def fingerprint(plan: Plan, blocks: list | None = None) -> str:
    """A digest of what the shares write into: per file its format, size and every tensor's name, dtype, shape,
    GGUF type and byte region (`blocks`: each file's `BlockLayout`, as staged). Two plans with one fingerprint put
    the same tensors at the same offsets."""
    blocks = [BlockLayout(*b) for b in blocks] if blocks else [BlockLayout()] * len(plan.files)
    h = hashlib.sha256()
    for f, block in zip(plan.files, blocks):
        where = regions(f, block)
        h.update(json.dumps([f.relpath, f.format, f.nbytes + block.pad]).encode())
        for t in f.tensors:
            e = t.entry
            h.update(json.dumps([e.name, str(e.dtype), list(e.shape), e.gguf_type, list(where[e.name])]).encode())
    return h.hexdigest()[:32]


def split_shares(plan: Plan, count: int) -> list[list[str]]:
    """The plan's tensors as at most `count` shares of about equal bytes (largest first, each to the lightest
    share), each a list of output tensor names; never an empty share. Tensor names are unique in an output (a
    split GGUF's parts and a folder's shards hold each name once)."""
    sizes = sorted(((t.entry.nbytes, t.name) for f in plan.files for t in f.tensors), key=lambda x: (-x[0], x[1]))
    count = max(1, min(count, len(sizes)))
    shares: list[list[str]] = [[] for _ in range(count)]
    load = [0] * count
    for n, name in sizes:
        i = min(range(count), key=lambda k: (load[k], k))
        shares[i].append(name)
        load[i] += n
    return [s for s in shares if s]


def share_bytes(plan: Plan, names) -> int:
    names = set(names)
    return sum(t.entry.nbytes for f in plan.files for t in f.tensors if t.name in names)


class ShareWriter(RegionWriter):
    """Writes the tensors of one share into a file the driver created (`ckpt.io.output.stage_file`): opened without
    truncating, header and other regions left alone, only this share's regions checked full at close."""

    def __init__(self, path: Path, f: OutFile, names: set[str], block: BlockLayout):
        mine = [t.entry for t in f.tensors if t.name in names]
        where = regions(f, block)
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        self._open(path, mine, {e.name: where[e.name] for e in mine}, fd)
        self.size = os.fstat(fd).st_size


def write_share(plan: Plan, staged: list, names: list[str], expected: str, device=None) -> int:
    """Write the tensors `names` of `plan` into the driver's temp files (`staged`: (file index, path, layout) per
    file, in plan order; layout: its `ckpt.io.writer.BlockLayout`, as a tuple), after checking that this plan
    is the driver's (`expected`, its `fingerprint`). Returns the bytes written. Raises CkptError for another plan;
    anything else the writers raise (their partial regions are rewritten whole by a retry)."""
    from ckpt.io.output import BYTE_COPY, write_tensors

    staged = sorted((int(i), Path(p), BlockLayout(int(b[0]), bool(b[1]))) for i, p, b in staged)
    blocks = [block for _, _, block in staged]
    if len(staged) != len(plan.files) or fingerprint(plan, blocks) != expected:
        raise CkptError("the plan made here differs from the driver's (another input, options or ckpt version "
                        "on this node); nothing of this share written")
    wanted, done = set(names), 0
    for (i, path, block), f in zip(staged, plan.files):
        mine = [t for t in f.tensors if t.name in wanted]
        if not mine:
            continue
        copies = {n: r for n, r in (f.byte_copies() if BYTE_COPY else {}).items() if n in wanted}
        write_tensors(ShareWriter(path, f, wanted, block), mine, copies, device, None, plan.busy_stage)
        done += sum(t.entry.nbytes for t in mine)
    return done
