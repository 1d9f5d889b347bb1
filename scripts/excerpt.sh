#!/usr/bin/env bash
# A README's excerpt of a program's output, read on stdin: the lines that match the
# extended regular expression KEEP (with -v: the lines that do not match DROP), and
# "..." for each run of lines left out. awk reads the expression, and Debian's mawk
# has no counted repeats: [0-9][0-9], not [0-9]{2}.
#   ./build/bin/00_single_gpu --steps 200 --print-every 20 | ./scripts/excerpt.sh '^model|^step +(1|200)/'
#   ./build/bin/00_single_gpu --steps 200 --print-every 20 | ./scripts/excerpt.sh -v '^step +[2-9]'
# scripts/update_readme_outputs.sh runs such pipelines for the chapter READMEs.
set -euo pipefail
usage() { echo "usage: $0 KEEP | -v DROP   (an extended regular expression)" >&2; exit 2; }
invert=0
if [[ "${1:-}" == -v ]]; then invert=1; shift; fi
[[ $# -eq 1 ]] || usage
# the expression through the environment: awk -v would turn its \( into (
PATTERN="$1" awk -v invert="$invert" '
  ($0 ~ ENVIRON["PATTERN"]) != invert { if (skipped) print "..."; skipped = 0; print; next }
  { skipped = 1 }
  END { if (skipped) print "..." }'
