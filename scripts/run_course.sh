#!/usr/bin/env bash
# The course's main job: set up, build, train every chapter on the CPU with the same
# seed, data and global batch, then print them side by side.
#   ./scripts/run_course.sh                 # the default run (about 100 s on 2 cores, after the build)
#   ./scripts/run_course.sh --steps 50      # extra flags go to every chapter
# COURSE_BIN_DIR=DIR runs DIR's programs and builds nothing (scripts/update_readme_outputs.sh
# does, to hold the README to this job's output); COURSE_RUNS_DIR=DIR puts the run's
# folder there instead of runs/.
set -euo pipefail
cd "$(dirname "$0")/.."
# build only what this job runs: the CPU build unless this machine has a GPU (the test
# command, scripts/run_tests.sh, still builds the CUDA backend wherever nvcc is)
if [[ -z "${COURSE_PRESET:-}" ]] && ! nvidia-smi -L >/dev/null 2>&1; then export COURSE_PRESET=cpu; fi
# what this job runs, and the tools the chapter READMEs use next (the planner, the
# checkpoint and trace tools): not the tests and benchmarks, which ./scripts/build.sh builds
if [[ -n "${COURSE_BIN_DIR:-}" ]]; then
  bin="$COURSE_BIN_DIR"
else
  bin="$(./scripts/build.sh launch collectives_tour 00_single_gpu 02_ddp 03_fsdp 04_naive_model_parallel 05_pipeline \
       06_tensor_parallel 07_3d 08_context_parallel 09_expert_parallel 10_slow_links compare_runs report 07_plan \
       consolidate_checkpoint export_safetensors import_safetensors merge_traces)"
fi
runs="${COURSE_RUNS_DIR:-runs}/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$runs"
common_flags=(--steps 200 --batch 8 --seed 1337 --print-every 20 "$@")
# rank 0's lines, without the launcher's "[rank 0] " prefix; sed -u passes each line
# on at once, so progress shows even when this script's output is piped or teed
rank0() { sed -un 's/^\[rank 0\] //p'; }

echo
echo "==== chapter 00: single device ===="
"$bin/00_single_gpu" "${common_flags[@]}" --log "$runs/00_single_gpu.jsonl"

echo
echo "==== chapter 01: the launcher starts 4 ranks; every collective, checked ===="
"$bin/launch" --nproc-per-node 4 --master-port 0 -- "$bin/collectives_tour" | rank0

echo
echo "==== chapter 02: data parallel on 2 ranks (the same global batch, split in two) ===="
"$bin/launch" --nproc-per-node 2 --master-port 0 -- "$bin/02_ddp" "${common_flags[@]}" \
  --log "$runs/02_ddp.jsonl" | rank0

echo
echo "==== chapter 03: ZeRO-3 / FSDP on 2 ranks (parameters, gradients and AdamW state sharded) ===="
"$bin/launch" --nproc-per-node 2 --master-port 0 -- "$bin/03_fsdp" --zero-stage 3 "${common_flags[@]}" \
  --log "$runs/03_fsdp.jsonl" | rank0

for chapter in 02_ddp 03_fsdp; do
  echo
  echo "==== chapter ${chapter:0:2} on 4 ranks: per-rank memory, DDP against ZeRO-3 (in the table below) ===="
  "$bin/launch" --nproc-per-node 4 --master-port 0 -- "$bin/$chapter" "${common_flags[@]}" \
    --log "$runs/${chapter}_4ranks.jsonl" | rank0
done

echo
echo "==== chapter 04: the model cut in two by layers (one rank busy at a time) ===="
"$bin/launch" --nproc-per-node 2 --master-port 0 -- "$bin/04_naive_model_parallel" "${common_flags[@]}" \
  --log "$runs/04_naive_model_parallel.jsonl" | rank0

for schedule in 1f1b zb-h1; do
  echo
  echo "==== chapter 05: pipeline on 2 ranks, 8 micro-batches, schedule $schedule ===="
  "$bin/launch" --nproc-per-node 2 --master-port 0 -- "$bin/05_pipeline" --schedule "$schedule" \
    --micro-batches 8 "${common_flags[@]}" --log "$runs/05_pipeline_$schedule.jsonl" \
    --trace "$runs/05_pipeline_$schedule.trace.json" | rank0
