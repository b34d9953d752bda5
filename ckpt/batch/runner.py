"""Running one operation over every checkpoint of a folder: plan the jobs, run them, summarise.

Jobs run one at a time in this process (`--jobs 1`), in N long-lived worker processes
(`ckpt.batch.worker`, which import only the package this process runs, never one from the cwd), or as
Ray tasks (`--executor ray`, `ckpt.batch.ray_pool`); or they are only listed for another scheduler
(`--plan-only`) whose results `--collect` folds in (`ckpt.batch.joblist`). Each job goes through the
operation's Python API, whose writer is atomic: a failing or interrupted job leaves no partial output,
and every finished one is recorded in the manifest at once (by this process only), so Ctrl-C keeps all
finished work and a second run resumes.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.batch.discover import Found, discover, fingerprint, made_by_ckpt
from ckpt.batch.job_run import run_job
from ckpt.batch.manifest import HIDDEN_NAME, NAME, Manifest, ManifestRecord
from ckpt.batch.operations import Operation
from ckpt.batch.worker import command as worker_command
from ckpt.errors import CkptError
from ckpt.io.hub import local_path
from ckpt.io.output import check_container, check_name, short_path
from ckpt.io.publish import remove_stale_temps, temp_name


CLOCK_SLACK_NS = 2_000_000_000  # filesystems with coarse timestamps may date a file before its job began


class BatchFailed(CkptError):
    """Some jobs failed (the others finished): exit code 1, distinct from 2 = the command itself is wrong."""

    exit_code = 1


@dataclass
class BatchJob:
    item: Found
    output: Path | None
    size: int
    mtime_ns: int
    reason: str  # why it runs (or is skipped)
    overwrite: bool = False
    estimate: int | None = None


@dataclass
class Outcome:
    job: BatchJob
    status: str  # "ok" | "failed" | "skipped"
    error: str | None = None
    seconds: float = 0.0
    messages: list[str] = field(default_factory=list)
    row: dict | None = None
    output: str | None = None  # what was written (None: failed, or nothing to do)
    recognised: bool = False  # finished in a killed run, recognised now: recorded when this run starts


@dataclass
class BatchResult:
    operation: str
    outcomes: list[Outcome] = field(default_factory=list)
    todo: list[BatchJob] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    manifest: Path | None = None
    interrupted: bool = False
    dry_run: bool = False
    job_lines: list[dict] | None = None  # --plan-only: one per job (ckpt.batch.joblist.job_line)
    missing: list[BatchJob] | None = None  # --collect: jobs that have not reported a result yet

    def of(self, status: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == status]


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


# ---------------------------------------------------------------------------------------------- planning


def manifest_path(root: Path, outdir: Path | None) -> Path:
    if outdir is not None:
        return outdir / NAME
    return (root if root.is_dir() else root.parent) / HIDDEN_NAME


def _disambiguate(out: Path, item: Found) -> Path:
    """Two inputs that would share an output name (x.ckpt and x.safetensors): keep the input's
    extension in the later one's name."""
    tag = item.path.suffix.lstrip(".") or "dir"
    if out.suffix in (".safetensors", ".gguf"):
        return out.with_name(f"{out.stem}-{tag}{out.suffix}")
    return out.with_name(f"{out.name}-{tag}")


def _outputs(op: Operation, items: list[Found], outdir: Path | None) -> dict[Found, Path | None]:
    """Each input's output path. Where two inputs would share one (x.ckpt and x.safetensors both give
    x.safetensors), the non-safetensors ones keep their extension in the name, whatever the order."""
    if not op.writes:
        return {item: None for item in items}
    outs = {item: op.mirrored_output(item, outdir) if outdir is not None else op.default_output(item)
            for item in items}
    groups: dict[str, list[Found]] = {}
    for item, out in outs.items():
        groups.setdefault(str(out.resolve()), []).append(item)
    for group in groups.values():
        if len(group) > 1:
            keep = next((i for i in group if not i.is_folder and i.path.suffix == ".safetensors"), group[0])
            for item in group:
                if item is not keep:
                    outs[item] = _disambiguate(outs[item], item)
    # Disambiguated once; a name still shared (a.pt -> a-pt.safetensors beside an input a-pt.safetensors)
    # is refused before anything runs: one output can never silently hold another input's tensors.
    taken: dict[str, Found] = {}
    for item in sorted(outs, key=lambda i: i.rel):
        key = str(outs[item].resolve())
        if key in taken:
            raise CkptError(f"batch: {taken[key].rel} and {item.rel} would both write {outs[item]}; rename one "
                            "of them, or run them apart with --glob")
        taken[key] = item
    return outs


