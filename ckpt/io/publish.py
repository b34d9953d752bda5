"""Publishing an output atomically: the temp output beside OUT, its checks, and the one rename.

Every writing command ends here (through `ckpt.io.output.execute`). The rules it keeps:

- The temp output is `.OUT.ckpt-tmp-PID-XXXXXXXX` beside OUT (same filesystem, so the rename is atomic),
  created exclusively and locked (`flock`) by its owner for as long as it lives. A later run writing OUT
  removes such leftovers only when they are provably stale: the name is ckpt's, the process PID is gone and
  nobody holds the lock (`remove_stale_temps`); for a GGUF OUT also those of every part of a split set of
  its name (`ckpt.io.gguf_parts.set_member`: a run killed while it wrote or published a set leaves one per
  part). What it removed is recorded in `CLEANED`, which the run's summary says (`cleanup_notes`).
- Everything inside the temp output is created relative to directory descriptors opened once
  (`O_EXCL`, `O_NOFOLLOW`, never `mkdir(parents=True)` by path): if the temp output, one of its
  folders or OUT's parent folder is removed or replaced during the run, a later step fails or the
  identity check before the rename does (same `st_dev`/`st_ino`), and nothing is published.
- Without --overwrite, "OUT does not exist" is checked by the rename itself (`renameat2` with
  `RENAME_NOREPLACE`; where the filesystem lacks it: `link` + `unlink` for a file, an exclusive `mkdir`
  placeholder for a folder): of two runs racing for one OUT, exactly one wins and the other fails with
  "already exists". With --overwrite a folder is swapped in one step (`RENAME_EXCHANGE`) where possible.
- --overwrite deletes only what the run checked: the entry at OUT when the temp output was opened (right
  after `ckpt.io.output.check_target` refused folders holding someone else's files). At the publish, the
  entry there must still be that one (same `st_dev`/`st_ino`) and a folder must still hold only ckpt's files
  and files the new output rewrites (`ckpt.io.previous_output.foreign_files`); once swapped out, the same is
  checked again before it is deleted, and a failed check swaps it back: a folder swapped in by a race, or
  files put into it meanwhile, are never deleted; the run fails with nothing written.
- Missing parent folders of OUT are created (as `save_pretrained` does) and removed again if the run
  fails before publishing.
- `PUBLISHED` lists what this process published, recorded in the same signal-free step as the rename:
  the CLI reads it to say "interrupted after writing X" rather than "nothing was written".
- Sibling files that make one output (the parts of a split GGUF, `ckpt.io.gguf_split`) each get a
  single-file `Staging` and are published together by `publish_set`: all renamed in one signal-free step,
  or, if one rename fails, every part renamed so far taken back (and any part an --overwrite moved aside
  put back). Each part moved aside is checked to be the file that was there (a folder swapped in is put
  back, never deleted). Parts of an earlier set a stopped run published incompletely are recognised by
  `ckpt.io.gguf_split.partial_sets` and removed with `remove_checked` (moved aside, checked, deleted).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import stat
import uuid
from pathlib import Path

from ckpt.errors import CkptError
from ckpt.interrupts import signals_deferred

PUBLISHED: list[Path] = []  # every output this process published, in order

# Files this run writes besides its output (the --report file, a batch manifest): absolute path -> what
# it is. `ckpt.io.output.check_target` refuses an output that is, or holds, one of them, so a report can
# never be swapped away with (or written into) the temp output that replaces it.
OTHER_WRITES: dict[Path, str] = {}

# ckpt's own leftovers this process removed beside its outputs, in order: ("temp", path) for a stale temp output
# (`remove_stale_temps`), ("part", path) for a part of a split GGUF a stopped run published incompletely that an
# --overwrite run replaced (`ckpt.io.gguf_split.PartialSet.remove`). `cleanup_notes` says them in the summary.
CLEANED: list[tuple[str, Path]] = []

# `.NAME.ckpt-tmp-PID-8hex` (a temp output) and `.NAME.ckpt-old-PID-8hex` (a replaced output being removed)
_TEMP_TAIL = re.compile(r"ckpt-(?:tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}")
# `.NAME.ckpt-kept-PID-8hex`: someone else's entry a failed publish could not put back at OUT, under a name no
# stale-temp sweep removes (`_keep_aside`)
_KEPT = "kept"

_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def temp_name(out_name: str, kind: str = "tmp") -> str:
    return f".{out_name}.ckpt-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------------------- renameat2


def _load_renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2_fn = _load_renameat2()


def _renameat2(dir_fd: int, old: str, new: str, flags: int) -> None:
    """renameat2(2) within one folder. Raises OSError; ENOSYS/EINVAL where the C library, the kernel or
    the filesystem has no such flag (callers fall back)."""
    if _renameat2_fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if _renameat2_fn(dir_fd, os.fsencode(old), dir_fd, os.fsencode(new), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _unsupported(e: OSError) -> bool:
    return e.errno in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)


# ----------------------------------------------------------------------------------- small helpers


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _remove_at(dir_fd: int, name: str) -> None:
    """Delete `name` in the folder `dir_fd` (a file, a link, or a whole folder, without following links).
    Best effort: an error (EROFS, EACCES, already gone) leaves the rest for the stale-temp cleanup."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return
    try:
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dir_fd)
            return
        for _, dirs, files, fd in os.fwalk(name, topdown=False, dir_fd=dir_fd):
            for n in files:
                with contextlib.suppress(OSError):
                    os.unlink(n, dir_fd=fd)
            for n in dirs:
                try:
                    os.rmdir(n, dir_fd=fd)
                except NotADirectoryError:  # a link to a folder is listed with the folders
                    with contextlib.suppress(OSError):
                        os.unlink(n, dir_fd=fd)
                except OSError:
                    pass
        os.rmdir(name, dir_fd=dir_fd)
    except OSError:
        pass


