// BF16 GEMV for one decode token: y[rows] = W[rows, cols] . x[cols], W BF16 row-major, x BF16 or
// FP32, FP32 accumulation, y FP32 or BF16. Called by the CUDA decode step for every BF16 linear
// (GDN/QSA projections, HC down/up, shared expert, router, lm_head; docs/model.md §C). Invariants:
// 16-byte loads (W, x 16-byte aligned, cols and ld multiples of 8), deterministic (fixed summation
// order, no atomics), graph-capturable (no host sync, no allocation).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"

namespace fn {

/// How the GEMV kernel splits the work: a "team" of team_threads lanes (a power of two, 8..256)
/// shares one group of rows_per_team consecutive rows (1, 2 or 4) and strides over the columns in
/// 16-byte vectors; a 256-thread block holds 256 / team_threads teams. Chosen once per shape
/// (plan_gemv_bf16) so the variant is fixed at model load (docs/design.md "Decisions").
struct GemvBf16Plan {
  int rows_per_team = 0;  ///< 1, 2 or 4 rows per team (0: let the launcher plan)
  int team_threads = 0;   ///< 8, 16, 32, 64, 128 or 256 lanes per team
  int64_t blocks = 0;     ///< grid size: ceil(rows / (rows_per_team * 256 / team_threads))
};

/// Operands of one GEMV. All pointers are device memory.
struct GemvBf16Params {
  const uint16_t* weight = nullptr;  ///< W: BF16 bits, row r at weight + r * ld; 16-byte aligned
  int64_t rows = 0;                  ///< N (output length), >= 1
  int64_t cols = 0;                  ///< K (input length), >= 8, multiple of 8
  int64_t ld = 0;                    ///< row stride of W in elements (>= cols, multiple of 8)
  const void* x = nullptr;           ///< x: [cols] BF16 bits or FP32 (x_dtype), 16-byte aligned
  DType x_dtype = DType::BF16;       ///< BF16 or F32
  void* y = nullptr;                 ///< y: [rows] FP32 or BF16 bits (y_dtype); must not alias x/W
  DType y_dtype = DType::F32;        ///< F32 or BF16 (round to nearest even)
  GemvBf16Plan plan{};               ///< zero: plan_gemv_bf16(rows, cols, SM count) per launch
  /// Overlap with the stream predecessor (the QSA decode launcher's projection beside the
  /// indexer's select): the kernel lets its successor launch at once and computes and stores
  /// without a programmatic wait (cuda/common/pdl.cuh), reading x through L2 into shared memory.
  /// Legal only when x was complete before the predecessor was launched (written at least two
  /// launches back, the predecessor having waited) and no unfinished kernel reads or writes y. x
  /// and y FP32, cols <= 8192. The same bits as the plain launch.
  bool no_pdl_wait = false;
  /// When non-null, each block adds one signal to this join word once its rows are stored
  /// (dev::join_signal, cuda/common/device_util.cuh), for a reader in a launch that does not wait
  /// for this one (the GDN recurrence, cuda/kernels/gdn.h). At most 65535 blocks then.
  unsigned* done_word = nullptr;
  /// Rows left out: with skip > 0, computed row r >= skip_at is row r + skip of W and of y
  /// (W and y then hold rows + skip rows). The same bits per row.
  int64_t skip_at = 0;
  int64_t skip = 0;
};

/// The launch plan for a rows x cols GEMV on a GPU with sm_count multiprocessors: at most 16
/// vectors per lane per row, and teams widened (then rows per team lowered) until the grid has at
/// least 2 * sm_count blocks where the shape allows. Pure host arithmetic; deterministic.
GemvBf16Plan plan_gemv_bf16(int64_t rows, int64_t cols, int sm_count);

/// The plan for `rows` rows of a matrix whose GEMV over all rows plans as `whole`: the same team
/// width (so each row gets the bits it gets in the whole's launch: a row's sum depends only on
/// the team width, cuda/kernels/gemv_bf16.cuh) and `rows_per_team` (1, 2 or 4) rows per team. Used
/// where a matrix's rows are split over launches (the QSA and GDN projections). Pure host
/// arithmetic.
GemvBf16Plan plan_gemv_bf16_part(const GemvBf16Plan& whole, int64_t rows, int rows_per_team);

/// y = W x on `stream` (docs/model.md §C: every BF16 linear of the decode step). Each y[r] is
/// sum_c W[r, c] * x[c] in FP32: every lane sums its columns in ascending order, then the lanes of
/// a team are combined in a fixed butterfly/tree order, so results are bitwise reproducible.
/// Throws fn::Error(Internal) on a null pointer, bad shape, misalignment, unsupported dtype or bad
/// plan; fn::Error(Cuda) when the launch fails. Legal during stream capture.
void launch_gemv_bf16(const GemvBf16Params& params, cudaStream_t stream);

/// launch_gemv_bf16 for a dense row-major W (ld = cols) with the planned launch: y = W x, the
/// same math, errors and capture rules as above.
void launch_gemv_bf16(const uint16_t* weight, int64_t rows, int64_t cols, const void* x,
                      DType x_dtype, void* y, DType y_dtype, cudaStream_t stream);

}  // namespace fn
