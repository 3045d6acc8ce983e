#!/usr/bin/env bash
# Configures and builds fngen into build/ (or $FN_BUILD_DIR). Extra arguments go to cmake.
# CUDA targets are built when nvcc is found (/usr/local/cuda/bin/nvcc); -DFN_ENABLE_CUDA=OFF
# skips them.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${FN_BUILD_DIR:-build}"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE="${FN_BUILD_TYPE:-Release}" "$@" >/dev/null
ninja -C "$build_dir" -j "${FN_JOBS:-$(nproc)}"
