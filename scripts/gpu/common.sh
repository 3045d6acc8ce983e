#!/usr/bin/env bash
# The preamble of the GPU-machine scripts (source it from the repository root, after
# setting fn_out_default): $out (= $OUT, or fn_out_default) created, the carried .deps folder,
# the no-multicast NCCL environment, Open MPI allowed as root, $mpi (mpirun as every test and
# bench of these scripts runs it), $b (the build folder: $FN_BUILD_DIR or build-new) and $t0. Also fresh_build_dir (below).
out=${OUT:-$fn_out_default}
mkdir -p "$out"
export FN_DEPS_DIR=${FN_DEPS_DIR:-$(pwd)/.deps}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# shellcheck disable=SC2034  # used by the sourcing script
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
b=${FN_BUILD_DIR:-build-new}
t0=$SECONDS

# fresh_build_dir DIR TREE: empties DIR unless it was last built from TREE's exact files. A
# `git archive` extraction gives every file its commit's time, older than the objects a warm
# machine keeps from an earlier call's tree, so ninja would reuse those objects and relink some of
# them with the few it does rebuild (objects of two versions in one binary, which once printed
# garbage and hung). The key is a checksum of TREE's files (build folders excluded).
fresh_build_dir() {
  local dir=$1 tree=$2 sum
  sum=$(cd "$tree" && find . -path './build*' -prune -o -type f -print0 | sort -z |
    xargs -0 md5sum | md5sum | cut -c1-16)
  if [ "$(cat "$dir/.fn_tree" 2>/dev/null)" != "$sum" ]; then
    rm -rf "$dir"
    mkdir -p "$dir"
    echo "$sum" >"$dir/.fn_tree"
  fi
}
