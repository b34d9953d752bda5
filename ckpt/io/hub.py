"""Hugging Face Hub sources: `owner/name[@revision][/subfolder]`, through huggingface_hub's cache.

Only safetensors weights, index files and small sidecars are fetched (allow_patterns); torch pickles
are fetched only when the repository (or subfolder) has no safetensors, so a repo that ships both is
never downloaded twice. With HF_HUB_OFFLINE=1 or no network, the cache alone answers.

huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE once, at import; ckpt reads them again at call
time and passes them explicitly, so the environment of the run is what counts.

Paths a command names are looked at through `local_path` here (SRC and LoRAs by `check_source` and
`check_lora`, options such as -o, --shapes-from, --lora by the callbacks of `ckpt.cli.options`), so a
folder the user cannot enter is "permission denied" in one line rather than a traceback, and a spec that
looks local (see `looks_like_repo_id`) is a local "no such file" at once. Only what is left goes to the
hub, through `_lookup`: one line saying so, a deadline (CKPT_HUB_TIMEOUT seconds) for the hub's answer
instead of huggingface_hub's retries, the cache as the fallback, and one line when it fails.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from pathlib import Path

from ckpt import env
from ckpt.errors import CkptError
from ckpt.io.file_kinds import LITGPT_LORA, WEIGHT_SUFFIXES

REPO = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w.\-]+))?(?:/(?P<sub>.+))?$")
SIDECARS = ("*.json", "*.txt", "*.model", "*.yaml", "*.tiktoken")
SAFETENSORS = ("*.safetensors",)
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt")
TIMEOUT_ENV = "CKPT_HUB_TIMEOUT"
DEFAULT_TIMEOUT = 10.0  # seconds: a hub look-up that takes longer is given up (the cache may still answer)


def _blocked_at(p: Path) -> Path | None:
    """The first folder on the way to `p` that this user may not enter (search permission), if any."""
    p = Path(os.path.abspath(p))
    for folder in reversed(p.parents):
        if folder.is_dir() and not os.access(folder, os.X_OK):
            return folder
        if not folder.is_dir():
            return None
    return None


def local_path(spec: str | os.PathLike, what: str = "") -> Path | None:
    """`spec` as a local path when it exists, None when it does not. A folder on the way that cannot be
    entered is a one-line CkptError ("permission denied"), never the PermissionError `Path.exists` and
    `Path.is_dir` raise for it (Python < 3.12): the one check every path a command names goes through.
    `what` prefixes the message with the option (e.g. "--config ")."""
    p = Path(spec).expanduser()
    try:
        os.stat(p)
        return p
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError:
        folder = _blocked_at(p)
        why = f"cannot enter {folder}" if folder is not None else "cannot look at it"
        raise CkptError(f"{what}{spec}: permission denied ({why})") from None
    except OSError as e:  # a symlink loop, a name too long, an unreachable mount
        raise CkptError(f"{what}{spec}: {e.strerror or e}") from None


def check_readable(p: Path, what: str = "") -> None:
    """An existing input that this user cannot read (a file) or list (a folder): one line, before any
    work is planned."""
    if not os.access(p, os.R_OK | (os.X_OK if p.is_dir() else 0)):
        raise CkptError(f"{what}{p}: permission denied (cannot {'list' if p.is_dir() else 'read'} it)")


def local_input(spec: str | os.PathLike, what: str = "") -> Path | None:
    """`local_path`, where an input that exists must also be readable (`check_readable`)."""
    p = local_path(spec, what)
    if p is not None:
        check_readable(p, what)
    return p


def _weight_suffixes() -> tuple[str, ...]:
    return WEIGHT_SUFFIXES + (LITGPT_LORA, ".json")


def looks_like_repo_id(spec: str) -> bool:
    """True for `owner/name...` specs that are not plausibly a mistyped local path. Local-looking: `./`,
    `../`, `~`, an absolute path, a backslash, a repository name ending like a weight file
    (`models/x.safetensors`: a file in a folder, since no hub repository is named so; a file inside a
    repository, `owner/name/x.safetensors`, stays a hub id), or a leading folder that exists here
    (`out/model`, where `out/` is a local folder)."""
    if not REPO.match(spec) or spec.startswith((".", "/", "~")) or "\\" in spec or os.path.isabs(spec):
        return False
    parts = spec.split("/")
    name = parts[1].split("@", 1)[0]
    if name.lower().endswith(_weight_suffixes()):
        return False
    # `out/model.safetensors` where `out/` exists is a local path that is missing, not a repo.
    for i in range(1, len(parts)):
        folder = local_path("/".join(parts[:i]))
        if folder is not None and folder.is_dir():
            return False
    return True


def check_source(spec: str, what: str = "") -> None:
    """Refuse SRC when it is neither an existing local path nor a hub id: the first check of
    `ckpt.io.checkpoint.open_checkpoint`, also made by the CLI before a command imports torch, so that a
    mistyped path costs milliseconds rather than torch's start-up (and a locked folder is refused as
    such, not as a hub miss)."""
    if local_input(spec, what) is None and not looks_like_repo_id(spec):
        raise CkptError(f"{what}{spec}: no such file or directory")


def check_lora(spec: str) -> None:
    """Refuse a LoRA that does not exist (LoRAs are local files or folders): the first check of
    `ckpt.adapters.loading.load_lora`, made by the CLI before torch is imported, as `check_source` is."""
    if local_input(spec) is None:
        raise CkptError(f"{spec}: no such LoRA file or folder")


def parse_repo_spec(spec: str) -> tuple[str, str | None, str | None]:
    m = REPO.match(spec)
    if not m:
        raise CkptError(f"{spec}: not a hub id (expected owner/name[@revision][/subfolder])")
    return m["repo"], m["rev"], m["sub"]


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _cache_dir() -> str | None:
    """The hub cache as the current environment names it (None: huggingface_hub's default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return os.environ["HUGGINGFACE_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]).expanduser() / "hub")
    return None


def _has_safetensors(path: Path) -> bool:
    if path.is_file():
        return path.suffix == ".safetensors"
    return path.is_dir() and any(path.rglob("*.safetensors"))


def _offline() -> bool:
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def hub_timeout() -> float:
    """CKPT_HUB_TIMEOUT (seconds, default 10): how long a hub look-up may take before ckpt gives up on
    the network (and answers from the cache, if it can)."""
    return env.seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT)


