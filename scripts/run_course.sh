#!/usr/bin/env bash
# The course's main job: set up, build, train every chapter on the CPU with the same
# seed, data and global batch, then print them side by side.
#   ./scripts/run_course.sh                 # the default run (about a minute)
#   ./scripts/run_course.sh --steps 50      # extra flags go to every chapter
set -euo pipefail
cd "$(dirname "$0")/.."
bin="$(./scripts/build.sh)"
runs="runs/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$runs"
common_flags=(--steps 200 --batch 8 --seed 1337 --print-every 20 "$@")

echo
echo "==== chapter 00: single device ===="
"$bin/00_single_gpu" "${common_flags[@]}" --log "$runs/00_single_gpu.jsonl"

echo
echo "==== chapter 01: the launcher starts 4 ranks; every collective, checked ===="
"$bin/launch" --nproc-per-node 4 --master-port 0 -- "$bin/collectives_tour" | sed -n 's/^\[rank 0\] //p'

echo
echo "==== chapter 02: data parallel on 2 ranks (the same global batch, split in two) ===="
"$bin/launch" --nproc-per-node 2 --master-port 0 -- "$bin/02_ddp" "${common_flags[@]}" \
  --log "$runs/02_ddp.jsonl" | sed -n 's/^\[rank 0\] //p'

echo
echo "==== chapter 03: ZeRO-3 / FSDP on 2 ranks (parameters, gradients and AdamW state sharded) ===="
"$bin/launch" --nproc-per-node 2 --master-port 0 -- "$bin/03_fsdp" --zero-stage 3 "${common_flags[@]}" \
  --log "$runs/03_fsdp.jsonl" | sed -n 's/^\[rank 0\] //p'

echo
echo "==== side by side (metrics in $runs) ===="
"$bin/compare_runs" "$runs/00_single_gpu.jsonl" "$runs/02_ddp.jsonl" "$runs/03_fsdp.jsonl"
