"""`ckpt convert --executor ray`: one model's tensors encoded and written by the workers of a Ray cluster.

The driver plans the output as a local run does, creates every temp output file at its full size with its header
(`ckpt.io.output.execute(shares=...)`), then hands out shares: lists of output tensor names of about equal bytes
(`ckpt.io.shares.split_shares`), a few per CPU of the cluster so that a slow node takes fewer. Each share is one
Ray task (`run_share`): it opens the same input (a shared filesystem, as `ckpt batch --executor ray` assumes),
plans again from the same options, checks the plan's fingerprint against the driver's and writes its tensors at
their planned offsets (`ckpt.io.shares.write_share`). The driver publishes the set (`ckpt.io.publish`) only once
every share has reported success, so the bytes are those of a local run.

Failures: a share whose worker process or node dies is run again by Ray (`MAX_RETRIES`; a share is idempotent:
the same bytes at the same offsets); a share that fails for any other reason (bad input data, another plan on the
worker) fails the run in one line. Ctrl-C, a share that fails for good and a lost cluster all cancel the other
shares and leave nothing published: the driver owns the temp files and removes them (`ckpt.io.publish.Staging`).

Connection, its timeouts and the one-line refusals are `ckpt batch --executor ray`'s (`ckpt.batch.ray_pool`).
It lives beside it, in the package that composes commands: the task body runs `ckpt.convert`'s planning, and
`ckpt.convert` itself never imports Ray or batch (the CLI hands `RayShares` to `ckpt.convert.convert(shares=)`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

from ckpt.batch.ray_pool import KILL_TIMEOUT_S, POLL_S, STOP_TIMEOUT_S, RayPool, task_error
from ckpt.errors import CkptError

MAX_RETRIES = 3  # times a share whose worker or node died is run again
SHARES_PER_CPU = 2  # more, smaller shares than CPUs: a slower node ends up with fewer
ERROR_CHARS = 200  # a share's error, cut to this in the driver's one line


def _absolute(value):
    """A path option as every node sees it (workers run in another folder); a hub id stays as it is."""
    if value is None:
        return None
    p = Path(value).expanduser()
    return str(p.absolute()) if p.exists() else value


def _worker_options(opts) -> dict:
    d = dataclasses.asdict(opts)
    d.update(executor="local", ray_address=None, quiet=True, dry_run=False)
    for key in ("imatrix", "config"):
        if d.get(key):
            d[key] = _absolute(d[key])
    return d


def _first_line(text: str) -> str:
    line = (str(text).strip().splitlines() or [""])[0]
    return line if len(line) <= ERROR_CHARS else line[:ERROR_CHARS] + "..."


class RayShares:
    """The `shares` of `ckpt.io.output.execute` on a Ray cluster: connected on creation (before anything is
    written), called once with the staged temp files, `close()` disconnects."""

    def __init__(self, src, opts, fmt: str, plan, out: Path, report, log=None):
        from ckpt.io.shares import check_shareable

        check_shareable(plan)
        self.src, self.opts, self.fmt, self.plan, self.out, self.report = src, opts, fmt, plan, Path(out), report
        self.pool = RayPool.connection(opts.ray_address, log)
        self.ray = self.pool.ray
        try:
            self.cpus = self._fitting()
        except BaseException:
            self.close()
            raise

    def _fitting(self) -> int:
        """The cluster's CPUs; a share needs one CPU (and one GPU with --device cuda) on some node: on an
        instance we started nothing will add such a node, so it is refused."""
        gpus = 1 if self.opts.device.startswith("cuda") else 0
        nodes = [n.get("Resources", {}) for n in self.ray.nodes() if n.get("Alive")]
        fit = [r for r in nodes if r.get("CPU", 0) >= 1 and r.get("GPU", 0) >= gpus]
        if not fit and self.pool.local:
            raise CkptError("--executor ray: no node of this local Ray instance offers 1 CPU"
                            + (" and 1 GPU (use --device cpu)" if gpus else ""))
        return max(1, int(sum(r.get("CPU", 0) for r in fit)))

    def close(self) -> None:
        self.pool.close()

    # ------------------------------------------------------------------------------------------ the shares

    def __call__(self, staged, progress=None) -> None:
        import ckpt
        from ckpt.io.shares import fingerprint, share_bytes, split_shares

        ray, plan = self.ray, self.plan
        blocks = [s.layout for s in staged]
        base = {"version": ckpt.__version__, "src": _absolute(self.src), "opts": _worker_options(self.opts),
                "fmt": self.fmt, "staged": [(s.index, str(Path(s.path).absolute()), s.layout) for s in staged],
                "fingerprint": fingerprint(plan, blocks)}
        gpus = 1 if self.opts.device.startswith("cuda") else 0
        # max_calls=1: a worker process serves one share, then exits. A share cancelled (Ctrl-C, another share's
        # failure) gets a KeyboardInterrupt wherever it is, also inside `import torch`, and a half-imported torch
        # breaks every later import in that process ("cannot initialize type ...: already defined"), so a reused
        # worker would fail the next run's share; the cost is one interpreter start per share.
        task = ray.remote(max_calls=1)(run_share).options(num_cpus=1, num_gpus=gpus, max_retries=MAX_RETRIES,
                                                          retry_exceptions=False,
                                                          name=f"ckpt convert share of {self.out.name}")
        refs: dict = {}
        try:
            for names in split_shares(plan, self.cpus * SHARES_PER_CPU):
                refs[task.remote({**base, "names": names})] = names
            while refs:
                try:
                    ready, _ = ray.wait(list(refs), num_returns=1, timeout=POLL_S)
                except ray.exceptions.RayError as e:
                    raise CkptError(f"--executor ray: lost the Ray cluster ({_first_line(e)}); nothing written") from None
                for ref in ready:
                    names = refs.pop(ref)
                    res = self._result(ref, names)
                    self._merge(res)
                    if progress is not None:
                        progress.update(res.get("bytes") or share_bytes(plan, names))
        except BaseException:
            self._stop(refs)
            raise

    def _result(self, ref, names) -> dict:
        try:
            res = self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            raise CkptError(f"{self.out}: a share of {len(names)} tensors ({names[0]}, ...) failed: "
                            f"{_first_line(task_error(e))}; nothing written") from None
        if res.get("error"):
            raise CkptError(f"{self.out}: a share of {len(names)} tensors ({names[0]}, ...) failed on a Ray worker: "
                            f"{_first_line(res['error'])}; nothing written")
        return res

    def _merge(self, res: dict) -> None:
        """The counted warnings of the share's writes (overflows, NaN ...), into the run's report."""
        for kind, per in (res.get("counts") or {}).items():
            for name, n in per.items():
                self.report.count(kind, name, n)
        for w in res.get("warned") or []:
            self.report.warn(w)

    def _stop(self, refs: dict) -> None:
        """Cancel every share still out (a running one gets a KeyboardInterrupt: its writers stop) and wait a while
        for them to end; those still running then are killed. The temp files are the driver's to remove."""
        ray = self.ray
        for ref in refs:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while refs and time.monotonic() < deadline:
            with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C does not cut the clean-up short
                try:
                    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=POLL_S)
                except Exception:  # the cluster is gone: nothing left to wait for
                    return
                for ref in ready:
                    refs.pop(ref, None)
        for ref in refs:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while refs and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=POLL_S)
                for ref in ready:
                    refs.pop(ref, None)


