#include "cuda/common/cuda_check.h"
#include "tests/comm_test_kernels.h"

namespace fn::test {

namespace {

// Device copies of the pattern (the header's inline functions are host-only).
__device__ uint32_t d_pattern_f32_bits(uint64_t i, int rank, uint32_t salt) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(rank) * 0xC2B2AE3D27D4EB4Full +
               static_cast<uint64_t>(salt) * 0x165667B19E3779F9ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  const uint32_t sign = static_cast<uint32_t>(x >> 63) << 31;
  const uint32_t exponent = 119u + static_cast<uint32_t>((x >> 40) % 16u);
  return sign | (exponent << 23) | static_cast<uint32_t>(x & 0x7FFFFFu);
}

__device__ uint16_t d_bf16_from_float(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__global__ void fill_kernel(void* buf, std::size_t count, bool bf16, int rank,
                            const uint32_t* salt_dev, uint32_t salt_add) {
  const uint32_t salt = (salt_dev != nullptr ? *salt_dev : 0u) + salt_add;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const uint32_t bits = d_pattern_f32_bits(i, rank, salt);
    if (bf16) {
      static_cast<uint16_t*>(buf)[i] = static_cast<uint16_t>(bits >> 16);
    } else {
      static_cast<uint32_t*>(buf)[i] = bits;
    }
  }
}

__global__ void check_kernel(const void* out, std::size_t count, bool bf16, int world,
                             const uint32_t* salt_dev, uint32_t salt_add, unsigned long long* wrong,
                             unsigned long long* checks) {
  const uint32_t salt = (salt_dev != nullptr ? *salt_dev : 0u) + salt_add;
  unsigned long long bad = 0;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (int r = 0; r < world; ++r) {
      uint32_t bits = d_pattern_f32_bits(i, r, salt);
      if (bf16) bits &= 0xffff0000u;
      const float v = __uint_as_float(bits);
      acc = r == 0 ? v : __fadd_rn(acc, v);
    }
    if (bf16) {
      bad += static_cast<const uint16_t*>(out)[i] != d_bf16_from_float(acc);
    } else {
      bad += static_cast<const uint32_t*>(out)[i] != __float_as_uint(acc);
    }
  }
  if (bad != 0) atomicAdd(wrong, bad);
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(checks, 1ull);
}

__global__ void bump_kernel(uint32_t* counter) {
  *counter += 1u;
}

__global__ void busy_kernel(float* buf, std::size_t n, int rounds) {
  for (int k = 0; k < rounds; ++k) {
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
      buf[i] = buf[i] * 0.999f + 1.0f;
    }
  }
}

int grid_for(std::size_t count) {
  const std::size_t blocks = (count + 255) / 256;
  return static_cast<int>(blocks < 1024 ? (blocks == 0 ? 1 : blocks) : 1024);
}

}  // namespace

void launch_fill_pattern(void* buf, std::size_t count, bool bf16, int rank,
                         const uint32_t* salt_dev, uint32_t salt_add, cudaStream_t stream) {
  fill_kernel<<<grid_for(count), 256, 0, stream>>>(buf, count, bf16, rank, salt_dev, salt_add);
  FN_CUDA_LAUNCH_CHECK("fill_kernel");
}

void launch_check_sum(const void* out, std::size_t count, bool bf16, int world,
                      const uint32_t* salt_dev, uint32_t salt_add, unsigned long long* wrong,
                      unsigned long long* checks, cudaStream_t stream) {
  check_kernel<<<grid_for(count), 256, 0, stream>>>(out, count, bf16, world, salt_dev, salt_add,
                                                    wrong, checks);
  FN_CUDA_LAUNCH_CHECK("check_kernel");
}

void launch_bump(uint32_t* counter, cudaStream_t stream) {
  bump_kernel<<<1, 1, 0, stream>>>(counter);
  FN_CUDA_LAUNCH_CHECK("bump_kernel");
}

void launch_busy(float* buf, std::size_t n, int rounds, cudaStream_t stream) {
  busy_kernel<<<1024, 256, 0, stream>>>(buf, n, rounds);
  FN_CUDA_LAUNCH_CHECK("busy_kernel");
}

}  // namespace fn::test