def unplaceable(out: Path | None, outdir: Path | None, folder: bool) -> str | None:
    """Why a job's output cannot be written where it is planned (one line), or None: it would lie outside
    OUTDIR (`outside`), its name is one no file can have (`ckpt.io.output.check_name`), or it is a `folder`
    named like a GGUF file (an input folder `m.gguf/`: `ckpt.io.output.check_container`)."""
    if out is None:
        return None
    why = outside(out, outdir) if outdir is not None else None
    if why is not None:
        return f"{short_path(out)}: {why}"
    try:
        check_name(out)
        if folder:
            check_container(out, "folder", label=short_path(out),
                            fix="rename the input folder (its output folder takes its name)")
        local_path(out)  # a folder on the way that cannot be entered: "permission denied", this entry alone
    except CkptError as e:
        return str(e)
    return None


def outside(out: Path, outdir: Path) -> str | None:
    """Why a mirrored output would not lie inside OUTDIR, or None. Every output of a batch with -o lies
    inside OUTDIR whatever the input tree's names: as spelled (no `..` taking it up, never OUTDIR itself)
    and once its folder is resolved (no symbolic link in OUTDIR's tree leading out of it)."""
    n = len(outdir.parts)
    tail = out.parts[n:] if out.parts[:n] == outdir.parts else None
    if tail is None or ".." in tail:
        return f"would lie outside -o {outdir} (`..` in its name); nothing written for it"
    if not tail:
        return f"would be -o {outdir} itself, not a path inside it; nothing written for it"
    root, parent = outdir.resolve(), out.parent.resolve()  # a link at OUT itself is replaced, never followed
    if parent != root and root not in parent.parents:
        return f"would lie outside -o {outdir} (a symbolic link leads out of it); nothing written for it"
    return None


def plan_jobs(op: Operation, root: Path, outdir: Path | None, pattern: str | None, overwrite: bool,
              manifest: Manifest | None) -> tuple[list[BatchJob], list[Outcome], list[tuple[str, str]]]:
    """(jobs to run, skipped and refused outcomes, ignored paths with why)."""
    disc = discover(root, exclude=[outdir] if outdir is not None else [], pattern=pattern,
                    skip_ckpt_outputs=op.writes)
    if pattern and not disc.matched:  # a mistyped pattern is a bad command line, not a batch with nothing to do
        shown = pattern if len(pattern) <= 80 else pattern[:80] + "..."
        raise CkptError(f"--glob {shown}: matches no checkpoint under {root}; nothing run, nothing written")
    ignored = list(disc.ignored)
    recorded = manifest.outputs() if manifest else set()
    inputs = {str(f.path.resolve()) for f in disc.found}
    jobs: list[BatchJob] = []
    # an input that is no file (a FIFO, a device): that job fails, in one line, before anything runs
    done: list[Outcome] = [Outcome(BatchJob(Found(path, rel, False), None, 0, 0, "refused"), "failed", why)
                           for path, rel, why in disc.refused]
    fixed = {str(p.resolve()) for p in op.excluded_inputs()}
    items = []
    for item in disc.found:
        key = str(item.path.resolve())
        if key in fixed:
            ignored.append((item.rel, f"the {op.name} input given on the command line"))
        elif key in recorded:
            ignored.append((item.rel, "an output recorded in the manifest"))
        else:
            items.append(item)
    outputs = _outputs(op, items, outdir)
    for item in items:
        key = str(item.path.resolve())
        size, mtime = fingerprint(item.path)
        out = outputs[item]
        job = BatchJob(item, out, size, mtime, "new", overwrite=overwrite)
        why = unplaceable(out, outdir, out is not None and op.output_is_folder(item))
        if why is not None:  # refused alone: the other jobs run
            done.append(Outcome(job, "failed", why))
            continue
        if out is not None and str(out.resolve()) in inputs:
            done.append(Outcome(job, "failed", f"{item.path}: its output {out} is another input; "
                                               "pass -o OUTDIR to write elsewhere"))
            continue
        rec = manifest.last(key, op.signature) if manifest else None
        if rec is not None:
            ours = out is not None and rec.output == str(out.resolve())
            same = rec.size == size and rec.mtime_ns == mtime
            if rec.status == "ok" and same and (rec.output is None or (ours and out.exists())):
                job.reason = "done in an earlier run"
                done.append(Outcome(job, "skipped"))
                continue
            if rec.status == "started" and same and ours and _finished_by(op, item, out, rec):
                job.reason = "done in an earlier run that was stopped before recording it"
                done.append(Outcome(job, "skipped", output=str(out.resolve()), recognised=True))
                continue
            if rec.status == "started":
                job.reason = "retry: interrupted in an earlier run"
                # an output at this path with ckpt's provenance for this operation is this job's own
                ours = ours and out.exists() and op.owns(made_by_ckpt(out), item)
            elif rec.status != "ok":
                job.reason = "retry: failed in an earlier run"
            elif not same:
                job.reason = "redo: the input changed since the earlier run"
            else:
                job.reason = "redo: the earlier output is gone"
            job.overwrite = overwrite or (ours and out.exists())
        if out is not None and job.reason == "new" and (out.exists() or out.is_symlink()):
            job.reason = f"new; {out} would be overwritten" if overwrite else f"new; {out} exists: needs --overwrite"
        jobs.append(job)
    return jobs, done, ignored