def run_share(spec: dict) -> dict:
    """The body of every share's Ray task (module level: Ray ships it by reference, each node imports its own
    ckpt, which must be the driver's version). Plans the conversion again and writes the share's tensors."""
    import ckpt

    if spec.get("version") not in (None, ckpt.__version__):
        return {"error": f"this Ray node runs ckpt {ckpt.__version__}, the driver ckpt {spec['version']}: install "
                         "the same version on every node"}
    from ckpt import targets
    from ckpt.convert.command import ConvertOptions, plan_convert
    from ckpt.devices import resolve_device
    from ckpt.io.checkpoint import open_checkpoint
    from ckpt.io.shares import write_share
    from ckpt.report import Report
    from ckpt.targets.casts import KEEP

    opts = ConvertOptions(**spec["opts"])
    report = Report()
    try:
        with open_checkpoint(spec["src"]) as c:
            plan, views = plan_convert(c, opts, report, spec["fmt"])
            device = None
            if opts.device.startswith("cuda"):
                device = resolve_device(opts.device, heavy=False)
            elif opts.device == "auto" and targets.choose(opts, KEEP).heavy(opts, views):
                device = resolve_device("auto")
            counts = {k: dict(v) for k, v in report.counts.items()}  # planning's own: the driver has them
            warned = len(report.warned)
            n = write_share(plan, spec["staged"], spec["names"], spec["fingerprint"], device)
    except CkptError as e:
        return {"error": str(e)}
    except Exception as e:  # one line for the driver; a dead worker is Ray's to retry, not an exception
        return {"error": f"{type(e).__name__}: {e}"}
    new = {k: {t: n_ - counts.get(k, {}).get(t, 0) for t, n_ in per.items() if n_ != counts.get(k, {}).get(t, 0)}
           for k, per in report.counts.items()}
    return {"bytes": n, "counts": {k: v for k, v in new.items() if v}, "warned": report.warned[warned:]}
