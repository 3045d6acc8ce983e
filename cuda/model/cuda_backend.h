// CudaBackend: one rank's CUDA model (cuda/model/cuda_model.h) behind the Backend interface
// (core/backend.h), for `--backend cuda`. It owns the rank's GPU communicator, its all-reduce and
// the model, and destroys them model first, then the all-reduce (it uses the communicator), then
// the communicator. Prefill is CudaModel's batched prefill; decode samples inside the decode
// graph; the benchmark probes (device memory, graph captures, set position, per-family profile)
// are all there.
#pragma once

#include <memory>

#include "comm/device_all_reduce.h"
#include "comm/gpu_comm.h"
#include "core/backend.h"
#include "cuda/model/cuda_model.h"

namespace fn {

class CudaBackend final : public Backend {
 public:
  /// Takes ownership of this rank's communicator `gpu` (may be null), its all-reduce
  /// `all_reduce` (null at TP = 1) and the model `model` (not null, built with that all-reduce
  /// in its CudaModelOptions). `load_ms`: the wall time of the setup and load on this rank;
  /// `random_weights`: the model came from CudaModel::random. The facts: name "cuda", the
  /// all-reduce's name (or ""), the model's vocab_size, TP size `tp_size`, its device weight
  /// bytes in MiB. Throws fn::Error(Internal) for a null model.
  CudaBackend(std::unique_ptr<GpuComm> gpu, std::unique_ptr<DeviceAllReduce> all_reduce,
              std::unique_ptr<CudaModel> model, int tp_size, double load_ms, bool random_weights);
  ~CudaBackend() override;

  /// The wrapped model (load statistics, --check-choices' last_choices()).
  CudaModel& model() noexcept { return *model_; }
  const CudaModel& model() const noexcept { return *model_; }

  /// All of them: device decode, device memory, graph captures, set position, profile, snapshot,
  /// batched sampling.
  BackendCapabilities capabilities() const noexcept override;
  /// CudaModel::reset.
  void reset() override;
  int64_t position() const noexcept override;
  /// CudaModel::forward (the step graph replayed unless --no-graph; throws as it does).
  std::span<const float> forward(int32_t token) override;
  /// CudaModel::prefill in passes of --prefill-chunk tokens (PrefillLogits::Last or None).
  std::span<const float> prefill(std::span<const int32_t> tokens, PrefillOutput output) override;
  /// CudaModel::prefill_rows: the rows reduced on the device (cuda/kernels/logit_stats.h).
  RowResults prefill_rows(std::span<const int32_t> tokens, const RowQuery& q) override;
  /// CudaModel::prefill_slots: the pieces in shared passes of the batched prefill.
  RowResults prefill_slots(std::span<const SlotTokens> pieces, const RowQuery* q) override;
  /// CudaModel::copy_slot (device-to-device copies).
  void copy_slot(int64_t from, int64_t to) override;
  /// CudaModel::snapshot (device-to-device copies into the model's snapshot slot).
  void snapshot() override;
  /// CudaModel::restore.
  void restore() override;
  /// CudaModel's sequence slots (--max-batch); forward_batch is CudaModel::forward_batch (one
  /// pass of the batched prefill's kernels over the slots' rows).
  int64_t slot_count() const noexcept override;
  int64_t selected_slot() const noexcept override;
  void select_slot(int64_t slot) override;
  std::span<const float> forward_batch(std::span<const int64_t> slots,
                                       std::span<const int32_t> tokens) override;
  /// CudaModel::sample_batch with each SlotSampling's settings and seed; with penalties on, over
  /// the slot's penalty window (CudaModel::penalty_window), loaded from SlotSampling::history at
  /// step 0. Throws as CudaModel::sample_batch and CudaModel::load_penalty_window.
  std::vector<int32_t> sample_batch(std::span<const int64_t> slots, std::span<const int32_t> tokens,
                                    std::span<const SlotSampling> sampling) override;
  /// CudaModel::decode (sampling in the decode graph, `history` starting the penalty window;
  /// throws as it does).
  std::vector<int32_t> decode(int32_t first, int64_t count, const SamplingParams& sampling,
                              uint64_t seed, const std::function<bool(int32_t)>& on_token,
                              int64_t top_logprobs, std::vector<TokenLogprobs>* logprobs,
                              std::span<const int32_t> history) override;
  /// cudaMemGetInfo on the current device: (total - free) in MiB. Throws fn::Error(Cuda) when
  /// the query fails.
  double device_used_mib() const override;
  /// CudaModel::graph_captures.
  int64_t graph_captures() const override;
  /// CudaModel::set_position_for_benchmark (throws fn::Error(Usage) outside [0, ctx_size)).
  void set_position_for_benchmark(int64_t position) override;
  /// CudaModel::profile_steps, its StepProfile given per family name (step_family_name order).
  StepBreakdown profile_steps(int32_t first, int64_t steps, bool in_graph) override;
  /// CudaModel::set_prefill_profile.
  void set_prefill_profile(bool on) override;
  /// CudaModel::last_prefill_profile, per family name (step_family_name order).
  std::optional<PrefillBreakdown> last_prefill_profile() const override;

 private:
  // Declared in destruction order reversed: the model goes first, the communicator last.
  std::unique_ptr<GpuComm> gpu_;
  std::unique_ptr<DeviceAllReduce> all_reduce_;
  std::unique_ptr<CudaModel> model_;
};

}  // namespace fn
