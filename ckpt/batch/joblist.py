"""The job list: `ckpt batch ... --plan-only [--json]` for other schedulers, `run-job`, `--collect`.

A scheduler that ckpt does not drive (Slurm array jobs, Kubernetes Jobs, GNU parallel) runs one printed
argv per job: `ckpt batch run-job SPEC`, where SPEC is the very job spec a local worker process reads
(`ckpt.batch.worker.run_spec`). How a job run elsewhere reports back: it writes its result, the same
dict a local worker answers, to one JSON file per job in `.ckpt-batch-results/` beside the manifest
(temp file + rename in that folder, so a result is whole or absent), together with the fingerprint of
the input it read. `--collect` plans again, folds each result whose fingerprint still matches the
input into the manifest exactly as the local runner would have (then deletes the file), and lists the
jobs that have not reported yet. The driver alone writes the manifest: `--plan-only` records each
listed job as started, so that an output published by a job killed before it wrote its result is
recognised by `--collect` through its provenance (the local runner's own rule after a SIGKILL).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from pathlib import Path

from ckpt.batch.discover import fingerprint
from ckpt.errors import CkptError
from ckpt.io.publish import remove_stale_temps, temp_name
from ckpt.io.side_files import check_side_file, head

RESULTS = ".ckpt-batch-results"  # beside the manifest; hidden, so never an input


def results_dir(manifest_path: Path) -> Path:
    return Path(manifest_path).parent / RESULTS


def result_path(folder: Path, input_key: str, operation: str) -> Path:
    """One file per (input, operation): the manifest's own key."""
    digest = hashlib.sha256(f"{input_key}\0{operation}".encode()).hexdigest()[:24]
    return folder / f"{digest}.json"


def job_line(spec: dict, job, op, folder: Path) -> dict:
    """The printed object: argv for `ckpt`, input, output, estimated memory (bytes), device."""
    key = str(job.item.path.resolve())
    full = {**spec, "report": {"path": str(result_path(folder, key, op.signature)), "input": key,
                               "operation": op.signature}}
    return {"argv": ["ckpt", "batch", "run-job", json.dumps(full, sort_keys=True)], "input": spec["src"],
            "output": spec["out"], "memory": job.estimate, "device": op.params.get("device") or "cpu"}


def render(line: dict, as_json: bool) -> str:
    return json.dumps(line, sort_keys=True) if as_json else shlex.join(line["argv"])


# ------------------------------------------------------------------------------------ the job, run elsewhere


def spec_from_list(path: Path, index: int) -> dict:
    """The spec of line INDEX (0-based: Slurm's --array=0-N) of a `--plan-only --json` list."""
    try:
        lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise CkptError(f"--list {path}: cannot read the job list ({getattr(e, 'strerror', None) or e})") from None
    if not 0 <= index < len(lines):
        raise CkptError(f"--index {index}: the job list {path} has {len(lines)} jobs (0 to {len(lines) - 1})")
    try:
        argv = json.loads(lines[index])["argv"]
        return parse_spec(argv[argv.index("run-job") + 1])
    except (json.JSONDecodeError, KeyError, ValueError, IndexError, TypeError):
        raise CkptError(f"--list {path}: line {index + 1} is not a job of `ckpt batch ... --plan-only --json`") \
            from None


def parse_spec(text: str) -> dict:
    try:
        spec = json.loads(text)
        if not isinstance(spec, dict) or not {"op", "params", "src", "out", "overwrite"} <= set(spec):
            raise ValueError
    except (json.JSONDecodeError, ValueError):
        raise CkptError("run-job: SPEC is not a job of `ckpt batch ... --plan-only` (a JSON object)") from None
    return spec


def run_spec_reporting(spec: dict) -> dict:
    """Run one job as a local worker would, and write its result for `--collect`."""
    from ckpt.batch.operations import make_operation
    from ckpt.batch.worker import run_spec

    make_operation(spec["op"], spec["params"]).check_available()
    src = Path(spec["src"])
    if not src.exists():
        raise CkptError(f"{src}: no such file or directory")
    size, mtime = fingerprint(src)  # what this run reads; --collect checks the input is still that
    if spec.get("out"):
        remove_stale_temps(Path(spec["out"]))
    report = spec.get("report")
    if report is not None:
        if not (isinstance(report, dict) and all(isinstance(report.get(k), str) for k in ("path", "input", "operation"))):
            raise CkptError("run-job: SPEC's report is not the one `ckpt batch ... --plan-only` writes")
        check_result_path(Path(report["path"]))
    res = run_spec(spec)
    if report:
        write_result(Path(report["path"]), {"input": report["input"], "operation": report["operation"],
                                            "size": size, "mtime_ns": mtime, "output": spec["out"],
                                            "result": res})
    return res


def check_result_path(path: Path) -> None:
    """The result file a spec names is replaced in place, so before the job runs it must be what
    `--plan-only` names (a `.json` file in a `.ckpt-batch-results` folder) and, if it exists, a regular
    file holding a job result (ckpt.io.side_files): a hand-edited spec cannot make run-job replace any
    other file."""
    label = f"run-job: result file {path}"
    if path.parent.name != RESULTS or path.suffix != ".json":
        raise CkptError(f"{label}: not a file of a {RESULTS} folder; run-job writes its result only there")
    check_side_file(path, label, "ckpt batch job result", _is_result, check_folder=False)


def _is_result(path: Path) -> bool:
    return head(path, 16).startswith(b'{"input": ')  # json.dump(sort_keys=True) of write_result's keys


def write_result(path: Path, data: dict) -> None:
    """Whole or absent: a temp file in the same folder, then one rename."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(temp_name(path.name))
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        raise CkptError(f"{path}: cannot write the job's result ({e.strerror or e}); its output, if any, is "
                        "kept and `--collect` recognises it") from None


# --------------------------------------------------------------------------------------------- collect


def take_result(folder: Path, job, op) -> dict | None:
    """The result a job reported, if it is this job's for the input as it is now; a stale one (the input
    changed since) is deleted and the job counts as not run."""
    key = str(job.item.path.resolve())
    path = result_path(folder, key, op.signature)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        print(f"warning: {path}: unreadable job result, ignored", file=sys.stderr)
        return None
    if (data.get("input"), data.get("operation"), data.get("size"), data.get("mtime_ns")) != \
            (key, op.signature, job.size, job.mtime_ns) or not isinstance(data.get("result"), dict):
        path.unlink(missing_ok=True)
        return None
    return data["result"]


def reported_first(folder: Path, op, todo: list, done: list) -> tuple[list, list]:
    """A job whose output the plan recognised (recorded as started, output with ckpt's provenance) but
    that also reported a result: the result is what it says (seconds, notes), so the job is collected
    from it rather than skipped."""
    back = [o for o in done if o.recognised and
            result_path(folder, str(o.job.item.path.resolve()), op.signature).exists()]
    for o in back:
        o.job.reason = "reported"
    jobs = sorted([*todo, *(o.job for o in back)], key=lambda j: j.item.rel)
    return jobs, [o for o in done if o not in back]


def drop_result(folder: Path, job, op) -> None:
    result_path(folder, str(job.item.path.resolve()), op.signature).unlink(missing_ok=True)
