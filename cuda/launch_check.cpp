#include "cuda/launch_check.h"

#include <cuda_runtime_api.h>

#include <atomic>

#include "comm/cuda_check.h"
#include "core/error.h"

namespace fn::detail {

void throw_launch_precondition(const char* op, const char* cond, const char* file, int line) {
  throw_error(ErrorKind::Internal, file, line,
              fmt::format("{}: precondition failed: {} ({}:{})", op, cond, file, line));
}

namespace {

// A device attribute of the current device, queried once per device and cached in `cache`.
int cached_attribute(std::atomic<int>* cache, int max_devices, cudaDeviceAttr attr) {
  int device = 0;
  FN_CUDA_CHECK(cudaGetDevice(&device));
  FN_CHECK(device >= 0 && device < max_devices, "device index {} out of range", device);
  int value = cache[device].load(std::memory_order_relaxed);
  if (value == 0) {
    FN_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
    cache[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

constexpr int kMaxDevices = 64;

}  // namespace

int current_sm_count() {
  static std::atomic<int> cache[kMaxDevices] = {};
  return cached_attribute(cache, kMaxDevices, cudaDevAttrMultiProcessorCount);
}

int current_max_smem_optin() {
  static std::atomic<int> cache[kMaxDevices] = {};
  return cached_attribute(cache, kMaxDevices, cudaDevAttrMaxSharedMemoryPerBlockOptin);
}

}  // namespace fn::detail
