"""Benchmark `ckpt convert --to mlx-qN` against `mlx_lm.convert -q` on the same synthetic Llama folder (issue 36,
"Memory"): wall time and peak RSS of each (subprocesses, `os.wait4`, benchlib.py), the import baseline (`python -c
"import torch"`), and whether the outputs' tensors are byte-identical.

Run it with the serving oracles' venv (mlx, mlx-lm, transformers and ckpt installed there):

    .venv-serve/bin/python scripts/bench_mlx.py [--size-mb 300] [--bits 4] [--group-size 64] [--workdir DIR]

The model is a bf16 Llama (hidden 1024, GQA, vocab 32000, untied lm_head) with as many layers as make about
`--size-mb`; its tokenizer a tiny byte-level BPE (mlx_lm.convert needs one; its size does not matter here). Target:
ckpt's peak RSS at most the import baseline + 400 MB (the issue's "import + a few bands + 400 MB"); printed as met /
NOT met, `--check-targets` exits 1 when unmet. Warm cache: an untimed read of the source first.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

MB = 1 << 20

COMPARE = r"""
import sys, torch
from safetensors.torch import load_file
a, b = load_file(sys.argv[1] + "/model.safetensors"), load_file(sys.argv[2] + "/model.safetensors")
raw = lambda t: (t.view(torch.int32) if t.dtype == torch.uint32 else t).contiguous().view(torch.uint8)
same = set(a) == set(b) and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(raw(a[k]), raw(b[k])) for k in a)
cfg = open(sys.argv[1] + "/config.json").read() == open(sys.argv[2] + "/config.json").read()
print("identical" if same and cfg else f"DIFFERENT (tensors same: {same}, config same: {cfg})")
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=300)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--check-targets", action="store_true")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(dir=args.workdir, prefix="bench-mlx-"))
    try:
        src = root / "hf"
        layers, size = bl.llama_folder(src, args.size_mb, tokenizer=True)
        base = bl.run_py("-c", "import torch")
        ours = bl.measure(bl.ckpt_argv("convert", src, "--to", f"mlx-q{args.bits}", "--group-size", args.group_size,
                                       "-o", root / "ours", "-q"))
        ref = bl.measure([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", src, "--mlx-path", root / "ref", "-q",
                          "--q-bits", args.bits, "--q-group-size", args.group_size])
        verdict = bl.run_py("-c", COMPARE, root / "ours", root / "ref").stdout.strip()
        limit = base.peak_rss + 400 * MB
        met = ours.peak_rss <= limit
        print(f"source: Llama bf16, {layers} layers, {size / MB:.0f} MiB; --to mlx-q{args.bits} --group-size "
              f"{args.group_size}; workdir {bl.where(root)}")
        print(f"import torch baseline: peak RSS {base.peak_rss / MB:.0f} MiB")
        print(f"ckpt convert:     {ours.seconds:6.2f} s   peak RSS {ours.peak_rss / MB:6.0f} MiB")
        print(f"mlx_lm.convert:   {ref.seconds:6.2f} s   peak RSS {ref.peak_rss / MB:6.0f} MiB")
        print(f"outputs: {verdict}")
        print(f"target: ckpt peak RSS <= import + 400 MiB ({limit / MB:.0f} MiB): {'met' if met else 'NOT met'}")
        print(json.dumps({"layers": layers, "source_mib": size / MB, "ckpt_s": ours.seconds, "ckpt_rss_mib":
                          ours.peak_rss / MB, "mlx_lm_s": ref.seconds, "mlx_lm_rss_mib": ref.peak_rss / MB,
                          "import_rss_mib": base.peak_rss / MB, "outputs": verdict}))
        return 1 if (args.check_targets and not met) or not verdict.startswith("identical") else 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
