"""Benchmark `ckpt merge-lora` against a naive full-load merge and against `ckpt convert`.

One synthetic Flux-like bf16 base is generated (benchlib's model shapes; `--size-gb` is the base file
size) and a kohya-style LoRA of rank `--rank` (default 32) on every linear weight, alpha = rank / 2
(`--targets attention`: on the attention's `qkv` and `proj` only, 22% of the base; the rest is copied
unread by the kernel, ckpt.io.byte_copy).
Three commands run on it, each timed as a subprocess with its peak RSS (`os.wait4`, see benchlib.py):

- ckpt:    `ckpt merge-lora BASE LORA -o OUT -q` (the real CLI; keeps bf16, fsyncs its output);
- naive:   `load_file` of base and LoRA, W = (W.float() + scale * up @ down).to(bf16) for every
           module, `save_file`, fsync: what the usual merge scripts do;
- convert: `ckpt convert BASE -o OUT --to bf16 -q`, the same read and write without the LoRA math;
- cp:      `cp` of ckpt's output then `sync`: the least that writing those bytes durably takes here.

Warm cache: an untimed `ckpt convert` reads the base into the page cache first. Targets (from the
issue): peak RSS of ckpt at most the import baseline (`python -c "import torch"`, with a CUDA context
for `--device cuda`) + 2x the largest tensor (bf16 bytes) + the pipeline's buffers + LoRA file size +
300 MB, and wall time within 1.5x of cp + sync of the output. They print as met / NOT met
(`--check-targets`: exit 1 if not). `--device cuda` runs both ckpt commands on the GPU; `--workdir`
chooses tmpfs (/dev/shm) or a disk, and the report says which.
`--folder`: the base is a model folder (config.json beside model.safetensors, as transformers saves one) and so is
ckpt's output; `--merge-args "--to bf16"` passes more options to ckpt merge-lora alone. ckpt's first MiB: when the
temp output beside OUT first holds 1 MiB (polled every 5 ms; what starts it early: `ckpt.io.early_copies`).
Correctness: ckpt's output is compared with the naive output; both round once from fp32, and the
only difference is fp32 summation order (addmm in row bands vs one matmul), so elements may differ by
at most one bf16 ulp (exit 1 otherwise; `--no-verify` skips it).

The parent imports only the standard library (torch runs in subprocesses), as benchlib requires.
Internal entry points: `--make-lora BASE LORA RANK`, `--naive BASE LORA OUT`, `--compare A B`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

TIME_FACTOR = {"all": 1.5, "attention": 1.3}  # x cp + sync (issues 14 and 25)


def make_lora(base: str, out: str, rank: int, targets: str = "all") -> None:
    """A kohya LoRA on every 2-D `.weight` of the base (`targets` "attention": of the attention only):
    lora_down [r, in], lora_up [out, r], alpha."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {}
    with safe_open(base, "pt") as f:
        for k in f.keys():
            shape = f.get_slice(k).get_shape()
            if k.endswith(".weight") and len(shape) == 2 and (targets == "all" or ".attn." in k):
                m = k[: -len(".weight")]
                tensors[m + ".lora_down.weight"] = (torch.randn(rank, shape[1], generator=g) * 0.01).bfloat16()
                tensors[m + ".lora_up.weight"] = (torch.randn(shape[0], rank, generator=g) * 0.01).bfloat16()
                tensors[m + ".alpha"] = torch.tensor(rank / 2, dtype=torch.bfloat16)
    save_file(tensors, out)


def naive_merge(base: str, lora: str, out: str) -> None:
    from safetensors.torch import load_file, save_file

    sd, lo = load_file(base), load_file(lora)
    for k in [k for k in lo if k.endswith(".lora_down.weight")]:
        m = k[: -len(".lora_down.weight")]
        down, up = lo[k].float(), lo[m + ".lora_up.weight"].float()
        scale = lo[m + ".alpha"].float().item() / down.shape[0]
        w = sd[m + ".weight"]
        sd[m + ".weight"] = (w.float() + scale * (up @ down)).to(w.dtype)
    save_file(sd, out, metadata={"format": "pt"})
    bl.fsync_path(out)


