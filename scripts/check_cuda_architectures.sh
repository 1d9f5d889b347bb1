#!/usr/bin/env bash
# Checks that a CUDA build's binary holds code for the GPUs it was configured for
# (CMakeLists.txt picks them: the machine's own GPU, else sm_80 and sm_90). A kernel
# with no code for the GPU it meets fails with "no kernel image is available", at
# the first op of a run, on the user's machine: this finds it at build time.
#   ./scripts/check_cuda_architectures.sh CUOBJDUMP BINARY ARCHITECTURES
# ARCHITECTURES is CMAKE_CUDA_ARCHITECTURES with commas: "80-real,90". An entry N
# or N-real needs machine code for sm_N (cuobjdump --list-elf), N or N-virtual
# needs PTX for it (--list-ptx; cuobjdump names both files .sm_N.). Exits 77
# (CTest: skipped) without cuobjdump, or when the list is resolved only at build
# time (native, all, all-major); 1 naming what is missing.
set -euo pipefail

cuobjdump="$1"
binary="$2"
architectures="$3"

if [ ! -x "$cuobjdump" ]; then
  echo "SKIPPED: no cuobjdump next to nvcc or on PATH (hint: install the toolkit's cuobjdump, e.g." \
       "apt-get install cuda-cuobjdump-13-0 or pip install nvidia-cuda-cuobjdump, and configure again)"
  exit 77
fi
case ",$architectures," in
  *,native,* | *,all,* | *,all-major,*)
    echo "SKIPPED: CMAKE_CUDA_ARCHITECTURES=$architectures is resolved by nvcc, no fixed list to check"
    exit 77
    ;;
esac

elf="$("$cuobjdump" --list-elf "$binary")"
ptx="$("$cuobjdump" --list-ptx "$binary")"
missing=0
require() {  # listing, "machine code" or "PTX", N, entry
  if grep -q "\.sm_$3\." <<<"$1"; then
    echo "ok: $2 for sm_$3 (from $4)"
  else
    echo "MISSING: $2 for sm_$3 (from $4) in $binary"
    missing=1
  fi
}
IFS=',' read -ra entries <<<"$architectures"
for entry in "${entries[@]}"; do
  number="${entry%%-*}"
  case "$entry" in
    *-real) require "$elf" "machine code" "$number" "$entry" ;;
    *-virtual) require "$ptx" "PTX" "$number" "$entry" ;;
    *) require "$elf" "machine code" "$number" "$entry" && require "$ptx" "PTX" "$number" "$entry" ;;
  esac
done
if [ "$missing" -ne 0 ]; then
  echo "hint: configure again (rm -rf build/cuda && cmake --preset cuda) so that CMAKE_CUDA_ARCHITECTURES is used"
  exit 1
fi
