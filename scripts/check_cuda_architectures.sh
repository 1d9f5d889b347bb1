#!/usr/bin/env bash
# Checks that a CUDA build's binary holds code for the GPUs it was configured for
# (CMakeLists.txt picks them: the machine's own GPU, else sm_80 and sm_90). A kernel
# with no code for the GPU it meets fails with "no kernel image is available", at
# the first op of a run, on the user's machine: this finds it at build time.
#   ./scripts/check_cuda_architectures.sh CUOBJDUMP BINARY ARCHITECTURES
# ARCHITECTURES is CMAKE_CUDA_ARCHITECTURES with commas: "80-real,90". An entry N
# or N-real needs machine code for sm_N (cuobjdump --list-elf), N or N-virtual
# needs PTX for it (--list-ptx; cuobjdump names both files .sm_N.). A toolkit
# without cuobjdump (this course's CI machines) is read with objcopy and python3
# instead (list_fatbin below). Exits 77 (CTest: skipped) with neither, or when the
# list is resolved only at build time (native, all, all-major); 1 naming what is
# missing.
set -euo pipefail

cuobjdump="$1"
binary="$2"
architectures="$3"

case ",$architectures," in
  *,native,* | *,all,* | *,all-major,*)
    echo "SKIPPED: CMAKE_CUDA_ARCHITECTURES=$architectures is resolved by nvcc, no fixed list to check"
    exit 77
    ;;
esac

# Without cuobjdump: the .nv_fatbin section of every object in the archive, read by
# hand. A fat binary is a 16-byte header (magic 0xBA55ED50, version, header size,
# payload size) followed by entries, each led by a header of its own: the kind (1 =
# PTX, 2 = machine code) at byte 0, the header's size at 4, the payload's padded size
# at 8, and the SM version (80 = sm_80) at 28. Prints ".sm_N." per entry of `kind`,
# as cuobjdump's listings name their files.
list_fatbin() {  # archive kind
  local archive dir object
  archive="$(realpath "$1")"
  dir="$(mktemp -d)"
  (cd "$dir" && ar x "$archive")
  for object in "$dir"/*.o; do
    objcopy -O binary --only-section=.nv_fatbin "$object" "$object.fatbin" 2>/dev/null || continue
    python3 - "$object.fatbin" "$2" <<'EOF'
import struct, sys
data, kind_wanted = open(sys.argv[1], "rb").read(), int(sys.argv[2])
offset = 0
while offset + 16 <= len(data):
    magic, _, header_size, payload_size = struct.unpack_from("<IHHQ", data, offset)
    if magic != 0xBA55ED50:
        break
    entry, end = offset + header_size, offset + header_size + payload_size
    while entry < end:
        kind, _, entry_header_size, padded_size = struct.unpack_from("<HHIQ", data, entry)
        sm = struct.unpack_from("<I", data, entry + 28)[0]
        if kind == kind_wanted:
            print(f"{sys.argv[1]}: .sm_{sm}.")
        entry += entry_header_size + padded_size
    offset = end
EOF
  done
  rm -rf "$dir"
}

if [ -x "$cuobjdump" ]; then
  elf="$("$cuobjdump" --list-elf "$binary")"
  ptx="$("$cuobjdump" --list-ptx "$binary")"
elif command -v objcopy >/dev/null && command -v python3 >/dev/null; then
  elf="$(list_fatbin "$binary" 2)"
  ptx="$(list_fatbin "$binary" 1)"
else
  echo "SKIPPED: neither cuobjdump nor objcopy and python3 to read the fat binaries (hint: install the" \
       "toolkit's cuobjdump, e.g. apt-get install cuda-cuobjdump-13-0, and configure again)"
  exit 77
fi
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
