// Random weight generation in device memory for the in-memory full-geometry model
// (CudaModel::random; pieces of a tensor for its host-resident n-gram table): fills a device tensor
// with values drawn per core/synth.h's rules without staging anything on the host, so the real
// 48-layer geometry (120 GB at TP=1) loads in seconds. Each element depends only on (seed, stream,
// index).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"

namespace fn {

/// What a filled tensor holds.
enum class RandomFill {
  Uniform,      ///< uniform in [lo, hi], stored as dtype (F32 or BF16)
  E2M1Codes,    ///< U8 bytes: two uniform random E2M1 codes (any of the 16)
  E4M3NearOne,  ///< F8_E4M3 block scales: codes 0x36..0x39 (0.875, 0.9375, 1.0, 1.125)
  E4M3Uniform,  ///< F8_E4M3 codes uniform over the finite codes (n-gram table rows)
};

/// Fill parameters. `dst` is device memory of `count` elements of `dtype`.
struct RandomFillParams {
  void* dst = nullptr;
  int64_t count = 0;          ///< elements (bytes for U8 / F8_E4M3)
  DType dtype = DType::BF16;  ///< F32 or BF16 for Uniform; U8 / F8_E4M3 for the code fills
  RandomFill kind = RandomFill::Uniform;
  float lo = -1.0f, hi = 1.0f;  ///< Uniform range
  uint64_t seed = 0;            ///< model seed
  uint64_t stream = 0;          ///< per-tensor stream id (e.g. a hash of the tensor name)
  /// Index of dst[0] in the tensor: element i of dst gets the value of tensor element first + i,
  /// so a tensor filled in pieces holds the bytes of one whole fill. >= 0.
  int64_t first = 0;
};

/// Enqueues the fill on `stream`. Throws fn::Error(Internal) on a null pointer, a negative count
/// or a dtype that does not match `kind`; fn::Error(Cuda) when the launch fails.
void launch_random_fill(const RandomFillParams& params, cudaStream_t stream);

}  // namespace fn