def _finished_by(op: Operation, item: Found, out: Path, rec: ManifestRecord) -> bool:
    """Whether OUT is what the job recorded as started finished writing before the run was killed: it
    carries ckpt's provenance for this operation and was written after the job started. (The record
    also names this input with its size and mtime, checked by the caller.)"""
    if not out.exists() or not op.owns(made_by_ckpt(out), item):
        return False
    _, newest = fingerprint(out)
    return rec.started_ns is not None and newest >= rec.started_ns - CLOCK_SLACK_NS


def check_memory(op: Operation, jobs: list[BatchJob], n: int) -> str | None:
    """With N parallel jobs the worst case is the N hungriest running together: refuse a peak above
    MemAvailable. Returns a note for the summary."""
    for j in jobs:
        j.estimate = op.estimate(j.item)
    worst = sorted((j.estimate for j in jobs), reverse=True)
    peak = sum(worst[:n])
    avail = mem_available()
    if avail is None:
        return f"estimated peak memory {gb(peak)} (available RAM unknown)"
    if peak > avail:
        fit = 0
        while fit < len(worst) and sum(worst[: fit + 1]) <= avail:
            fit += 1
        hint = f"use --jobs {fit}" if fit >= 1 else "even one job may not fit; close other programs"
        raise CkptError(f"--jobs {n}: estimated peak memory {gb(peak)} (the {min(n, len(worst))} largest jobs "
                        f"together) exceeds available RAM {gb(avail)}; {hint}")
    return f"estimated peak memory {gb(peak)} of {gb(avail)} available"


# ----------------------------------------------------------------------------------------------- running


SCRATCH_PREFIX = "ckpt-batch-"  # the workers' stderr files: TMPDIR/ckpt-batch-PID-XXXXXXXX/


