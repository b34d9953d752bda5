"""Hugging Face Hub sources: `owner/name[@revision][/subfolder]`, through huggingface_hub's cache.

Only weight, index and small sidecar files are fetched (allow_patterns); with HF_HUB_OFFLINE=1 or no
network, the cache alone answers.
"""

from __future__ import annotations

import re
from pathlib import Path

from ckpt.errors import CkptError

REPO = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w.\-]+))?(?:/(?P<sub>.+))?$")


def looks_like_repo_id(spec: str) -> bool:
    return bool(REPO.match(spec)) and not spec.startswith((".", "/", "~"))


def parse_repo_spec(spec: str) -> tuple[str, str | None, str | None]:
    m = REPO.match(spec)
    if not m:
        raise CkptError(f"{spec}: not a hub id (expected owner/name[@revision][/subfolder])")
    return m["repo"], m["rev"], m["sub"]


def resolve_repo(spec: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, rev, sub = parse_repo_spec(spec)
    prefix = f"{sub.strip('/')}/" if sub else ""
    patterns = [f"{prefix}{p}" for p in ("*.safetensors", "*.json", "*.txt", "*.model", "*.yaml",
                                         "**/*.safetensors", "**/*.json", "**/*.txt", "**/*.model")]
    try:
        root = Path(snapshot_download(repo, revision=rev, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise CkptError(f"{spec}: not in the local Hugging Face cache and the hub cannot be reached") from None
    except HfHubHTTPError as e:
        raise CkptError(f"{spec}: hub error: {str(e).splitlines()[0]}") from None
    path = root / sub if sub else root
    if not path.exists():
        raise CkptError(f"{spec}: the repository has no {sub!r}")
    return path
