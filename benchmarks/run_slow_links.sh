#!/usr/bin/env bash
# Chapter 10's benchmark: every way of talking less, at 4 workers in 4 sites on a
# simulated 100 Mbit/s, 25 ms link, at equal tokens (the same steps and global batch).
# As the DiLoCo paper does, the workers start from a pretrained model: chapter 00's
# weights at step 400 (its own run, first), then every variant trains steps 401-800.
#   ./benchmarks/run_slow_links.sh [--bin build/cpu/bin] [--steps 800] [--pretrain 400] [--out DIR] [--pictures]
#                                  [--seeds "11 12 13"]
# Prints one row per variant: the eval loss of its final model (16 batches no step
# trained on), the MB each worker sent and the time its steps took, each against
# DDP's. The logs and the report's pictures (report.html) stay in DIR;
# --pictures also copies its chapter-10 picture to docs/pictures/slow_links_benchmark.svg
# (chapter 10's README shows it). --seeds then runs DDP and int8 again (without the
# link: the losses do not depend on it) at each of those data orders, from the same
# pretrained weights, and prints int8's mean difference: one run's difference is
# mostly rounding's chaos (DDP against itself with its sums reordered differs by 3%).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=build/bin
steps=800
pretrain=400
out="runs/slow_links-$(date +%Y%m%d-%H%M%S)"
pictures=0
seeds=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --pretrain) pretrain="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --pictures) pictures=1; shift ;;
    --seeds) seeds="$2"; shift 2 ;;
    *) echo "usage: $0 [--bin DIR] [--steps N] [--pretrain N] [--out DIR] [--pictures] [--seeds LIST]" >&2; exit 2 ;;
  esac
done
[[ -x "$bin/10_slow_links" ]] || { echo "run_slow_links: no $bin/10_slow_links (hint: ./scripts/build.sh)" >&2; exit 2; }
mkdir -p "$out"
link=(--sites 4 --wan-bandwidth 100Mbit --wan-latency 25ms)

echo "pretraining: chapter 00, steps 1-$pretrain"
"$bin/00_single_gpu" --steps "$pretrain" --quiet --checkpoint-dir "$out/pretrained" --log "$out/00_single_gpu.jsonl" >/dev/null
start="$(ls "$out"/pretrained/step_*.ckpt | tail -n 1)"

variants=(
  "ddp|--algorithm ddp"
  "ddp_int8|--algorithm ddp --grad-compression int8"
  "diloco_h10|--inner-steps 10"
  "diloco_h50|--inner-steps 50"
  "diloco_h200|--inner-steps 200"
  "streaming_h50_p2|--inner-steps 50 --fragments 2 --overlap-steps 1"
)
for variant in "${variants[@]}"; do
  name="${variant%%|*}"
  read -r -a flags <<<"${variant#*|}"
  echo "4 workers, steps $((pretrain + 1))-$steps: $name (${flags[*]})"
  "$bin/launch" --nproc-per-node 4 --master-port 0 -- "$bin/10_slow_links" "${flags[@]}" "${link[@]}" \
    --steps "$steps" --init-from "$start" --quiet --log "$out/10_slow_links_$name.jsonl" >/dev/null
done

# fault tolerance over the same link: DiLoCo at H 50 with --fault-tolerant, without a
# fault and with worker 2 killed half-way (the tests' switch, common/comm/test_faults.h)
# and restarted alone; the report draws the two curves together
for fault in none killed; do
  echo "4 workers, steps $((pretrain + 1))-$steps: fault tolerant, $fault"
  fault_env=()
  [[ "$fault" == killed ]] && fault_env=("COURSE_TEST_FAULT=die_at_step=$(((pretrain + steps) / 2 + 23)),rank=2")
  if ! "$bin/launch" --nproc-per-node 4 --master-port 0 --restart-policy worker --max-restarts 1 -- \
    env "${fault_env[@]}" "$bin/10_slow_links" --fault-tolerant --inner-steps 50 "${link[@]}" --steps "$steps" \
    --init-from "$start" --quiet --log "$out/10_slow_links_ft_$fault.jsonl" >"$out/ft_$fault.out" 2>&1; then
    echo "run_slow_links: the fault-tolerant run ($fault) failed:" >&2
    tail -n 5 "$out/ft_$fault.out" >&2
    exit 1
  fi
  grep -E "restarting|joined|lost" "$out/ft_$fault.out" || true
