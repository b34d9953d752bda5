"""Benchmark `ckpt lora extract` against a kohya-style full-load extraction, in one run.

A synthetic Flux-shaped bf16 base is generated (benchlib's model shapes; `--size-gb` is its size; at
2 GB and more the hidden size is Flux's 3072 and the largest matrix 18432 x 3072) and a "fine-tune" of
it: every 2-D weight plus a random delta of rank `--delta-rank` (default 64) plus small full-rank
noise, written tensor by tensor. Commands, each timed as a subprocess with its peak RSS (`os.wait4`):

- ckpt:       `ckpt lora extract BASE TUNED --rank R -o OUT --device cpu` (full torch.linalg.svd);
- ckpt-lowrank: the same with `--lowrank` (torch.svd_lowrank, q = 2R, 2 power iterations);
- ckpt-cuda:  the same as ckpt with `--device cuda`: with `--device cuda` (asked: without a GPU the bench
              stops in one line), or `--device auto` (the default) when CUDA is present; `--device cpu`
              leaves it out;
- kohya:      what kohya's extract_lora_from_models.py does: `load_file` of both models (all of them
              in RAM), for every 2-D weight `torch.linalg.svd(diff)` (its default full_matrices=True),
              U[:, :R] @ diag(S[:R]), Vh[:R], the 0.99-quantile clamp, `save_file` (no alpha folding:
              alpha = R); `--kohya-device cuda` runs its SVDs on the GPU like kohya's --device;
- cp:         `cp` of ckpt's output then `sync` (benchlib's yardstick, as in every bench).

Targets (issue #13): ckpt's peak RSS under 4 x the largest tensor (bf16 bytes) + 300 MB over the RSS
of `python -c "import torch"` (with a CUDA context for the CUDA row); ckpt CPU faster than the kohya-style
run; on a GPU, ckpt-cuda at least 5x faster than ckpt on the CPU. Printed as met / NOT met
(`--check-targets`: exit 1 if not), with benchlib's verdict lines (time against cp + sync, peak RSS
against the bound) for every ckpt row. `--workdir` chooses tmpfs (/dev/shm) or a disk; the report says which.
Correctness: for the largest weights, each LoRA's relative error ||dW - up @ down|| / ||dW|| is measured
here from the files (`--verify-modules`, default 4): ckpt's must not exceed kohya's (ckpt keeps the best
rank-R approximation; kohya's clamp can only add error) by more than 1e-4, and must equal the error ckpt
reported.

The parent imports only the standard library (torch runs in subprocesses), as benchlib requires.
Internal entry points: `--make-tuned BASE OUT RANK`, `--kohya BASE TUNED OUT RANK DEVICE`,
`--verify BASE TUNED A B N`.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

GPU_FACTOR = 5.0


def make_tuned(base: str, out: str, rank: int) -> None:
    """BASE + a rank-`rank` delta (+ 1e-4 noise) on every 2-D weight, written header-first tensor by
    tensor in the base's own layout (the header is the base's: same names, dtypes, shapes, offsets)."""
    import torch
    from safetensors import safe_open

    with open(base, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header_bytes = f.read(n)
    header = json.loads(header_bytes)
    start = 8 + n
    g = torch.Generator().manual_seed(1)
    with safe_open(base, "pt") as src, open(out, "wb") as dst:
        dst.write(struct.pack("<Q", n) + header_bytes)
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        for k in names:
            t = src.get_tensor(k)
            if t.dim() == 2 and k.endswith(".weight"):
                o, i = t.shape
                d = torch.randn(o, rank, generator=g) @ torch.randn(rank, i, generator=g) * (0.02 / math.sqrt(rank))
                d += torch.randn(o, i, generator=g) * 1e-4
                t = (t.float() + d).to(t.dtype)
                del d
            b = t.contiguous().view(torch.uint8).numpy().tobytes()
            assert dst.tell() == start + header[k]["data_offsets"][0]
            dst.write(b)


def kohya_extract(base: str, tuned: str, out: str, rank: int, device: str) -> None:
    """kohya's extract_lora_from_models.py, its SVD part as written there, on state dicts."""
    import torch
    from safetensors.torch import load_file, save_file

    org, tun = load_file(base), load_file(tuned)  # both models whole in RAM, as kohya's loaders hold them
    lora = {}
    with torch.no_grad():
        for k, w in org.items():
            if w.dim() != 2 or not k.endswith(".weight"):
                continue
            mat = (tun[k] - w).float()
            if device != "cpu":
                mat = mat.to(device)
            r = min(rank, *mat.shape)
            U, S, Vh = torch.linalg.svd(mat)
            U = U[:, :r] @ torch.diag(S[:r])
            Vh = Vh[:r, :]
            dist = torch.cat([U.flatten(), Vh.flatten()])
            hi = torch.quantile(dist, 0.99)
            U, Vh = U.clamp(-hi, hi), Vh.clamp(-hi, hi)
            name = "lora_unet_" + k[: -len(".weight")].replace(".", "_")
            lora[name + ".lora_up.weight"] = U.cpu().contiguous()
            lora[name + ".lora_down.weight"] = Vh.cpu().contiguous()
            lora[name + ".alpha"] = torch.tensor(float(r))
            del mat, U, S, Vh
    save_file(lora, out)
    bl.fsync_path(out)