def remove_stale_scratch() -> None:
    """Scratch folders of batches whose process is gone (killed: its `close()` never ran)."""
    base = Path(tempfile.gettempdir())
    try:
        entries = list(base.iterdir())
    except OSError:
        return
    for p in entries:
        m = re.fullmatch(rf"{SCRATCH_PREFIX}(\d+)-\w+", p.name)
        if m and p.is_dir() and not p.is_symlink() and not _alive(int(m[1])):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class _Workers:
    """Up to N long-lived worker processes (torch is imported once per worker, not once per job).

    Protocol: one JSON job per line on a worker's stdin, one JSON result per line on its stdout. A
    worker that dies mid-job (killed for memory, a crash) fails that job only; a new worker takes the
    next one.
    """

    def __init__(self, op: Operation, n: int):
        self.op, self.n = op, n
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
        self.idle: list[subprocess.Popen] = []
        self.busy: dict[subprocess.Popen, BatchJob] = {}
        self.errs: dict[subprocess.Popen, Path] = {}

    @property
    def running(self) -> bool:
        return bool(self.busy)

    def free(self) -> bool:
        return len(self.busy) < self.n

    def _spawn(self) -> subprocess.Popen:
        ef = self.tmp / f"worker-{len(self.errs)}.stderr"
        with open(ef, "wb") as err:
            p = subprocess.Popen(worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                 text=True, bufsize=1)
        self.errs[p] = ef
        return p

    def start(self, job: BatchJob) -> None:
        p = self.idle.pop() if self.idle else self._spawn()
        spec = job_spec(self.op, job)
        self.busy[p] = job
        try:
            p.stdin.write(json.dumps(spec) + "\n")
            p.stdin.flush()
        except OSError:
            pass  # it died already: wait_one reports the job as failed

    def wait_one(self) -> tuple[BatchJob, dict]:
        with selectors.DefaultSelector() as sel:
            for p in self.busy:
                sel.register(p.stdout, selectors.EVENT_READ, p)
            key, _ = sel.select()[0]
        p = key.data
        job = self.busy.pop(p)
        line = p.stdout.readline()
        try:
            res = json.loads(line)
            self.idle.append(p)
            return job, res
        except json.JSONDecodeError:
            return job, self._died(p)

    def _died(self, p: subprocess.Popen) -> dict:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        ef = self.errs[p]
        tail = ef.read_text(errors="replace").strip().splitlines()[-1:] if ef.exists() else []
        why = "killed (out of memory?)" if p.returncode == -signal.SIGKILL else f"exit code {p.returncode}"
        return {"status": "failed", "output": None, "seconds": 0.0, "messages": [], "row": None,
                "error": f"worker process died, {why}" + (f": {tail[0]}" if tail else "")}

    def stop_all(self) -> list:
        """Ctrl-C: each worker removes its temp output on SIGTERM (or on the SIGINT the terminal sent it);
        one that hangs is killed and its temp output (hidden, beside the output) removed here. A job that
        finished meanwhile is recognised by the next run (its "started" line): nothing to return."""
        procs = list(self.busy) + self.idle
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for job in self.busy.values():
            if job.output is not None:
                remove_stale_temps(job.output)
        self.busy.clear()
        self.idle.clear()
        return []

    def close(self) -> None:
        """Normal end: idle workers exit when their stdin closes."""
        for p in self.idle + list(self.busy):
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in self.idle + list(self.busy):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def job_spec(op: Operation, job: BatchJob, absolute: bool = False) -> dict:
    """What a worker, a Ray task or `ckpt batch run-job` runs (ckpt.batch.worker.run_spec). `absolute`:
    for a process with another current folder (another node)."""
    src, out = job.item.path, job.output
    if absolute:  # not resolve(): a symlinked input (the HF cache's) keeps its name and suffix
        src, out = Path(os.path.abspath(src)), Path(os.path.abspath(out)) if out is not None else None
    return {"op": op.name, "params": op.params, "src": str(src), "out": str(out) if out is not None else None,
            "overwrite": job.overwrite}


EXECUTORS = ("local", "ray")


def run_batch(op: Operation, folder: str | Path, outdir: str | Path | None = None, **kw) -> BatchResult:
    """Plan and run (`plan_and_run`). Every failure outside the jobs is one CkptError line, also for a Python
    caller, whom no CLI callback checked the paths for: an OSError the checks did not foresee (a folder that
    cannot be entered or listed, a scratch folder that cannot be made) names its path and the problem."""
    try:
        return plan_and_run(op, folder, outdir, **kw)
    except OSError as e:
        where = e.filename if e.filename is not None else folder
        why = "permission denied" if isinstance(e, PermissionError) else (e.strerror or str(e))
        raise CkptError(f"{short_path(Path(os.fsdecode(where)))}: {why}") from None


