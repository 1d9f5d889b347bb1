#!/usr/bin/env bash
# Builds the asan preset (AddressSanitizer + UndefinedBehaviorSanitizer) and runs the
# unit and communication tests under it: a memory error or undefined behaviour in
# common/ then fails a test instead of passing unnoticed.
#   ./scripts/run_asan_tests.sh              # the unit and comm labels
#   ./scripts/run_asan_tests.sh -L launcher  # extra arguments go to ctest instead
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >&2
cmake --preset asan >&2
cmake --build --preset asan -j "$(nproc)" >&2
if [ "$#" -eq 0 ]; then set -- -L "unit|comm"; fi
ctest --preset asan -j "$(nproc)" "$@"