class _NoRetryLines(logging.Filter):
    """Drops huggingface_hub's "Retrying in Ns [Retry k/5]" warnings: ckpt's deadline replaces them."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Retrying in") or "[Retry " in msg)


_FILTER = _NoRetryLines()


def _silence_retries() -> None:
    for name in ("huggingface_hub", "huggingface_hub.utils._http", "huggingface_hub.hf_api",
                 "huggingface_hub.file_download", "huggingface_hub._snapshot_download"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def _quiet() -> bool:
    """Whether the running command was given --quiet. A hub look-up announces itself on the command line
    only (a Python caller or a batch worker has no terminal to tell)."""
    import click

    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return True
    while ctx is not None:
        if ctx.params.get("quiet"):
            return True
        ctx = ctx.parent
    return False


def _say(line: str) -> None:
    if not _quiet():
        print(f"note: {line}", file=sys.stderr, flush=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def _lookup(spec: str, what: str, call, missing: str):
    """Run `call(info)`, a huggingface_hub look-up of `spec`, as ckpt's rules say. `info` is the hub's
    `model_info` answer, or None where only the local cache may answer (`local_files_only`). Offline
    (HF_HUB_OFFLINE): the cache alone answers, at once. Online: one line says the hub is being asked; the
    hub must answer a metadata request (`model_info`) within `hub_timeout()` seconds (huggingface_hub
    retries a dead network for ~25 s, and its retry warnings are dropped); if it does not, the cache
    answers if it can. Only once the hub has answered does `call` download, with no deadline (weights take
    as long as they take). Every failure is one CkptError. `missing`: what to say when the repository
    has no such file (e.g. "no config.json")."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    label = f"{what}{spec}"
    if _offline():
        try:
            return call(None)
        except CkptError:
            raise
        except Exception:  # LocalEntryNotFoundError, a revision never fetched, an unreadable cache
            raise CkptError(f"{label}: not a local path, and not in the local Hugging Face cache "
                            "(offline mode: HF_HUB_OFFLINE is set, so the hub was not asked)") from None
    timeout = hub_timeout()
    _silence_retries()
    _say(f"{label}: not a local path; looking it up on the Hugging Face hub (giving up after {timeout:g} s, "
         f"{TIMEOUT_ENV})")
    repo, rev, _ = parse_repo_spec(spec)
    try:
        info = _within(timeout, lambda: _hub_api().model_info(repo, revision=rev, timeout=timeout))
    except TimeoutError:  # the network hangs: the cache may still hold it
        return _from_cache(label, call, f"the Hugging Face hub did not answer within {timeout:g} s (set "
                                        f"{TIMEOUT_ENV} to wait longer)")
    except Exception as e:
        if not (_unreachable(e) or isinstance(e, LocalEntryNotFoundError)):
            _refuse(label, e, missing)
        return _from_cache(label, call, f"the Hugging Face hub could not be reached ({_first_line(e)})")
    try:
        return call(info)
    except CkptError:
        raise
    except Exception as e:
        _refuse(label, e, missing)


