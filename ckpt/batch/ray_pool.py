"""`ckpt batch --executor ray`: each planned job is one Ray task, packed onto nodes by its memory.

The task runs the same function as a local worker process (`ckpt.batch.worker.run_spec`), on paths that
every node sees (a shared filesystem): the output is published by the atomic rename of `ckpt.io.publish`
on whichever node ran the job, and the result comes back to the driver, which alone writes the manifest.
So resume, skip, retry-failed and "inputs that changed are redone" are the local runner's own.

Resources per task: `memory` = the job's estimated peak (`Operation.estimate`), `num_gpus` = 1 with
`--device cuda` (else 0), one CPU. `max_retries=0`: a job whose worker or node dies is failed and recorded
like a local worker that died; the next run retries it, and recognises an output that was published
before the death (its "started" line). Ctrl-C cancels every outstanding task (a running one gets a
KeyboardInterrupt, so its writer removes the temp output), records the results that still came back,
and waits for the rest to end; a task still running after STOP_TIMEOUT_S is killed, and its temp output
removed by the driver once its process is provably gone. Ray delivers the cancel with
`_thread.interrupt_main()`, not a signal: `ckpt.interrupts.signals_deferred` holds it back all the same
while a task publishes or removes its temp output.

Connecting is bounded (CKPT_RAY_TIMEOUT seconds, default 30): an explicit address (--ray-address or
RAY_ADDRESS) is first probed with a plain TCP connection, so "nothing listens there" is one line at once;
Ray's own connection timeouts are set (before ray is imported) so that one attempt fits the budget, and
Ray retries that attempt once, not 20 times (~14 minutes). Ray's core prints its retries straight to
stderr: that output is held while connecting, and shown only if the connection succeeds.

Ray is imported only here, and only with `--executor ray` (an optional extra: `pip install ray`, the `ckpt-toolkit[ray]` extra).
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from ckpt import DIST, env
from ckpt.errors import CkptError
from ckpt.report import plural

INSTALL_HINT = f"--executor ray needs Ray: pip install ray (the {DIST}[ray] extra) on every node"
POLL_S = 0.2  # ray.wait timeout: a Ctrl-C is delivered between polls
STOP_TIMEOUT_S = 60  # how long cancelled tasks get to remove their temp outputs before they are killed
KILL_TIMEOUT_S = 20  # how long a killed task's worker gets to be gone (its temp output removed then)
TIMEOUT_ENV = "CKPT_RAY_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT_S = 30.0  # how long reaching a Ray cluster may take before the batch is refused


def connect_timeout() -> float:
    """CKPT_RAY_TIMEOUT in seconds (default 30)."""
    return env.seconds(TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT_S)


def _ray_timeouts(timeout: float) -> dict[str, str]:
    """Ray's core timeouts for one attempt to reach a cluster's GCS within `timeout`: two connects (GCS and
    its pubsub) and the wait for the cluster id. Ray's core reads them once, as ray is imported."""
    connect = max(1, min(5, int(timeout // 6)))
    return {"RAY_gcs_rpc_server_connect_timeout_s": str(connect),
            "RAY_py_gcs_connect_timeout_s": str(max(1, int(timeout) - 2 * connect - 3))}


def require():
    """The ray module, or a one-line CkptError saying how to install it. Imported with Ray's connection
    timeouts bounded (`_ray_timeouts`; a user's own RAY_* settings win); they are set for the import only,
    so the processes of a local instance started later keep Ray's defaults."""
    with _env_defaults(_ray_timeouts(connect_timeout()) if sys.modules.get("ray") is None else {}):
        try:
            import ray
        except ImportError:
            raise CkptError(INSTALL_HINT) from None
    return ray


@contextlib.contextmanager
def _env_defaults(values: dict[str, str]):
    """The environment variables of `values` that the user has not set, set for the block only."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _host_port(address: str | None) -> tuple[str, int] | None:
    """(host, port) of an explicit cluster address (`host:port`, `ray://host:port`); None for none, "auto",
    "local", or a form Ray itself will judge."""
    if not address or address in ("auto", "local"):
        return None
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.split("/", 1)[0].rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def probe(address: str, where: str, timeout: float) -> None:
    """Refuse at once an address where nothing accepts a connection (Ray would retry it for minutes)."""
    hp = _host_port(address)
    if hp is None:
        return
    try:
        with socket.create_connection(hp, timeout=min(timeout, 10.0)):
            pass
    except OSError as e:
        why = "no answer within {:g} s".format(min(timeout, 10.0)) if isinstance(e, TimeoutError) else \
            (e.strerror or str(e) or type(e).__name__)
        raise CkptError(f"{where}: no Ray cluster answers at {hp[0]}:{hp[1]} ({why[:1].lower() + why[1:]}); "
                        "start one there with `ray start --head`, or check the address") from None


@contextlib.contextmanager
def _stderr_held():
    """Ray's core logs each failed connection attempt to file descriptor 2 itself (not through Python):
    held in a temp file while connecting, written out only if the connection succeeds (a failure is the
    one `error:` line instead)."""
    sys.stderr.flush()
    saved = os.dup(2)
    ok = False
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
            ok = True
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if ok:
                held.seek(0)
                data = held.read()
                if data:
                    os.write(2, data)


def run_task(spec: dict) -> dict:
    """The body of every Ray task (a module-level function, so Ray ships it by reference: each node
    imports its own installed ckpt, which must be the driver's version)."""
    import ckpt
    from ckpt.batch.worker import run_spec

    if spec.get("version") not in (None, ckpt.__version__):
        return {"status": "failed", "output": None, "seconds": 0.0, "messages": [], "row": None,
                "error": f"this Ray node runs ckpt {ckpt.__version__}, the driver ckpt {spec['version']}: "
                         "install the same version on every node"}
    return run_spec(spec)


@contextlib.contextmanager
def _in_folder(folder: str):
    here = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(here)


def task_options(op, job) -> dict:
    """Ray's resource request for one job: its estimated peak memory, a GPU with --device cuda, one CPU.
    No retries: see the module's docstring."""
    return dict(memory=max(int(job.estimate or 0), 1), num_gpus=1 if op.params.get("device") == "cuda" else 0,
                num_cpus=1, max_retries=0, name=f"ckpt batch {op.name} {job.item.rel}")


def started_here(ray) -> bool:
    """Whether this process started the Ray instance it is connected to (a single node, no autoscaler)."""
    try:
        return bool(getattr(ray._private.worker._global_node, "head", False))
    except AttributeError:
        return False


def _failed(error: str) -> dict:
    return {"status": "failed", "output": None, "seconds": 0.0, "messages": [], "row": None, "error": error}


def _why(e: BaseException) -> str:
    """One line for a task that raised (the function itself never does: only Ray's own errors come here)."""
    cause = getattr(e, "cause", None) or e
    first = (str(cause).strip().splitlines() or [""])[0]
    return f"Ray task failed: {type(cause).__name__}" + (f": {first}" if first else "")


def task_error(e: BaseException) -> str:
    """One line for a Ray task that raised Ray's own error (a dead worker or node, a lost cluster)."""
    return _why(e)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


class RayPool:
    """The executor interface of `ckpt.batch.runner` (start, free, running, wait_one, stop_all, close)
    over Ray tasks. Connects on creation: `address` as `ray.init` takes it (None: RAY_ADDRESS, else a
    cluster `ray start` runs on this machine, else a new local instance for the length of the batch);
    an instance this process already initialised (the Python API) is used as it is."""

    def __init__(self, op, jobs, address: str | None, limit: int | None, spec_of, log=None):
        ray = self.ray = require()
        self.op, self.limit, self.spec_of = op, limit, spec_of
        self.log = log or (lambda line: None)
        self.refs: dict = {}  # ObjectRef -> BatchJob
        self.connected = False  # by us: we disconnect (and stop a local instance we started) in close()
        self.scratch = None
        self.local = False  # a new single-node instance: nothing will ever add a node to it
        if not ray.is_initialized():
            self._connect(address)
        self.local = started_here(ray)
        self._check_fits(jobs)
        self.remote = ray.remote(run_task)

    @classmethod
    def connection(cls, address: str | None, log=None) -> "RayPool":
        """Connected as a batch's pool is (the same address rules, timeouts and one-line refusals), but with no
        jobs: for a caller that submits its own tasks (`ckpt convert --executor ray`, `ckpt.convert.ray_shares`).
        `close()` disconnects."""
        self = cls.__new__(cls)
        self.ray = require()
        self.op, self.limit, self.spec_of = None, None, None
        self.log = log or (lambda line: None)
        self.refs, self.connected, self.scratch = {}, False, None
        if not self.ray.is_initialized():
            self._connect(address)
        self.local = started_here(self.ray)
        return self

    def _connect(self, address):
        import logging

        ray = self.ray
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # ckpt does not report usage on the user's behalf
        main = threading.current_thread() is threading.main_thread()
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        # Ray puts the driver's current folder first on every worker's sys.path (and starts a local
        # instance's workers in it): a `./ckpt/` there, a common name for a checkpoint folder, would be
        # imported instead of the installed package. Connect from an empty folder of our own instead
        # (kept until close(): a local instance's workers live in it).
        target = address or os.environ.get("RAY_ADDRESS") or None
        where = f"--ray-address {address}" if address else f"RAY_ADDRESS={target}" if target else "--executor ray"
        timeout = connect_timeout()
        explicit = _host_port(target) is not None
        probe(target, where, timeout)
        # An explicit address names a running cluster: Ray tries it once (its default is 20 attempts of
        # ~40 s each); a local instance being started keeps Ray's own patience.
        once = {"RAY_gcs_server_port_wait_time_s": "1"} if explicit else {}
        self.scratch = tempfile.mkdtemp(prefix="ckpt-ray-")
        try:
            with _env_defaults(once), _in_folder(self.scratch), \
                    (_stderr_held() if explicit else contextlib.nullcontext()):
                ray.init(address=address, include_dashboard=False, log_to_driver=False,
                         logging_level=logging.WARNING)
        except Exception as e:
            self.close()
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CkptError(f"{where}: cannot start or reach a Ray cluster ({first})") from None
        finally:
            for s, h in handlers.items():  # ray.init replaces SIGTERM's: ours turns it into Ctrl-C
                signal.signal(s, h)
        self.connected = True

    def _check_fits(self, jobs) -> None:
        """A job no node can hold waits forever. On an instance we started ourselves nothing will ever
        add such a node: refuse before anything runs. On a cluster (which may autoscale) say so and wait."""
        nodes = [n.get("Resources", {}) for n in self.ray.nodes() if n.get("Alive")]
        gpus = 1 if self.op.params.get("device") == "cuda" else 0
        for j in jobs:
            j.estimate = self.op.estimate(j.item)
        unfit = [j for j in jobs if not any(r.get("memory", 0) >= j.estimate and r.get("CPU", 0) >= 1
                                            and r.get("GPU", 0) >= gpus for r in nodes)]
        if not unfit:
            return
        worst = max(unfit, key=lambda j: j.estimate)
        need = f"{_gb(worst.estimate)} of memory" + (" and 1 GPU" if gpus else "")
        mem = max((r.get("memory", 0) for r in nodes), default=0)
        gpu = max((r.get("GPU", 0) for r in nodes), default=0)
        offer = f"the largest node offers {_gb(mem)} of memory and {gpu:g} GPUs"
        if self.local:
            raise CkptError(f"--executor ray: {worst.item.rel} needs {need}; {offer} (this local Ray instance; "
                            f"pass --ray-address to use a cluster{'' if not gpus else ', or --device cpu'})")
        self.log(f"{plural(len(unfit), 'job')} need{'s' * (len(unfit) == 1)} more than any node of the Ray cluster "
                 "offers now (e.g. "
                 f"{worst.item.rel}: {need}; {offer}): they wait until the cluster has such a node")

    # ------------------------------------------------------------------------- the executor interface

    @property
    def running(self) -> bool:
        return bool(self.refs)

    def free(self) -> bool:
        return self.limit is None or len(self.refs) < self.limit

    def start(self, job) -> None:
        import ckpt

        ref = self.remote.options(**task_options(self.op, job)).remote({**self.spec_of(job), "version": ckpt.__version__})
        self.refs[ref] = job

    def _result(self, ref) -> dict:
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            return _failed(_why(e))

    def wait_one(self):
        while True:
            ready, _ = self.ray.wait(list(self.refs), num_returns=1, timeout=POLL_S)
            if ready:
                ref = ready[0]
                return self.refs.pop(ref), self._result(ref)

    def stop_all(self) -> list:
        """Ctrl-C: cancel every task (queued ones never start, running ones are interrupted and remove
        their temp output). Returns (job, result) for those that finished all the same."""
        from ckpt.io.publish import remove_stale_temps

        ray = self.ray
        for ref in self.refs:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        finished = []
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self.refs and time.monotonic() < deadline:
            with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C does not cut the clean-up short
                ready, _ = ray.wait(list(self.refs), num_returns=len(self.refs), timeout=POLL_S)
                for ref in ready:
                    job = self.refs.pop(ref)
                    try:
                        res = ray.get(ref)
                    except ray.exceptions.RayError:
                        continue  # cancelled: it wrote nothing, its "started" line says it may be redone
                    finished.append((job, res))
        if self.refs:  # did not stop in time: killed, and once dead (its lock gone) its temp output removed
            for ref in self.refs:
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
            outputs = [Path(j.output) for j in self.refs.values() if j.output is not None]
            deadline = time.monotonic() + KILL_TIMEOUT_S
            with contextlib.suppress(KeyboardInterrupt):
                # A temp output is removed once its owner is provably gone (PID reaped, lock free): poll.
                while outputs and time.monotonic() < deadline:
                    for o in outputs:
                        remove_stale_temps(o)
                    outputs = [o for o in outputs if any(o.parent.glob(f".{glob.escape(o.name)}.ckpt-tmp-*"))]
                    if outputs:
                        time.sleep(POLL_S)
        self.refs.clear()
        return finished

    def close(self) -> None:
        if self.connected:
            self.ray.shutdown()
            self.connected = False
        if self.scratch is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self.scratch)
            self.scratch = None
