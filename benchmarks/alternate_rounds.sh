# Sourced by the benchmarks that race one of our trainers against PyTorch
# (run_pipeline.sh, run_tensor_parallel.sh): build ours, find a Python with the
# PyTorch module, then alternate rounds of the two and print the ratio. The machine
# is shared and noisy, so rounds alternate (a slow spell hits both sides) and the
# summary is a median with its spread.
#
# The sourcing script sets: script (its name, for messages), program (our trainer in
# bin/), module (the torch module PyTorch's side needs), bin, build (1: build first),
# python (empty: look for one), ranks, rounds, label (the table's title), and defines
#   run_ours LOG OUT      runs our trainer for one round with --log LOG, output to OUT
#   run_theirs OUT        runs PyTorch's side for one round, output (with RESULT {json}) to OUT
# then calls find_both_sides and alternate_rounds. Its flag loop hands what it does
# not know itself to shared_flag (the flags every such script takes).

# Sets the flag at $1 if it is one every script takes (the model's shape, rounds,
# steps, which Python, which build) and puts in `consumed` how many arguments it
# took; fails for any other flag.
shared_flag() {
  consumed=2
  case "$1" in
    --rounds) rounds="${2:?--rounds needs a value}" ;;
    --layers) layers="${2:?--layers needs a value}" ;;
    --d-model) dmodel="${2:?--d-model needs a value}" ;;
    --heads) heads="${2:?--heads needs a value}" ;;
    --seq) seq="${2:?--seq needs a value}" ;;
    --batch) batch="${2:?--batch needs a value}" ;;
    --steps) steps="${2:?--steps needs a value}" ;;
    --warmup) warmup="${2:?--warmup needs a value}" ;;
    --python) python="${2:?--python needs a value}" ;;
    --bin) bin="${2:?--bin needs a value}"; build=0 ;;
    --no-build) build=0; consumed=1 ;;
    *) return 1 ;;
  esac
}

find_both_sides() {
  if [[ $build == 1 ]]; then
    if ! bin="$(./scripts/build.sh)"; then
      echo "$script: the build failed; only the PyTorch rows follow" >&2
      bin=""
    fi
  fi
  ours_ok=0
  if [[ -n "$bin" && -x "$bin/$program" && -x "$bin/launch" ]]; then
    ours_ok=1
  else
    echo "(no $bin/$program: the course's column is n/a)" >&2
  fi

  local venv="$HOME/.cache/course-bench-venv" candidate
  if [[ -n "$python" ]] && ! "$python" -c "import $module" 2>/dev/null; then
    echo "$script: --python $python cannot import $module" >&2
    exit 2
  fi
  if [[ -z "$python" ]]; then
    for candidate in "$venv/bin/python" python3; do
      if command -v "$candidate" >/dev/null && "$candidate" -c "import $module" 2>/dev/null; then
        python="$candidate"
        break
      fi
    done
  fi
  torch_version="none"
  if [[ -n "$python" ]]; then
    torch_version="$("$python" -c "import torch; print(torch.__version__)" 2>/dev/null)"
  else
    echo "(no python with $module: the PyTorch column is n/a; to get one (PyPI, CPU is enough):" >&2
    echo "   python3 -m venv $venv && $venv/bin/pip install torch )" >&2
  fi
  if [[ $ours_ok == 0 && -z "$python" ]]; then
    echo "$script: neither side can run" >&2
    exit 1
  fi
}

alternate_rounds() {
  local cores load_before round ours theirs
  cores="$(nproc)"  # before OMP_NUM_THREADS=1, which nproc obeys
  load_before="$(cut -d" " -f1-3 /proc/loadavg 2>/dev/null || echo "?")"
  export OMP_NUM_THREADS=1
  tmp="$(mktemp -d)"  # global: the EXIT trap runs after this function has returned
  trap 'rm -rf "$tmp"' EXIT
  : > "$tmp/rows.tsv"
  for ((round = 1; round <= rounds; round++)); do
    ours="nan" theirs="nan"
    if [[ $ours_ok == 1 ]]; then
      if ! run_ours "$tmp/ours_$round.jsonl" "$tmp/ours_$round.out"; then
        echo "$script: round $round: $program failed; its output:" >&2
        tail -n 30 "$tmp/ours_$round.out" >&2
        exit 1
      fi
      # our median tokens/s: the summary line of the trainer's --log
      ours="$(python3 -c '
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
summary = [r for r in rows if r.get("summary")]
print((summary or rows)[-1]["median_tokens_per_s"])' "$tmp/ours_$round.jsonl")"
    fi
    if [[ -n "$python" ]]; then
      if ! run_theirs "$tmp/theirs_$round.out"; then
        echo "$script: round $round: PyTorch's side failed; its output:" >&2
        tail -n 30 "$tmp/theirs_$round.out" >&2
        exit 1
      fi
      theirs="$(sed -n 's/^RESULT //p' "$tmp/theirs_$round.out" | python3 -c 'import json, sys; print(json.load(sys.stdin)["tokens_per_s"])')"
    fi
    printf '%s\t%s\t%s\n' "$round" "$ours" "$theirs" >> "$tmp/rows.tsv"
    printf 'round %d: ours %s tok/s, PyTorch %s tok/s\n' "$round" "$ours" "$theirs" >&2
  done

  echo
  python3 - "$tmp/rows.tsv" "$label" <<'EOF'
import math, statistics, sys
rows = [line.split("\t") for line in open(sys.argv[1]).read().splitlines()]
fmt = lambda v: "n/a" if math.isnan(v) else f"{v:.0f}"
print(f"{'round':>5} {'ours tok/s':>12} {'PyTorch tok/s':>14} {'ours/PyTorch':>13}   ({sys.argv[2]})")
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
  echo "($ranks ranks need $ranks idle cores: anything else running shows up as a slow round on either side)"
}
