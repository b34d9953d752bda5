#!/usr/bin/env bash
# One CSV row per checkpoint under a folder: kind (model/LoRA), family, storage encodings (FP8,
# optimum-quanto, ...), dtypes, tensor/parameter counts, bytes and warnings. Reads headers only.
#
#   usage: inspect-to-csv.sh FOLDER [CSV]
#
# CSV defaults to checkpoints.csv in the current folder. A file that cannot be read gets a row with
# status "failed" and the error; the script then exits non-zero after writing the CSV.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 FOLDER [CSV]" >&2
    exit 2
fi
folder=${1%/}
csv=${2:-checkpoints.csv}

ckpt batch inspect "$folder" --csv "$csv" --quiet
