// Launchers of the two QSA top-k block selects of cuda/kernels/qsa_device.cuh on given scores, for
// the GPU tests (tests/qsa_select_probe.cu): the radix select of the prefill
// (qsa_dev::select_top_blocks), the reference, and the select of the decode step's scores launch
// (qsa_dev::select_top_blocks_cg: warp-aggregated histogram atomics, keys in the caller's shared
// array, the scores read as posted mailbox slots), which must choose the same blocks. Host C++
// only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fn::test {

/// One 1024-thread CTA selects the top k of scores[0, B) (device, FP32; higher score first, equal
/// scores -> lower index, NaN keyed by qsa_dev::order_key) and writes their indices ascending to
/// selected[0, k) (device, int32). reference: select_top_blocks, else select_top_blocks_cg.
/// 1 <= k < B < 2^31 (unchecked); no score may have all bits set (the mailbox's empty slot). Legal
/// during stream capture; throws fn::Error(Cuda) on a launch error.
void qsa_select_blocks(bool reference, const float* scores, int B, int k, int32_t* selected,
                       cudaStream_t stream);

}  // namespace fn::test
