// CudaModel::profile_steps (see cuda_model.h): the per-family time of the greedy decode step,
// from CUDA events recorded at every family boundary of the step (Impl::mark), eagerly or inside
// a graph of its own; the switch and the result of the prefill's profile (recorded by
// cuda_prefill.cpp).
#include "cuda/model/cuda_model.h"

#include "comm/device_all_reduce.h"
#include "core/error.h"
#include "cuda/common/cuda_check.h"
#include "cuda/model/cuda_model_impl.h"

namespace fn {

using namespace model_detail;

const char* step_family_name(StepFamily f) noexcept {
  switch (f) {
    case StepFamily::Hc:
      return "hc";
    case StepFamily::GdnMixer:
      return "gdn";
    case StepFamily::QsaMixer:
      return "qsa";
    case StepFamily::Router:
      return "router";
    case StepFamily::RoutedMoe:
      return "moe_routed";
    case StepFamily::SharedExpert:
      return "shared_expert";
    case StepFamily::AllReduce:
      return "all_reduce";
    case StepFamily::LmHead:
      return "lm_head";
    case StepFamily::Ple:
      return "ple";
    case StepFamily::Other:
      return "other";
  }
  return "?";
}

StepProfile CudaModel::profile_steps(int32_t token, int64_t count, bool in_graph) {
  Impl& I = *impl_;
  require_slot0("profile_steps()");
  require_steps(cfg_, token, count >= 1, count, "profiling", "steps", position_, opt_.ctx_size);
  SamplingParams greedy;
  greedy.temperature = 0;
  prepare_sampling(greedy, 0);
  Impl::Marks& mk = in_graph ? I.graph_marks : I.eager_marks;
  if (mk.events.empty()) {
    // At most 14 boundaries per layer (PLE, all-reduces, HC, mixer, router, experts, shared).
    const std::size_t n = static_cast<std::size_t>(16 * cfg_.num_hidden_layers + 32);
    mk.events.assign(n, nullptr);
    mk.family.assign(n, 0);
    for (cudaEvent_t& e : mk.events) FN_CUDA_CHECK(cudaEventCreate(&e));
  }
  mk.external = in_graph;
  struct MarksOff {
    Impl& impl;
    ~MarksOff() { impl.marks = nullptr; }
  } marks_off{I};
  FN_CUDA_CHECK(cudaMemsetAsync(I.sample_step, 0, sizeof(int64_t), I.stream));
  I.host_token[0] = token;
  FN_CUDA_CHECK(
      cudaMemcpyAsync(I.token, I.host_token, sizeof(int32_t), cudaMemcpyHostToDevice, I.stream));
  if (in_graph && !I.profile_graph) {
    mk.used = 0;
    I.marks = &mk;
    I.profile_graph =
        capture_graph(I.stream, [&] { I.encode_step(cfg_, opt_, &I.sample_graph_params); });
    I.marks = nullptr;
    ++I.captures;
  }
  StepProfile out;
  out.in_graph = in_graph;
  int32_t fed = token;
  for (int64_t i = 0; i < count; ++i) {
    if (in_graph) {
      FN_CUDA_CHECK(cudaGraphLaunch(I.profile_graph, I.stream));
    } else {
      mk.used = 0;
      I.marks = &mk;
      I.encode_step(cfg_, opt_, &I.sample_graph_params);
      I.marks = nullptr;
    }
    FN_CUDA_CHECK(cudaMemcpyAsync(I.host_token + 1, I.token, sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, I.stream));
    FN_CUDA_CHECK(cudaMemcpyAsync(I.host_flag, I.error_flag, sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, I.stream));
    FN_CUDA_CHECK(cudaStreamSynchronize(I.stream));
    ++position_;
    check_step_errors(fed);
    fed = I.host_token[1];
    FN_CHECK(mk.used >= 2 && mk.family[mk.used - 1] == kStepFamilyCount,
             "a profiled step recorded {} events", mk.used);
    out.segments = {};
    out.events = static_cast<int64_t>(mk.used);
    for (std::size_t j = 0; j + 1 < mk.used; ++j) {
      float ms = 0;
      FN_CUDA_CHECK(cudaEventElapsedTime(&ms, mk.events[j], mk.events[j + 1]));
      out.ms[static_cast<std::size_t>(mk.family[j])] += ms;
      ++out.segments[static_cast<std::size_t>(mk.family[j])];
    }
    float total = 0;
    FN_CUDA_CHECK(cudaEventElapsedTime(&total, mk.events[0], mk.events[mk.used - 1]));
    out.step_ms += total;
  }
  for (double& v : out.ms) v /= static_cast<double>(count);
  out.step_ms /= static_cast<double>(count);
  out.steps = count;
  if (opt_.all_reduce) opt_.all_reduce->check_health();
  return out;
}

void CudaModel::set_prefill_profile(bool on) {
  impl_->prefill_profile = on;
}

std::optional<PrefillProfile> CudaModel::last_prefill_profile() const {
  return impl_->last_prefill_profile;
}

}  // namespace fn
