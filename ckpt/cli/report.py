"""`--report FILE.json`: what a command did, as one JSON object for scripts (written on success and on a
one-line error alike).

The shape (`ckpt_report: 1`; keys are stable, absent facts are null or empty):

    {"ckpt_report": 1, "command": "merge-lora", "argv": [...], "status": "ok" | "dry-run" |
     "nothing-to-do" | "error", "exit_code": 0, "error": null | "the error line",
     "inputs": [...], "output": "path" | null,
     "notes": [...], "warnings": [...], "counts": {"overflow": {"tensor": n}, ...},
     "byte_copied": {"tensors": n, "bytes": n} (copied by the kernel, unread: ckpt.io.byte_copy),
     ...command-specific keys}

Command-specific keys: merge-lora `summary` (the lines it prints), `matched` {lora: modules},
`changed` [base tensors], `unmatched` {lora: [every stored key that matched nothing]}, `zero_delta`
{lora: [modules of rank 0 or an all-zero factor]}; inspect `inspect`
(the `--json` object); lora extract/resize/merge `summary`.

The path is checked while the command line is parsed, before any work (ckpt.io.side_files: new or a
previous ckpt report, a regular file, a writable folder; never an input, never the output or inside an
output folder); the command records its report and output with `record`; `_dispatch` in ckpt.cli writes
the file when the command ends, on success or CkptError. A report that cannot be written after the
command succeeded is exit code 3 (ReportNotWritten), never 2: the output stays, and the message says so.
"""

from __future__ import annotations

import functools
import json
import os
import re
import uuid
from pathlib import Path

import click

from ckpt.errors import CkptError, ReportNotWritten
from ckpt.io.publish import OTHER_WRITES
from ckpt.io.side_files import check_side_file, check_not_input, head

_STATE: dict = {}


_REPORT_HEAD = re.compile(rb'\s*\{\s*"ckpt_report"\s*:\s*1\b')


def is_report(path: Path) -> bool:
    """A file ckpt wrote as a report: its JSON starts with `{"ckpt_report": 1` (the first key, always)."""
    return bool(_REPORT_HEAD.match(head(path)))


def _check(path: Path, label: str) -> None:
    """The side-file rules (ckpt.io.side_files): new, or a previous ckpt report; a writable folder."""
    check_side_file(path, label, "ckpt report", is_report)


def _remember(ctx: click.Context, param, value):
    if value:
        p = Path(value).expanduser()
        label = f"--report {value}"
        _check(p, label)
        _STATE.update(path=p, label=label, command=ctx.command_path.split(" ", 1)[-1])
        OTHER_WRITES[p.absolute()] = "the --report file"
    return value


def _check_arguments(kwargs: dict) -> None:
    """Before the command runs: the report is none of the paths it was given (an input, --config,
    --base, ...; nor inside an input folder) and not `-o` itself (inside an output folder is refused by
    `ckpt.io.output.check_target`, once the output path is known)."""
    path = _STATE.get("path")
    if path is None:
        return
    label = _STATE["label"]
    out = kwargs.get("out")
    given = []
    for name, value in kwargs.items():
        if name == "out":
            continue
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, str) and v:
                given.append(v)
    try:
        if out and Path(out).expanduser().absolute().resolve() == path.absolute().resolve():
            raise CkptError(f"{label}: is the output (-o {out}); name another file for the report")
        check_not_input(path, label, given)
    except CkptError:
        OTHER_WRITES.pop(path.absolute(), None)  # a refused report path is not written, not even the error
        raise


def REPORT(f):
    """The `--report FILE.json` option; the command's own paths are checked against it before it runs."""

    @functools.wraps(f)
    def checked(*args, **kwargs):
        _check_arguments(kwargs)
        return f(*args, **kwargs)

    return click.option("--report", "report_file", metavar="FILE.json", expose_value=False, callback=_remember,
                        is_eager=True,
                        help="Also write what the command did (inputs, output, notes, warnings, counts, every "
                             "unmatched key...) as one JSON object, also on errors. FILE is new or a previous "
                             "ckpt report; never an input, the output, or a file ckpt did not write.")(checked)


def reset(argv) -> None:
    path = _STATE.get("path")
    if path is not None:
        OTHER_WRITES.pop(path.absolute(), None)
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
    """Write the report file, if --report was given. A report that cannot be written is a
    ReportNotWritten (exit 3: the command's own work stands; see docs/commands.md "The report file")."""
    path = _STATE.get("path")
    if path is None or OTHER_WRITES.pop(path.absolute(), None) is None:  # none, or the path was refused
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
        "byte_copied": dict(getattr(report, "byte_copied", None) or {"tensors": 0, "bytes": 0}),
    }
    if report is not None and hasattr(report, "facts"):
        data.update(report.facts())
    data.update(_STATE.get("facts", {}))
    _STATE.pop("path")
    label = _STATE.get("label", f"--report {path}")
    done = "" if error is not None else "; the command itself succeeded" + (
        f" and wrote {data['output']}" if data["output"] and data["status"] == "ok" else "")
    tmp = path.absolute().parent / f".{path.name}.ckpt-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _check(path, label)  # again: something may have appeared at the path while the command ran
    except CkptError as e:
        raise ReportNotWritten(f"{e}{done}") from None
    try:
        tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False, default=str) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ReportNotWritten(f"{label}: cannot write it ({e.strerror or e}){done}") from None


def print_report(report, quiet: bool) -> None:
    """A command's notes (unless --quiet) and warnings, on stderr: what every command says besides its result."""
    if not quiet:
        for n in report.notes:
            click.echo(f"note: {n}", err=True)
    for w in report.warnings():
        click.echo(w, err=True)
