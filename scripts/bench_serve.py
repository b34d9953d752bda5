"""Benchmark `ckpt convert --to ct-*` against llm-compressor 0.14's `model_free_ptq` (its data-free, model-free path)
on the same synthetic Llama folder (issue 36, "Memory"): wall time and peak RSS of each (subprocesses, `os.wait4`,
benchlib.py), the import baseline (`python -c "import torch"`), and whether the Linear weights' tensors are
byte-identical (model_free_ptq also quantizes the embedding, which is no Linear: it is told to ignore it here).

Run it with the serving oracles' venv (llm-compressor and ckpt installed there):

    .venv-serve/bin/python scripts/bench_serve.py [--size-mb 300] [--to ct-w4a16] [--workdir DIR] [--check-targets]

The model is a bf16 Llama (hidden 1024, GQA, vocab 32000, untied lm_head) with as many layers as make about
`--size-mb`. Target: ckpt's peak RSS at most the import baseline + 400 MB; printed as met / NOT met,
`--check-targets` exits 1 when unmet. Warm cache: an untimed read of the source first.
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
SCHEMES = {"ct-fp8-dynamic": "FP8_DYNAMIC", "ct-fp8-block": "FP8_BLOCK", "ct-w4a16": "W4A16", "ct-w8a16": "W8A16",
           "ct-nvfp4a16": "NVFP4A16"}

REFERENCE = r"""
import sys
from llmcompressor import model_free_ptq
model_free_ptq(sys.argv[1], sys.argv[2], scheme=sys.argv[3], ignore=["lm_head", "model.embed_tokens"], device="cpu")
"""

COMPARE = r"""
import glob, sys, torch
from safetensors.torch import load_file
def load(d):
    out = {}
    for f in sorted(glob.glob(d + "/*.safetensors")):
        out.update(load_file(f))
    return out
a, b = load(sys.argv[1]), load(sys.argv[2])
raw = lambda t: t.contiguous().view(torch.uint8)
same = set(a) == set(b) and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(raw(a[k]), raw(b[k])) for k in a)
print("identical" if same else "DIFFERENT")
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=300)
    ap.add_argument("--to", default="ct-w4a16", choices=sorted(SCHEMES))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--check-targets", action="store_true")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(dir=args.workdir, prefix="bench-serve-"))
    try:
        src = root / "hf"
        layers, size = bl.llama_folder(src, args.size_mb, tokenizer=False)
        base = bl.run_py("-c", "import torch")
        ours = bl.measure(bl.ckpt_argv("convert", src, "--to", args.to, "-o", root / "ours", "-q"))
        ref = bl.measure([sys.executable, "-c", REFERENCE, src, root / "ref", SCHEMES[args.to]])
        verdict = bl.run_py("-c", COMPARE, root / "ours", root / "ref").stdout.strip()
        limit = base.peak_rss + 400 * MB
        met = ours.peak_rss <= limit
        print(f"source: Llama bf16, {layers} layers, {size / MB:.0f} MiB; --to {args.to}; workdir {bl.where(root)}")
        print(f"import torch baseline: peak RSS {base.peak_rss / MB:.0f} MiB")
        print(f"ckpt convert:     {ours.seconds:6.2f} s   peak RSS {ours.peak_rss / MB:6.0f} MiB")
        print(f"model_free_ptq:   {ref.seconds:6.2f} s   peak RSS {ref.peak_rss / MB:6.0f} MiB")
        print(f"outputs: {verdict}")
        print(f"target: ckpt peak RSS <= import + 400 MiB ({limit / MB:.0f} MiB): {'met' if met else 'NOT met'}")
        print(json.dumps({"layers": layers, "source_mib": size / MB, "to": args.to, "ckpt_s": ours.seconds,
                          "ckpt_rss_mib": ours.peak_rss / MB, "model_free_ptq_s": ref.seconds,
                          "model_free_ptq_rss_mib": ref.peak_rss / MB, "import_rss_mib": base.peak_rss / MB,
                          "outputs": verdict}))
        return 1 if (args.check_targets and not met) or verdict != "identical" else 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
