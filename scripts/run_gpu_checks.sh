#!/usr/bin/env bash
# What to run on a machine with NVIDIA GPUs, before believing anything the course says
# about GPUs. It
#   1. builds the `cuda` preset for the GPU it finds (its own architecture only);
#   2. runs every CUDA test, then again under compute-sanitizer (memcheck, racecheck)
#      when the toolkit has it;
#   3. trains every chapter 02-07 on the GPU and holds its losses against chapter 00's
#      on the same GPU: fp32 within 1e-5 relative, bf16 within 1e-2 (below). With one
#      GPU the ranks share it through the staged tcp backend; with a GPU per rank they
#      use nccl;
#   4. prints chapter 00's step at GPT-2 small's shape (d-model 768, 12 layers, 12 heads,
#      sequence 1024) in fp32, tf32 and bf16: MFU against the GPU's dense bf16 peak and
#      against the rate cuBLAS reaches alone on the model's largest GEMM;
#   5. prints the share of DDP's all-reduce time hidden behind backward.
# Exits 1 naming what failed (every part runs; the failures are listed at the end).
#   ./scripts/run_gpu_checks.sh            # about 6 minutes on an H100 with 16 cores
#
# The bf16 bound: a parallel run splits the batch or the matrices, so its fp32
# accumulations add in another order and its weights differ from chapter 00's in the
# last bits. Rounded to bf16 (8 significant bits) for the next product, a value that
# sits near a rounding boundary can go the other way: a 2^-8 = 0.4% change in one
# input of one product. Averaged over the batch's tokens those flips move the loss
# by far less, but they do not cancel step after step, so 20 steps get 1e-2 (fp32
# runs stay within 1e-5 because nothing rounds away the last bits).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

failures=()
fail() { failures+=("$1"); echo "FAILED: $1"; }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "run_gpu_checks: no NVIDIA GPU here (nvidia-smi finds none; hint: run it on a machine with one)" >&2
  exit 2
fi
gpus=$(nvidia-smi -L | wc -l)
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
echo "== $gpus GPU(s): $gpu_name (sm_$arch)"

# ---- 1. build --------------------------------------------------------------------------
# A machine with no package registry may have everything already: only install what lacks.
./scripts/setup.sh || echo "(setup could not install packages; building with what is here)"
cmake --preset cuda -DCMAKE_CUDA_ARCHITECTURES="$arch" >/dev/null || { echo "configure failed" >&2; exit 1; }
if ! cmake --build --preset cuda -j "$(nproc)" >/tmp/course_gpu_build.txt 2>&1; then
  grep -E "error" /tmp/course_gpu_build.txt | head -20
  echo "build failed (log: /tmp/course_gpu_build.txt)" >&2
  exit 1
fi
bin=build/cuda/bin

# ---- 2. the CUDA tests --------------------------------------------------------------------
echo "== CUDA tests"
ctest --preset cuda -L cuda --output-on-failure || fail "CUDA tests"
if command -v compute-sanitizer >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool on test_cuda"
    "$sanitizer" --tool "$tool" --error-exitcode 3 "$bin/test_cuda" >/tmp/course_sanitizer_$tool.txt 2>&1 ||
      fail "compute-sanitizer $tool (log: /tmp/course_sanitizer_$tool.txt)"
    tail -3 /tmp/course_sanitizer_$tool.txt
  done
else
  echo "(compute-sanitizer not found: skipped)"
fi

# ---- 3. every chapter on the GPU against chapter 00 on the same GPU -------------------------
ranks=2
backend=tcp  # one GPU: the ranks share it, their buffers staged through the host
if [ "$gpus" -ge "$ranks" ]; then backend=nccl; fi
model=(--layers 4 --d-model 128 --heads 4 --seq 128 --batch 8 --micro-batches 2 --steps 20 --quiet)
logs=$(mktemp -d)

# the losses of two logs, step by step: the largest relative difference
max_relative_difference() {
  paste <(grep -o '"loss": [-0-9.e+]*' "$1" | cut -d' ' -f2) <(grep -o '"loss": [-0-9.e+]*' "$2" | cut -d' ' -f2) |
    awk 'BEGIN { worst = 0; n = 0 }
         { n++; d = ($1 - $2) / ($2 == 0 ? 1 : $2); if (d < 0) d = -d; if (d > worst) worst = d }
         END { if (n == 0) print "none"; else printf "%.3g\n", worst }'
}