def _hub_api():
    from huggingface_hub import HfApi

    return HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)


def _within(timeout: float, fn):
    """`fn()` in a daemon thread, given `timeout` seconds (TimeoutError after that; the thread is left to
    end on its own). A thread, because huggingface_hub's retries sleep between attempts whatever the
    per-request timeout says."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name="ckpt hub look-up", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise TimeoutError
    if "error" in box:
        raise box["error"]
    return box["value"]


def _from_cache(label: str, call, why: str):
    """The cached copy when the hub cannot answer (said in one note), else one CkptError saying why."""
    try:
        value = call(None)
    except CkptError:
        raise
    except Exception:
        raise CkptError(f"{label}: not a local path; {why}, and it is not in the local cache") from None
    _say(f"{label}: {why}; using the copy in the local cache")
    return value


def _refuse(label: str, e: Exception, missing: str):
    """One CkptError for what the hub answered (or how it failed)."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    if isinstance(e, GatedRepoError):
        raise CkptError(f"{label}: a gated repository on the Hugging Face hub: accept its terms and log in "
                        "(hf auth login)") from None
    if isinstance(e, RepositoryNotFoundError):
        raise CkptError(f"{label}: not a local path, and no such repository on the Hugging Face hub "
                        "(or a private one: log in with hf auth login)") from None
    if isinstance(e, RevisionNotFoundError):
        raise CkptError(f"{label}: the repository has no such revision") from None
    if isinstance(e, EntryNotFoundError) and not isinstance(e, LocalEntryNotFoundError):
        raise CkptError(f"{label}: {missing} in the repository") from None
    if isinstance(e, HfHubHTTPError):
        raise CkptError(f"{label}: hub error: {_first_line(e)}") from None
    if _unreachable(e) or isinstance(e, LocalEntryNotFoundError):
        raise CkptError(f"{label}: not a local path; the Hugging Face hub could not be reached "
                        f"({_first_line(e.__cause__ or e)}), and it is not in the local cache") from None
    raise CkptError(f"{label}: the Hugging Face hub look-up failed ({_first_line(e)})") from None


def _unreachable(e: BaseException) -> bool:
    """A network failure (no route, no DNS, refused, timed out) rather than an answer from the hub: an
    OSError, or the HTTP client's transport error (httpx's, whichever module huggingface_hub ships it as;
    requests' ConnectionError / Timeout in older stacks)."""
    return isinstance(e, OSError) or any(c.__name__ in ("TransportError", "ConnectionError", "Timeout")
                                         for c in type(e).__mro__)


def resolve_repo(spec: str) -> Path:
    """Local path (inside the hub cache) of `spec`: the snapshot folder, or the subfolder/file in it."""
    from huggingface_hub import snapshot_download

    repo, rev, sub = parse_repo_spec(spec)
    sub = sub.strip("/") if sub else None

    def fetch(kinds, local_only: bool) -> Path:
        patterns = [p for k in kinds for p in k]
        if sub:
            patterns = [f"{sub}/{p}" for p in patterns] + [sub]  # `sub` itself may be a file
        return Path(snapshot_download(repo, revision=rev, allow_patterns=patterns, cache_dir=_cache_dir(),
                                      local_files_only=local_only, etag_timeout=hub_timeout()))

    def both(info) -> Path:
        local_only = info is None
        root = fetch([SAFETENSORS, SIDECARS], local_only)
        path = root / sub if sub else root
        if not _has_safetensors(path):
            root = fetch([PICKLES, SIDECARS], local_only)
            path = root / sub if sub else root
        return path

    path = _lookup(spec, "", both, "no such file")
    if not path.exists():
        raise CkptError(f"{spec}: the repository has no {sub!r}")
    return path