def compare_close(a: str, b: str) -> dict:
    """Same keys, dtypes, shapes; values equal or one bf16/fp16 ulp apart (different fp32 summation order)."""
    import torch
    from safetensors import safe_open

    worst, differing, total = 0, 0, 0
    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        if set(fa.keys()) != set(fb.keys()):
            return {"ok": False, "problem": "keys differ"}
        for k in fa.keys():
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            if x.dtype != y.dtype or x.shape != y.shape:
                return {"ok": False, "problem": f"{k}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"}
            if x.dtype in (torch.bfloat16, torch.float16):
                d = (x.view(torch.int16).int() - y.view(torch.int16).int()).abs()  # ulps for same-sign values
                worst = max(worst, int(d.max()) if d.numel() else 0)
                differing += int((d != 0).sum())
            elif not torch.equal(x, y):
                return {"ok": False, "problem": f"{k}: values differ"}
            total += x.numel()
    return {"ok": worst <= 1, "max_ulps": worst, "differing": differing, "elements": total,
            "problem": None if worst <= 1 else f"elements differ by up to {worst} ulps"}


def first_mib(out: Path, run) -> tuple[object, float | None]:
    """`run()` (a measured ckpt command writing OUT), and the seconds from its start until its temp output
    (`.OUT.ckpt-tmp-*` beside OUT: a file, or a folder of files) first held 1 MiB; None if never seen."""
    seen: list[float] = []
    stop = threading.Event()

    def allocated(p: Path) -> int:
        try:
            if p.is_dir():
                return sum(allocated(c) for c in p.iterdir())
            return p.stat().st_blocks * 512
        except OSError:  # renamed into place meanwhile
            return 0

    def poll():
        while not stop.is_set():
            for p in out.parent.glob(f".{out.name}.ckpt-tmp-*"):
                if allocated(p) >= 1 << 20:
                    seen.append(time.perf_counter())
                    return
            time.sleep(0.005)

    os.sync()  # measure() syncs first too: nothing left to flush there, so t0 is its start within a few ms
    t0 = time.perf_counter()
    th = threading.Thread(target=poll, daemon=True)
    th.start()
    try:
        m = run()
    finally:
        stop.set()
        th.join()
    return m, (seen[0] - t0 if seen else None)


