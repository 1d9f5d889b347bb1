#!/usr/bin/env bash
# Chapter 05's pipeline trainer next to PyTorch's torch.distributed.pipelining on the
# same model, batch and micro-batches, on this machine's CPU, in alternating rounds:
#   ./benchmarks/run_pipeline.sh [--rounds 3] [--schedule 1f1b|gpipe] [--micro-batches 8]
#       [--pp 2] [--layers 4] [--d-model 128] [--heads 4] [--seq 128] [--batch 8]
#       [--steps 30] [--warmup 3] [--python PATH] [--no-build | --bin DIR]
# Each round runs ours (build/bin/launch ... 05_pipeline, our median tokens/s over
# --steps steps) and then benchmarks/pytorch_pipeline.py (median over --steps steps
# after --warmup untimed ones), then prints ours / PyTorch per round, the median
# ratio and its spread. Both sides: one process per stage, one thread per process.
# PyTorch is looked for in ~/.cache/course-bench-venv (see below), then python3;
# without it only our rows are printed. --no-build uses build/bin as it is, --bin DIR
# another build's bin/ (build/cpu/bin), without building.
set -euo pipefail
cd "$(dirname "$0")/.."

bin=build/bin rounds=3 schedule=1f1b micro=8 pp=2 layers=4 dmodel=128 heads=4 seq=128 batch=8 steps=30 warmup=3
python="" build=1
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    --schedule) schedule="$2"; shift 2 ;;
    --micro-batches) micro="$2"; shift 2 ;;
    --pp) pp="$2"; shift 2 ;;
    --layers) layers="$2"; shift 2 ;;
    --d-model) dmodel="$2"; shift 2 ;;
    --heads) heads="$2"; shift 2 ;;
    --seq) seq="$2"; shift 2 ;;
    --batch) batch="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --warmup) warmup="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    --bin) bin="$2"; build=0; shift 2 ;;
    -h|--help) usage ;;
    *) echo "run_pipeline.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
case "$schedule" in 1f1b|gpipe) ;; *) echo "--schedule must be 1f1b or gpipe (the schedules both sides have)" >&2; exit 2 ;; esac

# ---- our side
if [[ $build == 1 ]]; then
  if ! bin="$(./scripts/build.sh)"; then
    echo "run_pipeline.sh: the build failed; only the PyTorch rows follow" >&2
    bin=""
  fi
fi
ours_ok=0
if [[ -n "$bin" && -x "$bin/05_pipeline" && -x "$bin/launch" ]]; then
  ours_ok=1
else
  echo "(no $bin/05_pipeline: the course's column is n/a)" >&2
fi

# ---- PyTorch's side
venv="$HOME/.cache/course-bench-venv"
if [[ -n "$python" ]] && ! "$python" -c "import torch.distributed.pipelining" 2>/dev/null; then
  echo "run_pipeline.sh: --python $python cannot import torch.distributed.pipelining" >&2
  exit 2
fi
if [[ -z "$python" ]]; then
  for candidate in "$venv/bin/python" python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "import torch.distributed.pipelining" 2>/dev/null; then
      python="$candidate"
      break
    fi
  done
fi
torch_version="none"
if [[ -n "$python" ]]; then
  torch_version="$("$python" -c "import torch; print(torch.__version__)" 2>/dev/null)"
else
  echo "(no python with torch.distributed.pipelining: the PyTorch column is n/a; to get one (PyPI, CPU is enough):" >&2
  echo "   python3 -m venv $venv && $venv/bin/pip install torch )" >&2
fi
if [[ $ours_ok == 0 && -z "$python" ]]; then
  echo "run_pipeline.sh: neither side can run" >&2
  exit 1
fi

cores="$(nproc)"  # before OMP_NUM_THREADS=1, which nproc obeys
load_before="$(cut -d" " -f1-3 /proc/loadavg 2>/dev/null || echo "?")"
export OMP_NUM_THREADS=1
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
shape=(--micro-batches "$micro" --layers "$layers" --d-model "$dmodel" --heads "$heads" --seq "$seq" --batch "$batch"
       --steps "$steps")
