#!/usr/bin/env bash
# A README's excerpt of a program's output, read on stdin: the lines that match the
# extended regular expression KEEP, and "..." for each run of lines left out.
#   ./build/bin/00_single_gpu --steps 200 --print-every 20 | ./scripts/excerpt.sh '^model|^step +(1|200)/'
# scripts/update_readme_outputs.sh runs such pipelines for the chapter READMEs.
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 KEEP   (an extended regular expression)" >&2; exit 2; }
awk -v keep="$1" '
  $0 ~ keep { if (skipped) print "..."; skipped = 0; print; next }
  { skipped = 1 }
  END { if (skipped) print "..." }'
