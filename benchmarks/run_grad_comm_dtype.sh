#!/usr/bin/env bash
# What sending the gradients in bf16 buys: chapter 02 at 2 ranks with --grad-comm-dtype
# fp32 and bf16, at the default model (0.9M parameters) and at C 512 (13M parameters,
# 52 MB of fp32 gradients a step). The two run in alternating rounds (a slow spell of
# this shared machine hits both), and each row is the median over rounds of each run's
# median step time, with the range. Bytes are rank 0's per step, from the log.
#
#   ./benchmarks/run_grad_comm_dtype.sh              # 5 rounds, about 5 minutes on 2 cores
#   ./benchmarks/run_grad_comm_dtype.sh --rounds 3 --bin build/cpu/bin
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=5
bin=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) rounds="${2:?--rounds needs a value}"; shift 2 ;;
    --bin) bin="${2:?--bin needs a value}"; shift 2 ;;
    *) echo "run_grad_comm_dtype.sh: unknown flag '$1' (hint: --rounds N, --bin DIR)" >&2; exit 2 ;;
  esac
done
[[ -n "$bin" ]] || bin="$(./scripts/build.sh 02_ddp launch)"
out="runs/grad_comm_dtype-$(date +%Y%m%d-%H%M%S)"
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

echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; 2 ranks, tcp; $rounds alternating rounds"
for round in $(seq "$rounds"); do
  for shape in default c512; do
    for dtype in fp32 bf16; do
      # shellcheck disable=SC2086  # the shape's flags are words
      "$bin/launch" --nproc-per-node 2 -- "$bin/02_ddp" ${shapes[$shape]} --quiet --grad-comm-dtype "$dtype" \
        --log "$out/${shape}_${dtype}_$round.jsonl" >/dev/null
    done
  done
done
printf "%-8s %-5s %10s %14s %9s %14s %14s %12s\n" "model" "sent" "ms/step" "range" "vs fp32" "MB sent/step" \
  "exposed ms" "final loss"
for shape in default c512; do
  fp32_ms=""
  for dtype in fp32 bf16; do
    runs=()
    for round in $(seq "$rounds"); do runs+=("$out/${shape}_${dtype}_$round.jsonl"); done
    # ms per step from each run's median tokens/s
    ms_list="$(for log in "${runs[@]}"; do
                 awk -v t="$(field median_tokens_per_s "$log")" -v n="${tokens[$shape]}" 'BEGIN { print n / t * 1000 }'
               done)"
    ms="$(median <<<"$ms_list")"
    fp32_ms="${fp32_ms:-$ms}"
    exposed="$(for log in "${runs[@]}"; do field exposed_comm_ms_per_step "$log"; done | median)"
    sent="$(field bytes_sent_per_step "${runs[0]}")"
    loss="$(field final_loss "${runs[0]}")"
    awk -v s="$shape" -v d="$dtype" -v ms="$ms" -v r="$(range <<<"$ms_list")" -v f="$fp32_ms" -v b="$sent" \
      -v e="$exposed" -v l="$loss" \
      'BEGIN { printf "%-8s %-5s %10.1f %14s %+8.1f%% %14.3f %14.1f %12.6f\n", s, d, ms, r, 100 * (ms / f - 1), b / 1e6, e, l }'
  done
done
echo "logs: $out"
