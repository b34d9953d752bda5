"""A batch worker process: `python -m ckpt.batch.worker`, started by `ckpt.batch.runner`.

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


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGTERM, _sigterm)
    answer = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        from ckpt.batch.operations import make_operation
        from ckpt.batch.runner import run_job

        for line in sys.stdin:
            spec = json.loads(line)
            op = make_operation(spec["op"], spec["params"])
            res = run_job(op, Path(spec["src"]), Path(spec["out"]) if spec["out"] else None, spec["overwrite"])
            answer.write(json.dumps(res) + "\n")
            answer.flush()
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
