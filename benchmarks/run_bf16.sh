#!/usr/bin/env bash
# What bf16 costs and buys, on this machine:
#   1. chapter 00 with --dtype fp32 and bf16 (every GEMM's inputs rounded to bf16, fp32
#      sums: gemm_cpu.h), at the default model (0.9M parameters) and at C 512 (13M);
#   2. chapter 02 at 2 ranks with --grad-comm-dtype fp32 and bf16 (the gradient
#      buckets sent in bf16), at the same two shapes.
# Each pair runs in alternating rounds (a slow spell of this shared machine hits both),
# one thread per rank; each row is the median over rounds of each run's median step
# time, with the range. Bytes are rank 0's per step, from the log.
#
#   ./benchmarks/run_bf16.sh              # 5 rounds, about 6 minutes on 2 cores
#   ./benchmarks/run_bf16.sh --rounds 3 --bin build/cpu/bin
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=5
bin=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) rounds="${2:?--rounds needs a value}"; shift 2 ;;
    --bin) bin="${2:?--bin needs a value}"; shift 2 ;;
    *) echo "run_bf16.sh: unknown flag '$1' (hint: --rounds N, --bin DIR)" >&2; exit 2 ;;
  esac
done
[[ -n "$bin" ]] || bin="$(./scripts/build.sh 00_single_gpu 02_ddp launch)"
out="runs/bf16-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"
declare -A shapes=(
  [default]="--steps 30"
  [c512]="--layers 4 --d-model 512 --heads 8 --seq 256 --batch 8 --steps 8"
)
declare -A tokens=([default]=1024 [c512]=2048)  # per step: batch x seq

field() {  # field NAME FILE: a number from the run's summary line
  grep '"summary"' "$2" | grep -o "\"$1\": [-0-9.e+]*" | head -1 | sed 's/.*: //'
}
median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
range() { sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END { printf "%.1f-%.1f", lo, hi }'; }

# run NAME SHAPE DTYPE ROUND: one run of the pair NAME ("00" or "02")
run() {
  # shellcheck disable=SC2086  # the shape's flags are words
  if [[ $1 == 00 ]]; then
    "$bin/00_single_gpu" ${shapes[$2]} --quiet --dtype "$3" --log "$out/00_${2}_${3}_$4.jsonl" >/dev/null
  else
    "$bin/launch" --nproc-per-node 2 -- "$bin/02_ddp" ${shapes[$2]} --quiet --grad-comm-dtype "$3" \
      --log "$out/02_${2}_${3}_$4.jsonl" >/dev/null 2>&1
  fi
}

# table NAME TITLE: the rows of pair NAME
table() {
  echo
  echo "$2"
  printf "%-8s %-5s %10s %14s %9s %14s %12s\n" "model" "dtype" "ms/step" "range" "vs fp32" "MB sent/step" "final loss"
  for shape in default c512; do
    fp32_ms=""
    for dtype in fp32 bf16; do
      logs=()
      for round in $(seq "$rounds"); do logs+=("$out/$1_${shape}_${dtype}_$round.jsonl"); done
      # ms per step from each run's median tokens/s
      ms_list="$(for log in "${logs[@]}"; do
                   awk -v t="$(field median_tokens_per_s "$log")" -v n="${tokens[$shape]}" 'BEGIN { print n / t * 1000 }'
                 done)"
      ms="$(median <<<"$ms_list")"
      fp32_ms="${fp32_ms:-$ms}"
      awk -v s="$shape" -v d="$dtype" -v ms="$ms" -v r="$(range <<<"$ms_list")" -v f="$fp32_ms" \
        -v b="$(field bytes_sent_per_step "${logs[0]}")" -v l="$(field final_loss "${logs[0]}")" \
        'BEGIN { printf "%-8s %-5s %10.1f %14s %+8.1f%% %14.3f %12.6f\n", s, d, ms, r, 100 * (ms / f - 1), b / 1e6, l }'
    done
  done
}

echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(grep -o -m1 -w 'avx512_bf16\|amx_bf16' /proc/cpuinfo || echo 'no bf16 instructions'); $rounds alternating rounds"
for round in $(seq "$rounds"); do
  for pair in 00 02; do
    for shape in default c512; do
      for dtype in fp32 bf16; do run "$pair" "$shape" "$dtype" "$round"; done
    done
  done
done
table 00 "chapter 00, --dtype (1 process)"
table 02 "chapter 02, --grad-comm-dtype (2 ranks, tcp)"
echo "logs: $out"
