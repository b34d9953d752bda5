"""The rules for every file a command writes besides its output (`--report FILE.json`, the batch manifest).

Such a file is replaced in place (report) or appended to (manifest), so unlike the output it gets no
temp-and-swap protection from `ckpt.io.publish`; these checks stand in for it and run before any work:

- it is never an input, nor inside an input folder (`check_not_input`), nor the output or inside an
  output folder (`ckpt.io.output.check_target` reads `ckpt.io.publish.OTHER_WRITES`);
- where something already exists at its path, that is a regular file (not a link, a device, a FIFO, a
  socket or a folder) that ckpt wrote itself (`is_ours` reads its first bytes): anything else is refused
  by name, never replaced;
- its folder exists and is writable.

Nothing here imports torch: `--report` is checked while the command line is parsed.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Callable

from ckpt.errors import CkptError

_NONBLOCK_READ = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _why(e: OSError) -> str:
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if e.errno == errno.EROFS:
        return "read-only file system"
    return e.strerror or str(e)


def head(path: Path, n: int = 256) -> bytes:
    """The first `n` bytes of a regular file (never blocks on a FIFO, never follows a link)."""
    fd = os.open(path, _NONBLOCK_READ)
    try:
        return os.read(fd, n)
    finally:
        os.close(fd)


def check_side_file(path: Path, label: str, kind: str, is_ours: Callable[[Path], bool], *,
                    check_folder: bool = True) -> None:
    """Refuse `path` (named `label` in messages, e.g. "--report r.json") unless it is new or a regular
    file `is_ours` recognises as a `kind` (e.g. "ckpt report"), and (`check_folder`) its folder exists and
    is writable. Whoever passes `check_folder=False` creates the folder and reports its errors itself."""
    path = Path(path).expanduser()
    parent = path.absolute().parent
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        st = None
    except PermissionError:  # a folder on the way that cannot be entered: said as for every other path
        from ckpt.io.hub import local_path

        option, _, given = label.rpartition(" ")
        local_path(given, f"{option} " if option else "")
        raise CkptError(f"{label}: permission denied") from None
    except OSError as e:
        raise CkptError(f"{label}: cannot check it ({_why(e)})") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise CkptError(f"{label}: is a folder (name a file)")
        if stat.S_ISLNK(st.st_mode):
            raise CkptError(f"{label}: is a symbolic link; refusing to replace it (name a new file)")
        if not stat.S_ISREG(st.st_mode):
            raise CkptError(f"{label}: is not a regular file (a device, FIFO or socket); refusing to replace it")
        try:
            ours = is_ours(path)
        except OSError as e:
            raise CkptError(f"{label}: cannot read it ({_why(e)})") from None
        if not ours:
            raise CkptError(f"{label}: exists and is not a {kind}; refusing to replace it (name a new file)")
    if not check_folder:
        return
    try:
        is_dir = parent.is_dir()
    except OSError as e:
        raise CkptError(f"{label}: cannot check its folder {parent} ({_why(e)})") from None
    if not is_dir:
        raise CkptError(f"{label}: folder {parent} does not exist")
    why = unwritable(parent)
    if why:
        raise CkptError(f"{label}: cannot write in {parent} ({why})")


def unwritable(folder: Path) -> str | None:
    """Why this user cannot create a file in `folder` ("read-only file system", "permission denied"), or
    None when it can: the one check behind every "cannot write in FOLDER (...)" line (outputs, -o as it is
    read, side files)."""
    if os.access(folder, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return "read-only file system" if read_only else "permission denied"


def check_not_input(path: Path, label: str, inputs) -> None:
    """Refuse a path ckpt would write that is one of `inputs` (paths as given; missing ones are skipped),
    holds one (a folder output around an input), or lies inside an input folder: inputs are never
    written, and a folder input never gains a file. The output (`ckpt.io.output.check_target`) and the
    side files share this check."""
    p = Path(path).expanduser().absolute().resolve()
    resolved = []
    for given in inputs:
        q = Path(given).expanduser()
        try:
            if q.exists() or q.is_symlink():
                resolved.append((given, q, q.resolve()))
        except OSError:
            continue
    for given, q, q_r in resolved:
        if q_r == p or p in q_r.parents:
            raise CkptError(f"{label}: refusing to write over an input ({given})")
    for given, q, q_r in resolved:
        if q_r in p.parents and q.is_dir():
            raise CkptError(f"{label}: is inside the input folder {given}; choose a path outside it")
