"""The batch manifest: one JSON line per finished job, so that a second run can resume.

Append-only and written only by the parent process, one fsynced line per job as it finishes: an
interrupted run keeps every record of the jobs that completed, and a torn last line (power loss) is
ignored when read. The last line for an (input, operation) pair wins. A run holds an exclusive lock
on the file, so two batches cannot write the same output folder at once.

Fields: input (absolute path), size and mtime_ns (the input's fingerprint when it was processed),
operation (the op and its options, e.g. "convert --to fp16"), output (absolute path or null), status
("ok" | "failed" | "started"), error (one line or null), seconds, finished (UTC time), started_ns.

A "started" line is written just before a job runs (with `started_ns`, the wall clock in ns): when the
batch is killed after the job's output was published but before its "ok" line, the next run finds the
output there, made by ckpt for this operation after that moment, and records it as done.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ckpt.errors import CkptError
from ckpt.io.side_files import check_side_file, head

NAME = "ckpt-batch.jsonl"  # in OUTDIR
HIDDEN_NAME = ".ckpt-batch.jsonl"  # beside the inputs when there is no OUTDIR: hidden, so never a sidecar


def is_manifest(path: Path) -> bool:
    """Empty (created, nothing recorded yet), or its first line is one of our JSON records."""
    first = head(path, 4096)
    if not first.strip():
        return True
    try:
        d = json.loads(first.split(b"\n", 1)[0])
    except ValueError:
        return False
    return isinstance(d, dict) and {"input", "operation", "status"} <= set(d)


@dataclass
class ManifestRecord:
    input: str
    size: int
    mtime_ns: int
    operation: str
    output: str | None
    status: str
    error: str | None = None
    seconds: float = 0.0
    finished: str = ""
    started_ns: int | None = None


class Manifest:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.records: dict[tuple[str, str], ManifestRecord] = {}
        self._fh = None
        # appended to in place: the side-file rules (a regular file ckpt wrote, or new; a writable folder)
        check_side_file(self.path, str(self.path), "ckpt batch manifest", is_manifest, check_folder=False)
        if self.path.exists():
            self._read()

    def _read(self) -> None:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CkptError(f"{self.path}: cannot read the batch manifest ({e})") from None
        fields = set(ManifestRecord.__dataclass_fields__)
        for line in text.splitlines():
            try:
                d = json.loads(line)
                rec = ManifestRecord(**{k: v for k, v in d.items() if k in fields})
            except (json.JSONDecodeError, TypeError):
                continue  # a torn or foreign line: that job is simply redone
            self.records[(rec.input, rec.operation)] = rec

    def last(self, input_path: str, operation: str) -> ManifestRecord | None:
        return self.records.get((input_path, operation))

    def outputs(self) -> set[str]:
        return {r.output for r in self.records.values() if r.output}

    def open_for_append(self) -> None:
        """Create the file if needed and take the run's lock (refusing a concurrent batch)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")
        try:
            fcntl.flock(self._fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._fh.close()
            self._fh = None
            raise CkptError(f"{self.path}: another `ckpt batch` is running with this manifest") from None
        if self.path.stat().st_size:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._fh.write("\n")  # end a torn last line, so the next record starts clean

    def append(self, rec: ManifestRecord) -> None:
        rec.finished = rec.finished or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.records[(rec.input, rec.operation)] = rec
        fields = {k: v for k, v in asdict(rec).items() if v is not None or k != "started_ns"}
        try:
            self._fh.write(json.dumps(fields, sort_keys=True) + "\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())
        except OSError as e:
            raise CkptError(f"{self.path}: cannot write the batch manifest ({e.strerror or e})") from None

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
