"""Benchmark `ckpt convert` against the naive way and against `cp`, on synthetic checkpoints.

For each case (fp32->fp16, bf16->fp16, ComfyUI scaled-fp8 -> bf16) one Flux-like model is generated
(`--size-gb` is its size in fp32; the bf16 file is half that, the fp8 file about a quarter), then three
commands write the same output, each timed as a subprocess with its peak RSS (`os.wait4`, see
benchlib.py):

- ckpt:  the real CLI, `ckpt convert SRC -o OUT --to DTYPE -q` (fsyncs its output);
- naive: `safetensors.torch.load_file` + cast (+ the ComfyUI scale formula for fp8) + `save_file`,
         then an fsync, so it does the same durable work;
- cp:    `cp` of a file of the output's size (ckpt's own output), then `sync` of the copy. On a filesystem
         that shares extents (XFS with reflink, btrfs) `cp` shares blocks too, so `cp --reflink=never`
         (bytes copied) is timed as well.

The `flux2->diffusers` case is layout conversion: a synthetic Flux.2 file in its original (BFL) layout
(real names and proportions, fused `qkv` and 9x-width `linear1`) becomes a diffusers model folder;
ckpt runs `ckpt convert SRC --layout diffusers`, naive loads the file, runs diffusers' own
`convert_flux2_transformer_checkpoint_to_diffusers` and saves (the way `from_single_file` users convert),
cp copies ckpt's weight file into a folder. Target: peak RSS under 2 x the largest tensor + 300 MB.

Warm cache, stated rather than hidden: dropping the page cache needs root. Each source is freshly
written, and an untimed warm-up `ckpt convert` reads all of it (and writes the reference output that
`cp` copies and the naive output is checked against), so every timed run reads from the page cache.
With `--repeat N` the order of the three variants rotates each round; seconds are the median, peak RSS
the maximum over rounds.

Targets (from the issue): peak RSS of ckpt at most the import baseline (`python -c "import torch"`, with
a CUDA context for `--device cuda`, measured in the same run) + 2x the largest tensor (its bytes in the
larger of the input and output dtypes) + the write stages' buffers + 300 MB; wall time within 1.5x of
cp + sync of the output bytes (1.2x for the layout conversion, 2x for fp8 -> bf16); faster than naive. `--device cuda` runs ckpt on the GPU; `--workdir`
chooses tmpfs (/dev/shm: the disk out of the figures) or a real disk, and the report says which. They are printed as
met / NOT met; `--check-targets` makes an unmet target exit 1. Correctness is checked too: ckpt's output
must equal the naive output bit for bit (exit 1 otherwise; `--no-verify` skips it).

The script itself imports only the standard library (torch runs in subprocesses), because a measured
child's peak RSS starts at this process's own peak. `--naive SRC DST DTYPE` is the internal entry point
of the naive baseline.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

CASES = {
    # name: (source dtype, source layout, target: a dtype, or "layout:diffusers" for convert --layout)
    "fp32->fp16": ("fp32", "plain", "fp16"),
    "bf16->fp16": ("bf16", "plain", "fp16"),
    "fp8->bf16": ("fp8_e4m3fn", "comfy-scaled-fp8", "bf16"),
    "flux2->diffusers": ("bf16", "flux2-bfl", "layout:diffusers"),
}
LAYOUT_FILE = "diffusion_pytorch_model.safetensors"  # what --layout diffusers writes in its folder
VARIANTS = ("ckpt", "naive", "cp")
# wall time targets against cp + sync (issue 25): a layout conversion changes no byte, an fp8 upcast writes
# twice the bytes it reads
TIME_FACTOR = {"flux2->diffusers": 1.2, "fp8->bf16": 2.0}
DEFAULT_TIME_FACTOR = 1.5


def naive_convert(src: str, dst: str, to: str) -> None:
    """The naive way: the whole file in memory, cast, save, fsync (ComfyUI scaled fp8: W = w * scale).
    Layout conversion: diffusers' own single-file converter on the loaded dict, saved in a folder."""
    import os

    import torch
    from safetensors.torch import load_file, save_file

    if to.startswith("layout:"):
        from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

        sd = convert_flux2_transformer_checkpoint_to_diffusers(load_file(src))
        os.makedirs(dst)
        dst = os.path.join(dst, LAYOUT_FILE)
        save_file({k: v.contiguous() for k, v in sd.items()}, dst, metadata={"format": "pt"})
        bl.fsync_path(dst)
        return
    target = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[to]
    sd = load_file(src)
    scaled = any(k == "scaled_fp8" or k.endswith(".scaled_fp8") for k in sd)
    out = {}
    for k, v in sd.items():
        if scaled and (k == "scaled_fp8" or k.endswith((".scaled_fp8", ".scale_weight", ".scale_input"))):
            continue
        scale = sd.get(k[: -len(".weight")] + ".scale_weight") if scaled and k.endswith(".weight") else None
        if scale is not None:
            v = v.float() * scale.float()
        out[k] = v.to(target) if v.is_floating_point() else v
    save_file(out, dst)
    bl.fsync_path(dst)


