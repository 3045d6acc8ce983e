// Row launchers of the router top-k block for the GPU tests (tests/router_topk_reference.cu): the
// current fn::dev::router_topk_block and a verbatim copy of the earlier sorted-list version, which
// must give the same bits. Host C++ only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fn::test {

/// Runs the router softmax + top-k on `rows` rows, one 512-thread block per row, on `stream`:
/// logits [rows, stride] FP32 (device; row r starts at r * stride, E <= stride), ids and
/// weights [rows, k] (device), flags [rows] (device; flags[r] set to 4 when row r has a NaN p,
/// untouched otherwise). reference: the copy of the earlier version, else the current device
/// code. 1 <= E <= 1024, 1 <= k <= min(E, 64) (unchecked). Legal during stream capture; throws
/// fn::Error(Cuda) on a launch error.
void router_topk_rows(bool reference, const float* logits, int64_t stride, int rows, int E, int k,
                      bool norm, int32_t* ids, float* weights, int32_t* flags, cudaStream_t stream);

}  // namespace fn::test
