#!/usr/bin/env bash
# Chapter 07's 2x2x2 step, two builds against each other: rounds alternate (this
# machine is shared and noisy, so a slow spell hits both sides), and each side's
# figures are medians over its runs.
#
#   ./benchmarks/run_3d_before_after.sh BEFORE_BIN AFTER_BIN [ROUNDS] [-- 07_3d flags...]
#   ./benchmarks/run_3d_before_after.sh /tmp/main-bin build/cpu/bin 20 -- --zero-stage 1
#
# BEFORE_BIN and AFTER_BIN are folders holding a 07_3d (build one from main into
# another folder first); the launcher is AFTER_BIN's. Each run is 30 steps of the
# default model. Per side: the step time (each run's median step, the first left
# out), comm/step (the rank table's: time on the communication threads, mean over
# the ranks), its tp, pp and dp parts (rank 0's, where the build records them: "-"
# otherwise), dp exposed (the rank table's, where the build records it: the time
# the training thread waited for the DP reductions, mean over the ranks), dp bytes
# and the final loss (equal on both sides, or something broke).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 2 ]]; then
  echo "usage: $0 BEFORE_BIN AFTER_BIN [ROUNDS] [-- 07_3d flags...]" >&2
  exit 2
fi
before="$1" after="$2"
shift 2
rounds=10
if [[ $# -gt 0 && "$1" != "--" ]]; then rounds="$1"; shift; fi
if [[ "${1:-}" == "--" ]]; then shift; fi
flags=("$@")
out="runs/3d-before-after-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR ? v[int((NR + 1) / 2)] : "-") }'; }
field() {  # field NAME FILE: a number from the run's summary line
  grep '"summary"' "$2" | grep -o "\"$1\": [-0-9.e+]*" | head -1 | sed 's/.*: //'
}
rank_mean() {  # rank_mean NAME FILE: the summary's rank<r>_NAME, mean over the 8 ranks ("-" when absent)
  grep '"summary"' "$2" | grep -o "\"rank[0-9]*_$1\": [-0-9.e+]*" | sed 's/.*: //' |
    awk '{ s += $1; n++ } END { if (n) printf "%.2f\n", s / n; else print "-" }'
}
dp_exposed() {  # builds that record the TP waits too name the DP ones by their axis
  if grep -q '"rank0_dp_exposed_comm_ms_per_step"' "$1"; then
    rank_mean dp_exposed_comm_ms_per_step "$1"
  else
    rank_mean exposed_comm_ms_per_step "$1"
  fi
}
step_ms() {  # the run's median step time, the first step left out
  grep '"step"' "$1" | grep -v '"summary"' | tail -n +2 | grep -o '"ms": [0-9.e+]*' | sed 's/.*: //' | median
}

run_side() {  # run_side NAME BIN ROUND
  local log="$out/$1_$3.jsonl"
  "$after/launch" --nproc-per-node 8 -- "$2/07_3d" --dp 2 --pp 2 --tp 2 --steps 30 --print-every 100 --quiet \
    --log "$log" "${flags[@]}" >"$out/$1_$3.out" 2>&1
}

echo "07_3d 2x2x2, 30 steps, ${flags[*]:-(default flags)}; $rounds alternating rounds; logs in $out"
for round in $(seq "$rounds"); do
  if ((round % 2)); then order=(before after); else order=(after before); fi
  for side in "${order[@]}"; do
    if [[ $side == before ]]; then run_side before "$before" "$round"; else run_side after "$after" "$round"; fi
  done
done

printf "%-7s %10s %12s %9s %9s %9s %12s %12s %12s\n" side "step ms" "comm/step" "tp ms" "pp ms" "dp ms" \
  "dp exposed" "dp sent" "final loss"
for side in before after; do
  logs=("$out/${side}"_*.jsonl)
  printf "%-7s %10s %12s %9s %9s %9s %12s %12s %12s\n" "$side" \
    "$(for log in "${logs[@]}"; do step_ms "$log"; done | median)" \
    "$(for log in "${logs[@]}"; do rank_mean comm_ms_per_step "$log"; done | median)" \
    "$(for log in "${logs[@]}"; do field tp_comm_ms_per_step "$log"; done | median)" \
    "$(for log in "${logs[@]}"; do field pp_comm_ms_per_step "$log"; done | median)" \
    "$(for log in "${logs[@]}"; do field dp_comm_ms_per_step "$log"; done | median)" \
    "$(for log in "${logs[@]}"; do dp_exposed "$log"; done | median)" \
    "$(field dp_bytes_sent_per_step "${logs[0]}")" \
    "$(for log in "${logs[@]}"; do field final_loss "$log"; done | sort -u | tr '\n' ' ')"
done