@dataclass
class Row:
    case: str
    variant: str
    in_bytes: int
    out_bytes: int
    seconds: float
    peak_rss: int


def variant_argv(variant: str, src: Path, ref: Path, out: Path, to: str, device: str = "cpu") -> list[str]:
    layout = to.startswith("layout:")
    if variant == "ckpt":
        what = ["--layout", to.split(":", 1)[1]] if layout else ["--to", to]
        return bl.ckpt_argv("convert", src, "-o", out, *what, "--device", device, "-q")
    if variant == "naive":
        return [sys.executable, __file__, "--naive", str(src), str(out), to]
    flag = " --reflink=never" if variant == "cp --reflink=never" else ""
    if layout:  # the same bytes into a folder
        return ["sh", "-c", f'mkdir -- "$2" && cp{flag} -- "$1" "$2/x" && sync -- "$2/x"', "sh", str(ref / LAYOUT_FILE),
                str(out)]
    return ["sh", "-c", f'cp{flag} -- "$1" "$2" && sync -- "$2"', "sh", str(ref), str(out)]


def _weights(p: Path) -> Path:
    """The weight file of an output: the file itself, or the one file of a --layout folder."""
    return p / LAYOUT_FILE if p.is_dir() else p


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_case(name: str, params: int, work: Path, args, mem_avail: int) -> tuple[list[Row], dict, dict]:
    src_dtype, layout, to = CASES[name]
    ext = "" if to.startswith("layout:") else ".safetensors"  # a --layout output is a folder: no file suffix
    src, ref, out = work / f"src-{src_dtype}.safetensors", work / f"ref{ext}", work / f"out{ext}"
    log(f"[{name}] generating {layout} {src_dtype} source ...")
    info = bl.generate(src, params, src_dtype, layout)
    try:
        log(f"[{name}] warm-up: ckpt convert (untimed; reads the source into the page cache) ...")
        bl.measure(variant_argv("ckpt", src, ref, ref, to, args.device))
        bl.warm(_weights(ref))  # written with O_DIRECT: read into the cache for cp, as the source is for ckpt
        out_bytes = _weights(ref).stat().st_size
        variants = list(VARIANTS)
        if bl.shares_extents(work):  # cp shares the blocks there too (coreutils 9: --reflink=auto); the bytes copied:
            variants.append("cp --reflink=never")
        skipped = {}
        if args.no_naive:
            skipped["naive"] = "--no-naive"
        elif info["bytes"] + out_bytes + 1e9 > 0.8 * mem_avail:
            skipped["naive"] = (f"needs about {bl.fmt_gb(info['bytes'] + out_bytes)} GB of RAM, "
                                f"{bl.fmt_gb(mem_avail)} GB available")
        variants = [v for v in variants if v not in skipped]
        samples: dict[str, list[bl.Measurement]] = {v: [] for v in variants}
        verified = None
        for r in range(args.repeat):
            order = variants[r % len(variants):] + variants[: r % len(variants)]
            for v in order:
                log(f"[{name}] round {r + 1}/{args.repeat}: {v} ...")
                m = bl.measure(variant_argv(v, src, ref, out, to, args.device))
                samples[v].append(m)
                if v == "naive" and verified is None and not args.no_verify:
                    verified = bl.compare(_weights(ref), _weights(out))
                _remove(out)
        rows = [Row(name, v, info["bytes"], out_bytes, statistics.median(m.seconds for m in ms),
                    max(m.peak_rss for m in ms)) for v, ms in samples.items()]
        if verified is None and not args.no_verify:  # naive skipped: check ckpt against nothing
            verified = {"equal": None, "problem": "naive baseline skipped, nothing to compare with"}
        return rows, info, {"skipped": skipped, "verified": verified}
    finally:
        for p in (src, ref, out):
            _remove(p)


