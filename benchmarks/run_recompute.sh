#!/usr/bin/env bash
# What activation recomputation costs in time and saves in memory: chapter 00 with
# --recompute none, selective and full, at a shape where attention's T x T matrices
# matter (seq 256, d-model 128: per block B NH T^2 = 2.1M floats of attention
# probabilities against 16 B T C = 4.2M of everything else). The modes run in
# alternating rounds (a slow spell of this shared machine hits all three), and each
# row is the median over rounds of each run's median step time.
#
#   ./benchmarks/run_recompute.sh              # 5 rounds of 12 steps, about 2 minutes on 2 cores
#   ROUNDS=3 ./benchmarks/run_recompute.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${ROUNDS:-5}"
bin="$(./scripts/build.sh 00_single_gpu)"
out="runs/recompute-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"
model=(--layers 4 --d-model 128 --heads 4 --seq 256 --batch 8 --steps 12 --quiet)
modes=(none selective full)

field() {  # field NAME FILE: a number from the run's summary line
  grep '"summary"' "$2" | grep -o "\"$1\": [-0-9.e+]*" | head -1 | sed 's/.*: //'
}
median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

echo "model: ${model[*]}"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $rounds alternating rounds"
for round in $(seq "$rounds"); do
  for mode in "${modes[@]}"; do
    "$bin/00_single_gpu" "${model[@]}" --recompute "$mode" --log "$out/${mode}_$round.jsonl" >/dev/null
  done
done
printf "%-10s %12s %9s %16s %12s\n" "recompute" "ms/step" "vs none" "activations MB" "final loss"
none_ms=""
for mode in "${modes[@]}"; do
  # ms per step from the median tokens/s: 8 sequences x 256 tokens per step
  ms="$(for round in $(seq "$rounds"); do
          awk -v t="$(field median_tokens_per_s "$out/${mode}_$round.jsonl")" 'BEGIN { print 8 * 256 / t * 1000 }'
        done | median)"
  none_ms="${none_ms:-$ms}"
  acts="$(field peak_activations "$out/${mode}_1.jsonl")"
  loss="$(field final_loss "$out/${mode}_1.jsonl")"
  awk -v m="$mode" -v ms="$ms" -v n="$none_ms" -v a="$acts" -v l="$loss" \
    'BEGIN { printf "%-10s %12.1f %+8.1f%% %16.2f %12.6f\n", m, ms, 100 * (ms / n - 1), a / 1e6, l }'
done
echo "logs: $out"