done

for sp in "" --sp; do
  echo
  echo "==== chapter 06: tensor parallel on 2 ranks (every matrix split in two)${sp:+, sequence parallel} ===="
  "$bin/launch" --nproc-per-node 2 --master-port 0 -- "$bin/06_tensor_parallel" $sp "${common_flags[@]}" \
    --log "$runs/06_tensor_parallel${sp/--/_}.jsonl" | rank0
done

echo
echo "==== chapter 07: 3D parallel on 8 ranks: dp 2 x pp 2 x tp 2 (8 ranks share 2 cores here) ===="
"$bin/launch" --nproc-per-node 8 --master-port 0 -- "$bin/07_3d" --dp 2 --pp 2 --tp 2 "${common_flags[@]}" \
  --log "$runs/07_3d.jsonl" | rank0

echo
echo "==== chapter 08: context parallel on 2 ranks (every sequence split in two, zigzag; ring attention) ===="
"$bin/launch" --nproc-per-node 2 --master-port 0 -- "$bin/08_context_parallel" --cp 2 --cp-split zigzag \
  "${common_flags[@]}" --log "$runs/08_context_parallel.jsonl" | rank0

echo
echo "==== chapter 00 again, a mixture of experts: 4 expert MLPs per block, each token to 2 of them ===="
"$bin/00_single_gpu" --experts 4 --top-k 2 "${common_flags[@]}" --log "$runs/00_single_gpu_moe.jsonl"

echo
echo "==== chapter 09: expert parallel on 2 ranks (2 of the 4 experts each; tokens sent to them and back) ===="
"$bin/launch" --nproc-per-node 2 --master-port 0 -- "$bin/09_expert_parallel" --experts 4 --top-k 2 \
  "${common_flags[@]}" --log "$runs/09_expert_parallel.jsonl" | rank0

echo
echo "==== chapter 10: DiLoCo on 2 workers at 2 sites, 100 Mbit/s and 25 ms apart (weights averaged every 10 steps) ===="
"$bin/launch" --nproc-per-node 2 --master-port 0 -- "$bin/10_slow_links" --inner-steps 10 \
  --sites 2 --wan-bandwidth 100Mbit --wan-latency 25ms "${common_flags[@]}" --log "$runs/10_slow_links.jsonl" | rank0

echo
echo "==== chapter 00 at bf16: mixed precision (each product's inputs rounded to bf16, fp32 sums) ===="
"$bin/00_single_gpu" --dtype bf16 "${common_flags[@]}" --log "$runs/00_single_gpu_bf16.jsonl"

echo
echo "==== chapter 07 at bf16: activations cross tp and pp as bf16, gradients cross dp as bf16 (half the bytes) ===="
"$bin/launch" --nproc-per-node 8 --master-port 0 -- "$bin/07_3d" --dp 2 --pp 2 --tp 2 --dtype bf16 \
  --grad-comm-dtype bf16 "${common_flags[@]}" --log "$runs/07_3d_bf16.jsonl" | rank0

echo
echo "==== side by side (metrics in $runs) ===="
"$bin/compare_runs" "$runs/00_single_gpu.jsonl" "$runs/02_ddp.jsonl" "$runs/03_fsdp.jsonl" \
  "$runs/02_ddp_4ranks.jsonl" "$runs/03_fsdp_4ranks.jsonl" \
  "$runs/04_naive_model_parallel.jsonl" "$runs/05_pipeline_1f1b.jsonl" "$runs/05_pipeline_zb-h1.jsonl" \
  "$runs/06_tensor_parallel.jsonl" "$runs/06_tensor_parallel_sp.jsonl" "$runs/07_3d.jsonl" \
  "$runs/08_context_parallel.jsonl" "$runs/00_single_gpu_moe.jsonl" "$runs/09_expert_parallel.jsonl" \
  "$runs/10_slow_links.jsonl" "$runs/00_single_gpu_bf16.jsonl" "$runs/07_3d_bf16.jsonl"

echo
echo "==== the course report: every chapter side by side, in pictures (open it in a browser) ===="
"$bin/report" "$runs"
