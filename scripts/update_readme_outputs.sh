#!/usr/bin/env bash
# Regenerates the program output the READMEs show, from the programs themselves, so
# that a README's figures are the code's and cannot drift. A block is two marker lines
# around a fenced block; the first names the command, run from the repository root:
#
#   <!-- output: ./build/bin/07_plan --layers 4 (scripts/update_readme_outputs.sh writes this block) -->
#   ```
#   ...what the command prints on stdout...
#   ```
#   <!-- end output -->
#
# `<!-- output (times vary): ... -->` marks a block whose times, rates and shares of
# time are the machine's (a training run): --check compares it with those masked
# (a number before ms, s, tok/s, GFLOP/s, TFLOP/s or %, or after tokens/s or GFLOP/s;
# the busy-machine note, and where an excerpt's "..." gaps fall),
# and every other figure exactly. A command may be a pipeline (`... | sed -n 1,12p`)
# to show an excerpt.
#
#   ./scripts/update_readme_outputs.sh           # rewrite every block from a fresh run
#   ./scripts/update_readme_outputs.sh --check   # change nothing; exit 1 naming each stale block
# COURSE_BIN_DIR=DIR runs DIR's programs for ./build/bin/ (CTest points it at its build).
# Exit 0: every block up to date (or, without --check, now written); 1: stale (--check);
# 2: a command that failed, a marker without its end, bad usage. CTest runs --check
# (test readme_outputs).
set -euo pipefail
cd "$(dirname "$0")/.."
export LC_ALL=C

usage() {
  echo "usage: $0 [--check]   (rewrites, or with --check only checks, the READMEs' output blocks)" >&2
  exit 2
}
check=0
case "${1:-}" in
  "") ;;
  --check) check=1 ;;
  -h | --help) usage ;;
  *) echo "update_readme_outputs: unknown argument '$1'" >&2; usage ;;
esac
[[ $# -le 1 ]] || usage

fail() {
  echo "update_readme_outputs: $*" >&2
  exit 2
}
bin="${COURSE_BIN_DIR:-./build/bin}"
suffix=' (scripts/update_readme_outputs.sh writes this block) -->'
end_marker='<!-- end output -->'
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

# what --check compares for a "times vary" block: the machine's times masked, spaces squeezed
mask_times() {
  # and "..." (excerpt.sh): a busy machine prints more progress lines, so an excerpt's gaps move
  grep -v -E -e '^note: the machine was busy' -e '^\.\.\.$' |
    sed -E -e 's/[0-9][0-9.]*( ?)(ms|s|tok\/s|GFLOP\/s|TFLOP\/s|%)([^a-zA-Z0-9]|$)/#\1\2\3/g' \
      -e 's/(tokens\/s|GFLOP\/s|TFLOP\/s) +[0-9][0-9.]*/\1 #/g' \
      -e 's/load average [0-9.]+/load average #/g' -e 's/  +/ /g'
}

# Runs a block's command; its stdout, fenced, into $scratch/block.
run_block() {
  local readme="$1" command="$2"
  local runnable="${command//.\/build\/bin\//$bin/}"
  if ! timeout 600 bash -o pipefail -c "$runnable" >"$scratch/out" 2>"$scratch/err"; then
    fail "$readme: the command of an output block failed: $command
$(tail -n 5 "$scratch/err")
(hint: build first, ./scripts/build.sh; or fix the marker's command)"
  fi
  {
    echo '```'
    cat "$scratch/out"
    echo '```'
  } >"$scratch/block"
}

stale=0
blocks=0
while IFS= read -r readme; do
  : >"$scratch/readme"
  inside=0
  while IFS= read -r line || [[ -n "$line" ]]; do
    if [[ $inside == 1 ]]; then
      if [[ "$line" == "$end_marker" ]]; then
        inside=0
        if [[ $timed == 1 ]]; then
          same=0
          cmp -s <(mask_times <"$scratch/old") <(mask_times <"$scratch/block") && same=1
        else
          same=0
          cmp -s "$scratch/old" "$scratch/block" && same=1
        fi
        if [[ $same == 0 && $check == 1 ]]; then
          echo "$readme: stale: the output of '$command' is not what the README shows (hint: ./scripts/update_readme_outputs.sh)" >&2
          diff <(if [[ $timed == 1 ]]; then mask_times <"$scratch/old"; else cat "$scratch/old"; fi) \
            <(if [[ $timed == 1 ]]; then mask_times <"$scratch/block"; else cat "$scratch/block"; fi) | head -n 20 >&2 || true
          stale=1
        fi
        if [[ $same == 1 ]]; then cat "$scratch/old" >>"$scratch/readme"; else cat "$scratch/block" >>"$scratch/readme"; fi
        echo "$line" >>"$scratch/readme"
      else
        echo "$line" >>"$scratch/old"
      fi
      continue
    fi
    echo "$line" >>"$scratch/readme"
    if [[ "$line" == '<!-- output'* ]]; then
      [[ "$line" == *"$suffix" ]] || fail "$readme: an output marker without its ending '$suffix': $line"
      case "$line" in
        '<!-- output (times vary): '*) timed=1; command="${line#'<!-- output (times vary): '}" ;;
        '<!-- output: '*) timed=0; command="${line#'<!-- output: '}" ;;
        *) fail "$readme: '$line' is neither '<!-- output: COMMAND' nor '<!-- output (times vary): COMMAND'" ;;
      esac
      command="${command%"$suffix"}"
      run_block "$readme" "$command"
      : >"$scratch/old"
      inside=1
      blocks=$((blocks + 1))
    fi
  done <"$readme"
  [[ $inside == 0 ]] || fail "$readme: no '$end_marker' after the block of '$command'"
  if ! cmp -s "$readme" "$scratch/readme" && [[ $check == 0 ]]; then
    cat "$scratch/readme" >"$readme"  # in place: keeps the file's mode and links
    echo "$readme: updated"
  fi
done < <(find . \( -path ./build -o -path ./runs -o -path ./.git -o -path ./gpu_kit \) -prune -o -name '*.md' -print |
  sed 's|^\./||' | sort | xargs -r grep -l -e '^<!-- output' -- || true)
echo "update_readme_outputs: $blocks block(s) $([[ $check == 1 ]] && echo checked || echo written)"
exit $stale