def as_folder(base: Path) -> Path:
    """BASE moved into a model folder of its name (config.json + model.safetensors, as transformers saves one)."""
    folder = base.with_suffix("")
    folder.mkdir()
    base.rename(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"architectures": ["BenchModel"], "torch_dtype": "bfloat16"}))
    return folder


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--make-lora"]:
        make_lora(argv[1], argv[2], int(argv[3]), argv[4] if len(argv) > 4 else "all")
        return 0
    if argv[:1] == ["--naive"]:
        naive_merge(*argv[1:4])
        return 0
    if argv[:1] == ["--compare"]:
        res = compare_close(argv[1], argv[2])
        print(json.dumps(res))
        return 0 if res["ok"] else 1
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=4.0, help="base size in bf16, GB (1e9 bytes); default 4")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--targets", choices=("all", "attention"), default="all",
                    help="the LoRA's modules: every linear, or the attention's qkv and proj only")
    bl.add_run_args(ap)
    ap.add_argument("--no-naive", action="store_true", help="skip the naive baseline (it holds the whole base)")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--check-targets", action="store_true", help="exit 1 if a target is not met")
    ap.add_argument("--json", help="also write the results to this JSON file")
    ap.add_argument("--folder", action="store_true",
                    help="the base (and so ckpt's output) is a model folder with config.json, not one file")
    ap.add_argument("--merge-args", default="", metavar="ARGS",
                    help='more options for ckpt merge-lora alone, e.g. "--to bf16" or "--device auto"')
    args = ap.parse_args(argv)

    params = int(args.size_gb * 1e9 / 2)
    baseline = bl.import_baseline(args.device)  # first: --device cuda without a GPU stops here, in one line
    parent = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-merge-", dir=parent))
    base, lora, out = work / "base.safetensors", work / "lora.safetensors", work / "out.safetensors"
    in_dir = out_dir = None
    ref, copy = work / "naive.safetensors", work / "cp.safetensors"
    dev = ["--device", args.device]
    results: dict = {"machine": bl.machine_info(), "launcher_floor": bl.launcher_floor()}
    try:
        log("generating base ...")
        info = bl.generate(base, params, "bf16")
        log("generating LoRA ...")
        bl.run_py(__file__, "--make-lora", base, lora, args.rank, args.targets)
        lora_bytes = lora.stat().st_size
        src = base
        if args.folder:
            src = in_dir = as_folder(base)
            base, out_dir = src / "model.safetensors", work / "out"
        log("warm-up (untimed convert) ...")
        bl.measure(bl.ckpt_argv("convert", base, "-o", out, "--to", "bf16", "-q"))
        out.unlink()
        runs = {}
        log("convert ...")
        runs["convert"] = bl.measure(bl.ckpt_argv("convert", base, "-o", out, "--to", "bf16", *dev, "-q"))
        out.unlink()
        log("ckpt merge-lora ...")
        extra = shlex.split(args.merge_args)
        runs["ckpt"], first = first_mib(out_dir or out, lambda: bl.measure(
            bl.ckpt_argv("merge-lora", src, lora, "-o", out_dir or out, *dev, *extra, "-q")))
        if out_dir is not None:  # the folder's weights: what the baselines write and are compared with
            out = out_dir / "model.safetensors"
        log("cp + sync of the output ...")
        runs["cp"] = bl.cp_baseline(out, copy)
        if not args.no_naive:
            log("naive merge ...")
            runs["naive"] = bl.measure([sys.executable, __file__, "--naive", base, lora, ref])
        verify = None
        if not args.no_verify and "naive" in runs:
            m = bl.run_py(__file__, "--compare", out, ref, check=False)
            verify = json.loads(m.stdout.strip().splitlines()[-1])
        largest = info["largest_numel"] * 2
        out_bytes = out.stat().st_size
        verdict, vals = bl.verdict_lines("merge-lora", runs["ckpt"], runs["cp"], out_bytes, baseline, largest,
                                         bl.pipeline_bytes(2, 2), lora_bytes, "LoRA")
        bound, rss_ok = vals["rss_bound"], vals["rss_ok"]
        ck = runs["ckpt"]
        ratio = vals["vs_cp"]
        factor = TIME_FACTOR[args.targets]
        time_ok = ratio <= factor
        rows = [[name, f"{m.seconds:.2f}", bl.fmt_mb(m.peak_rss), bl.gbps(info["bytes"], m.seconds)]
                for name, m in runs.items()]
        print("\n".join(bl.machine_lines()))
        print(f"device: {args.device}; files in {parent} ({bl.where(parent)})")
        print(f"base: {bl.fmt_gb(info['bytes'])} GB bf16, {info['tensors']} tensors, largest {info['largest']} "
              f"{info['largest_shape']}; LoRA rank {args.rank} on "
              f"{'every linear' if args.targets == 'all' else 'the attention qkv and proj'}: {bl.fmt_mb(lora_bytes)} MB; "
              f"launcher RSS floor {bl.fmt_mb(results['launcher_floor'])} MB")
        print(bl.markdown_table(["command", "seconds", "peak RSS MB", "base GB/s"], rows))
        print(f"ckpt merge-lora{' of a model folder' if args.folder else ''}"
              f"{' ' + args.merge_args if args.merge_args else ''}: first MiB of the output "
              + (f"{first:.2f} s after start" if first is not None else "not seen") + f", total {ck.seconds:.2f} s")
        print("\n".join(verdict))
        print(f"target peak RSS: {'met' if rss_ok else 'NOT met'}; target time <= {factor}x cp: "
              f"{'met' if time_ok else 'NOT met'} ({ratio:.2f}x; {ck.seconds / runs['convert'].seconds:.2f}x convert)")
        if verify is not None:
            print(f"ckpt vs naive: {'ok' if verify['ok'] else 'MISMATCH'} "
                  f"({verify.get('differing', '-')} of {verify.get('elements', '-')} elements 1 ulp apart; "
                  f"{verify.get('problem') or 'within 1 ulp'})")
        results.update(info=info, lora_bytes=lora_bytes, rss_bound=bound, rss_ok=rss_ok, vs_cp=ratio,
                       vs_convert=ck.seconds / runs["convert"].seconds, time_ok=time_ok, device=args.device,
                       workdir=bl.where(parent), import_baseline_rss=baseline.peak_rss, verify=verify,
                       folder=args.folder, merge_args=args.merge_args, first_mib_seconds=first,
                       runs={k: {"seconds": m.seconds, "peak_rss": m.peak_rss} for k, m in runs.items()})
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        if verify is not None and not verify["ok"]:
            return 1
        if args.check_targets and not (rss_ok and time_ok):
            return 1
        return 0
    finally:
        for p in (base, lora, out, ref, copy):
            p.unlink(missing_ok=True)
        for d in (out_dir, in_dir):
            if d is not None and d.is_dir():
                for p in d.iterdir():
                    p.unlink()
                d.rmdir()
        try:
            work.rmdir()
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
