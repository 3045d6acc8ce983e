#!/usr/bin/env bash
# The test command (README, .ci/run): setup, build, then the cpu and mpi test labels; then an
# ASan+UBSan build (CPU only) runs the cpu label again (less the "heavy" arithmetic tests).
# Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
phase() { echo "test.sh: $1 (${SECONDS} s so far)" >&2; }  # where the time goes
bash scripts/setup.sh
phase "setup done"
bash scripts/build.sh
phase "build done"
(cd build && ctest -L 'cpu|mpi' --output-on-failure -j "${FN_TEST_JOBS:-2}")
phase "cpu and mpi tests done"
if [ "${FN_SKIP_SANITIZERS:-0}" != 1 ]; then
  FN_BUILD_DIR=build-asan FN_BUILD_TYPE=Debug bash scripts/build.sh -DFN_SANITIZE=ON -DFN_ENABLE_CUDA=OFF
  phase "sanitizer build done"
  # "heavy" = exhaustive arithmetic tests (shard plan, memory plan): run above, not again here.
  (cd build-asan && ctest -L cpu -LE heavy --output-on-failure -j "${FN_TEST_JOBS:-2}")
  phase "sanitizer tests done"
fi
echo "test.sh: all tests passed" >&2
