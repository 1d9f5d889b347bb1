#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite through CTest; then, when run with no
# arguments, the unit and communication tests again under AddressSanitizer and
# UndefinedBehaviorSanitizer (scripts/run_asan_tests.sh: about 6 more minutes on 2
# cores, most of it the asan build; COURSE_ASAN=0 leaves that step out).
#   ./scripts/run_tests.sh              # everything
#   ./scripts/run_tests.sh -L unit      # extra arguments go to ctest (here: one label), no asan step
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh >/dev/null
preset="${COURSE_PRESET:-$(./scripts/pick_preset.sh)}"
ctest --preset "$preset" -j "$(nproc)" "$@"
if [ "$#" -eq 0 ] && [ "${COURSE_ASAN:-1}" != 0 ]; then
  echo "---- the unit and comm tests under the asan preset (COURSE_ASAN=0 skips this) ----"
  ./scripts/run_asan_tests.sh
fi
