// Test-only access to CudaModel (cuda/model/cuda_model.h): a model built with extra device buffers
// that replay a reference's discrete choices (router expert ids, indexer blocks) into the next
// decode step, so a comparison with the CPU model is not dominated by near-tie flips, and that
// keep the residual H after every HC inject of the last step. Used by tests/test_cuda_model*.cpp
// and tests/test_cuda_prefill.cpp; never by the apps. The hooks act on the decode step
// (forward()); the batched prefill refuses a model built with either of them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

#include "core/config.h"
#include "cuda/model/cuda_model.h"

namespace fn {

/// The test-only buffers a model is built with.
struct CudaModelTestOptions {
  /// Allocate the buffers of CudaModelTesting::set_forced_choices ([layers, top_k] int32 router
  /// ids and [QSA layers, block_topk] int32 indexer blocks).
  bool replay_choices = false;
  /// Keep the residual H ([hc_count * hidden] FP32) after every HC inject and PLE apply of the
  /// last step (CudaModelTesting::debug_residuals).
  bool keep_residuals = false;
};

/// The test hooks of CudaModel.
struct CudaModelTesting {
  /// CudaModel::load with the buffers of `test`. Throws as CudaModel::load.
  static std::unique_ptr<CudaModel> load(const std::filesystem::path& dir,
                                         const CudaModelOptions& options,
                                         const CudaModelTestOptions& test);
  /// CudaModel::random with the buffers of `test`. Throws as CudaModel::random.
  static std::unique_ptr<CudaModel> random(const ModelConfig& config, const QuantConfig& quant,
                                           uint64_t seed, const CudaModelOptions& options,
                                           const CudaModelTestOptions& test);
  /// The reference's choices for the NEXT forward() (a model built with replay_choices): per
  /// decoder layer the top-k expert ids, best first (num_hidden_layers lists of
  /// num_experts_per_tok ids); per QSA layer in layer order the selected blocks ascending
  /// (block_topk = indexer_budget / indexer_compress_ratio ids), or an empty list while every
  /// complete block is selected (that layer keeps its own selection). The routing weights are
  /// recomputed from the step's own router logits for the forced ids. Throws fn::Error(Usage) on
  /// a shape mismatch or a model built without replay_choices; fn::Error(Cuda) when a copy fails.
  static void set_forced_choices(CudaModel& model, const std::vector<std::vector<int32_t>>& router,
                                 const std::vector<std::vector<int32_t>>& indexer);
  /// H after every HC inject and PLE apply of the last step (a model built with keep_residuals),
  /// as CpuModel::last_residuals() lays them out: 2 * num_hidden_layers + (PLE layers) vectors
  /// of hc_count * hidden FP32 values in step order. Waits for the stream. Throws
  /// fn::Error(Usage) for a model built without keep_residuals; fn::Error(Cuda) when a copy fails.
  static std::vector<std::vector<float>> debug_residuals(const CudaModel& model);
};

}  // namespace fn
