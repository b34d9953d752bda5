"""`--report FILE.json`: what a command did, as one JSON object for scripts (written on success and on a
one-line error alike).

The shape (`ckpt_report: 1`; keys are stable, absent facts are null or empty):

    {"ckpt_report": 1, "command": "merge-lora", "argv": [...], "status": "ok" | "dry-run" |
     "nothing-to-do" | "error", "exit_code": 0, "error": null | "the error line",
     "inputs": [...], "output": "path" | null,
     "notes": [...], "warnings": [...], "counts": {"overflow": {"tensor": n}, ...},
     ...command-specific keys}

Command-specific keys: merge-lora `summary` (the lines it prints), `matched` {lora: modules},
`changed` [base tensors], `unmatched` {lora: [every stored key that matched nothing]}; inspect `inspect`
(the `--json` object); lora extract/resize/merge `summary`.

The option is parsed before the command runs (a folder that does not exist is refused at once); the
command records its report and output with `record`; `_dispatch` in ckpt.cli writes the file when the
command ends, on success or CkptError.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import click

from ckpt.errors import CkptError

_STATE: dict = {}


def _remember(ctx: click.Context, param, value):
    if value:
        p = Path(value).expanduser()
        if not p.absolute().parent.is_dir():
            raise CkptError(f"--report {value}: folder {p.absolute().parent} does not exist")
        if p.is_dir():
            raise CkptError(f"--report {value}: is a folder (name a .json file)")
        _STATE.update(path=p, command=ctx.command_path.split(" ", 1)[-1])
    return value


REPORT = click.option("--report", "report_file", metavar="FILE.json", expose_value=False, callback=_remember,
                      is_eager=True, help="Also write what the command did (inputs, output, notes, warnings, "
                                          "counts, every unmatched key...) as one JSON object, also on errors.")


def reset(argv) -> None:
    _STATE.clear()
    _STATE["argv"] = list(argv) if argv is not None else None


def record(report=None, *, inputs=(), output=None, status: str | None = None, **facts) -> None:
    """Called by a command with what it did (the report object, its inputs and output, extra facts)."""
    if report is not None:
        _STATE["report"] = report
    if inputs:
        _STATE["inputs"] = [str(i) for i in inputs]
    if output is not None:
        _STATE["output"] = str(output)
    if status:
        _STATE["status"] = status
    _STATE.setdefault("facts", {}).update(facts)


def finish(exit_code: int, error: str | None = None, report=None) -> None:
    """Write the report file, if --report was given. A report that cannot be written is a CkptError."""
    path = _STATE.get("path")
    if path is None:
        return
    report = report if report is not None else _STATE.get("report")
    import sys

    argv = _STATE.get("argv")
    data = {
        "ckpt_report": 1,
        "command": _STATE.get("command"),
        "argv": argv if argv is not None else sys.argv[1:],
        "status": "error" if error is not None else _STATE.get("status", "ok"),
        "exit_code": exit_code,
        "error": error,
        "inputs": _STATE.get("inputs", []),
        "output": _STATE.get("output"),
        "notes": list(getattr(report, "notes", [])),
        "warnings": report.warnings() if report is not None else [],
        "counts": {k: dict(v) for k, v in getattr(report, "counts", {}).items()},
    }
    if report is not None and hasattr(report, "facts"):
        data.update(report.facts())
    data.update(_STATE.get("facts", {}))
    _STATE.pop("path")
    tmp = path.absolute().parent / f".{path.name}.ckpt-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False, default=str) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CkptError(f"--report {path}: cannot write ({e.strerror or e})") from None