def plan_and_run(op: Operation, folder: str | Path, outdir: str | Path | None = None, *, pattern: str | None = None,
                 jobs: int | None = None, dry_run: bool = False, overwrite: bool = False, quiet: bool = False,
                 log=None, executor: str = "local", ray_address: str | None = None, plan_only: bool = False,
                 collect: bool = False) -> BatchResult:
    """Plan and run; `log(line)` hears each finished job. Raises CkptError for a bad command line
    (nothing run); job failures are in the result. `jobs`: worker processes (local, default 1), or at
    most that many Ray tasks at once (default: as many as the cluster holds). `plan_only`: record the
    jobs as started and return them as `job_lines`; `collect`: fold in the results they reported.

    The steps, in this order because each may refuse before the next writes anything: check the command
    line, plan the jobs (and the memory), connect to Ray, open the manifest, then list/collect or run."""
    check_options(op, jobs, executor, ray_address, plan_only, collect, dry_run)
    root, out_root = check_folders(folder, outdir)
    manifest = Manifest(manifest_path(root, out_root)) if op.writes else None
    todo, done, ignored = plan_jobs(op, root, out_root, pattern, overwrite, manifest)
    if collect:
        from ckpt.batch.joblist import reported_first, results_dir

        todo, done = reported_first(results_dir(manifest.path), op, todo, done)
    result = BatchResult(op.title, list(done), todo, ignored, manifest.path if manifest else None, dry_run=dry_run)
    log = log or (lambda line: None)
    if executor == "local" and (jobs or 1) > 1 and len(todo) > 1:
        log(check_memory(op, todo, jobs))
    if dry_run:
        return result
    pool = None
    if executor == "ray" and todo:  # connected before anything is recorded: an unreachable cluster writes nothing
        from ckpt.batch.ray_pool import RayPool

        pool = RayPool(op, todo, ray_address, jobs, lambda job: job_spec(op, job, absolute=True), log)
    if manifest is not None and (todo or plan_only or collect or any(o.recognised for o in done)):
        open_manifest(op, manifest, out_root, done, pool)
    elif manifest is not None and not manifest.path.exists():  # nothing to run or record: nothing written
        result.manifest = None
    if plan_only or collect:
        try:
            return _list_or_collect(op, result, manifest, plan_only, quiet)
        finally:
            manifest.close()
    run_jobs(op, result, manifest, pool, jobs, quiet)
    return result


def check_options(op: Operation, jobs: int | None, executor: str, ray_address: str | None, plan_only: bool,
                  collect: bool, dry_run: bool) -> None:
    """Refuse a command line whose options contradict each other, or an executor or operation this
    installation cannot run, before any file is looked at."""
    if jobs is not None and jobs < 1:
        raise CkptError(f"--jobs {jobs}: must be at least 1")
    if executor not in EXECUTORS:
        raise CkptError(f"--executor {executor}: choose {' or '.join(EXECUTORS)}")
    if ray_address is not None and executor != "ray":
        raise CkptError("--ray-address: only with --executor ray")
    if plan_only and collect:
        raise CkptError("--plan-only lists the jobs, --collect gathers their results: give one of them")
    if (plan_only or collect) and (executor != "local" or dry_run):
        raise CkptError(f"--{'plan-only' if plan_only else 'collect'}: the jobs run elsewhere; "
                        "not with --executor ray or --dry-run")
    if (plan_only or collect) and not op.writes:
        raise CkptError(f"batch {op.name}: --plan-only and --collect are for operations that write outputs "
                        f"(nothing to collect: run `ckpt batch {op.name}` where the files are)")
    if executor == "ray":
        from ckpt.batch.ray_pool import require

        require()
    op.check_available()


def check_folders(folder: str | Path, outdir: str | Path | None) -> tuple[Path, Path | None]:
    """(FOLDER, OUTDIR) as paths: FOLDER exists and can be read; OUTDIR, when given, can be looked at, neither
    contains FOLDER nor is a file. The checks the CLI's callbacks make (`ckpt.cli.options`), made again for a
    Python caller: a folder on the way that cannot be entered is "permission denied" in one line."""
    from ckpt.io.hub import local_input, local_path

    root = Path(folder).expanduser()
    if local_input(root) is None:
        raise CkptError(f"{root}: no such file or directory")
    out_root = Path(outdir).expanduser() if outdir is not None else None
    if out_root is not None:
        local_path(out_root, "-o ")
        r, o = root.resolve(), out_root.resolve()
        if r == o or o in r.parents:
            raise CkptError(f"-o {out_root}: contains the input folder {root}; choose an output folder outside it")
        if out_root.exists() and not out_root.is_dir():
            raise CkptError(f"-o {out_root}: exists and is not a folder")
    return root, out_root


