#!/usr/bin/env bash
# Builds fngen with CUDA on the GPU machine: sources scripts/gpu/setup.sh (the Debian packages
# in .deps), configures into $FN_BUILD_DIR (default build-gpu) and builds the targets given as
# arguments (all targets when none). ccache is used only where it exists (the top-level CMake
# looks for it).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/setup.sh
build_dir="${FN_BUILD_DIR:-build-gpu}"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE="${FN_BUILD_TYPE:-Release}" \
  -DFN_CUDA_ARCHS="${FN_CUDA_ARCHS:-90a}" ${FN_CMAKE_ARGS:-}
ninja -C "$build_dir" -j "${FN_JOBS:-$(nproc)}" "$@"
