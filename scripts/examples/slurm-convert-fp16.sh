#!/usr/bin/env bash
# Convert every checkpoint under a models folder to fp16 on a Slurm cluster: one array task per checkpoint,
# then one job that records the results in OUT_DIR's manifest (so a second submission resumes).
#
#   usage: slurm-convert-fp16.sh MODELS_DIR OUT_DIR          (on the login node: plans and submits)
#
# MODELS_DIR and OUT_DIR must be on a filesystem every node mounts at the same path (see README, "Many
# machines"), and ckpt installed on every node. What it does:
#   1. `ckpt batch convert ... --plan-only --json` writes OUT_DIR/jobs.jsonl: one job per line, with the
#      memory it needs (each array task asks Slurm for the largest);
#   2. `sbatch --array=0-(N-1)`: array task i runs line i (`ckpt batch run-job --list ... --index i`);
#   3. `sbatch --dependency=afterany:ARRAY`: `ckpt batch convert ... --collect` folds the results into
#      OUT_DIR/ckpt-batch.jsonl and lists failed or missing jobs (exit 1 then). Run this script again to
#      retry exactly those.
# Extra sbatch options (partition, account, time limit) go in SBATCH_OPTS, e.g. SBATCH_OPTS="-p gpu -t 1:00:00";
# DEVICE=cuda converts on the GPU and asks for one per task.
set -euo pipefail

if [[ $# -eq 2 && $1 == --task ]]; then  # the body of array task $SLURM_ARRAY_TASK_ID
    exec ckpt batch run-job --list "$2" --index "${SLURM_ARRAY_TASK_ID:?not inside a Slurm array job}"
fi
if [[ $# -eq 3 && $1 == --collect ]]; then  # the final job
    exec ckpt batch convert "$2" --to fp16 -o "$3" --device "${DEVICE:-cpu}" --collect
fi
if [[ $# -ne 2 ]]; then
    echo "usage: $0 MODELS_DIR OUT_DIR" >&2
    exit 2
fi
models=$(realpath "${1%/}")
out=$(realpath -m "${2%/}")
device=${DEVICE:-cpu}
script=$(realpath "$0")
mkdir -p "$out"

list="$out/jobs.jsonl"
ckpt batch convert "$models" --to fp16 -o "$out" --device "$device" --plan-only --json > "$list"
n=$(grep -c . "$list" || true)
if [[ $n -eq 0 ]]; then
    echo "nothing to do: every checkpoint under $models is converted (see $out/ckpt-batch.jsonl)"
    exit 0
fi
# Slurm gives every task of an array the same resources: the largest job's memory, in MB.
mem_mb=$(python3 -c 'import json, sys; print(max(json.loads(l)["memory"] for l in open(sys.argv[1]) if l.strip()) // 2**20 + 1)' "$list")
gres=()
[[ $device == cuda ]] && gres=(--gres=gpu:1)

# shellcheck disable=SC2086  # SBATCH_OPTS is a list of options
array=$(sbatch --parsable ${SBATCH_OPTS:-} --job-name=ckpt-fp16 --array="0-$((n - 1))" --cpus-per-task=1 \
        --mem="${mem_mb}M" "${gres[@]}" --output="$out/slurm-%A_%a.log" "$script" --task "$list")
array=${array%%;*}
# shellcheck disable=SC2086
collect=$(sbatch --parsable ${SBATCH_OPTS:-} --job-name=ckpt-fp16-collect --dependency="afterany:$array" \
          --output="$out/slurm-%j-collect.log" "$script" --collect "$models" "$out")
echo "submitted $n conversions as array job $array, and job ${collect%%;*} to collect them into $out/ckpt-batch.jsonl"
