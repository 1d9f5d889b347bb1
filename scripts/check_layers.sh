#!/usr/bin/env bash
# Checks that every #include of the project points down its layers (docs/ARCHITECTURE.md):
#
#   common/tensor <- common/comm <- common/model <- common/train
#     <- 00_single_gpu <- 01_torchrun <- 02_ddp <- ... <- 10_slow_links
#     <- planner/ <- tools/, benchmarks/, tests/
#
# A file may include a header of its own folder's layer or of a lower one, never a
# higher one: the comm library knows nothing of models, and chapter N nothing of
# chapter N+1. (The build says the same of common/: each layer's target sees only the
# headers of its layer and those below, common/CMakeLists.txt.) Prints each wrong-way
# include as file:line and exits 1; exits 0 with a count when there is none.
#   ./scripts/check_layers.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# the rank of a path's layer; higher ranks may include lower ones
layer_of() {
  case "$1" in
    common/tensor/*) echo 1 ;;
    common/comm/*) echo 2 ;;
    common/model/*) echo 3 ;;
    common/train/*) echo 4 ;;
    [01][0-9]_*/*) echo $((10 + 10#${1:0:2})) ;;
    planner/*) echo 30 ;;
    tools/* | benchmarks/* | tests/*) echo 40 ;;
    *) echo "" ;;
  esac
}

checked=0
wrong=0
while IFS= read -r file; do
  from=$(layer_of "$file")
  [ -n "$from" ] || continue
  while IFS=: read -r line included; do
    to=$(layer_of "$included")
    if [ -z "$to" ]; then
      echo "UNKNOWN LAYER: $file:$line includes \"$included\" (add its folder to scripts/check_layers.sh)"
      wrong=$((wrong + 1))
    elif [ "$to" -gt "$from" ]; then
      echo "WRONG WAY: $file:$line includes \"$included\", a layer above its own"
      wrong=$((wrong + 1))
    fi
    checked=$((checked + 1))
  done < <(grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$file" |
           sed -E 's/^([0-9]+):[^"]*"([^"]+)".*/\1:\2/' | grep -E ':(common/|[01][0-9]_[a-z_]+/|planner/|tools/|benchmarks/|tests/)' || true)
done < <(git ls-files -- '*.h' '*.cpp' '*.cu' '*.cuh' 2>/dev/null || find . -name '*.h' -o -name '*.cpp' -o -name '*.cu')

if [ "$wrong" -gt 0 ]; then
  echo "$wrong of $checked project includes point the wrong way (hint: move what both need into the lower layer, or let the higher one pass it down through an interface the lower one defines)"
  exit 1
fi
echo "ok: all $checked project includes point down the layers"
