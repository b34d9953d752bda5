#!/usr/bin/env bash
# Merge one LoRA into every base checkpoint of a folder (kohya, LyCORIS, PEFT/diffusers LoRAs).
#
#   usage: merge-lora-into-bases.sh LORA BASES_DIR [OUT_DIR] [RATIO]
#
# Each base gets its own merged copy under OUT_DIR (default: BASES_DIR-merged), mirroring BASES_DIR.
# RATIO is the LoRA strength (default 1.0). A base the LoRA does not fit fails alone: the others are
# still merged, the summary lists the failure, and the script exits non-zero.
# The reverse (many LoRAs into one base) is: ckpt batch merge-lora LORAS_DIR --base BASE -o OUT_DIR
set -euo pipefail

if [[ $# -lt 2 || $# -gt 4 ]]; then
    echo "usage: $0 LORA BASES_DIR [OUT_DIR] [RATIO]" >&2
    exit 2
fi
lora=$1
bases=${2%/}
out=${3:-$bases-merged}
ratio=${4:-1.0}

ckpt batch merge-lora "$bases" --lora "$lora" --ratio "$ratio" -o "$out"