def config_from_hub(spec: str, what: str = "--config ") -> Path:
    """The config.json of a hub model `owner/name[@rev][/subfolder]`, fetched alone (or from the cache)."""
    from huggingface_hub import hf_hub_download

    repo, rev, sub = parse_repo_spec(spec)
    return _lookup(spec, what, lambda info: Path(hf_hub_download(
        repo, "config.json", subfolder=sub.strip("/") if sub else None, revision=rev, cache_dir=_cache_dir(),
        local_files_only=info is None, etag_timeout=hub_timeout())), "no config.json")


def sidecars_from_hub(spec: str, what: str = "--config ") -> Path:
    """A hub repository's non-weight files (configs, tokenizers, scheduler), fetched without weights."""
    from huggingface_hub import snapshot_download

    repo, rev, sub = parse_repo_spec(spec)
    root = _lookup(spec, what, lambda info: Path(snapshot_download(
        repo, revision=rev, allow_patterns=list(SIDECARS), cache_dir=_cache_dir(), local_files_only=info is None,
        etag_timeout=hub_timeout())), "no such file")
    return root / sub.strip("/") if sub else root


def cached_snapshot(spec: str) -> Path | None:
    """`spec`'s snapshot folder (or subfolder) in the local cache when it holds safetensors files, found
    without any network access; else None."""
    from huggingface_hub import snapshot_download

    repo, rev, sub = parse_repo_spec(spec)
    sub = sub.strip("/") if sub else None
    patterns = [f"{sub}/{p}" for p in SAFETENSORS + SIDECARS] if sub else list(SAFETENSORS + SIDECARS)
    try:
        root = Path(snapshot_download(repo, revision=rev, allow_patterns=patterns, cache_dir=_cache_dir(),
                                      local_files_only=True))
    except Exception:  # LocalEntryNotFoundError, a revision never fetched, an unreadable cache: not cached
        return None
    path = root / sub if sub else root
    return path if _has_safetensors(path) else None


def remote_safetensors_shapes(spec: str, what: str) -> dict[str, dict[str, tuple]]:
    """{subfolder relative to `spec`: {tensor: shape}} from the repository's safetensors headers, read with
    range requests (no weights downloaded). The cache is `cached_snapshot`'s business; this is the network
    step, refused at once when offline: `_lookup`'s `model_info` (given its deadline) lists the files,
    `parse_safetensors_file_metadata` reads each header (huggingface_hub's per-request timeout, no retries)."""
    repo, rev, sub = parse_repo_spec(spec)
    sub = sub.strip("/") if sub else ""
    label = f"{what} " if what else ""

    def headers(info) -> dict[str, dict[str, tuple]]:
        if info is None:  # `cached_snapshot` already looked in the cache: nothing more to find there
            from huggingface_hub.errors import LocalEntryNotFoundError

            raise LocalEntryNotFoundError(f"{spec} is not in the local cache")
        api = _hub_api()
        files = [s.rfilename for s in (info.siblings or []) if s.rfilename.endswith(".safetensors")
                 and (not sub or s.rfilename.startswith(sub + "/"))]
        by_sub: dict[str, dict[str, tuple]] = {}
        for f in files:
            meta = api.parse_safetensors_file_metadata(repo, f, revision=rev)
            folder = f.rsplit("/", 1)[0] if "/" in f else ""
            folder = folder[len(sub):].strip("/") if sub else folder
            by_sub.setdefault(folder, {}).update({n: tuple(i.shape) for n, i in meta.tensors.items()})
        return by_sub

    by_sub = _lookup(spec, label, headers, "no such file")
    if not by_sub:
        raise CkptError(f"{label}{spec}: the repository has no safetensors files" + (f" under {sub}/" if sub else ""))
    return by_sub