echo "shape: --pp $pp --schedule $schedule ${shape[*]} (PyTorch: --warmup $warmup more)"
: > "$tmp/rows.tsv"
for ((round = 1; round <= rounds; round++)); do
  ours="nan" theirs="nan"
  if [[ $ours_ok == 1 ]]; then
    log="$tmp/ours_$round.jsonl"
    if ! "$bin/launch" --nproc-per-node "$pp" --master-port 0 -- "$bin/05_pipeline" --pp "$pp" \
        --schedule "$schedule" "${shape[@]}" --quiet --log "$log" > "$tmp/ours_$round.out" 2>&1; then
      echo "run_pipeline.sh: round $round: 05_pipeline failed; its output:" >&2
      tail -n 30 "$tmp/ours_$round.out" >&2
      exit 1
    fi
    ours="$(python3 -c '
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
summary = [r for r in rows if r.get("summary")]
print((summary or rows)[-1]["median_tokens_per_s"])' "$log")"
  fi
  if [[ -n "$python" ]]; then
    if ! "$python" benchmarks/pytorch_pipeline.py --pp "$pp" --schedule "$schedule" "${shape[@]}" \
        --warmup "$warmup" > "$tmp/theirs_$round.out" 2>&1; then
      echo "run_pipeline.sh: round $round: pytorch_pipeline.py failed; its output:" >&2
      tail -n 30 "$tmp/theirs_$round.out" >&2
      exit 1
    fi
    theirs="$(sed -n 's/^RESULT //p' "$tmp/theirs_$round.out" | python3 -c 'import json, sys; print(json.load(sys.stdin)["tokens_per_s"])')"
  fi
  printf '%s\t%s\t%s\n' "$round" "$ours" "$theirs" >> "$tmp/rows.tsv"
  printf 'round %d: ours %s tok/s, PyTorch %s tok/s\n' "$round" "$ours" "$theirs" >&2
done

echo
python3 - "$tmp/rows.tsv" "$schedule" "$pp" "$micro" <<'EOF'
import math, statistics, sys
rows = [line.split("\t") for line in open(sys.argv[1]).read().splitlines()]
schedule, pp, micro = sys.argv[2:5]
fmt = lambda v: "n/a" if math.isnan(v) else f"{v:.0f}"
print(f"{'round':>5} {'ours tok/s':>12} {'PyTorch tok/s':>14} {'ours/PyTorch':>13}   ({schedule}, {pp} stages, {micro} micro-batches)")
ratios = []
for r, ours, theirs in rows:
    ours, theirs = float(ours), float(theirs)
    ratio = ours / theirs if not (math.isnan(ours) or math.isnan(theirs)) and theirs > 0 else float("nan")
    if not math.isnan(ratio):
        ratios.append(ratio)
    print(f"{r:>5} {fmt(ours):>12} {fmt(theirs):>14} {'n/a' if math.isnan(ratio) else f'{ratio:.3f}':>13}")
for name, col in (("ours", 1), ("PyTorch", 2)):
    vals = [float(row[col]) for row in rows if not math.isnan(float(row[col]))]
    if vals:
        print(f"{name}: median {statistics.median(vals):.0f} tok/s, min {min(vals):.0f}, max {max(vals):.0f}")
if ratios:
    print(f"ratio ours/PyTorch: median {statistics.median(ratios):.3f}, spread {min(ratios):.3f} to {max(ratios):.3f}"
          f" over {len(ratios)} round(s)")
EOF
echo "torch: $torch_version${python:+ ($python)} | CPU: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1), $cores cores"
echo "load average (1, 5, 15 min) before: $load_before, after: $(cut -d" " -f1-3 /proc/loadavg 2>/dev/null || echo "?")"
echo "($pp ranks need $pp idle cores: anything else running shows up as a slow round on either side)"