def missing_parents(path: Path) -> list[Path]:
    """The folders above `path` that do not exist yet, outermost first."""
    missing = []
    p = Path(path).absolute().parent
    while not p.exists() and not p.is_symlink() and p != p.parent:
        missing.append(p)
        p = p.parent
    return missing[::-1]


# ------------------------------------------------------------------------------- stale temp outputs


def _owner_gone(dir_fd: int, name: str, pid: int) -> bool:
    """True only when the PID is not a live process here and nobody holds the entry's lock (a process
    in another PID namespace or on another NFS client still holds it)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
        return False
    except ProcessLookupError:
        pass
    except OSError:  # EPERM: alive, someone else's
        return False
    try:
        # O_NONBLOCK: a FIFO planted under a temp name must not hang the run
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _stale_name(name: str, member) -> int | None:
    """The PID in `name` if it is a temp name (`.X.ckpt-tmp-PID-8hex`, `.X.ckpt-old-PID-8hex`) of an output X that
    `member` accepts, else None."""
    if not name.startswith("."):
        return None
    head, sep, tail = name[1:].rpartition(".ckpt-")
    m = _TEMP_TAIL.fullmatch("ckpt-" + tail) if sep else None
    return int(m["pid"]) if m and member(head) else None


def remove_stale_temps(out: Path, siblings: bool = True) -> list[str]:
    """Remove ckpt's own leftovers beside OUT (`.OUT.ckpt-tmp-PID-X`, `.OUT.ckpt-old-PID-X`) whose
    process is gone: what a SIGKILL or a power loss left. With `siblings`, also those of the files that make
    one output with OUT (the parts of a split GGUF named OUT, any count: `ckpt.io.gguf_parts.set_member`).
    Returns the names removed (also recorded in `CLEANED`). Never raises."""
    from ckpt.io.gguf_parts import set_member

    out = Path(out).absolute()
    of_set = set_member(out) if siblings else None
    member = (lambda n: n == out.name or of_set(n)) if of_set is not None else (lambda n: n == out.name)
    removed = []
    try:
        dfd = os.open(out.parent, _DIR_FLAGS)
    except OSError:
        return removed
    try:
        for entry in os.scandir(dfd):
            pid = _stale_name(entry.name, member)
            if pid is not None and _owner_gone(dfd, entry.name, pid):
                _remove_at(dfd, entry.name)
                if _lstat_at(dfd, entry.name) is None:
                    removed.append(entry.name)
                    CLEANED.append(("temp", out.parent / entry.name))
    except OSError:
        pass
    finally:
        os.close(dfd)
    return removed


def remove_checked(path: Path, ident: tuple[int, int]) -> bool:
    """Delete the regular file `path` only if it is still the file `ident` names (device, inode): it is first
    renamed aside (`.NAME.ckpt-old-PID-X`), then checked there, so what is deleted is what was checked, never an
    entry swapped in meanwhile (which is put back). Returns whether it was deleted. Never raises."""
    path = Path(path).absolute()
    try:
        dfd = os.open(path.parent, _DIR_FLAGS)
    except OSError:
        return False
    try:
        st = _lstat_at(dfd, path.name)
        if st is None or _ident(st) != ident or not stat.S_ISREG(st.st_mode):
            return False
        old = temp_name(path.name, "old")
        with signals_deferred():
            try:
                os.rename(path.name, old, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError:
                return False
            st = _lstat_at(dfd, old)
            if st is None or _ident(st) != ident or not stat.S_ISREG(st.st_mode):
                _put_back_at(dfd, old, path.name)
                return False
            try:
                os.unlink(old, dir_fd=dfd)
            except OSError:
                _put_back_at(dfd, old, path.name)
                return False
        return True
    finally:
        os.close(dfd)


def _put_back_at(dfd: int, name: str, home: str) -> None:
    """Someone else's entry, moved aside by a publish, back at `home` where nothing should be now; where that fails
    (something took `home` meanwhile), under a `.HOME.ckpt-kept-` name that no stale-temp sweep removes."""
    try:
        _renameat2(dfd, name, home, _RENAME_NOREPLACE)
        return
    except OSError as e:
        if not _unsupported(e):
            return _keep_aside(dfd, name, home)
    if _lstat_at(dfd, home) is None:
        try:
            os.rename(name, home, src_dir_fd=dfd, dst_dir_fd=dfd)
            return
        except OSError:
            pass
    _keep_aside(dfd, name, home)


def _keep_aside(dfd: int, name: str, home: str) -> None:
    with contextlib.suppress(OSError):
        os.rename(name, temp_name(home, _KEPT), src_dir_fd=dfd, dst_dir_fd=dfd)


def cleanup_notes(since: int) -> list[str]:
    """The summary lines of what `CLEANED` gained since `since` (its length before the run)."""
    from ckpt.report import listed, plural

    notes = []
    temps = sorted(p.name for kind, p in CLEANED[since:] if kind == "temp")
    parts = sorted(p.name for kind, p in CLEANED[since:] if kind == "part")
    if temps:
        notes.append(f"removed {plural(len(temps), 'temporary output')} that a stopped ckpt run left beside the "
                     f"output ({listed(temps, 3)})")
    if parts:
        notes.append(f"removed {plural(len(parts), 'part')} of a split GGUF of this name that a stopped ckpt run "
                     f"published incompletely ({listed(parts, 3)}): --overwrite replaces it")
    return notes


# ----------------------------------------------------------------------------------------- staging


class Staging:
    """The temp output of one run and its publication as OUT.

    `open()` creates missing parents, the temp file or folder (locked), and remembers the identity of
    OUT's parent and of everything created inside; `file()` / `create(rel)` hand out descriptors of new
    files; `publish(overwrite)` checks identities and renames; `discard()` removes the temp output (and
    the parents this run created) unless it was published. A `Staging` is used once."""

    def __init__(self, out: Path, single_file: bool):
        self.out = Path(out).absolute()  # not resolved: a symlink at OUT is replaced, not followed
        self.single_file = single_file
        self.name = temp_name(self.out.name)
        self.created: list[Path] = []
        self.pfd = -1
        self.lock_fd = -1  # the temp file, or the temp folder; flock-ed until we are done
        self.parent_id: tuple[int, int] | None = None
        self.ids: dict[str, tuple[int, int]] = {}  # relpath inside the temp folder -> identity
        self.dir_fds: dict[str, int] = {}  # "" and created subfolders -> open descriptor
        self.published = False
        self.old: str | None = None  # the previous OUT, moved aside by an --overwrite publish
        self.out_id: tuple[int, int] | None = None  # what was at OUT when the run checked it (`open`)

    @property
    def tmp(self) -> Path:
        return self.out.parent / self.name

    def open(self) -> None:
        for p in missing_parents(self.out):
            try:
                p.mkdir()
            except FileExistsError:
                continue  # made meanwhile by someone else: not ours to remove
            self.created.append(p)
        self.pfd = os.open(self.out.parent, _DIR_FLAGS)
        self.parent_id = _ident(os.fstat(self.pfd))
        st = _lstat_at(self.pfd, self.out.name)  # checked just before (`ckpt.io.output.check_target`)
        self.out_id = _ident(st) if st is not None else None
        remove_stale_temps(self.out)
        if self.single_file:
            self.lock_fd = os.open(self.name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW
                                   | getattr(os, "O_CLOEXEC", 0), 0o666, dir_fd=self.pfd)
        else:
            os.mkdir(self.name, 0o777, dir_fd=self.pfd)
            self.lock_fd = os.open(self.name, _DIR_FLAGS | _NOFOLLOW, dir_fd=self.pfd)
            self.dir_fds[""] = self.lock_fd
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.root_id = _ident(os.fstat(self.lock_fd))

    def file(self) -> int:
        """A new descriptor of the single temp file (the writer owns and closes it)."""
        return os.dup(self.lock_fd)

    def _dir(self, rel: str) -> int:
        """The descriptor of folder `rel` inside the temp folder, creating it (one level at a time)."""
        if rel in self.dir_fds:
            return self.dir_fds[rel]
        parent, _, name = rel.rpartition("/")
        pfd = self._dir(parent)
        try:
            os.mkdir(name, 0o777, dir_fd=pfd)
        except FileExistsError:
            raise CkptError(f"{self.out}: {rel} is planned twice in the output (internal error)") from None
        fd = os.open(name, _DIR_FLAGS | _NOFOLLOW, dir_fd=pfd)
        self.dir_fds[rel] = fd
        self.ids[rel] = _ident(os.fstat(fd))
        return fd

    def create(self, rel: str) -> int:
        """A descriptor of the new file `rel` (POSIX path) inside the temp folder; the caller closes it."""
        folder, _, name = rel.rpartition("/")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     0o666, dir_fd=self._dir(folder))
        self.ids[rel] = _ident(os.fstat(fd))
        return fd

    def write_bytes(self, rel: str, data: bytes) -> None:
        with os.fdopen(self.create(rel), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def copy_file(self, src: Path, rel: str) -> None:
        with open(src, "rb") as fsrc, os.fdopen(self.create(rel), "wb") as fdst:
            while chunk := fsrc.read(1 << 20):
                fdst.write(chunk)
            fdst.flush()
            os.fsync(fdst.fileno())

    def verify(self) -> None:
        """Everything this run created is still where it was put (same device and inode), and OUT's
        parent folder is still the one the temp output lives in."""
        gone = f"{self.out}: the temporary output was removed or replaced during the run; nothing written"
        try:
            parent = os.stat(self.out.parent)
        except OSError:
            parent = None
        if parent is None or _ident(parent) != self.parent_id:
            raise CkptError(f"{self.out}: its folder {self.out.parent} was removed or replaced during the run; "
                            "nothing written")
        st = _lstat_at(self.pfd, self.name)
        if st is None or _ident(st) != self.root_id:
            raise CkptError(gone)
        for rel, ident in self.ids.items():
            st = _lstat_at(self.lock_fd, rel)
            if st is None or _ident(st) != ident:
                raise CkptError(f"{self.out}: {rel} in the temporary output was removed or replaced during the run; "
                                "nothing written")

    def publish(self, overwrite: bool) -> None:
        """Rename the temp output to OUT; without `overwrite` only if OUT does not exist at that moment."""
        for fd in self.dir_fds.values():
            with contextlib.suppress(OSError):
                os.fsync(fd)
        with signals_deferred():
            self.verify()
            if overwrite:
                self.old = self._replace()
            else:
                self._rename_noreplace()
            self.published = True
            PUBLISHED.append(self.out)
        if self.old is not None:
            _remove_at(self.pfd, self.old)
            self.old = None
        with contextlib.suppress(OSError):
            os.fsync(self.pfd)

    def _exists(self) -> CkptError:
        return CkptError(f"{self.out}: already exists (another run wrote it meanwhile; pass --overwrite to replace it)")

    def _rename_noreplace(self) -> None:
        try:
            _renameat2(self.pfd, self.name, self.out.name, _RENAME_NOREPLACE)
            return
        except FileExistsError:
            raise self._exists() from None
        except OSError as e:
            if not _unsupported(e):
                raise
        if self.single_file:  # link fails if OUT exists: the check and the publish are one step
            try:
                os.link(self.name, self.out.name, src_dir_fd=self.pfd, dst_dir_fd=self.pfd, follow_symlinks=False)
            except FileExistsError:
                raise self._exists() from None
            os.unlink(self.name, dir_fd=self.pfd)
            return
        try:  # an exclusive placeholder; renaming a folder over an empty folder is atomic
            os.mkdir(self.out.name, 0o700, dir_fd=self.pfd)
        except FileExistsError:
            raise self._exists() from None
        try:
            os.rename(self.name, self.out.name, src_dir_fd=self.pfd, dst_dir_fd=self.pfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(self.out.name, dir_fd=self.pfd)
            raise

    def _replace(self) -> str | None:
        """Replace OUT (or create it). Returns the temp name now holding the previous OUT, to remove."""
        st = _lstat_at(self.pfd, self.out.name)
        if st is None:
            try:
                self._rename_noreplace()
                return None
            except CkptError:  # appeared just now: replace it after all
                st = _lstat_at(self.pfd, self.out.name)
        out_is_dir = st is not None and stat.S_ISDIR(st.st_mode)
        if self.single_file and out_is_dir:
            raise CkptError(f"{self.out}: is a folder; refusing to replace it with a single file (name a file)")
        if self.single_file or st is None:
            os.rename(self.name, self.out.name, src_dir_fd=self.pfd, dst_dir_fd=self.pfd)
            return None
        self._check_replaced(self.out.name)
        try:  # one step: the temp folder and OUT swap places
            _renameat2(self.pfd, self.name, self.out.name, _RENAME_EXCHANGE)
        except OSError as e:
            if not _unsupported(e):
                raise
        else:
            try:  # what was swapped out is what was checked: else it goes back, and nothing is written
                self._check_replaced(self.name)
            except CkptError:
                try:
                    _renameat2(self.pfd, self.name, self.out.name, _RENAME_EXCHANGE)
                except OSError:  # short of an I/O error, cannot happen: ours stays published, theirs is kept
                    _keep_aside(self.pfd, self.name, self.out.name)
                    return None
                raise
            return self.name
        old = temp_name(self.out.name, "old")
        os.rename(self.out.name, old, src_dir_fd=self.pfd, dst_dir_fd=self.pfd)
        try:
            self._check_replaced(old)
            os.rename(self.name, self.out.name, src_dir_fd=self.pfd, dst_dir_fd=self.pfd)
        except BaseException:
            _put_back_at(self.pfd, old, self.out.name)
            raise
        return old

    def _check_replaced(self, name: str) -> None:
        """Refuse (CkptError) to delete the entry `name` in OUT's folder (OUT itself, or the previous OUT
        swapped out to `name`) unless it is what was at OUT when the run checked it (`self.out_id`: same device
        and inode) and, a folder, still holds only ckpt's files and files the new output rewrites."""
        st = _lstat_at(self.pfd, name)
        if self.out_id is None:
            raise CkptError(f"{self.out}: appeared during the run, so ckpt did not check it; it is left as it is, "
                            "nothing written (run again to replace it)")
        if st is None or _ident(st) != self.out_id:
            raise CkptError(f"{self.out}: was replaced during the run by something ckpt did not check; it is left "
                            "as it is, nothing written")
        if stat.S_ISDIR(st.st_mode):
            from ckpt.io.previous_output import MAX_LISTED, foreign_files
            from ckpt.report import listed

            foreign = foreign_files(self.out.parent / name, set(self.ids))
            if foreign:
                raise CkptError(f"{self.out}: files ckpt did not write appeared in it during the run "
                                f"({listed(foreign, MAX_LISTED)}); it is left as it is, nothing written")

    def close(self) -> None:
        """Release descriptors (and with them the lock); remove the temp output unless it was published."""
        with signals_deferred():
            if self.pfd >= 0:
                if not self.published:
                    _remove_at(self.pfd, self.name)
                elif self.old is not None:
                    _remove_at(self.pfd, self.old)
            for fd in set(self.dir_fds.values()) | {self.lock_fd}:
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self.dir_fds.clear()
            self.lock_fd = -1
            if not self.published:
                for p in reversed(self.created):
                    with contextlib.suppress(OSError):
                        p.rmdir()  # only if still empty: another run may be using it meanwhile
            if self.pfd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self.pfd)
                self.pfd = -1


