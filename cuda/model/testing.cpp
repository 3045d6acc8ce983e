// CudaModelTesting (see cuda_model_testing.h): the test hooks over CudaModel's internals.
#include "cuda/model/cuda_model_testing.h"

#include "core/error.h"
#include "cuda/common/cuda_check.h"
#include "cuda/model/cuda_model_impl.h"

namespace fn {

std::unique_ptr<CudaModel> CudaModelTesting::load(const std::filesystem::path& dir,
                                                  const CudaModelOptions& options,
                                                  const CudaModelTestOptions& test) {
  return CudaModel::load_with(dir, options, test);
}

std::unique_ptr<CudaModel> CudaModelTesting::random(const ModelConfig& config,
                                                    const QuantConfig& quant, uint64_t seed,
                                                    const CudaModelOptions& options,
                                                    const CudaModelTestOptions& test) {
  return CudaModel::random_with(config, quant, seed, options, test);
}

std::vector<std::vector<float>> CudaModelTesting::debug_residuals(const CudaModel& model) {
  const CudaModel::Impl& I = *model.impl_;
  const ModelConfig& c = model.cfg_;
  FN_REQUIRE(I.residuals != nullptr, Usage,
             "debug_residuals needs a model built with CudaModelTestOptions::keep_residuals");
  const int64_t W = c.hc_width();
  const int64_t n = 2 * c.num_hidden_layers + static_cast<int64_t>(c.ple_layer_ids.size());
  std::vector<float> all(static_cast<std::size_t>(n * W));
  FN_CUDA_CHECK(cudaStreamSynchronize(I.stream));
  FN_CUDA_CHECK(
      cudaMemcpy(all.data(), I.residuals, all.size() * sizeof(float), cudaMemcpyDeviceToHost));
  std::vector<std::vector<float>> out;
  for (int64_t i = 0; i < n; ++i) out.emplace_back(all.begin() + i * W, all.begin() + (i + 1) * W);
  return out;
}

void CudaModelTesting::set_forced_choices(CudaModel& model,
                                          const std::vector<std::vector<int32_t>>& router,
                                          const std::vector<std::vector<int32_t>>& indexer) {
  CudaModel::Impl& I = *model.impl_;
  const ModelConfig& c = model.cfg_;
  FN_REQUIRE(I.forced_router != nullptr, Usage,
             "set_forced_choices needs a model built with CudaModelTestOptions::replay_choices");
  const int64_t k = c.num_experts_per_tok;
  const int64_t topk = c.indexer_budget / c.indexer_compress_ratio;
  FN_REQUIRE(static_cast<int64_t>(router.size()) == c.num_hidden_layers, Usage,
             "{} router choices for {} layers", router.size(), c.num_hidden_layers);
  int64_t n_qsa = 0;
  for (const model_detail::DevLayer& L : I.layers) n_qsa += L.qsa ? 1 : 0;
  FN_REQUIRE(static_cast<int64_t>(indexer.size()) <= n_qsa, Usage,
             "{} indexer choices for {} QSA layers", indexer.size(), n_qsa);
  std::vector<int32_t> r;
  for (const auto& ids : router) {
    FN_REQUIRE(static_cast<int64_t>(ids.size()) == k, Usage, "{} expert ids, top-k is {}",
               ids.size(), k);
    r.insert(r.end(), ids.begin(), ids.end());
  }
  FN_CUDA_CHECK(
      cudaMemcpy(I.forced_router, r.data(), r.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  for (std::size_t q = 0; q < indexer.size(); ++q) {
    if (indexer[q].empty()) continue;
    FN_REQUIRE(static_cast<int64_t>(indexer[q].size()) == topk, Usage,
               "{} indexer blocks, block_topk is {}", indexer[q].size(), topk);
    FN_CUDA_CHECK(cudaMemcpy(I.forced_blocks + static_cast<int64_t>(q) * topk, indexer[q].data(),
                             indexer[q].size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
}

}  // namespace fn