def open_manifest(op: Operation, manifest: Manifest, out_root: Path | None, done: list[Outcome], pool) -> None:
    """Open the manifest for appending (creating OUTDIR) and record the jobs a killed run finished; a
    manifest that cannot be written refuses the run, closing the Ray pool already connected."""
    try:
        if out_root is not None:
            out_root.mkdir(parents=True, exist_ok=True)
        manifest.open_for_append()
    except OSError as e:
        where = "choose another -o" if out_root is not None else \
            "pass -o OUTDIR to write the outputs and the manifest there"
        if pool is not None:
            pool.close()
        raise CkptError(f"{manifest.path}: cannot write the batch manifest ({e.strerror or e}); {where}") from None
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    for o in done:  # finished in a killed run: recorded now, so the next run needs no second look
        if o.recognised:
            manifest.append(ManifestRecord(str(o.job.item.path.resolve()), o.job.size, o.job.mtime_ns, op.signature,
                                   o.output, "ok"))


def run_jobs(op: Operation, result: BatchResult, manifest: Manifest | None, pool, jobs: int | None,
             quiet: bool) -> None:
    """Run `result.todo` on `pool` (Ray), on `jobs` worker processes, or in this process; one
    progress bar over their bytes; Ctrl-C stops the pool, keeps what finished and marks the result
    interrupted. Closes the pool and the manifest."""
    from tqdm import tqdm

    todo, done = result.todo, len(result.outcomes)
    remove_stale_scratch()
    for job in [*todo, *(o.job for o in result.outcomes if o.status != "failed")]:  # failed: refused as planned
        if job.output is not None:
            remove_stale_temps(job.output)
    bar = tqdm(total=sum(j.size for j in todo), desc=f"batch {op.name}", unit="B", unit_scale=True,
               unit_divisor=1024, file=sys.stderr, disable=quiet or None, leave=False, dynamic_ncols=True)
    finish, started = _recorders(op, result, manifest, bar, quiet)

    if pool is None and (jobs or 1) > 1 and len(todo) > 1:
        pool = _Workers(op, jobs)
    queue = list(todo)
    try:
        if pool is None:
            for job in queue:
                bar.set_postfix_str(f"{len(result.outcomes) - done}/{len(todo)} jobs, {job.item.rel}",
                                    refresh=True)
                started(job)
                finish(job, run_job(op, job.item.path, job.output, job.overwrite))
        else:
            while queue or pool.running:
                while queue and pool.free():
                    job = queue.pop(0)
                    started(job)
                    pool.start(job)
                job, res = pool.wait_one()
                finish(job, res)
                bar.set_postfix_str(f"{len(result.outcomes) - done}/{len(todo)} jobs", refresh=False)
    except KeyboardInterrupt:
        result.interrupted = True
        if pool is not None:
            for job, res in pool.stop_all():  # finished while the others were being stopped
                finish(job, res)
    finally:
        bar.close()
        if pool is not None:
            pool.close()
        if manifest is not None:
            manifest.close()


def _recorders(op: Operation, result: BatchResult, manifest: Manifest | None, bar, quiet: bool):
    """finish(job, res): one job's result into the outcomes, the manifest and the log lines; started(job):
    its "started" line. Shared by every executor and by --collect, so their manifests are the same."""

    def finish(job: BatchJob, res: dict) -> None:
        written = str(Path(res["output"]).resolve()) if res.get("output") else None
        oc = Outcome(job, res["status"], res.get("error"), res.get("seconds", 0.0), res.get("messages", []),
                     res.get("row"), written)
        result.outcomes.append(oc)
        if manifest is not None:
            manifest.append(ManifestRecord(str(job.item.path.resolve()), job.size, job.mtime_ns, op.signature,
                                   written, oc.status, oc.error, round(oc.seconds, 3)))
        if bar is None:  # --collect: the summary lists every job
            return
        bar.update(job.size)
        line = (f"ok      {job.item.rel}" + (f" -> {res['output']}" if res.get("output") else "")
                + f" ({oc.seconds:.1f} s)") if oc.status == "ok" else f"FAILED  {job.item.rel}: {oc.error}"
        bar.write(line, file=sys.stderr) if not quiet or oc.status != "ok" else None
        if not quiet:
            for m in oc.messages:
                bar.write(f"        {m}", file=sys.stderr)

    def started(job: BatchJob) -> None:
        """Recorded before the job runs: if this process is killed after the job's output is published
        but before its result is recorded, the next run recognises that output as this job's."""
        if manifest is not None and job.output is not None:
            manifest.append(ManifestRecord(str(job.item.path.resolve()), job.size, job.mtime_ns, op.signature,
                                   str(job.output.resolve()), "started", started_ns=time.time_ns()))

    return finish, started


