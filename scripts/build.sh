#!/usr/bin/env bash
# Installs what is missing, configures and builds. Prints the build directory's bin/.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >&2
preset="${COURSE_PRESET:-$(./scripts/pick_preset.sh)}"
cmake --preset "$preset" >&2
cmake --build --preset "$preset" -j "$(nproc)" >&2
# build/bin is the preset just built, so the docs' commands work whichever it was
ln -sfn "$preset/bin" build/bin
echo "build/bin"
