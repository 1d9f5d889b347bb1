#!/usr/bin/env bash
# A README's excerpt of a 07_plan listing, read on stdin: the column header and the
# first N layouts (default 8) but those matching DROP (an awk regex; default " z3r",
# the ZeRO-3 twins), each without the program's two leading spaces (so that rows stay
# within 100 columns), then the count of layouts.
#   ./build/bin/07_plan --model gpt2-124m --rows 1000 | ./scripts/plan_rows.sh 8 ' z(1|3r)'
# scripts/update_readme_outputs.sh runs such pipelines for 07_3d/README.md.
set -euo pipefail
rows="${1:-8}"
drop="${2:- z3r}"
awk -v rows="$rows" -v drop="$drop" '
  !done && /^  dp x pp x tp/ { sub(/^  /, ""); print; listing = 1; next }
  listing && /^$/ { listing = 0; done = 1; next }
  listing && $0 !~ drop && shown < rows { sub(/^  /, ""); print; shown++ }
  / layouts, / { sub(/;.*/, ""); print "(" $0 ")" }'