def _list_or_collect(op: Operation, result: BatchResult, manifest: Manifest, plan_only: bool,
                     quiet: bool) -> BatchResult:
    """--plan-only: each job recorded as started and listed; --collect: each reported result recorded."""
    from ckpt.batch import joblist

    folder = joblist.results_dir(manifest.path)
    finish, started = _recorders(op, result, manifest, None, quiet)
    if plan_only:
        result.job_lines = []
        for job in result.todo:
            job.estimate = op.estimate(job.item)
            started(job)
            result.job_lines.append(joblist.job_line(job_spec(op, job, absolute=True), job, op, folder))
        return result
    result.missing = []
    for o in result.outcomes:  # done (now or earlier): a result file left behind is no longer needed
        joblist.drop_result(folder, o.job, op)
    for job in result.todo:
        res = joblist.take_result(folder, job, op)
        if res is None:
            result.missing.append(job)
            continue
        finish(job, res)
        joblist.drop_result(folder, job, op)
    return result


# ----------------------------------------------------------------------------------------------- summary


def _ok_detail(o: Outcome) -> str:
    if o.row:
        r = o.row
        family = r.get("family") or "unknown family"
        return f" ({r.get('model_kind')}, {family}, {r.get('encodings')}, {r.get('dtypes')})"
    if o.output:
        return f" -> {o.job.output}"
    return " (nothing to do; nothing written)" if o.job.output else ""


def summary_lines(result: BatchResult, quiet: bool = False) -> list[str]:
    ok, skipped, failed = result.of("ok"), result.of("skipped"), result.of("failed")
    lines = []
    if result.dry_run:
        lines.append(f"batch {result.operation}: dry run, {len(result.todo)} to run, {len(skipped)} done earlier, "
                     f"{len(failed)} refused")
        for j in result.todo:
            dst = f" -> {j.output}" if j.output else ""
            lines.append(f"  would run  {j.item.rel}{dst} ({j.reason})")
        for o in skipped:
            lines.append(f"  skip       {o.job.item.rel} ({o.job.reason})")
    else:
        head = f"batch {result.operation}: {len(ok)} ok, {len(skipped)} skipped, {len(failed)} failed"
        if result.interrupted:
            ran = {id(o.job) for o in result.outcomes}
            head += f", {sum(id(j) not in ran for j in result.todo)} not run (interrupted)"
        if result.missing is not None:
            head += f", {len(result.missing)} not reported yet"
        lines.append(head)
        if not quiet:
            for o in ok:
                lines.append(f"  ok       {o.job.item.rel}" + _ok_detail(o))
            for o in skipped:
                lines.append(f"  skipped  {o.job.item.rel} ({o.job.reason})")
    for o in failed:
        lines.append(f"  failed   {o.job.item.rel}: {o.error}")
    for j in result.missing or []:
        lines.append(f"  missing  {j.item.rel} (no result from its job yet)")
    if not quiet:
        for rel, why in result.ignored:
            lines.append(f"  ignored  {rel} ({why})")
    if result.manifest is not None and not result.dry_run:
        lines.append(f"manifest: {result.manifest}")
    return lines


def write_csv(result: BatchResult, path: Path, columns) -> None:
    """The inspect rows as CSV, written to a temp file and renamed (no partial CSV)."""
    import csv

    path = Path(path)
    remove_stale_temps(path)
    tmp = path.with_name(temp_name(path.name))
    try:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
            w.writeheader()
            for o in sorted(result.outcomes, key=lambda o: o.job.item.rel):
                w.writerow({**(o.row or {}), "input": o.job.item.rel, "status": o.status, "error": o.error or ""})
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CkptError(f"{path}: cannot write the CSV ({e.strerror or e})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
