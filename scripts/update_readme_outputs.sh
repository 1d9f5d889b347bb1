#!/usr/bin/env bash
# Regenerates the program output the READMEs show, from the programs themselves, so
# that a README's figures are the code's and cannot drift. A block is two marker lines
# around a fenced block; the first names the command, as the README's reader types it
# in the repository's root (here it runs in an empty folder of its own, so that files
# it writes, such as a checkpoint directory, start fresh and go away; ./build/bin/ and
# ./scripts/ stand for the repository's):
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
# and every other figure exactly; a relative difference (1.0e-07) and a run's folder
# (runs/<stamp>) are masked too, since their last bits and names are the machine's.
# `<!-- output (times and routing vary): ... -->` marks a mixture-of-experts run:
# past step 20 a router's near-tied choice flips on the CPU's last bits (README, "the
# MoE losses"), so its losses after step 20, its final loss, the bytes its routing
# sends and its load are masked as well; its memory and first steps are not. The
# course run's bf16 rows are masked the same way: over 200 steps the rounding of each
# product's inputs amplifies the last bits of the CPU's sums (0.5% apart between an
# AVX2 and an AVX-512 machine), where fp32's losses agree to the digit; and their total
# memory, whose GEMM input copies are 2 bytes a value where oneDNN's bf16 matmul runs
# (gemm_cpu.h), 4 elsewhere.
# A command may be a pipeline (`... | sed -n 1,12p`) to show an excerpt. Blocks whose
# first command (up to the first " | ") is the same share one run of it: the
# README's course run (scripts/run_course.sh) runs once for all of its excerpts.
#
#   ./scripts/update_readme_outputs.sh           # rewrite every block from a fresh run
#   ./scripts/update_readme_outputs.sh --check   # change nothing; exit 1 naming each stale block
#   ./scripts/update_readme_outputs.sh 03_fsdp/README.md   # only that file's blocks
# COURSE_BIN_DIR=DIR runs DIR's programs for ./build/bin/ (CTest points it at its build).
# Exit 0: every block up to date (or, without --check, now written); 1: stale (--check);
# 2: a command that failed, a marker without its end, bad usage. CTest runs --check
# (test readme_outputs).
set -euo pipefail
cd "$(dirname "$0")/.."
export LC_ALL=C

usage() {
  echo "usage: $0 [--check] [FILE.md ...]   (rewrites, or with --check only checks, the output blocks of" \
    "FILE.md, or of every README)" >&2
  exit 2
}
check=0
files=()
for arg in "$@"; do
  case "$arg" in
    --check) check=1 ;;
    -h | --help) usage ;;
    -*) echo "update_readme_outputs: unknown argument '$arg'" >&2; usage ;;
    *) [[ -f "$arg" ]] || { echo "update_readme_outputs: no file '$arg'" >&2; usage; }; files+=("$arg") ;;
  esac
done

fail() {
  echo "update_readme_outputs: $*" >&2
  exit 2
}
root="$(pwd)"
bin="$(cd "${COURSE_BIN_DIR:-./build/bin}" 2>/dev/null && pwd)" ||
  fail "no programs in ${COURSE_BIN_DIR:-./build/bin} (hint: build first, ./scripts/build.sh)"
suffix=' (scripts/update_readme_outputs.sh writes this block) -->'
end_marker='<!-- end output -->'
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
# the course run builds nothing and leaves its runs/<stamp> folder in the scratch folder
export COURSE_BIN_DIR="$bin" COURSE_RUNS_DIR="$scratch/runs"

# what --check compares for a "times vary" block: the machine's times masked, spaces squeezed
mask_times() {
  # and "..." (excerpt.sh): a busy machine prints more progress lines, so an excerpt's gaps move
  grep -v -E -e '^note: the machine was busy' -e '^\.\.\.$' |
    sed -E -e 's/[0-9][0-9.]*( ?)(ms|s|tok\/s|GFLOP\/s|TFLOP\/s|%)([^a-zA-Z0-9]|$)/#\1\2\3/g' \
      -e 's/(tokens\/s|GFLOP\/s|TFLOP\/s) +[0-9][0-9.]*/\1 #/g' \
      -e 's/kept [0-9.]+ of its/kept # of its/g' -e 's|runs/[0-9]{8}-[0-9]{6}|runs/#|g' \
      -e 's/([0-9]\.[0-9]e[-+][0-9]+ +)[0-9]+( +[0-9.]+ +)/\1#\2/' -e 's/[0-9]\.[0-9]+e[-+][0-9]+/#/g' -e 's/  +/ /g'
}

