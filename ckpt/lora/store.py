"""Factors whose shapes are known only after their SVD, spilled to a scratch file until the output
can be planned.

With a dynamic rank (or modules skipped by --min-diff) the output's header is not known before every
module has been decomposed, and a writer that is header-first needs it. Holding all factors in memory
would cost a whole LoRA (a rank-32 fp32 Flux LoRA is about 0.6 GB, rank 128 about 2.5 GB), beyond the
bounded-memory promise. So each module's factors, once computed and cast to the save dtype, are
appended to a scratch file beside the output (same filesystem; named and locked like the writer's temp
outputs, `ckpt.io.publish`, so a later run removes it after a SIGKILL); the final file is then planned from their shapes and
written header-first, each factor read back band by band like any stored tensor (`RawTensor`). The
scratch file is removed on success, error and Ctrl-C alike.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from ckpt.lazy import torch

from ckpt.dtypes import TORCH_TO_ST
from ckpt.errors import CkptError
from ckpt.io.header import TensorInfo
from ckpt.io.publish import missing_parents, temp_name
from ckpt.io.tensors import FileHandles, RawTensor, Tensor


class FactorStore:
    def __init__(self, out: Path):
        out = Path(out).absolute()
        missing = missing_parents(out)  # -o in folders still to be made: the nearest one that exists
        home = missing[0].parent if missing else out.parent
        self.path = home / temp_name(out.name)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as e:
            raise CkptError(f"{out}: cannot create a scratch file in {home} ({e.strerror or e})") from None
        fcntl.flock(self.fd, fcntl.LOCK_EX)  # held while we live: a stale-temp sweep leaves it alone
        self.size = 0
        self.handles = FileHandles()

    def put(self, name: str, value: torch.Tensor) -> Tensor:
        """Append `value` (any device) and return a logical tensor that reads it back."""
        data = value.detach().to("cpu").contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""
        mv, pos = memoryview(raw), self.size
        try:
            while len(mv):
                n = os.pwrite(self.fd, mv, pos)
                mv, pos = mv[n:], pos + n
        except OSError as e:
            raise CkptError(f"{self.path.parent}: cannot hold the factors being computed "
                            f"({e.strerror or e}); nothing written") from None
        info = TensorInfo(name, TORCH_TO_ST[data.dtype], tuple(data.shape), self.path, self.size, pos)
        self.size = pos
        return RawTensor(info, self.handles, "")

    @property
    def nbytes(self) -> int:
        return self.size

    def close(self) -> None:
        self.handles.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ScratchDir:
    """A private folder beside the output for intermediate LoRAs (`resize`/`merge --format` convert
    their inputs first): named and locked like the writer's temp outputs, so a later run's stale sweep
    removes it after a SIGKILL; removed on success, error and Ctrl-C alike."""

    def __init__(self, out: Path):
        import shutil

        self._rmtree = shutil.rmtree
        out = Path(out).absolute()
        missing = missing_parents(out)
        home = missing[0].parent if missing else out.parent
        self.path = home / temp_name(out.name)
        try:
            os.mkdir(self.path, 0o700)
        except OSError as e:
            raise CkptError(f"{out}: cannot create a scratch folder in {home} ({e.strerror or e})") from None
        self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._rmtree(self.path, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
