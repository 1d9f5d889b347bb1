#!/usr/bin/env bash
# Chapter 08 on a long sequence: how evenly the ranks share attention (contiguous
# against zigzag), how much of the ring's K/V traffic hides behind attention's math,
# all-to-all's bytes against the ring's; then chapter 08 next to PyTorch's context
# parallelism on the same model, in alternating rounds:
#   ./benchmarks/run_context_parallel.sh [--rounds 3] [--cp 2] [--layers 2] [--d-model 64]
#       [--heads 4] [--seq 1024] [--batch 2] [--steps 10] [--warmup 3] [--python PATH]
#       [--no-build | --bin DIR]
# Part 1 runs 08_context_parallel --cp N with --cp-split contiguous, zigzag and with
# --cp-mode a2a, and prints each rank's attention compute per step (from the run's
# per-rank table), the slowest rank over the fastest, the share of the cp group's
# transfer time the compute hid, and the bytes per step. Part 2 races the zigzag ring
# against benchmarks/pytorch_context_parallel.py (torch's ring, zigzag, all-gather
# rotation; its CPU handlers are explained there), one thread per rank on both sides.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/alternate_rounds.sh

bin=build/bin rounds=3 cp=2 layers=2 dmodel=64 heads=4 seq=1024 batch=2 steps=10 warmup=3
python="" build=1
usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cp) cp="$2"; shift 2 ;;
    -h|--help) usage ;;
    *) if shared_flag "$@"; then shift "$consumed"; else echo "run_context_parallel.sh: unknown argument '$1'" >&2; usage; fi ;;
  esac
done

script=run_context_parallel.sh program=08_context_parallel module=torch.distributed.tensor.experimental ranks=$cp
label="cp $cp, zigzag, ring"
shape=(--layers "$layers" --d-model "$dmodel" --heads "$heads" --seq "$seq" --batch "$batch" --steps "$steps")
find_both_sides
echo "shape: --cp $cp ${shape[*]} (PyTorch: --warmup $warmup more)"

# ---- part 1: the balance, the overlap and the bytes (ours only)
if [[ $ours_ok == 1 ]]; then
  part1="$(mktemp -d)"
  echo
  printf '%-22s %-28s %10s %8s %10s %10s\n' "chapter 08" "attention ms/step per rank" "slow/fast" "hidden" "cp sent" "tokens/s"
  for variant in "--cp-split contiguous" "--cp-split zigzag" "--cp-mode a2a"; do
    OMP_NUM_THREADS=1 "$bin/launch" --nproc-per-node "$cp" --master-port 0 -- "$bin/08_context_parallel" --cp "$cp" \
      $variant "${shape[@]}" --quiet --log "$part1/run.jsonl" > "$part1/run.out" 2>&1 ||
      { echo "run_context_parallel.sh: 08_context_parallel $variant failed:" >&2; tail -n 20 "$part1/run.out" >&2; exit 1; }
    python3 - "$part1/run.jsonl" "$variant" "$cp" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
s = [r for r in rows if r.get("summary")][-1]
ms = [float(s[f"rank{r}_attention_ms_per_step"]) for r in range(int(sys.argv[3]))]
print(f"{sys.argv[2]:<22} {' '.join(f'{m:6.1f}' for m in ms):<28} {max(ms) / min(ms):9.2f}x "
      f"{100 * float(s['cp_hidden_fraction']):7.0f}% {float(s['cp_bytes_sent_per_step']) / 1e6:7.2f} MB "
      f"{float(s['median_tokens_per_s']):10.0f}")
PY
  done
  rm -rf "$part1"
  echo "(hidden: of the time the cp group's transfers took on the communication thread, the part attention's"
  echo " compute covered; a2a's all-to-alls cannot overlap: attention needs their results at once)"
fi

# ---- part 2: against PyTorch's context parallelism, in alternating rounds
run_ours() {
  "$bin/launch" --nproc-per-node "$cp" --master-port 0 -- "$bin/08_context_parallel" --cp "$cp" --cp-split zigzag \
    "${shape[@]}" --quiet --log "$1" > "$2" 2>&1
}
run_theirs() {
  "$python" benchmarks/pytorch_context_parallel.py --cp "$cp" --cp-split zigzag --rotate allgather "${shape[@]}" \
    --warmup "$warmup" > "$1" 2>&1
}
alternate_rounds
