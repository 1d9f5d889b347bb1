#!/usr/bin/env bash
# The pipeline bubble, measured: every schedule of chapter 05 at N = 2 and N = 4
# ranks, M = 8 micro-batches, on a model where compute dominates (8 blocks of
# d-model 256, seq 128, 2 sequences per micro-batch), next to the simulator's
# figure (the same schedule played with each rank's measured action costs) and the
# paper's formula. Also rank 0's peak activation memory, and the timelines.
#
#   ./benchmarks/run_pipeline_bubble.sh                 # about 5 minutes on 2 cores
#   ./benchmarks/run_pipeline_bubble.sh --images DIR    # also write the SVG timelines to DIR
#   ROUNDS=1 ./benchmarks/run_pipeline_bubble.sh        # one run per row instead of the median of 3
#
# N = 4 runs 4 processes on however many cores there are: on a 2-core machine two
# ranks share a core, and the measured bubble says more about the sharing than
# about the schedule (the README explains the difference).
set -euo pipefail
cd "$(dirname "$0")/.."
images=""
if [[ "${1:-}" == "--images" ]]; then images="$2"; mkdir -p "$images"; fi
rounds="${ROUNDS:-3}"
bin="$(./scripts/build.sh)"
out="runs/pipeline-bubble-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"
model=(--layers 8 --d-model 256 --heads 8 --seq 128 --batch 16 --micro-batches 8 --steps 6 --quiet)

field() {  # field NAME FILE: a number from the run's summary line
  grep '"summary"' "$2" | grep -o "\"$1\": [-0-9.e+]*" | head -1 | sed 's/.*: //'
}
percent() { awk -v x="$1" 'BEGIN { printf "%5.1f%%", 100 * x }'; }

echo "model: ${model[*]}"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
echo
median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
echo "each row: the median of $rounds run(s); bubble = idle share of the step, mean over ranks"
printf "%-3s %-12s %9s %10s %9s %14s %10s\n" "N" "schedule" "measured" "simulated" "formula" "rank 0 acts" "tokens/s"
for ranks in 2 4; do
  for schedule in gpipe 1f1b interleaved zb-h1; do
    logs=()
    for round in $(seq "$rounds"); do
      log="$out/N${ranks}_${schedule}_$round.jsonl"
      timeline=()
      if [[ -n "$images" && "$ranks" == 2 && "$round" == 1 ]]; then
        timeline=(--timeline "$images/measured_N2_$schedule.svg")
      fi
      "$bin/launch" --nproc-per-node "$ranks" --master-port 0 -- "$bin/05_pipeline" --schedule "$schedule" \
        "${model[@]}" --log "$log" "${timeline[@]}" >/dev/null 2>"$log.err" || { cat "$log.err" >&2; exit 1; }
      logs+=("$log")
    done
    of_runs() { for log in "${logs[@]}"; do field "$1" "$log"; done | median; }
    printf "%-3s %-12s %9s %10s %9s %11.2f MB %10.0f\n" "$ranks" "$schedule" \
      "$(percent "$(of_runs bubble_measured)")" "$(percent "$(of_runs bubble_simulated)")" \
      "$(percent "$(of_runs bubble_formula)")" "$(awk -v b="$(of_runs rank0_peak_activations)" 'BEGIN { print b / 1e6 }')" \
      "$(of_runs median_tokens_per_s)"
  done
done
if [[ -n "$images" ]]; then
  for schedule in gpipe 1f1b interleaved zb-h1; do
    "$bin/05_pipeline" --pp 4 --micro-batches 8 --schedule "$schedule" --dry-run \
      --timeline "$images/simulated_N4_M8_$schedule.svg" >/dev/null
  done
  echo
  echo "timelines written to $images"
fi
echo
echo "logs in $out"
