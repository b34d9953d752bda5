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

GENERATE = r"""
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import PreTrainedTokenizerFast

out, layers = Path(sys.argv[1]), int(sys.argv[2])
cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                               num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(cfg)
g = torch.Generator().manual_seed(0)
sd = {}
for name, p in model.state_dict().items():
    sd[name] = (torch.randn(p.shape, generator=g) * (0.02 if p.dim() == 2 else 1)).to(torch.bfloat16)
out.mkdir(parents=True)
save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
d = cfg.to_dict() | {"architectures": ["LlamaForCausalLM"], "dtype": "bfloat16"}
(out / "config.json").write_text(json.dumps(d, indent=2))
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10,
                        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                            show_progress=False))
PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="dog").save_pretrained(out)
"""

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
    per_layer = 2 * (2 * 1024 * 1024 + 2 * 1024 * 256 + 3 * 1024 * 2816)
    fixed = 2 * 2 * 32000 * 1024
    layers = max(1, round((args.size_mb * MB - fixed) / per_layer))
    root = Path(tempfile.mkdtemp(dir=args.workdir, prefix="bench-mlx-"))
    try:
        src = root / "hf"
        bl.run_py("-c", GENERATE, src, layers)
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        bl.warm(src / "model.safetensors")
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
