// CpuBackend: CpuModel behind the Backend interface (core/cpu_backend.h).
#include "core/cpu_backend.h"

#include <utility>

#include "core/error.h"

namespace fn {
namespace {

BackendInfo cpu_info(const CpuModel* model, double load_ms) {
  FN_CHECK(model != nullptr, "CpuBackend needs a model");
  BackendInfo info;
  info.name = "cpu";
  info.all_reduce_name = model->tp_size() > 1 ? "mpi" : "";
  info.vocab_size = model->config().vocab_size;
  info.tp_size = model->tp_size();
  info.load_ms = load_ms;
  info.weight_mib = static_cast<double>(model->weight_bytes()) / (1 << 20);
  return info;
}

}  // namespace

CpuBackend::CpuBackend(std::unique_ptr<CpuModel> model, double load_ms, int64_t slots)
    : Backend(cpu_info(model.get(), load_ms)), model_(std::move(model)) {
  FN_CHECK(slots >= 1, "CpuBackend needs at least one slot, got {}", slots);
  model_->set_slot_count(slots);
}

int64_t CpuBackend::slot_count() const noexcept {
  return model_->slot_count();
}

int64_t CpuBackend::selected_slot() const noexcept {
  return model_->selected_slot();
}

void CpuBackend::select_slot(int64_t slot) {
  model_->select_slot(slot);
}

BackendCapabilities CpuBackend::capabilities() const noexcept {
  BackendCapabilities c;
  c.snapshot = true;
  c.copy_slot = true;
  return c;
}

void CpuBackend::copy_slot(int64_t from, int64_t to) {
  model_->copy_slot(from, to);
}

void CpuBackend::snapshot() {
  model_->snapshot();
}

void CpuBackend::restore() {
  model_->restore();
}

void CpuBackend::reset() {
  model_->reset();
}

int64_t CpuBackend::position() const noexcept {
  return model_->position();
}

std::span<const float> CpuBackend::forward(int32_t token) {
  return model_->forward(token);
}

std::span<const float> CpuBackend::prefill(std::span<const int32_t> tokens, PrefillOutput output) {
  const std::span<const float> logits = model_->prefill(tokens);
  return output == PrefillOutput::Last ? logits : std::span<const float>();
}

}  // namespace fn