done

# per log: the eval loss, the MB rank 0 sent, and the seconds its steps took
summarize() {
  awk '
    /"summary"/ {
      match($0, /"eval_loss": [0-9.e+-]+/); eval = substr($0, RSTART + 13, RLENGTH - 13)
      match($0, /"sync_bytes_sent": [0-9.e+-]+/); bytes = substr($0, RSTART + 19, RLENGTH - 19)
      next
    }
    /"step"/ { match($0, /"ms": [0-9.e+-]+/); seconds += substr($0, RSTART + 6, RLENGTH - 6) / 1e3 }
    END { printf "%s %s %.3f\n", eval, bytes / 1e6, seconds }
  ' "$1"
}
read -r ddp_eval ddp_mb ddp_seconds <<<"$(summarize "$out/10_slow_links_ddp.jsonl")"
echo
echo "4 workers, 4 sites, 100 Mbit/s and 25 ms between them; steps $((pretrain + 1))-$steps from chapter 00's step $pretrain"
printf "%-18s %10s %10s %12s %10s %10s %14s\n" variant "eval loss" "vs ddp" "MB/worker" "vs ddp" "seconds" "vs ddp's time"
for name in "${variants[@]%%|*}" ft_none ft_killed; do
  read -r eval mb seconds <<<"$(summarize "$out/10_slow_links_$name.jsonl")"
  awk -v n="$name" -v e="$eval" -v de="$ddp_eval" -v mb="$mb" -v dmb="$ddp_mb" -v s="$seconds" -v ds="$ddp_seconds" \
    'BEGIN { printf "%-18s %10.4f %+9.1f%% %12.1f %9.1fx %10.1f %13.1fx\n", n, e, 100 * (e - de) / de, mb, dmb / mb, s, ds / s }'
done
echo "(vs ddp: the eval loss's difference, and how many times fewer bytes and less time than DDP's run took)"
if [[ -x "$bin/report" ]] && command -v gnuplot >/dev/null; then
  "$bin/report" "$out" >/dev/null && echo "pictures: $out/report.html"
  if [[ $pictures == 1 ]]; then
    cp "$out/report_files/slow_links.svg" docs/pictures/slow_links_benchmark.svg
    echo "copied to docs/pictures/slow_links_benchmark.svg"
  fi
fi

# int8 against DDP over several data orders (--seed: the batches; the weights are the pretrained ones)
[[ -n "$seeds" ]] || exit 0
mkdir -p "$out/seeds"  # beside the report's logs, not among them
echo
printf "%-6s %10s %10s %10s\n" seed "ddp" "int8" "int8 vs ddp"
for seed in $seeds; do
  for name in ddp ddp_int8; do
    flags=(--algorithm ddp)
    [[ "$name" == ddp_int8 ]] && flags+=(--grad-compression int8)
    "$bin/launch" --nproc-per-node 4 --master-port 0 -- "$bin/10_slow_links" "${flags[@]}" --seed "$seed" \
      --steps "$steps" --init-from "$start" --quiet --log "$out/seeds/${seed}_$name.jsonl" >/dev/null
  done
  read -r ddp_seed _ _ <<<"$(summarize "$out/seeds/${seed}_ddp.jsonl")"
  read -r int8_seed _ _ <<<"$(summarize "$out/seeds/${seed}_ddp_int8.jsonl")"
  echo "$seed $ddp_seed $int8_seed"
done | awk '{ d = 100 * ($3 - $2) / $2; sum += d; n++; printf "%-6s %10.4f %10.4f %+9.1f%%\n", $1, $2, $3, d }
            END { if (n) printf "mean int8 vs ddp over %d data orders: %+.2f%%\n", n, sum / n }'
