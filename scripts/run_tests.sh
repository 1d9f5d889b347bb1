#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite through CTest.
#   ./scripts/run_tests.sh              # everything
#   ./scripts/run_tests.sh -L unit      # extra arguments go to ctest (here: one label)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh >/dev/null
preset="${COURSE_PRESET:-$(./scripts/pick_preset.sh)}"
ctest --preset "$preset" -j "$(nproc)" "$@"