def targets(case: str, rows: list[Row], info: dict, baseline_rss: int) -> dict:
    src_dtype, _, to = CASES[case]
    src_item = 1 if info["layout"] == "comfy-scaled-fp8" else bl.ITEMSIZE[src_dtype]
    out_item = bl.ITEMSIZE.get(to, src_item)
    largest = info["largest_numel"] * max(src_item, out_item)
    pipeline = bl.pipeline_bytes(src_item, out_item)
    bound = bl.rss_bound(baseline_rss, largest, pipeline)
    by = {r.variant: r for r in rows}
    ck = by["ckpt"]
    res = {"largest_bytes": largest, "pipeline_bytes": pipeline, "baseline_rss": baseline_rss, "rss_bound": bound,
           "rss_ok": ck.peak_rss <= bound}
    if "cp" in by:
        res["vs_cp"] = ck.seconds / by["cp"].seconds
        res["time_factor"] = TIME_FACTOR.get(case, DEFAULT_TIME_FACTOR)
        res["time_ok"] = res["vs_cp"] <= res["time_factor"]
    if "cp --reflink=never" in by:
        res["vs_cp_copy"] = ck.seconds / by["cp --reflink=never"].seconds
    if "naive" in by:
        res["vs_naive"] = by["naive"].seconds / ck.seconds
        res["faster_ok"] = ck.seconds < by["naive"].seconds
    return res


def yes(ok) -> str:
    return "-" if ok is None else ("met" if ok else "NOT met")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--naive"]:
        naive_convert(*argv[1:4])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=4.0, help="model size in fp32, GB (1e9 bytes); default 4")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    ap.add_argument("--repeat", type=int, default=1, help="timed rounds per case (variant order rotates)")
    bl.add_run_args(ap)
    ap.add_argument("--no-naive", action="store_true", help="skip the naive baseline (it holds the whole file)")
    ap.add_argument("--no-verify", action="store_true", help="skip the bitwise check of ckpt vs naive output")
    ap.add_argument("--check-targets", action="store_true", help="exit 1 if a target is not met")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases or args.repeat < 1 or args.size_gb <= 0:
        ap.error(f"unknown case(s) {bad}" if bad else "need at least one case, --repeat >= 1 and --size-gb > 0")

    params = int(args.size_gb * 1e9 / 4)
    model = bl.model_specs(params)
    machine = bl.machine_info()
    parent = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    need = model.params * 4 * 2 + 1e9  # largest source + reference + one output, with margin
    free = shutil.disk_usage(parent).free
    if need > free:
        log(f"error: {parent}: about {bl.fmt_gb(need)} GB of free disk needed, {bl.fmt_gb(free)} GB free")
        return 2
    mem_avail = _mem_available()
    floor = bl.launcher_floor()
    startup = bl.import_baseline(args.device)

    all_rows, results = [], {}
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=parent))
    try:
        for case in cases:
            rows, info, extra = run_case(case, params, work, args, mem_avail)
            all_rows += rows
            results[case] = {"info": info, "targets": targets(case, rows, info, startup.peak_rss), **extra}
    except bl.BenchError as e:
        log(f"error: {e}")
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)

    report = render(args, argv, machine, model, floor, startup, all_rows, results)
    print(report)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "argv": argv, "rows": [r.__dict__ for r in all_rows],
                                               "results": results, "launcher_floor": floor,
                                               "startup": {"seconds": startup.seconds, "peak_rss": startup.peak_rss}}, indent=2) + "\n")
    failed_verify = [c for c, r in results.items() if r["verified"] and r["verified"]["equal"] is False]
    if failed_verify:
        log(f"error: ckpt output differs from the naive output in {', '.join(failed_verify)}: "
            + "; ".join(results[c]["verified"]["problem"] for c in failed_verify))
        return 1
    unmet = [c for c, r in results.items() for k in ("rss_ok", "time_ok", "faster_ok") if r["targets"].get(k) is False]
    return 1 if args.check_targets and unmet else 0


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return bl.machine_info()["ram"]


