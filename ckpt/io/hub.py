"""Hugging Face Hub sources: `owner/name[@revision][/subfolder]`, through huggingface_hub's cache.

Only safetensors weights, index files and small sidecars are fetched (allow_patterns); torch pickles
are fetched only when the repository (or subfolder) has no safetensors, so a repo that ships both is
never downloaded twice. With HF_HUB_OFFLINE=1 or no network, the cache alone answers.

huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE once, at import; ckpt reads them again at call
time and passes them explicitly, so the environment of the run is what counts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ckpt.errors import CkptError

REPO = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w.\-]+))?(?:/(?P<sub>.+))?$")
SIDECARS = ("*.json", "*.txt", "*.model", "*.yaml", "*.tiktoken")
SAFETENSORS = ("*.safetensors",)
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt")
HUB_TIMEOUT = 10  # seconds per request of the header-only reads


def looks_like_repo_id(spec: str) -> bool:
    """True for `owner/name...` specs that are not plausibly a mistyped local path."""
    if not REPO.match(spec) or spec.startswith((".", "/", "~")) or "\\" in spec:
        return False
    # `out/model.safetensors` where `out/` exists is a local path that is missing, not a repo.
    return not Path(spec.split("/", 1)[0]).is_dir()


def check_source(spec: str) -> None:
    """Refuse SRC when it is neither an existing local path nor a hub id: the first check of
    `ckpt.io.checkpoint.open_checkpoint`, also made by the CLI before a command imports torch, so that a
    mistyped path costs milliseconds rather than torch's start-up."""
    if not Path(spec).expanduser().exists() and not looks_like_repo_id(spec):
        raise CkptError(f"{spec}: no such file or directory")


def check_lora(spec: str) -> None:
    """Refuse a LoRA that does not exist (LoRAs are local files or folders): the first check of
    `ckpt.merge.loading.load_lora`, made by the CLI before torch is imported, as `check_source` is."""
    if not Path(spec).expanduser().exists():
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


def resolve_repo(spec: str) -> Path:
    """Local path (inside the hub cache) of `spec`: the snapshot folder, or the subfolder/file in it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, rev, sub = parse_repo_spec(spec)
    sub = sub.strip("/") if sub else None
    offline = _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")

    def fetch(kinds) -> Path:
        patterns = [p for k in kinds for p in k]
        if sub:
            patterns = [f"{sub}/{p}" for p in patterns] + [sub]  # `sub` itself may be a file
        try:
            return Path(snapshot_download(repo, revision=rev, allow_patterns=patterns, cache_dir=_cache_dir(),
                                          local_files_only=offline))
        except LocalEntryNotFoundError:
            where = "the local Hugging Face cache" + (" (HF_HUB_OFFLINE is set)" if offline else "")
            raise CkptError(f"{spec}: not a local path, and not found in {where} nor reachable on the hub") from None
        except HfHubHTTPError as e:
            raise CkptError(f"{spec}: not a local path; hub error: {str(e).splitlines()[0]}") from None

    root = fetch([SAFETENSORS, SIDECARS])
    path = root / sub if sub else root
    if not _has_safetensors(path):
        root = fetch([PICKLES, SIDECARS])
        path = root / sub if sub else root
    if not path.exists():
        raise CkptError(f"{spec}: the repository has no {sub!r}")
    return path


def config_from_hub(spec: str) -> Path:
    """The config.json of a hub model `owner/name[@rev][/subfolder]`, fetched alone (or from the cache)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    repo, rev, sub = parse_repo_spec(spec)
    offline = _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
    try:
        return Path(hf_hub_download(repo, "config.json", subfolder=sub.strip("/") if sub else None, revision=rev,
                                    cache_dir=_cache_dir(), local_files_only=offline))
    except (LocalEntryNotFoundError, EntryNotFoundError):
        raise CkptError(f"{spec}: no config.json in the local Hugging Face cache or on the hub") from None
    except HfHubHTTPError as e:
        raise CkptError(f"{spec}: hub error: {str(e).splitlines()[0]}") from None


def sidecars_from_hub(spec: str) -> Path:
    """A hub repository's non-weight files (configs, tokenizers, scheduler), fetched without weights."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, rev, sub = parse_repo_spec(spec)
    offline = _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
    try:
        root = Path(snapshot_download(repo, revision=rev, allow_patterns=list(SIDECARS), cache_dir=_cache_dir(),
                                      local_files_only=offline))
    except LocalEntryNotFoundError:
        raise CkptError(f"{spec}: not in the local Hugging Face cache nor reachable on the hub") from None
    except HfHubHTTPError as e:
        raise CkptError(f"{spec}: hub error: {str(e).splitlines()[0]}") from None
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
    step, refused at once when offline and never retried (huggingface_hub's listing retries a dead network
    for about 27 s): `model_info` lists the files, `parse_safetensors_file_metadata` reads each header."""
    from huggingface_hub import HfApi

    if _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE"):
        raise CkptError(f"{what} {spec}: not a local path, and not in the local Hugging Face cache "
                        "(HF_HUB_OFFLINE is set)")
    repo, rev, sub = parse_repo_spec(spec)
    sub = sub.strip("/") if sub else ""
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    try:
        info = api.model_info(repo, revision=rev, timeout=HUB_TIMEOUT)
        files = [s.rfilename for s in (info.siblings or []) if s.rfilename.endswith(".safetensors")
                 and (not sub or s.rfilename.startswith(sub + "/"))]
        by_sub: dict[str, dict[str, tuple]] = {}
        for f in files:
            meta = api.parse_safetensors_file_metadata(repo, f, revision=rev)
            folder = f.rsplit("/", 1)[0] if "/" in f else ""
            folder = folder[len(sub):].strip("/") if sub else folder
            by_sub.setdefault(folder, {}).update({n: tuple(i.shape) for n, i in meta.tensors.items()})
    except Exception as e:  # HTTP errors, no network, a bad repository: one line, no retries
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CkptError(f"{what} {spec}: not in the local Hugging Face cache, and the hub did not answer "
                        f"({first[:200]})") from None
    if not by_sub:
        raise CkptError(f"{what} {spec}: the repository has no safetensors files" + (f" under {sub}/" if sub else ""))
    return by_sub

