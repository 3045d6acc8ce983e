// CpuBackend: the CPU reference model (core/cpu_model.h) behind the Backend interface
// (core/backend.h), for `--backend cpu`, eval and the tests. Prefill runs token by token through
// CpuModel::forward; there is no device decode loop and no benchmark probe.
#pragma once

#include <memory>

#include "core/backend.h"
#include "core/cpu_model.h"

namespace fn {

class CpuBackend final : public Backend {
 public:
  /// Wraps `model` (not null) with `slots` sequence slots (CpuModel::set_slot_count; each
  /// slot's caches grow in host memory as its sequence does); `load_ms` is the wall time its
  /// load took on this rank. The facts: name "cpu", all-reduce "mpi" at TP > 1 (else ""), the
  /// model's vocab_size and TP size, its weight bytes in MiB. Throws fn::Error(Internal) for a
  /// null model or slots < 1.
  CpuBackend(std::unique_ptr<CpuModel> model, double load_ms, int64_t slots = 1);

  /// The wrapped model (for --check-choices' last_choices()).
  const CpuModel& model() const noexcept { return *model_; }

  /// snapshot and copy_slot (CpuModel::snapshot / restore / copy_slot).
  BackendCapabilities capabilities() const noexcept override;
  void reset() override;
  int64_t position() const noexcept override;
  /// CpuModel::forward (throws as it does).
  std::span<const float> forward(int32_t token) override;
  /// CpuModel::forward over `tokens` in order: exactly prefill(T-1) + one step. Throws
  /// fn::Error(Usage) for an empty list, and as forward().
  std::span<const float> prefill(std::span<const int32_t> tokens, PrefillOutput output) override;
  /// CpuModel::snapshot: copies of the state vectors.
  void snapshot() override;
  /// CpuModel::restore (fn::Error(Internal) before any snapshot()).
  void restore() override;
  /// CpuModel's slots; forward_batch is the default (forward() slot after slot, so each row is
  /// bitwise the one-sequence forward()).
  int64_t slot_count() const noexcept override;
  int64_t selected_slot() const noexcept override;
  void select_slot(int64_t slot) override;
  /// CpuModel::copy_slot (copies of the state vectors; prefill_slots is the default, one slot
  /// after another).
  void copy_slot(int64_t from, int64_t to) override;

 private:
  std::unique_ptr<CpuModel> model_;
};

}  // namespace fn
