#!/usr/bin/env bash
# Convert every checkpoint under a models folder to fp16 (FP8 layouts are decoded on the way).
#
#   usage: convert-folder-fp16.sh MODELS_DIR [OUT_DIR]
#
# OUT_DIR (default: MODELS_DIR-fp16) mirrors MODELS_DIR's tree: models/loras/x.safetensors becomes
# OUT_DIR/loras/x.safetensors, pickles (.ckpt/.pt/.bin) become .safetensors, model folders stay folders.
# Stopped halfway (Ctrl-C)? Run it again: finished checkpoints are skipped (OUT_DIR/ckpt-batch.jsonl).
# JOBS=2 converts two at a time (refused if their estimated memory exceeds the free RAM).
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 MODELS_DIR [OUT_DIR]" >&2
    exit 2
fi
models=${1%/}
out=${2:-$models-fp16}

# --keep leaves matching tensors in their dtype; add e.g. --keep '*norm*' if you want norms in fp32.
ckpt batch convert "$models" --to fp16 -o "$out" --jobs "${JOBS:-1}"