# ------------------------------------------------------------------------------------ sibling sets


def publish_set(stages: list[Staging], overwrite: bool) -> None:
    """Publish the single-file temp outputs of `stages` (the parts of a split GGUF, siblings in one folder)
    as a set: every part or none.

    All temp files are written and fsynced first (by the writers). Then, with signals deferred (Ctrl-C and
    SIGTERM wait until the set is published or rolled back), each part is checked (`verify`) and renamed
    into place in order, without --overwrite only where nothing exists at its name (`RENAME_NOREPLACE`,
    as for one file). With --overwrite an existing part is first moved aside to a `.ckpt-old-` name. If any
    rename fails (a part appeared meanwhile, an I/O error), every part renamed so far is moved back to its
    temp name (removed by `Staging.close`) and every part moved aside is put back: the folder is as
    before. Only a SIGKILL or a power loss between two renames (microseconds) can leave part of a set;
    the reader then refuses it, naming the missing part, and the next run removes the stale temps."""
    for s in stages:
        if s.single_file is not True or s.pfd < 0:
            raise ValueError("publish_set takes opened single-file stagings")
    done: list[Staging] = []
    with signals_deferred():
        try:
            for s in stages:
                s.verify()
            for s in stages:
                if overwrite:
                    st = _lstat_at(s.pfd, s.out.name)
                    if st is not None and stat.S_ISDIR(st.st_mode):
                        raise CkptError(f"{s.out}: is a folder; refusing to replace it with a file (name another -o)")
                    if st is not None:
                        old = temp_name(s.out.name, "old")
                        os.rename(s.out.name, old, src_dir_fd=s.pfd, dst_dir_fd=s.pfd)
                        moved = _lstat_at(s.pfd, old)
                        if moved is None or _ident(moved) != _ident(st) or stat.S_ISDIR(moved.st_mode):
                            _put_back_at(s.pfd, old, s.out.name)  # swapped in meanwhile: never deleted
                            raise CkptError(f"{s.out}: was replaced during the publish; it is left as it is, "
                                            "nothing written")
                        s.old = old
                    try:
                        os.rename(s.name, s.out.name, src_dir_fd=s.pfd, dst_dir_fd=s.pfd)
                    except BaseException:
                        _put_back(s)
                        raise
                else:
                    s._rename_noreplace()
                done.append(s)
        except BaseException:
            for s in reversed(done):
                st = _lstat_at(s.pfd, s.out.name)
                if st is not None and _ident(st) == s.root_id:  # ours: back to its temp name
                    with contextlib.suppress(OSError):
                        os.rename(s.out.name, s.name, src_dir_fd=s.pfd, dst_dir_fd=s.pfd)
                _put_back(s)
            raise
        for s in stages:
            s.published = True
            PUBLISHED.append(s.out)
    for s in stages:
        if s.old is not None:
            _remove_at(s.pfd, s.old)
            s.old = None
        with contextlib.suppress(OSError):
            os.fsync(s.pfd)


def _put_back(s: Staging) -> None:
    """The previous OUT that an --overwrite publish moved aside, back at OUT (nothing there now)."""
    if s.old is not None:
        with contextlib.suppress(OSError):
            os.rename(s.old, s.out.name, src_dir_fd=s.pfd, dst_dir_fd=s.pfd)
        s.old = None
