// The PDL switch and the per-device capability cache (see pdl.h, pdl.cuh).
#include "cuda/common/pdl.cuh"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace fn {
namespace {
std::atomic<int> g_pdl{-1};  // -1: not decided yet; 0 off; 1 on

// Compiled as every kernel of the build (FN_CUDA_ARCHS): its PTX version says whether the code the
// device runs has the griddepcontrol instructions (sm_90+ code; a 75 or 80 build JIT-compiled or
// run on an sm_90 device has none, so its kernels must not be launched as programmatic dependents).
__global__ void pdl_probe_kernel() {}
}  // namespace

void set_pdl_enabled(bool enabled) {
  g_pdl.store(enabled ? 1 : 0, std::memory_order_relaxed);
}

bool pdl_enabled() {
  int v = g_pdl.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("FN_PDL");
    int expected = -1;
    g_pdl.compare_exchange_strong(expected, env != nullptr && std::strcmp(env, "0") == 0 ? 0 : 1,
                                  std::memory_order_relaxed);
    v = g_pdl.load(std::memory_order_relaxed);
  }
  return v == 1;
}

namespace detail {
bool current_device_has_pdl() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};  // 0 unknown, 1 no, 2 yes
  int device = 0;
  FN_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) return false;
  int v = cache[device].load(std::memory_order_relaxed);
  if (v == 0) {
    int major = 0;
    FN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    v = 1;
    if (major >= 9) {
      cudaFuncAttributes attr = {};
      FN_CUDA_CHECK(cudaFuncGetAttributes(&attr, pdl_probe_kernel));
      v = attr.ptxVersion >= 90 ? 2 : 1;
    }
    cache[device].store(v, std::memory_order_relaxed);
  }
  return v == 2;
}
}  // namespace detail
}  // namespace fn
