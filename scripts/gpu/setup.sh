#!/usr/bin/env bash
# GPU-machine dependency setup (source it: `source scripts/gpu/setup.sh`). The GPU machine
# (Ubuntu 24.04) lacks the PCRE2 and utf8proc headers the top-level CMake requires, and nothing
# can be downloaded there. Unpacks the Debian .deb files carried in .deps/ (fetched on the dev
# machine, see below) with `dpkg -x` into .deps/root inside the work tree (never into /),
# rewrites their pkg-config prefixes and exports CMAKE_PREFIX_PATH, PKG_CONFIG_PATH,
# LD_LIBRARY_PATH (FN_DEPS_DIR / FN_DEPS_ROOT override the two folders). Also exports the
# no-multicast environment every GPU process must run with.
# Fetch on the dev machine (once):
#   mkdir -p .deps && cd .deps && apt-get download libpcre2-dev libpcre2-8-0 libpcre2-16-0 \
#     libpcre2-32-0 libpcre2-posix3 libutf8proc-dev libutf8proc2 doctest-dev
fn_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
fn_deps="${FN_DEPS_DIR:-$fn_repo/.deps}"
fn_root="${FN_DEPS_ROOT:-$fn_deps/root}"
if ! ls "$fn_deps"/*.deb >/dev/null 2>&1; then
  echo "gpu/setup: no .deb files in $fn_deps (fetch them as the comment at the top says)" >&2
  return 1 2>/dev/null || exit 1
fi
mkdir -p "$fn_root"
for deb in "$fn_deps"/*.deb; do
  dpkg -x "$deb" "$fn_root"
done
# The .pc files say prefix=/usr: point them at the unpacked tree.
for pc in "$fn_root"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc "$fn_root"/usr/share/pkgconfig/*.pc; do
  [ -f "$pc" ] && sed -i "s|^prefix=/usr\$|prefix=$fn_root/usr|" "$pc"
done
export CMAKE_PREFIX_PATH="$fn_root/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
export PKG_CONFIG_PATH="$fn_root/usr/lib/x86_64-linux-gnu/pkgconfig:$fn_root/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export LD_LIBRARY_PATH="$fn_root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Never NVLink multicast (shared GPUs can be put out of service by it).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo "gpu/setup: unpacked $(ls "$fn_deps"/*.deb | wc -l) packages into $fn_root" >&2
