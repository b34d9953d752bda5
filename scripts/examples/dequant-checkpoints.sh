#!/usr/bin/env bash
# Dequantize every `checkpoint-*` of a training run (optimum-quanto qint8/qfloat8/qint4, scaled FP8)
# back to plain weights, e.g. to resume training without the quanto "KeyError: '...weight._data'".
#
#   usage: dequant-checkpoints.sh RUN_DIR [OUT_DIR]
#
# Only checkpoints inside folders named checkpoint-* are touched; optimizer/scheduler/RNG state is not
# weights and is skipped. Checkpoints with nothing quantized (e.g. LoRA files) are listed, not written.
# OUT_DIR (default: RUN_DIR-dequant) mirrors RUN_DIR's tree; re-running skips what is done.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 RUN_DIR [OUT_DIR]" >&2
    exit 2
fi
run=${1%/}
out=${2:-$run-dequant}

# --to bf16 would write bf16 instead of each weight's original dtype.
ckpt batch dequant "$run" --glob 'checkpoint-*' -o "$out"
