// Device helpers of the comm GPU tests (tests/test_comm_gpu.cpp): a deterministic pattern that
// every rank can evaluate for every rank (so the expected sum is known everywhere), a checker
// kernel that recomputes the fixed-order sum independently of the all-reduce, and a busy
// kernel for the concurrency test. Plain C++ header; kernels in comm_test_kernels.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace fn::test {

/// Bits of rank `rank`'s F32 value at element i for pattern `salt`: random sign and mantissa,
/// exponents 2^-8..2^7 (so sums round, and the order of the sum matters).
inline uint32_t pattern_f32_bits(uint64_t i, int rank, uint32_t salt) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(rank) * 0xC2B2AE3D27D4EB4Full +
               static_cast<uint64_t>(salt) * 0x165667B19E3779F9ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  const uint32_t sign = static_cast<uint32_t>(x >> 63) << 31;
  const uint32_t exponent = 119u + static_cast<uint32_t>((x >> 40) % 16u);
  return sign | (exponent << 23) | static_cast<uint32_t>(x & 0x7FFFFFu);
}

/// BF16 pattern: the top half of the F32 pattern.
inline uint16_t pattern_bf16_bits(uint64_t i, int rank, uint32_t salt) {
  return static_cast<uint16_t>(pattern_f32_bits(i, rank, salt) >> 16);
}

/// FP32 -> BF16, round to nearest even (the reference rounding).
inline uint16_t bf16_from_float(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/// Fills buf[count] (F32 or BF16) with rank's pattern for salt (*salt_dev + salt_add).
void launch_fill_pattern(void* buf, std::size_t count, bool bf16, int rank,
                         const uint32_t* salt_dev, uint32_t salt_add, cudaStream_t stream);
/// Counts (atomically into *wrong) elements of out that differ bitwise from the sum over ranks
/// 0..world-1, in that order, in FP32 (then BF16 RNE) of the pattern for the same salt;
/// increments *checks once.
void launch_check_sum(const void* out, std::size_t count, bool bf16, int world,
                      const uint32_t* salt_dev, uint32_t salt_add, unsigned long long* wrong,
                      unsigned long long* checks, cudaStream_t stream);
/// ++*counter.
void launch_bump(uint32_t* counter, cudaStream_t stream);
/// Memory-bound busy work (reads and writes buf[n] `rounds` times) over many CTAs.
void launch_busy(float* buf, std::size_t n, int rounds, cudaStream_t stream);

}  // namespace fn::test