# ... and, for a mixture of experts, what its routing decides once a choice has flipped
# (and the course run's 200-step bf16 losses)
mask_routing() {
  awk '
    /^step +[0-9]+\// { split($2, step, "/"); if (step[1] + 0 > 20) { sub(/loss [0-9.]+/, "loss #"); sub(/sent [0-9.]+ [KMG]?B/, "sent #") } }
    /^final loss/ { sub(/[0-9][0-9.]+/, "#") }
    / experts [0-9]+-[0-9]+ .* ms/ { gsub(/[0-9][0-9.]* [KMG]?B/, "#") }
    /token-choices dropped over the run/ { gsub(/[0-9][0-9.]*/, "#") }
    / E[0-9]+ k[0-9]+ .*e[-+#]/ || / E[0-9]+ k[0-9]+ .* # / { n = split($0, f, " +"); line = ""; for (i = 1; i <= n; i++) line = line (i > 1 ? " " : "") (i > 4 && f[i] ~ /^[0-9.]+$/ ? "#" : f[i]); $0 = line }
    /^[0-9][0-9]_[a-z0-9_]+ .*bf16 / && !/ against / { gsub(/ [0-9]\.[0-9][0-9][0-9][0-9]( |$)/, " # "); sub(/ [0-9][0-9.]*$/, " #") }
    / bf16 against .*: final loss / { sub(/final loss [0-9.]+/, "final loss #") }
    { print }'
}

# A timed run also prints a step line whenever 3 s pass without one (a busy machine's
# progress), at steps that depend on its speed: keep the step lines of the steps the
# command's --print-every asks for (every step without it), the first and the last.
# Reads the block on stdin.
printed_steps_only() {
  local every=1
  [[ "$1" =~ --print-every[[:space:]]+([0-9]+) ]] && every="${BASH_REMATCH[1]}"
  awk -v every="$every" '
    /^step [0-9]+\/[0-9]+/ { split($2, at, "/"); s = at[1] + 0; if (s != 1 && s != at[2] + 0 && s % every != 0) next }
    { print }'
}

# what --check compares: the block, with the masks its marker asks for
comparable() {
  case "$1" in
    exact) cat ;;
    times) mask_times ;;
    routing) mask_times | mask_routing ;;
  esac
}

# Runs a block's command; its stdout, fenced, into $scratch/block.
run_block() {
  local readme="$1" command="$2"
  local runnable="${command//.\/build\/bin\//$bin/}"
  runnable="${runnable//.\/scripts\//$root/scripts/}"
  local first="${runnable%% | *}" rest=""
  [[ "$first" == "$runnable" ]] || rest="${runnable#* | }"
  local cached
  cached="$scratch/first.$(printf '%s' "$first" | md5sum | cut -c1-16)"
  mkdir -p "$cached.cwd"
  if [[ ! -e "$cached" ]] && ! (cd "$cached.cwd" && timeout 900 bash -o pipefail -c "$first") >"$cached.out" 2>"$scratch/err"; then
    fail "$readme: the command of an output block failed: $command
$(tail -n 5 "$scratch/err")
(hint: build first, ./scripts/build.sh; or fix the marker's command)"
  fi
  [[ -e "$cached" ]] || mv "$cached.out" "$cached"
  # (the course run's folder shows as the reader's runs/<stamp>, not the scratch folder's)
  if ! sed "s|$COURSE_RUNS_DIR/|runs/|g" "$cached" | timeout 60 bash -o pipefail -c "${rest:-cat}" >"$scratch/out" 2>"$scratch/err"; then
    fail "$readme: the excerpt of an output block failed: $command
$(tail -n 5 "$scratch/err")
(hint: fix the marker's command)"
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
  # read from a copy: the blocks take minutes to run, and the README may be edited meanwhile
  cp "$readme" "$scratch/source"
  : >"$scratch/readme"
  inside=0
  while IFS= read -r line || [[ -n "$line" ]]; do
    if [[ $inside == 1 ]]; then
      if [[ "$line" == "$end_marker" ]]; then
        inside=0
        comparable "$masks" <"$scratch/old" | printed_steps_only "$command" >"$scratch/old.compared"
        comparable "$masks" <"$scratch/block" | printed_steps_only "$command" >"$scratch/new.compared"
        same=0
        cmp -s "$scratch/old.compared" "$scratch/new.compared" && same=1
        if [[ $same == 0 && $check == 1 ]]; then
          echo "$readme: stale: the output of '$command' is not what the README shows (hint: ./scripts/update_readme_outputs.sh)" >&2
          diff "$scratch/old.compared" "$scratch/new.compared" | head -n 20 >&2 || true
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
        '<!-- output (times vary): '*) masks=times; command="${line#'<!-- output (times vary): '}" ;;
        '<!-- output (times and routing vary): '*) masks=routing; command="${line#'<!-- output (times and routing vary): '}" ;;
        '<!-- output: '*) masks=exact; command="${line#'<!-- output: '}" ;;
        *) fail "$readme: '$line' is not '<!-- output: COMMAND', '<!-- output (times vary): COMMAND' or '<!-- output (times and routing vary): COMMAND'" ;;
      esac
      command="${command%"$suffix"}"
      run_block "$readme" "$command"
      : >"$scratch/old"
      inside=1
      blocks=$((blocks + 1))
    fi
  done <"$scratch/source"
  [[ $inside == 0 ]] || fail "$readme: no '$end_marker' after the block of '$command'"
  if ! cmp -s "$readme" "$scratch/readme" && [[ $check == 0 ]]; then
    cmp -s "$readme" "$scratch/source" || fail "$readme: edited while its blocks ran; nothing written (run again)"
    cat "$scratch/readme" >"$readme"  # in place: keeps the file's mode and links
    echo "$readme: updated"
  fi
done < <(if [[ ${#files[@]} -gt 0 ]]; then printf '%s\n' "${files[@]}"; else
  find . \( -path ./build -o -path ./runs -o -path ./.git -o -path ./gpu_kit \) -prune -o -name '*.md' -print |
    sed 's|^\./||' | sort | xargs -r grep -l -e '^<!-- output' -- || true; fi)
echo "update_readme_outputs: $blocks block(s) $([[ $check == 1 ]] && echo checked || echo written)"
# none at all: the markers' format changed under the search, and nothing was held to a run
[[ $blocks -gt 0 ]] || fail "no output blocks found (hint: a block starts with a line '<!-- output: COMMAND$suffix')"
exit $stale
