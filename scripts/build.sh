#!/usr/bin/env bash
# Installs what is missing, configures and builds (everything, or the targets given:
# ./scripts/build.sh 00_single_gpu launch). Prints the build directory's bin/.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >&2
preset="${COURSE_PRESET:-$(./scripts/pick_preset.sh)}"
cmake --preset "$preset" >&2
if [ "$#" -gt 0 ]; then
  cmake --build --preset "$preset" -j "$(nproc)" --target "$@" >&2
else
  cmake --build --preset "$preset" -j "$(nproc)" >&2
fi
# build/bin is the preset just built, so the docs' commands work whichever it was
ln -sfn "$preset/bin" build/bin
echo "build/bin"
