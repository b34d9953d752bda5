"""One batch job run through its operation's API, as every executor runs it: in the batch's own process
(`ckpt.batch.runner`), in a worker process (`ckpt.batch.worker`), as a Ray task (`ckpt.batch.ray_pool`) and as
`ckpt batch run-job`. A failure is the job's result, never an exception: the other checkpoints go on."""

from __future__ import annotations

import time
from pathlib import Path

from ckpt.batch.operations import Operation
from ckpt.errors import CkptError


def one_line(e: BaseException) -> str:
    """The error line a failed job records: a CkptError's own first line, anything else as an internal error."""
    if isinstance(e, CkptError):
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return f"internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def run_job(op: Operation, src: Path, out: Path | None, overwrite: bool) -> dict:
    """One job through the operation's API; never raises except KeyboardInterrupt."""
    t0 = time.monotonic()
    try:  # the writer creates OUT's missing parent folders, and removes them if the job fails
        path, report, row = op.run(src, out, overwrite)
        msgs = [f"note: {n}" if not n.startswith("warning:") else n for n in report.notes] + report.warnings()
        return {"status": "ok", "output": str(path) if path else None, "error": None,
                "seconds": time.monotonic() - t0, "messages": msgs, "row": row}
    except Exception as e:  # isolate the failure: the other checkpoints go on
        return {"status": "failed", "output": None, "error": one_line(e), "seconds": time.monotonic() - t0,
                "messages": [], "row": None}
