"""Benchmark `ckpt convert --to gguf-q4_k_m --executor ray` with 1 and 2 Ray workers against the local run.

Source: bench_gguf.py's synthetic Flux (BFL layout) bf16 checkpoint of `--size-gb` (no ckpt code). Cases, each
in its own subprocess, all outputs fsynced by ckpt:

- local: `ckpt convert SRC --to gguf-q4_k_m -o OUT -q` (the K-quant encoder on every core, `busy_stage` "compute").
- ray N (N = 1, 2, ...): a local Ray instance of N CPUs started in the subprocess (`ray.init(num_cpus=N)`), then the
  same command with `--executor ray` run twice through the CLI in that process: "cold" (Ray starts its workers,
  each imports torch and ckpt) and "warm" (workers reused: what a long-lived cluster costs per model).
  Each share runs on one CPU (Ray sets one thread per task).
- check: every ray output is byte-identical to the local one.

The machine's load average is printed before and after: on a shared 2-core VM the figures move with it.

How it extrapolates: a share is a list of tensors of about equal bytes (2 per CPU of the cluster), each worker reads
its tensors from the shared filesystem, encodes them and pwrites its blocks at their planned offsets. Wall time is
about  plan + max(input bytes / (read bandwidth), values / (per-node encode rate x nodes), output bytes / (the shared
filesystem's aggregate write bandwidth)) + Ray's start-up (seconds, paid once per cluster). Q4_K_M encoding runs at
some tens of M values/s per core, so a 671B model is CPU-bound until the nodes together write faster than the
filesystem takes (Q4_K_M output is ~0.56 bytes per value: 100 cores at ~20 M values/s each write ~1.1 GB/s).

Usage: python scripts/bench_ray_convert.py [--size-gb 0.2] [--workers 1,2] [--workdir DIR]
Only the standard library is imported here; `--run-ray` is the subprocess entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402


def run_ray(n: int, src: str, out: str) -> None:
    """Subprocess: a local Ray instance of `n` CPUs, then the convert twice (cold and warm workers)."""
    import logging

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from ckpt.cli import main

    t0 = time.monotonic()
    ray.init(num_cpus=n, num_gpus=0, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
             object_store_memory=100 << 20)
    times = {"init": time.monotonic() - t0}
    for label in ("cold", "warm"):
        target = f"{out}.{label}.gguf"
        t = time.monotonic()
        try:
            main(["convert", src, "--to", "gguf-q4_k_m", "-o", target, "-q", "--executor", "ray", "--overwrite"])
        except SystemExit as e:
            if e.code not in (0, None):
                raise
        times[label] = time.monotonic() - t
    ray.shutdown()
    print(json.dumps(times))


def same(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 24), fb.read(1 << 24)
            if x != y:
                return False
            if not x:
                return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.2)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--run-ray", nargs=3, metavar=("N", "SRC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_ray:
        return run_ray(int(args.run_ray[0]), args.run_ray[1], args.run_ray[2])

    for line in benchlib.machine_lines():
        print(line)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench-ray-") as tmp:
        tmp = Path(tmp)
        src = tmp / "src.safetensors"
        benchlib.run_py(Path(__file__).with_name("bench_gguf.py"), "--generate", src, "--size-gb", args.size_gb)
        print(f"source: Flux bf16, {src.stat().st_size / 1e9:.2f} GB; workdir {benchlib.where(tmp)}")
        local = tmp / "local.gguf"
        m = benchlib.measure(benchlib.ckpt_argv("convert", src, "--to", "gguf-q4_k_m", "-o", local, "-q"))
        rows = [("local (all cores)", f"{m.seconds:.2f}", "-", "1.00x", "-")]
        for n in [int(x) for x in args.workers.split(",")]:
            r = benchlib.run_py(__file__, "--run-ray", n, src, tmp / f"ray{n}")
            t = json.loads(r.stdout.strip().splitlines()[-1])
            eq = all(same(local, Path(f"{tmp / f'ray{n}'}.{k}.gguf")) for k in ("cold", "warm"))
            rows.append((f"ray, {n} worker{'s' * (n > 1)}", f"{t['warm']:.2f}", f"{t['cold']:.2f}",
                         f"{m.seconds / t['warm']:.2f}x", "yes" if eq else "NO"))
            for k in ("cold", "warm"):
                Path(f"{tmp / f'ray{n}'}.{k}.gguf").unlink()
    load_after = os.getloadavg()
    print(benchlib.markdown_table(["case", "wall s (warm)", "wall s (cold start)", "speed-up vs local (warm)",
                                   "bytes equal"], rows))
    print(f"load average (1/5/15 min) before: {' '.join(f'{x:.2f}' for x in load_before)}; after: "
          f"{' '.join(f'{x:.2f}' for x in load_after)} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
