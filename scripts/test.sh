#!/usr/bin/env bash
# Runs every test: dependencies, configure, build, then ctest (unit and integration).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh "$@"
ctest --test-dir build --output-on-failure -j "${ACCEL_TEST_JOBS:-2}"