for dtype in fp32 bf16; do
  bound=1e-5
  if [ "$dtype" = bf16 ]; then bound=1e-2; fi
  reference="$logs/00_$dtype.jsonl"
  "$bin/00_single_gpu" "${model[@]}" --device cuda --dtype "$dtype" --log "$reference" >/dev/null ||
    { fail "00_single_gpu --dtype $dtype"; continue; }
  while read -r name chapter flags; do
    log="$logs/${name}_$dtype.jsonl"
    # shellcheck disable=SC2086
    if ! "$bin/launch" --nproc-per-node "$ranks" -- "$bin/$chapter" "${model[@]}" $flags --device cuda \
        --dtype "$dtype" --backend "$backend" --comm-timeout 120 --log "$log" >"$logs/$name.out" 2>&1; then
      fail "$name ($dtype): the run failed (output: $logs/$name.out)"
      tail -5 "$logs/$name.out"
      continue
    fi
    difference=$(max_relative_difference "$log" "$reference")
    verdict=ok
    if [ "$difference" = none ] || awk -v d="$difference" -v b="$bound" 'BEGIN { exit !(d > b) }'; then
      verdict="OVER $bound"
      fail "$name ($dtype): losses differ from chapter 00's by $difference (bound $bound)"
    fi
    printf '%-22s %-5s %-6s largest loss difference vs chapter 00: %-9s %s\n' "$name" "$dtype" "$backend" \
      "$difference" "$verdict"
  done <<'CHAPTERS'
02_ddp 02_ddp
03_zero1 03_fsdp --zero-stage 1
03_fsdp 03_fsdp --zero-stage 3
04_naive 04_naive_model_parallel
05_1f1b 05_pipeline --schedule 1f1b
05_zb-h1 05_pipeline --schedule zb-h1
06_tp 06_tensor_parallel
06_tp_sp 06_tensor_parallel --sp
07_dp_tp 07_3d --dp 1 --pp 1 --tp 2 --sp
07_pp 07_3d --dp 1 --pp 2 --tp 1
CHAPTERS
done

# ---- 4. chapter 00's MFU at GPT-2 small's shape ------------------------------------------------
case "$gpu_name" in
  *H100*PCIe*) peak=756 ;;
  *H100* | *H200*) peak=989.4 ;;
  *A100*) peak=312 ;;
  *L4*) peak=121 ;;
  *) peak=0 ;;
esac
echo "== chapter 00's step at GPT-2 small's shape (MFU against ${peak} TFLOP/s dense bf16; 0: unknown GPU)"
if [ "$peak" = 0 ]; then peak=1; fi
"$bin/bench_gpu_step" --peak-tflops "$peak" --steps 10 --warmup 3 | tee "$logs/mfu.txt" || fail "bench_gpu_step"
mfu=$(awk '$1 == "bf16" { sub("%", "", $6); print $6 }' "$logs/mfu.txt")
case "$gpu_name" in
  *H100* | *H200*)
    if [ -z "$mfu" ] || awk -v m="$mfu" 'BEGIN { exit !(m < 40) }'; then
      fail "chapter 00's bf16 MFU is ${mfu:-unknown}%, under the 40% target on an H100/H200"
    fi ;;
esac

# ---- 5. DDP's all-reduce hidden behind backward -----------------------------------------------
echo "== DDP on the GPU: the share of the all-reduce time hidden behind backward ($backend)"
if "$bin/launch" --nproc-per-node "$ranks" -- "$bin/02_ddp" --layers 12 --d-model 768 --heads 12 --seq 1024 \
    --batch "$((2 * ranks))" --steps 8 --quiet --device cuda --dtype bf16 --backend "$backend" --comm-timeout 300 \
    --log "$logs/ddp_overlap.jsonl" >/dev/null 2>&1; then
  tail -1 "$logs/ddp_overlap.jsonl" | grep -o '"\(comm_ms_per_step\|exposed_comm_ms_per_step\|comm_hidden_fraction\)": [-0-9.e+]*'
else
  fail "02_ddp at GPT-2 small's shape"
fi

echo
if [ ${#failures[@]} -eq 0 ]; then
  echo "run_gpu_checks: everything passed on $gpu_name"
  exit 0
fi
echo "run_gpu_checks: ${#failures[@]} failure(s) on $gpu_name:"
printf '  - %s\n' "${failures[@]}"
exit 1
