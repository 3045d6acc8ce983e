// CudaBackend: CudaModel behind the Backend interface (cuda/model/cuda_backend.h).
#include "cuda/model/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "core/error.h"
#include "cuda/common/cuda_check.h"

namespace fn {
namespace {

BackendInfo cuda_info(const CudaModel* model, const DeviceAllReduce* all_reduce, int tp_size,
                      double load_ms, bool random_weights) {
  FN_CHECK(model != nullptr, "CudaBackend needs a model");
  BackendInfo info;
  info.name = "cuda";
  info.all_reduce_name = all_reduce != nullptr ? all_reduce->name() : "";
  info.vocab_size = model->config().vocab_size;
  info.tp_size = tp_size;
  info.load_ms = load_ms;
  info.weight_mib = static_cast<double>(model->load_stats().weight_bytes) / (1 << 20);
  info.random_weights = random_weights;
  return info;
}

}  // namespace

CudaBackend::CudaBackend(std::unique_ptr<GpuComm> gpu, std::unique_ptr<DeviceAllReduce> all_reduce,
                         std::unique_ptr<CudaModel> model, int tp_size, double load_ms,
                         bool random_weights)
    : Backend(cuda_info(model.get(), all_reduce.get(), tp_size, load_ms, random_weights)),
      gpu_(std::move(gpu)),
      all_reduce_(std::move(all_reduce)),
      model_(std::move(model)) {}

CudaBackend::~CudaBackend() {
  // The members' order says it too; spelled out since the all-reduce uses the communicator and
  // the model uses both.
  model_.reset();
  all_reduce_.reset();
  gpu_.reset();
}

BackendCapabilities CudaBackend::capabilities() const noexcept {
  BackendCapabilities c;
  c.device_decode = true;
  c.batch_sampling = true;
  c.device_memory = true;
  c.graph_captures = true;
  c.copy_slot = true;
  c.set_position = true;
  c.profile = true;
  c.snapshot = true;
  return c;
}

void CudaBackend::reset() {
  model_->reset();
}

int64_t CudaBackend::position() const noexcept {
  return model_->position();
}

std::span<const float> CudaBackend::forward(int32_t token) {
  return model_->forward(token);
}

std::span<const float> CudaBackend::prefill(std::span<const int32_t> tokens, PrefillOutput output) {
  return model_->prefill(tokens,
                         output == PrefillOutput::Last ? PrefillLogits::Last : PrefillLogits::None);
}

RowResults CudaBackend::prefill_rows(std::span<const int32_t> tokens, const RowQuery& q) {
  return model_->prefill_rows(tokens, q);
}

RowResults CudaBackend::prefill_slots(std::span<const SlotTokens> pieces, const RowQuery* q) {
  return model_->prefill_slots(pieces, q);
}

void CudaBackend::copy_slot(int64_t from, int64_t to) {
  model_->copy_slot(from, to);
}

void CudaBackend::snapshot() {
  model_->snapshot();
}

void CudaBackend::restore() {
  model_->restore();
}

int64_t CudaBackend::slot_count() const noexcept {
  return model_->slot_count();
}

int64_t CudaBackend::selected_slot() const noexcept {
  return model_->selected_slot();
}

void CudaBackend::select_slot(int64_t slot) {
  model_->select_slot(slot);
}

std::vector<int32_t> CudaBackend::sample_batch(std::span<const int64_t> slots,
                                               std::span<const int32_t> tokens,
                                               std::span<const SlotSampling> sampling) {
  std::vector<DeviceSamplingParams> dp(sampling.size());
  std::vector<int64_t> steps(sampling.size());
  for (std::size_t i = 0; i < sampling.size(); ++i) {
    dp[i] = device_sampling_params(sampling[i].sampling, sampling[i].sampling.seed);
    steps[i] = sampling[i].step;
    if (!penalties_active(dp[i])) continue;
    // The slot's window: its prompt at the sequence's first step, then what the device added.
    if (steps[i] == 0) model_->load_penalty_window(slots[i], sampling[i].history);
    dp[i].window = model_->penalty_window(slots[i]);
  }
  return model_->sample_batch(slots, tokens, dp, steps);
}

std::span<const float> CudaBackend::forward_batch(std::span<const int64_t> slots,
                                                  std::span<const int32_t> tokens) {
  return model_->forward_batch(slots, tokens);
}

std::vector<int32_t> CudaBackend::decode(int32_t first, int64_t count,
                                         const SamplingParams& sampling, uint64_t seed,
                                         const std::function<bool(int32_t)>& on_token,
                                         int64_t top_logprobs, std::vector<TokenLogprobs>* logprobs,
                                         std::span<const int32_t> history) {
  return model_->decode(first, count, sampling, seed, on_token, top_logprobs, logprobs, history);
}

double CudaBackend::device_used_mib() const {
  std::size_t free_b = 0, total_b = 0;
  FN_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return static_cast<double>(total_b - free_b) / (1 << 20);
}

int64_t CudaBackend::graph_captures() const {
  return model_->graph_captures();
}

void CudaBackend::set_position_for_benchmark(int64_t position) {
  model_->set_position_for_benchmark(position);
}

StepBreakdown CudaBackend::profile_steps(int32_t first, int64_t steps, bool in_graph) {
  const StepProfile p = model_->profile_steps(first, steps, in_graph);
  StepBreakdown out;
  for (int f = 0; f < kStepFamilyCount; ++f) {
    out.families.emplace_back(step_family_name(static_cast<StepFamily>(f)));
    out.ms.push_back(p.ms[static_cast<std::size_t>(f)]);
    out.segments.push_back(p.segments[static_cast<std::size_t>(f)]);
  }
  out.step_ms = p.step_ms;
  out.steps = p.steps;
  out.in_graph = p.in_graph;
  out.events = p.events;
  return out;
}

void CudaBackend::set_prefill_profile(bool on) {
  model_->set_prefill_profile(on);
}

std::optional<PrefillBreakdown> CudaBackend::last_prefill_profile() const {
  const std::optional<PrefillProfile> p = model_->last_prefill_profile();
  if (!p) return std::nullopt;
  PrefillBreakdown out;
  for (int f = 0; f < kStepFamilyCount; ++f) {
    out.families.emplace_back(step_family_name(static_cast<StepFamily>(f)));
    out.ms.push_back(p->ms[static_cast<std::size_t>(f)]);
    out.flops.push_back(p->flops[static_cast<std::size_t>(f)]);
  }
  out.tokens = p->tokens;
  out.passes = p->passes;
  return out;
}

}  // namespace fn
