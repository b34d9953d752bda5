"""Benchmark `ckpt merge-lora` on a LitGPT finetune folder against `litgpt merge_lora` itself.

A TinyLlama-shaped LitGPT base (22 layers, n_embd 2048, 32 heads in 4 query groups: 1.1 B parameters,
2.2 GB in bf16; `--layers` scales it) and a rank-8 LoRA on q/k/v, projection, MLP and head are generated
with random values, in LitGPT's own files (lit_model.pth, model_config.yaml, lit_model.pth.lora,
hyperparameters.yaml). Then, each timed as a subprocess with its peak RSS (`os.wait4`, see benchlib.py):

- ckpt:   `ckpt merge-lora FT -o OUT -q` (streams, writes lit_model.pth as torch's zip, fsyncs);
- litgpt: `litgpt.scripts.merge_lora.merge_lora(FT)` on a copy of the folder (the model on the meta
          device, the base memory-mapped, merged in place, `torch.save`), followed by an fsync.

Both must agree: every tensor equal to within bf16 rounding (litgpt rounds three times in bf16, ckpt
once from fp32), checked after the timed runs. Needs the LitGPT venv (`make setup-litgpt`): run it with
`.venv-litgpt/bin/python scripts/bench_litgpt.py`. Warm page cache, as in bench_convert.py. ckpt's time
is also given as a ratio of `cp` + `sync` of its output file, and its peak RSS against import baseline
(`python -c "import torch"`, with a CUDA context for `--device cuda`) + 2x the largest tensor (the
embedding) + the pipeline's buffers + the LoRA file + 300 MB. `--device` is passed to ckpt; `--workdir`
chooses tmpfs (/dev/shm) or a disk (the folders are then kept).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

CONFIG = dict(name="bench-tinyllama", block_size=2048, vocab_size=32000, padded_vocab_size=32000, n_layer=22,
              n_embd=2048, n_head=32, n_query_groups=4, rotary_percentage=1.0, parallel_residual=False, bias=False,
              norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=5632)
LORA = dict(lora_r=8, lora_alpha=16, lora_query=True, lora_key=True, lora_value=True, lora_projection=True,
            lora_mlp=True, lora_head=True)


def make(work: Path, layers: int) -> None:
    """Subprocess side: write the base folder and the finetune folder (random bf16 values)."""
    import torch
    import yaml
    from litgpt.config import Config
    from litgpt.lora import GPT as LoraGPT, Config as LoraConfig
    from litgpt.model import GPT
    from litgpt.utils import save_config

    kw = dict(CONFIG, n_layer=layers)
    base, ft = work / "base", work / "ft"
    base.mkdir(parents=True)
    ft.mkdir()
    g = torch.Generator().manual_seed(0)
    cfg = Config(**kw)
    with torch.device("meta"):
        shapes = {k: t.shape for k, t in GPT(cfg).state_dict().items()}
        lora_shapes = {k: t.shape for k, t in LoraGPT(LoraConfig(**kw, **LORA)).state_dict().items() if "lora_" in k}
    sd = {k: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    torch.save(sd, base / "lit_model.pth")
    del sd
    save_config(cfg, base)
    lora = {k: (torch.randn(s, generator=g) * 0.01).to(torch.bfloat16) for k, s in lora_shapes.items()}
    torch.save({"model": lora}, ft / "lit_model.pth.lora")
    save_config(cfg, ft)
    for d in (base, ft):  # litgpt checks that a checkpoint folder has tokenizer files
        (d / "tokenizer.json").write_text("{}")
        (d / "tokenizer_config.json").write_text("{}")
    hp = dict(checkpoint_dir=str(base), precision="bf16-true", **LORA)
    (ft / "hyperparameters.yaml").write_text(yaml.safe_dump(hp))


def litgpt_merge(ft: Path) -> None:
    """Subprocess side: litgpt's own merge, then an fsync so it does the same durable work as ckpt."""
    from litgpt.scripts.merge_lora import merge_lora

    merge_lora(ft)
    bl.fsync_path(ft / "lit_model.pth")


def compare(a: Path, b: Path) -> None:
    """Subprocess side: same keys and dtypes; values within bf16 rounding of each other."""
    import torch

    x, y = torch.load(a, mmap=True, weights_only=True), torch.load(b, mmap=True, weights_only=True)
    assert set(x) == set(y), "different keys"
    worst = 0.0
    for k in x:
        assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, k
        d = ((x[k].float() - y[k].float()).abs() / y[k].float().abs().clamp_min(1e-3)).max().item()
        worst = max(worst, d)
    assert worst < 2 ** -5, f"relative difference {worst}"
    print(f"outputs agree: {len(x)} tensors, worst relative difference {worst:.2e} (bf16 step 7.8e-03)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=22, help="transformer layers (22: TinyLlama 1.1B)")
    bl.add_run_args(ap)
    ap.add_argument("--make", metavar="WORK", help=argparse.SUPPRESS)
    ap.add_argument("--litgpt-merge", metavar="FT", help=argparse.SUPPRESS)
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.make:
        make(Path(args.make), args.layers)
        return 0
    if args.litgpt_merge:
        litgpt_merge(Path(args.litgpt_merge))
        return 0
    if args.compare:
        compare(Path(args.compare[0]), Path(args.compare[1]))
        return 0

    baseline = bl.import_baseline(args.device)  # first: --device cuda without a GPU stops here, in one line
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckpt-bench-litgpt-"))
    try:
        print("\n".join(bl.machine_lines()))
        bl.run_py(__file__, "--make", work, "--layers", args.layers)
        size = (work / "base" / "lit_model.pth").stat().st_size
        shutil.copytree(work / "ft", work / "ft-litgpt")
        floor = bl.launcher_floor()
        ours = bl.measure(bl.ckpt_argv("merge-lora", work / "ft", "-o", work / "out", "--device", args.device, "-q"))
        out_file = work / "out" / "lit_model.pth"
        cp = bl.cp_baseline(out_file, work / "cp-lit_model.pth")
        lora_bytes = (work / "ft" / "lit_model.pth.lora").stat().st_size
        verdict, _ = bl.verdict_lines("ckpt merge-lora", ours, cp, out_file.stat().st_size, baseline,
                                      CONFIG["padded_vocab_size"] * CONFIG["n_embd"] * 2, bl.pipeline_bytes(2, 2),
                                      lora_bytes, "LoRA")
        theirs = bl.run_py(__file__, "--litgpt-merge", work / "ft-litgpt")
        print(bl.run_py(__file__, "--compare", work / "out" / "lit_model.pth",
                        work / "ft-litgpt" / "lit_model.pth").stdout.strip())
        rows = [["ckpt merge-lora", f"{ours.seconds:.1f}", bl.fmt_mb(ours.peak_rss)],
                ["cp + sync", f"{cp.seconds:.1f}", bl.fmt_mb(cp.peak_rss)],
                ["litgpt merge_lora", f"{theirs.seconds:.1f}", bl.fmt_mb(theirs.peak_rss)]]
        print(f"\nbase: {args.layers} layers, {bl.fmt_gb(size)} bf16 lit_model.pth; launcher floor "
              f"{bl.fmt_mb(floor)}; command: {' '.join(['python', 'scripts/bench_litgpt.py'] + (argv or sys.argv[1:]))}")
        print(f"device: {args.device}; files in {work} ({bl.where(work)})")
        print(bl.markdown_table(["variant", "seconds", "peak RSS"], rows))
        print("\n".join(verdict))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
