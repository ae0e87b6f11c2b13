#!/usr/bin/env bash
# Installs the dependencies (idempotent), configures and builds accel into build/ (binaries in
# build/bin). Extra arguments go to cmake's configure step, e.g. -DCMAKE_BUILD_TYPE=Debug.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -G Ninja "$@" >/dev/null
cmake --build build -j "${ACCEL_BUILD_JOBS:-2}"
