#include "cuda/common/launch_check.h"

#include <cuda_runtime_api.h>

#include <atomic>

#include "core/error.h"
#include "cuda/common/cuda_check.h"

namespace fn::detail {

void throw_launch_precondition(const char* op, const char* cond, const char* file, int line) {
  throw_error(ErrorKind::Internal, file, line,
              fmt::format("{}: precondition failed: {} ({}:{})", op, cond, file, line));
}

int current_sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  int device = 0;
  FN_CUDA_CHECK(cudaGetDevice(&device));
  FN_CHECK(device >= 0 && device < kMaxDevices, "device index {} out of range", device);
  int sms = cache[device].load(std::memory_order_relaxed);
  if (sms == 0) {
    FN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    cache[device].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

}  // namespace fn::detail
