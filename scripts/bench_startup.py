"""Start-up benchmark: how long a command takes when it has no tensor math to do.

Measures, as fresh processes (median of --repeat rounds, the order of the variants rotating each round):
the interpreter alone, `import torch` (what every command paid before torch was imported lazily),
`ckpt --help`, an error for a missing path, `ckpt inspect` of a ~300 kB safetensors file, and `ckpt
inspect --scan` of the same file (which reads tensors, so imports torch). Targets (issue 14, on the 2-core
machine): an error for a missing path in under 0.3 s; inspect of a 300 kB file in under 0.5 s.

`--compare DIR` runs every ckpt case also against the checkout in DIR (e.g. a worktree of an older
commit), in the same rounds, so before/after figures share the machine's load. The 1-minute load average
is printed before and after: the machine may be shared. Stdlib only (see benchlib.py); the input file is
written by hand (a safetensors header and zero bytes), so no ckpt or torch code builds it.

    python scripts/bench_startup.py --repeat 7 [--compare /path/to/old/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

HERE = Path(__file__).resolve().parent.parent
TARGETS = {"error: missing path": 0.3, "inspect 300 kB": 0.5}


def write_small(path: Path) -> int:
    """A 300 kB safetensors file: an fp32 [300, 250] weight and an fp16 bias (zeros)."""
    tensors = {"a.weight": ("F32", [300, 250], 300 * 250 * 4), "a.bias": ("F16", [300], 600)}
    header, at = {}, 0
    for name, (dt, shape, n) in tensors.items():
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + bytes(at))
    return path.stat().st_size


def load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--compare", type=Path, help="another checkout to time in the same rounds (PYTHONPATH=DIR)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        small = tmp / "small.safetensors"
        size = write_small(small)
        missing = tmp / "missing.safetensors"
        roots = {"this": HERE} | ({"compare": args.compare.resolve()} if args.compare else {})
        # Bytecode as an installed package has it (pip compiles at install): written once, in the untimed
        # warm-up round, under a prefix of our own (nothing lands in the checkouts), whatever
        # PYTHONDONTWRITEBYTECODE says; without it every run compiles every module again (~0.3 s here).
        base_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        base_env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
        py = [sys.executable]
        cases: list[tuple[str, str, list[str], dict | None, int]] = [
            ("python -c pass", "-", py + ["-c", "pass"], base_env, 0),
            ("python -c 'import torch'", "-", py + ["-c", "import torch"], base_env, 0),
        ]
        for label, root in roots.items():
            env = {**base_env, "PYTHONPATH": str(root)}
            ckpt = py + ["-m", "ckpt.cli"]
            cases += [
                ("ckpt --help", label, ckpt + ["--help"], env, 0),
                ("error: missing path", label, ckpt + ["inspect", str(missing)], env, 2),
                ("inspect 300 kB", label, ckpt + ["inspect", str(small)], env, 0),
                ("inspect 300 kB --scan", label, ckpt + ["inspect", str(small), "--scan"], env, 0),
            ]
        print("\n".join(bl.machine_lines()))
        print(f"input: {small.name}, {size:,} bytes; load average before: {load()}", flush=True)
        times: dict[int, list[float]] = {i: [] for i in range(len(cases))}
        for r in range(-1, args.repeat):  # round -1: the untimed warm-up (bytecode, page cache)
            order = list(range(len(cases)))
            order = order[r % len(order):] + order[: r % len(order)] if r >= 0 else order
            for i in order:
                name, _, argv, env, want = cases[i]
                m = bl.measure(argv, env=env, cwd=tmp, check=False)  # cwd: `-m` puts it first on sys.path
                if m.returncode != want:
                    raise SystemExit(f"{name}: exit {m.returncode}, expected {want}\n{m.stderr[-2000:]}")
                if r >= 0:
                    times[i].append(m.seconds)
        print(f"load average after: {load()}\n")
        rows, out = [], []
        for i, (name, label, argv, _, _) in enumerate(cases):
            med = statistics.median(times[i])
            target = TARGETS.get(name)
            verdict = "" if target is None or label == "compare" else ("met" if med < target else "NOT met")
            rows.append([name, label, f"{med:.3f}", f"{min(times[i]):.3f}", f"< {target}" if target else "", verdict])
            out.append({"case": name, "checkout": label, "median_s": med, "runs_s": times[i]})
        print(bl.markdown_table(["case", "checkout", "median s", "min s", "target s", ""], rows))
        if args.compare:
            print(f"\ncheckouts: this = {HERE}, compare = {args.compare}")
        if args.json:
            args.json.write_text(json.dumps({"machine": bl.machine_info(), "cases": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