def verify(base: str, tuned: str, a: str, b: str, n: int) -> dict:
    """Relative errors of both LoRAs on the n largest 2-D weights, measured from the files."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    la, lb = load_file(a), load_file(b)
    out = {}
    with safe_open(base, "pt") as fb, safe_open(tuned, "pt") as ft:
        keys = [k for k in fb.keys() if k.endswith(".weight") and len(fb.get_slice(k).get_shape()) == 2]
        keys.sort(key=lambda k: -math.prod(fb.get_slice(k).get_shape()))
        for k in keys[:n]:
            d = (ft.get_tensor(k).float() - fb.get_tensor(k).float()).double()
            name = "lora_unet_" + k[: -len(".weight")].replace(".", "_")
            errs = []
            for lo in (la, lb):
                up, down = lo[name + ".lora_up.weight"].double(), lo[name + ".lora_down.weight"].double()
                scale = float(lo[name + ".alpha"]) / down.shape[0] if name + ".alpha" in lo else 1.0
                errs.append(float((d - scale * up @ down).norm() / d.norm()))
            out[name] = errs
    return out


def reported_errors(stdout: str) -> dict[str, float]:
    rows = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0].startswith("lora_unet_") and "x" in parts[1]:
            rows[parts[0]] = float(parts[3])
    return rows


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _has_cuda() -> bool:
    m = bl.run_py("-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)", check=False)
    return m.returncode == 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--make-tuned"]:
        make_tuned(argv[1], argv[2], int(argv[3]))
        return 0
    if argv[:1] == ["--kohya"]:
        kohya_extract(argv[1], argv[2], argv[3], int(argv[4]), argv[5])
        return 0
    if argv[:1] == ["--verify"]:
        print(json.dumps(verify(*argv[1:5], int(argv[5]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="size of each model in bf16, GB (1e9 bytes)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--delta-rank", type=int, default=64, help="rank of the synthetic fine-tune's delta")
    bl.add_run_args(ap, auto_help="cpu: the CPU rows only; cuda: also the CUDA row (needs a GPU); "
                                  "auto (default): the CUDA row when a CUDA device is present")
    ap.add_argument("--no-kohya", action="store_true", help="skip the kohya-style baseline (holds both models)")
    ap.add_argument("--no-lowrank", action="store_true")
    ap.add_argument("--kohya-device", default="cpu", help="device of the kohya-style SVDs (cpu or cuda)")
    ap.add_argument("--verify-modules", type=int, default=4)
    ap.add_argument("--check-targets", action="store_true", help="exit 1 if a target is not met")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)

    params = int(args.size_gb * 1e9 / 2)
    cuda = args.device == "cuda" or (args.device == "auto" and _has_cuda())
    # first: --device cuda without a GPU stops here, in one line
    baselines = {d: bl.import_baseline(d) for d in ["cpu"] + ["cuda"] * cuda}
    parent = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-lora-", dir=parent))
    base, tuned, copy = work / "base.safetensors", work / "tuned.safetensors", work / "cp.safetensors"
    outs = {name: work / f"{name}.safetensors" for name in ("ckpt", "ckpt-lowrank", "ckpt-cuda", "kohya")}
    results: dict = {"machine": bl.machine_info(), "launcher_floor": bl.launcher_floor()}
    try:
        log("generating base ...")
        info = bl.generate(base, params, "bf16")
        log("generating tuned ...")
        bl.run_py(__file__, "--make-tuned", base, tuned, args.delta_rank)
        torch_floor = baselines["cpu"].peak_rss
        log("warm-up (untimed reads) ...")
        for p in (base, tuned):
            bl.measure(["sh", "-c", f"cat '{p}' > /dev/null"])
        extract = ("lora", "extract", base, tuned, "-r", args.rank)
        runs, devices = {}, {"ckpt": "cpu", "ckpt-lowrank": "cpu", "ckpt-cuda": "cuda"}
        log("ckpt lora extract ...")
        runs["ckpt"] = bl.measure(bl.ckpt_argv(*extract, "--device", "cpu", "-o", outs["ckpt"]))
        log("cp + sync of the output ...")
        runs["cp"] = bl.cp_baseline(outs["ckpt"], copy)
        if not args.no_lowrank:
            log("ckpt lora extract --lowrank ...")
            runs["ckpt-lowrank"] = bl.measure(bl.ckpt_argv(*extract, "--lowrank", "--device", "cpu",
                                                          "-o", outs["ckpt-lowrank"]))
        if cuda:
            log("ckpt lora extract --device cuda ...")
            runs["ckpt-cuda"] = bl.measure(bl.ckpt_argv(*extract, "--device", "cuda", "-o", outs["ckpt-cuda"]))
        if not args.no_kohya:
            log("kohya-style full-load extraction ...")
            runs["kohya"] = bl.measure([sys.executable, __file__, "--kohya", base, tuned, outs["kohya"], args.rank,
                                        args.kohya_device])
        largest = info["largest_numel"] * 2
        # issue #13's bound, 4 x largest + 300 MB over the import, as benchlib's: 2 x largest (+ no pipeline
        # buffers: extract writes its small factors whole) + 2 x largest for the SVD's delta and workspace
        verdict, verdicts = [], {}
        for name in [n for n in runs if n in devices]:
            lines, verdicts[name] = bl.verdict_lines(name, runs[name], runs["cp"], outs["ckpt"].stat().st_size,
                                                     baselines[devices[name]], largest, 0, 2 * largest, "SVD")
            verdict += lines
        ck = runs["ckpt"]
        bound, rss_ok = verdicts["ckpt"]["rss_bound"], verdicts["ckpt"]["rss_ok"]
        checks = [f"target peak RSS (ckpt, full SVD) <= torch import {bl.fmt_mb(torch_floor)} MB + 4 x "
                  f"{bl.fmt_mb(largest)} MB + 300 MB = {bl.fmt_mb(bound)} MB: {'met' if rss_ok else 'NOT met'} "
                  f"({bl.fmt_mb(ck.peak_rss)} MB)"]
        ok = rss_ok
        if "kohya" in runs:
            faster = ck.seconds < runs["kohya"].seconds
            ok &= faster
            checks.append(f"target ckpt (CPU) faster than kohya-style: {'met' if faster else 'NOT met'} "
                          f"({runs['kohya'].seconds / ck.seconds:.2f}x)")
        if "ckpt-cuda" in runs:
            gpu = ck.seconds / runs["ckpt-cuda"].seconds
            ok &= gpu >= GPU_FACTOR
            checks.append(f"target --device cuda >= {GPU_FACTOR:g}x faster than CPU: "
                          f"{'met' if gpu >= GPU_FACTOR else 'NOT met'} ({gpu:.2f}x)")
        verify_res, verify_ok = None, True
        if "kohya" in runs and args.verify_modules:
            m = bl.run_py(__file__, "--verify", base, tuned, outs["ckpt"], outs["kohya"], args.verify_modules)
            verify_res = json.loads(m.stdout.strip().splitlines()[-1])
            reported = reported_errors(ck.stdout)
            for name, (e_ckpt, e_kohya) in verify_res.items():
                verify_ok &= e_ckpt <= e_kohya + 1e-4
                verify_ok &= abs(reported.get(name, -1) - e_ckpt) <= 1e-3 * e_ckpt + 1e-6
        floors = {n: baselines[devices.get(n, "cpu")].peak_rss for n in runs if n != "cp"}  # python + torch
        rows = [[name, f"{m.seconds:.1f}", bl.fmt_mb(m.peak_rss),
                 bl.fmt_mb(m.peak_rss - floors[name]) if name in floors else "-"] for name, m in runs.items()]
        print("\n".join(bl.machine_lines()))
        print(f"device: {'cpu and cuda' if cuda else 'cpu'} (--device {args.device}); files in {parent} "
              f"({bl.where(parent)})")
        print(f"models: 2 x {bl.fmt_gb(info['bytes'])} GB bf16, {info['tensors']} tensors, largest {info['largest']} "
              f"{info['largest_shape']}; fine-tune delta rank {args.delta_rank} + noise; LoRA rank {args.rank}; "
              f"launcher RSS floor {bl.fmt_mb(results['launcher_floor'])} MB, python + torch {bl.fmt_mb(torch_floor)} MB")
        print(bl.markdown_table(["command", "seconds", "peak RSS MB", "over torch import MB"], rows))
        print("\n".join(verdict))
        for line in checks:
            print(line)
        if verify_res is not None:
            worst = ", ".join(f"{n}: ckpt {e[0]:.4e} / kohya {e[1]:.4e}" for n, e in list(verify_res.items())[:4])
            print(f"errors on the largest weights ({'ok' if verify_ok else 'MISMATCH'}): {worst}")
        results.update(info=info, torch_floor=torch_floor, rss_bound=bound, rss_ok=rss_ok, verify=verify_res,
                       device=args.device, devices=["cpu"] + ["cuda"] * cuda, workdir=bl.where(parent),
                       import_baseline_rss={d: m.peak_rss for d, m in baselines.items()}, verdicts=verdicts,
                       runs={k: {"seconds": m.seconds, "peak_rss": m.peak_rss} for k, m in runs.items()})
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        if not verify_ok:
            return 1
        if args.check_targets and not ok:
            return 1
        return 0
    finally:
        for p in [base, tuned, copy, *outs.values()]:
            p.unlink(missing_ok=True)
        try:
            work.rmdir()
        except OSError:
            pass

if __name__ == "__main__":
    sys.exit(main())
