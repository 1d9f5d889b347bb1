#!/usr/bin/env bash
# Regenerates the diff each chapter README shows under "what changed since the previous
# chapter": `diff -u` of the previous chapter's main.cpp against this one's, written
# between two marker lines, so the README's diff is the code's and cannot drift.
#   ./scripts/update_readme_diffs.sh           # rewrite the blocks that are stale
#   ./scripts/update_readme_diffs.sh --check   # change nothing; exit 1 naming each stale README
# Exit 0: every block up to date (or, without --check, now written); 1: stale (--check);
# 2: a README without its markers, a marker the table below does not name, bad usage.
# scripts/update_pictures.sh runs it too; CTest runs --check (test readme_diffs).
set -euo pipefail
cd "$(dirname "$0")/.."
export LC_ALL=C

# chapter, and the chapter a reader diffs it against (its README's block shows that diff)
pairs=(
  "02_ddp                  00_single_gpu"           # DDP on chapter 00's loop
  "03_fsdp                 02_ddp"                  # ZeRO/FSDP replaces DDP
  "04_naive_model_parallel 00_single_gpu"           # the model cut, not the batch: 00's, not 03's
  "05_pipeline             04_naive_model_parallel" # 04's cut, with micro-batches and a schedule
  "06_tensor_parallel      00_single_gpu"           # chapter 00's trainer with the layers split
  "07_3d                   05_pipeline"             # 05's pipeline with 06's TP chunks and 02/03's DP
  "08_context_parallel     02_ddp"                  # 02's replicas, each sequence split over a cp group
  "09_expert_parallel      02_ddp"                  # 02's replicas, the experts spread over the ranks
  "10_slow_links           02_ddp"                  # 02's replicas, talking less over a slow link
)

usage() {
  echo "usage: $0 [--check]   (rewrites, or with --check only checks, the chapter READMEs' diff blocks)" >&2
  exit 2
}
check=0
case "${1:-}" in
  "") ;;
  --check) check=1 ;;
  -h | --help) usage ;;
  *) echo "update_readme_diffs: unknown argument '$1'" >&2; usage ;;
esac
[[ $# -le 1 ]] || usage

fail() {
  echo "update_readme_diffs: $*" >&2
  exit 2
}
begin_marker() { echo "<!-- diff: $1 $2 (scripts/update_readme_diffs.sh writes this block) -->"; }
end_marker='<!-- end diff -->'

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

# every diff marker in the repository must be one of the table's: a block nobody updates would drift
declare -A known=()
for pair in "${pairs[@]}"; do
  read -r chapter previous <<<"$pair"
  known["$chapter/README.md"]=1
done
while IFS= read -r readme; do
  [[ -n "${known[$readme]:-}" ]] ||
    fail "$readme has a diff marker, but the table in scripts/update_readme_diffs.sh names no pair for it (hint: add the pair, or remove the marker)"
done < <(find . \( -path ./build -o -path ./runs -o -path ./.git \) -prune -o -name '*.md' -print |
  sed 's|^\./||' | sort | xargs -r grep -l -e '^<!-- diff: ' -- || true)

stale=0
for pair in "${pairs[@]}"; do
  read -r chapter previous <<<"$pair"
  readme="$chapter/README.md"
  old="$previous/main.cpp" new="$chapter/main.cpp"
  for file in "$readme" "$old" "$new"; do
    [[ -f "$file" ]] || fail "$file is missing (the pair $old -> $new in scripts/update_readme_diffs.sh)"
  done
  begin="$(begin_marker "$old" "$new")"

  # the markers: this pair's begin line once, no other diff marker, an end line after it
  count="$(grep -c -x -F -e "$begin" "$readme" || true)"
  if [[ "$count" != 1 ]]; then
    other="$(grep -m 1 -e '^<!-- diff: ' "$readme" || true)"
    if [[ "$count" == 0 && -n "$other" ]]; then
      fail "$readme: its diff marker names another pair: '$other' (hint: the script's table says '$begin')"
    fi
    fail "$readme: expected the marker line '$begin' once, found it $count times (hint: put it, and '$end_marker' on a line below, under the README's 'what changed' prose)"
  fi
  if [[ "$(grep -c -e '^<!-- diff: ' "$readme")" != 1 ]]; then
    fail "$readme: more than one diff marker (one block per README)"
  fi
  if ! awk -v begin="$begin" -v end="$end_marker" '$0 == begin { inside = 1; next } inside && $0 == end { found = 1 } END { exit !found }' "$readme"; then
    fail "$readme: no '$end_marker' line after '$begin'"
  fi

  # the block: one line with the counts, then the diff with stable headers (no times, relative
  # paths); plain `diff -u`, so the count is the one a reader gets (GNU diff; another diff
  # program may cut the hunks differently, and --check would then say stale)
  diff -u --label "$old" --label "$new" -- "$old" "$new" >"$scratch/diff" && status=0 || status=$?
  [[ $status -le 1 ]] || fail "diff $old $new failed"
  removed="$(tail -n +3 "$scratch/diff" | grep -c '^-' || true)"
  added="$(tail -n +3 "$scratch/diff" | grep -c '^+' || true)"
  {
    if [[ $status == 0 ]]; then
      echo "\`diff -u $old $new\`: the two files are identical."
    else
      echo "\`diff -u $old $new\` changes $((removed + added)) lines ($removed removed, $added added):"
      echo
      fence='```'  # longer than any run of backticks in the diff, so the block cannot end early
      while grep -q -F -e "$fence" "$scratch/diff"; do fence="$fence\`"; done
      echo "${fence}diff"
      cat "$scratch/diff"
      echo "$fence"
    fi
  } >"$scratch/block"
  awk -v begin="$begin" -v end="$end_marker" -v block="$scratch/block" '
    $0 == begin { print; while ((getline line < block) > 0) print line; skipping = 1; next }
    skipping && $0 == end { skipping = 0 }
    !skipping { print }' "$readme" >"$scratch/readme"

  if cmp -s "$readme" "$scratch/readme"; then
    echo "$readme: $old -> $new, $((removed + added)) changed lines, up to date"
  elif [[ $check == 1 ]]; then
    echo "$readme: stale: its diff of $old -> $new is not the code's (hint: ./scripts/update_readme_diffs.sh)" >&2
    stale=1
  else
    cat "$scratch/readme" >"$readme"  # in place: keeps the file's mode and links
    echo "$readme: $old -> $new, $((removed + added)) changed lines, updated"
  fi
done
exit $stale
