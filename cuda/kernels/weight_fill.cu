// Random device fills (see weight_fill.h): a counter-based hash (splitmix64 of seed, stream and
// index) per element, so every element is independent of launch geometry.
#include "cuda/common/cuda_check.h"
#include "cuda/common/launch_check.h"
#include "cuda/kernels/weight_fill.h"

namespace fn {

namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__device__ __forceinline__ uint16_t to_bf16_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // nearest even
}

__global__ void random_fill_kernel(RandomFillParams p, uint64_t key) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.count;
       i += stride) {
    const uint64_t r = mix64(key ^ mix64(static_cast<uint64_t>(p.first + i)));
    switch (p.kind) {
      case RandomFill::Uniform: {
        const float u = static_cast<float>(r >> 40) * (1.0f / 16777216.0f);  // [0, 1)
        const float v = p.lo + (p.hi - p.lo) * u;
        if (p.dtype == DType::F32)
          static_cast<float*>(p.dst)[i] = v;
        else
          static_cast<uint16_t*>(p.dst)[i] = to_bf16_bits(v);
        break;
      }
      case RandomFill::E2M1Codes:
        static_cast<uint8_t*>(p.dst)[i] = static_cast<uint8_t>(r >> 56);
        break;
      case RandomFill::E4M3NearOne:
        static_cast<uint8_t*>(p.dst)[i] = static_cast<uint8_t>(0x36 + ((r >> 60) & 3));
        break;
      case RandomFill::E4M3Uniform: {
        uint8_t c = static_cast<uint8_t>(r >> 56);
        if ((c & 0x7f) == 0x7f) c ^= 1;  // 0x7f / 0xff are NaN: take the neighbour
        static_cast<uint8_t*>(p.dst)[i] = c;
        break;
      }
    }
  }
}

}  // namespace

void launch_random_fill(const RandomFillParams& p, cudaStream_t stream) {
  constexpr const char* op = "launch_random_fill";
  FN_LAUNCH_REQUIRE(p.count >= 0 && p.first >= 0, op);
  if (p.count == 0) return;
  FN_LAUNCH_REQUIRE(p.dst != nullptr, op);
  if (p.kind == RandomFill::Uniform) {
    FN_LAUNCH_REQUIRE(p.dtype == DType::F32 || p.dtype == DType::BF16, op);
  } else {
    FN_LAUNCH_REQUIRE(p.dtype == DType::U8 || p.dtype == DType::F8_E4M3, op);
  }
  const int threads = 256;
  const int64_t want = (p.count + threads - 1) / threads;
  const int blocks = static_cast<int>(want < 65536 ? want : 65536);
  const uint64_t key = (p.seed * 0x9e3779b97f4a7c15ull) ^ (p.stream + 0x632be59bd9b4e019ull);
  random_fill_kernel<<<blocks, threads, 0, stream>>>(p, key);
  FN_CUDA_LAUNCH_CHECK("random_fill_kernel");
}

}  // namespace fn
