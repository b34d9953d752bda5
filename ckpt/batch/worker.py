"""A batch worker process, started by `ckpt.batch.runner` with `command()`.

Reads one JSON job per line on stdin, runs it through the operation's API, answers one JSON result per
line on the original stdout (anything else printing to stdout is sent to stderr, so the protocol stays
clean). SIGTERM (the parent stopping on Ctrl-C) becomes KeyboardInterrupt, so the operation's atomic
writer removes its temp output before the process exits; no result is written for that job.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


# Started as `python [-P] -c BOOT /path/to/ckpt/__init__.py`: the package is loaded from the file the
# parent itself runs, and nothing from the current folder. (`python -m ckpt.batch.worker` would put the
# current folder first on sys.path: a `./ckpt/` there, a common name for a checkpoint folder, would be
# imported instead, and a planted `ckpt/batch/worker.py` would run.)
BOOT = """
import importlib.util, os, sys
if sys.path and sys.path[0] in ("", ".") and not getattr(sys.flags, "safe_path", False):
    del sys.path[0]  # `-c` puts the current folder first (Python 3.10 has no -P)
init = sys.argv[1]
spec = importlib.util.spec_from_file_location("ckpt", init, submodule_search_locations=[os.path.dirname(init)])
module = importlib.util.module_from_spec(spec)
sys.modules["ckpt"] = module
spec.loader.exec_module(module)
from ckpt.batch.worker import main
sys.exit(main())
"""


def command() -> list[str]:
    """The command line that starts a worker running this very ckpt package."""
    import ckpt

    safe = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe, "-c", BOOT, str(Path(ckpt.__file__).resolve())]


def run_spec(spec: dict) -> dict:
    """One job from its JSON spec ({op, params, src, out, overwrite}): what every executor runs, a local
    worker process, a Ray task (`ckpt.batch.ray_pool`) and `ckpt batch run-job` (`ckpt.batch.joblist`)."""
    from ckpt.batch.operations import make_operation
    from ckpt.batch.job_run import run_job

    op = make_operation(spec["op"], spec["params"])
    return run_job(op, Path(spec["src"]), Path(spec["out"]) if spec["out"] else None, spec["overwrite"])


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGTERM, _sigterm)
    answer = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        for line in sys.stdin:
            res = run_spec(json.loads(line))
            answer.write(json.dumps(res) + "\n")
            answer.flush()
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
