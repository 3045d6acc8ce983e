// Helpers for the GPU kernel tests (tests/test_cuda_*.cpp): RAII device buffers, seeded random
// fills, and the one numeric comparator with per-element error bounds derived from the kernel's
// summation depth (no hand-picked tolerances). Host C++ only (CUDA runtime API).
#pragma once

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/codecs.h"
#include "cuda/common/cuda_check.h"
#include "cuda/kernels/moe_nvfp4.h"

namespace fn::test {

/// FP32 unit roundoff (2^-24): one rounding of a value x errs by at most kFp32Unit * |x|.
inline constexpr double kFp32Unit = 5.9604644775390625e-08;
/// BF16 unit roundoff: 8 significant bits, so round-to-nearest errs by at most half an ulp,
/// 2^-8 relative (2^-9 holds only near the top of a binade: measured BF16 outputs reach
/// error / bound up to 2 under 2^-9).
inline constexpr double kBf16Unit = 1.0 / 256.0;

/// gamma_h of Higham: the bound factor for a sum (or dot) whose every term passes through at most
/// h FP32 roundings: |computed - exact| <= gamma_h * sum |terms|.
inline double gamma_fp32(int h) {
  const double hu = h * kFp32Unit;
  return hu / (1.0 - hu);
}

/// A device allocation of n elements of T, freed on scope exit.
template <typename T>
struct DeviceArray {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceArray(size_t count) : n(count) {
    FN_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr), (count > 0 ? count : 1) * sizeof(T)));
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { upload(host); }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void upload(const std::vector<T>& host) {
    REQUIRE(host.size() == n);
    FN_CUDA_CHECK(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n);
    FN_CUDA_CHECK(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
};

/// NVFP4 expert codes uploaded in the checkpoint's layout -> the decode layout the expert kernels
/// read (Nvfp4Experts::packed, cuda/common/nvfp4_bits.h), in place; waits for the device.
inline void to_decode_layout(DeviceArray<uint8_t>& packed) {
  fn::nvfp4_codes_to_decode_layout(packed.ptr, static_cast<int64_t>(packed.n), nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
}

/// Result of compare_bounded: how many elements broke their bound and the worst one.
struct Comparison {
  int64_t wrong = 0;
  int64_t worst = -1;      ///< index with the largest |got - want| / bound
  double worst_ratio = 0;  ///< that ratio (<= 1 passes)
  double got = 0, want = 0, bound = 0;
  std::string describe() const {
    return "wrong " + std::to_string(wrong) + ", worst at " + std::to_string(worst) + ": got " +
           std::to_string(got) + " want " + std::to_string(want) + " bound " +
           std::to_string(bound) + " (ratio " + std::to_string(worst_ratio) + ")";
  }
};

/// The comparator: element i passes when |got[i] - want[i]| <= bound[i] (bound 0 means bitwise
/// equal values), NaN only where want is NaN, infinities only equal to the same infinity.
inline Comparison compare_bounded(const std::vector<float>& got, const std::vector<double>& want,
                                  const std::vector<double>& bound) {
  REQUIRE(got.size() == want.size());
  REQUIRE(bound.size() == want.size());
  Comparison c;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    double ratio;
    if (std::isnan(w) || std::isnan(g)) {
      ratio = (std::isnan(w) && std::isnan(g)) ? 0.0 : INFINITY;
    } else if (std::isinf(w) || std::isinf(g)) {
      ratio = g == w ? 0.0 : INFINITY;
    } else {
      const double err = std::fabs(g - w);
      ratio = err == 0.0 ? 0.0 : (bound[i] > 0 ? err / bound[i] : INFINITY);
    }
    if (ratio > 1.0) ++c.wrong;
    if (c.worst < 0 || ratio > c.worst_ratio) {
      c.worst = static_cast<int64_t>(i);
      c.worst_ratio = ratio;
      c.got = g;
      c.want = w;
      c.bound = bound[i];
    }
  }
  return c;
}

/// n samples of N(0, sigma^2) in FP32 from a std::mt19937_64 seeded with `seed` (test inputs).
inline std::vector<float> normal_floats(size_t n, float sigma, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

/// normal_floats(n, sigma, seed) rounded to BF16 (nearest even), as BF16 bit patterns.
inline std::vector<uint16_t> random_bf16_bits(size_t n, float sigma, uint64_t seed) {
  const std::vector<float> f = normal_floats(n, sigma, seed);
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = fn::float_to_bf16(f[i]);
  return v;
}

/// Microseconds per call of `enqueue(stream)` for the GPU benches (FN_BENCH=1): per_graph calls
/// captured into one CUDA graph on `stream`, one warm-up launch, then `replays` back-to-back
/// launches between two events, best of 3 such timings, divided by per_graph * replays. Throws
/// fn::Error(Cuda) on a failed CUDA call.
template <typename Enqueue>
double graph_us_per_call(cudaStream_t stream, int per_graph, int replays, Enqueue&& enqueue) {
  cudaEvent_t e0, e1;
  FN_CUDA_CHECK(cudaEventCreate(&e0));
  FN_CUDA_CHECK(cudaEventCreate(&e1));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < per_graph; ++i) enqueue(stream);
  FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));  // warm-up
  FN_CUDA_CHECK(cudaStreamSynchronize(stream));
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    FN_CUDA_CHECK(cudaEventRecord(e0, stream));
    for (int r = 0; r < replays; ++r) FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    FN_CUDA_CHECK(cudaEventRecord(e1, stream));
    FN_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    FN_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, 1000.0 * ms / (per_graph * replays));
  }
  FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
  FN_CUDA_CHECK(cudaGraphDestroy(graph));
  FN_CUDA_CHECK(cudaEventDestroy(e0));
  FN_CUDA_CHECK(cudaEventDestroy(e1));
  return best;
}

}  // namespace fn::test
