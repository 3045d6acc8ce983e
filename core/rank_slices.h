// One TP rank's view of a validated checkpoint: opens a model directory, validates every text
// tensor against docs/model.md §B.2 and reads this rank's slices through the shard plan
// (docs/model.md §E.2). Used by both backends' loaders (core/cpu_model.cpp,
// cuda/model/cuda_model.cpp): the CPU model keeps the slices as they are, the CUDA model copies
// them to the device. Invariants: only the rank's byte ranges are read (pread of row blocks, or
// copies of the touched pages of the mapping); slices keep their checkpoint dtype; every read
// checks the stored dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/checkpoint.h"
#include "core/config.h"
#include "core/dtype.h"
#include "core/model_tensors.h"
#include "core/shard_plan.h"

namespace fn {

/// The bytes of one tensor slice: the rank's rows stacked into a dense [rows, cols] tensor of
/// the 2-D view of the shard plan, in the checkpoint dtype. Empty (rows 0) for a tensor this
/// rank holds no part of (another rank's n-gram shard).
struct WeightSlice {
  DType dtype = DType::F32;
  int64_t rows = 0, cols = 0;
  std::shared_ptr<const std::vector<std::byte>> bytes;
};

/// Reads one rank's slices of an opened checkpoint.
class RankSliceReader {
 public:
  /// `bare`: the checkpoint uses `model.*` names instead of `model.language_model.*`.
  RankSliceReader(const Checkpoint& ck, const ShardPlan& plan, int rank, bool bare)
      : ck_(ck), plan_(plan), rank_(rank), bare_(bare) {}

  /// The checkpoint name of an expected (full-layout, `model.language_model.`) name.
  std::string stored_name(std::string_view name) const;

  /// The rank's blocks of `name` (an expected name of the shard plan), sorted by (row, col) and
  /// stacked. Scale tensors are checked (require_possible_scales, core/weight_checks.h: a
  /// negative NVFP4 global scale, a block scale with the sign bit set, a PLE weight_scale <= 0
  /// are fn::Error(Format) naming the tensor; a global scale of 0 over non-zero block scales is
  /// logged as a warning). Throws fn::Error(Format) when the stored dtype differs from the expected
  /// one, fn::Error(Io) on a failed read, fn::Error(Internal) for a name outside the plan.
  WeightSlice read(const std::string& name);
  /// read() plus a check that the slice is [rows, cols] (fn::Error(Internal) otherwise: the
  /// plan and the backend disagree).
  WeightSlice read(const std::string& name, int64_t rows, int64_t cols);

  /// read(name, rows, cols) into caller memory (e.g. a pinned staging buffer) instead of a new
  /// vector: `dst` receives rows * cols elements of the stored dtype; throws fn::Error(Internal)
  /// when they do not fit in `capacity` bytes or the shape disagrees. Returns the dtype.
  DType read_into(const std::string& name, int64_t rows, int64_t cols, std::byte* dst,
                  std::size_t capacity);

  /// Bytes read so far.
  uint64_t bytes() const noexcept { return bytes_; }
  int rank() const noexcept { return rank_; }
  const Checkpoint& checkpoint() const noexcept { return ck_; }

 private:
  // The rank's blocks of `name`, sorted, with the stored tensor's facts.
  struct Layout {
    std::vector<SliceBlock> blocks;
    std::string stored;
    TensorRole role = TensorRole::Embedding;
    DType dtype = DType::F32;
    int64_t rows = 0, cols = 0;  // of the stacked slice
  };
  Layout layout(const std::string& name) const;
  // Copies the slice described by `l` to dst (l.rows * l.cols elements), then checks the values
  // of a scale tensor (core/weight_checks.h).
  void copy(const std::string& name, const Layout& l, std::byte* dst);

  const Checkpoint& ck_;
  const ShardPlan& plan_;
  int rank_;
  bool bare_;
  uint64_t bytes_ = 0;
};

/// A model directory opened and validated for one TP size: config, quantization, shard plan,
/// checkpoint index and the name layout.
struct OpenedModel {
  ModelConfig config;
  QuantConfig quant;
  ShardPlan plan;
  Checkpoint checkpoint;
  bool bare_layout = false;  ///< `model.*` names (text-only export)
};

/// Loads config.json and the quantization config of `dir`, builds the shard plan for tp_size
/// and validates every text tensor's name, dtype and shape against docs/model.md §B.2 (vision and
/// MTP tensors skipped; the bare `model.*` layout is accepted). Throws fn::Error: Io/Format for
/// unreadable or invalid files (naming file and tensor), Usage when tp_size does not divide the
/// model. Reads headers only.
OpenedModel open_model(const std::filesystem::path& dir, int tp_size);

/// The value of a scalar stored as F32, BF16, F16 or F8_E4M3 at `p`. Throws fn::Error(Internal)
/// for another dtype.
float scalar_to_float(DType dtype, const std::byte* p);

/// Every element of a slice widened to FP32 (row-major). Same dtype rule as scalar_to_float.
std::vector<float> slice_to_f32(const WeightSlice& s);

}  // namespace fn