def render(args, argv, machine, model, floor, startup, rows, results) -> str:
    big = model.largest
    lines = ["## `ckpt convert` benchmark", ""]
    lines += ["```", "command: " + shlex.join([Path(sys.executable).name, "scripts/bench_convert.py", *argv])]
    lines += bl.machine_lines()
    lines.append(f"model: Flux-like, hidden {model.hidden}, {model.blocks} blocks, {len(model.specs)} logical tensors, "
                 f"{model.params / 1e9:.3f} G params ({bl.fmt_gb(model.params * 4)} GB in fp32)")
    lines.append(f"largest tensor: {big.name} {list(big.shape)} = {big.numel / 1e6:.1f} M elements "
                 f"({bl.fmt_mb(big.numel * 4)} MB fp32, {bl.fmt_mb(big.numel * 2)} MB 16-bit, {bl.fmt_mb(big.numel)} MB fp8)")
    lines.append("cache: warm (fresh source + an untimed warm-up ckpt run; all timed runs read from the page cache); "
                 f"{args.repeat} timed round(s), median seconds, max peak RSS")
    lines.append(f"peak RSS: os.wait4 ru_maxrss of the child (incl. waited-for grandchildren); "
                 f"floor inherited from the launcher: {bl.fmt_mb(floor)} MB")
    lines.append(f"device: {args.device}; files in {Path(args.workdir or tempfile.gettempdir())} "
                 f"({bl.where(args.workdir or tempfile.gettempdir())})")
    lines.append(f"import baseline (python -c 'import torch'{', a CUDA context' if args.device == 'cuda' else ''}): "
                 f"{startup.seconds:.2f} s, {bl.fmt_mb(startup.peak_rss)} MB peak RSS (included in the ckpt and naive figures)")
    lines.append("all three variants fsync their output; GB/s = output bytes / seconds")
    for case, r in results.items():
        t = r["targets"]
        info = r["info"]
        lines.append(f"{case}: source {info['layout']} {info['dtype']}, {info['tensors']} tensors, largest {info['largest']} "
                     f"{info['largest_shape']}; "
                     f"RSS bound = import {bl.fmt_mb(t['baseline_rss'])} + 2 x {bl.fmt_mb(t['largest_bytes'])} + pipeline "
                     f"{bl.fmt_mb(t['pipeline_bytes'])} + 300 = {bl.fmt_mb(t['rss_bound'])} MB"
                     + "".join(f"; {v} skipped ({why})" for v, why in r["skipped"].items()))
    lines += ["```", ""]
    table = []
    for row in rows:
        table.append([row.case, row.variant, bl.fmt_gb(row.in_bytes), bl.fmt_gb(row.out_bytes), f"{row.seconds:.2f}",
                      bl.gbps(row.out_bytes, row.seconds), bl.fmt_mb(row.peak_rss)])
    lines.append(bl.markdown_table(["case", "tool", "input GB", "output GB", "seconds", "GB/s", "peak RSS MB"], table))
    lines.append("")
    trows = []
    for case, r in results.items():
        t, by = r["targets"], {x.variant: x for x in rows if x.case == case}
        ck = by["ckpt"]
        ver = r["verified"]
        trows.append([
            case,
            f"{bl.fmt_mb(ck.peak_rss)} <= {bl.fmt_mb(t['rss_bound'])}: {yes(t['rss_ok'])}",
            (f"{t['vs_cp']:.2f}x cp (<= {t['time_factor']}x): {yes(t['time_ok'])}" if "vs_cp" in t else "-")
            + (f"; {t['vs_cp_copy']:.2f}x cp --reflink=never" if "vs_cp_copy" in t else ""),
            f"{t['vs_naive']:.2f}x faster: {yes(t['faster_ok'])}" if "vs_naive" in t else "skipped",
            "not checked" if ver is None else {True: "bit-identical", False: "DIFFERS", None: "-"}[ver["equal"]],
        ])
    lines.append(bl.markdown_table(["case", "peak RSS MB <= bound", "time vs cp", "faster than naive",
                                    "ckpt == naive"], trows))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
