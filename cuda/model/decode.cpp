// CudaModel's decode (see cuda_model.h): the step graphs (captured once per mode and replayed),
// forward(), the on-device decode loop with its one-step lookahead and optional top log-probs,
// reset, and the choice log of --check-choices.
#include "cuda/model/cuda_model.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "comm/device_all_reduce.h"
#include "core/error.h"
#include "cuda/common/cuda_check.h"
#include "cuda/kernels/logit_stats.h"
#include "cuda/kernels/sample.h"
#include "cuda/model/cuda_model_impl.h"

namespace fn {

using namespace model_detail;

static_assert(kTopLogprobsCapacity == kMaxTopLogprobs,
              "the device reduction reports the alternatives generate --logprobs allows");

cudaGraph_t model_detail::capture_stream(cudaStream_t stream, const std::function<void()>& encode) {
  FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    encode();
  } catch (...) {
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(stream, &g);
    if (g) cudaGraphDestroy(g);
    throw;
  }
  cudaGraph_t graph = nullptr;
  FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  return graph;
}

cudaGraphExec_t model_detail::capture_graph(cudaStream_t stream,
                                            const std::function<void()>& encode) {
  cudaGraph_t graph = capture_stream(stream, encode);
  cudaGraphExec_t exec = nullptr;
  const cudaError_t rc = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  FN_CUDA_CHECK(rc);
  return exec;
}

int64_t CudaModel::graph_captures() const noexcept {
  return impl_->captures;
}

void CudaModel::reset() {
  impl_->reset_slot(cfg_, slot_);
  position_ = 0;
}

int64_t CudaModel::slot_count() const noexcept {
  return impl_->usable_slots > 0 ? impl_->usable_slots : static_cast<int64_t>(impl_->slots.size());
}

void CudaModel::limit_slots(int64_t count) {
  FN_CHECK(count >= 1 && count <= slot_count() && slot_ == 0,
           "limit_slots: {} of {} slots (slot {} selected)", count, slot_count(), slot_);
  impl_->usable_slots = count;
}

void CudaModel::select_slot(int64_t slot) {
  FN_CHECK(slot >= 0 && slot < slot_count(), "slot {} outside [0, {})", slot, slot_count());
  if (slot == slot_) return;
  impl_->slots[static_cast<std::size_t>(slot_)].position = position_;
  slot_ = slot;
  position_ = impl_->slots[static_cast<std::size_t>(slot)].position;
}

void CudaModel::require_slot0(const char* what) const {
  FN_CHECK(slot_ == 0, "{} runs sequence slot 0 (the decode graph's), not slot {}", what, slot_);
}

namespace {
// Bytes of the n-gram context (reset_state fills max(ngram_size - 1, 1) ids).
std::size_t context_bytes(const ModelConfig& c) {
  return static_cast<std::size_t>(std::max<int64_t>(c.ngram_size - 1, 1)) * sizeof(int64_t);
}
}  // namespace

// The KV, value and indexer-key caches are not copied: each position's entries (and a QSA
// block's pooled key, written when its last position runs) are rewritten whenever that position
// runs again, and no step reads a position at or past its own, so the position restored is
// enough for them. The recurrent and convolution states and the n-gram context are overwritten
// in place by every step and are copied.
void CudaModel::snapshot() {
  Impl& I = *impl_;
  require_slot0("snapshot()");
  std::size_t total = context_bytes(cfg_);
  for (const auto& [ptr, bytes] : I.state_blocks) total += bytes;
  if (I.snap == nullptr) {
    void* p = nullptr;
    FN_CUDA_CHECK(cudaMalloc(&p, total));
    I.snap = static_cast<std::byte*>(p);
  }
  std::size_t at = 0;
  for (const auto& [ptr, bytes] : I.state_blocks) {
    FN_CUDA_CHECK(cudaMemcpyAsync(I.snap + at, ptr, bytes, cudaMemcpyDeviceToDevice, I.stream));
    at += bytes;
  }
  FN_CUDA_CHECK(cudaMemcpyAsync(I.snap + at, I.context, context_bytes(cfg_),
                                cudaMemcpyDeviceToDevice, I.stream));
  FN_CUDA_CHECK(cudaStreamSynchronize(I.stream));
  I.snap_position = position_;
}

void CudaModel::restore() {
  Impl& I = *impl_;
  require_slot0("restore()");
  FN_CHECK(I.snap_position >= 0, "restore() before any snapshot()");
  std::size_t at = 0;
  for (const auto& [ptr, bytes] : I.state_blocks) {
    FN_CUDA_CHECK(cudaMemcpyAsync(ptr, I.snap + at, bytes, cudaMemcpyDeviceToDevice, I.stream));
    at += bytes;
  }
  FN_CUDA_CHECK(cudaMemcpyAsync(I.context, I.snap + at, context_bytes(cfg_),
                                cudaMemcpyDeviceToDevice, I.stream));
  position_ = I.snap_position;
  FN_CUDA_CHECK(
      cudaMemcpyAsync(I.position, &position_, sizeof(int64_t), cudaMemcpyHostToDevice, I.stream));
  FN_CUDA_CHECK(cudaStreamSynchronize(I.stream));
}

void CudaModel::copy_slot(int64_t from, int64_t to) {
  Impl& I = *impl_;
  FN_CHECK(from >= 0 && from < slot_count() && to >= 0 && to < slot_count() && from != to,
           "copy_slot({}, {}) with {} slots", from, to, slot_count());
  const int64_t pos = from == slot_ ? position_ : I.slots[static_cast<std::size_t>(from)].position;
  const DeviceLayout& lay = I.slot_layout;
  const auto ctx = static_cast<uint64_t>(std::max<int64_t>(lay.ctx_size, 1));
  const auto upos = static_cast<uint64_t>(pos);
  const uint64_t blocks =
      std::max<uint64_t>(ctx / static_cast<uint64_t>(cfg_.indexer_compress_ratio), 1);
  const uint64_t full_blocks =
      std::min(blocks, upos / static_cast<uint64_t>(cfg_.indexer_compress_ratio));
  const auto copy = [&](void* dst, const void* src, uint64_t bytes) {
    if (bytes > 0)
      FN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, I.stream));
  };
  const DevSlot& a = I.slots[static_cast<std::size_t>(from)];
  DevSlot& b = I.slots[static_cast<std::size_t>(to)];
  for (std::size_t li = 0; li < I.layers.size(); ++li) {
    const DevLayer& L = I.layers[li];
    const DevSlotLayer& x = a.layers[li];
    const DevSlotLayer& y = b.layers[li];
    if (L.has_ple) copy(y.ple_conv, x.ple_conv, lay.ple_conv_state);
    if (L.qsa) {  // the rows before the position (the later ones are rewritten before read)
      copy(y.k_cache, x.k_cache, lay.k_cache / ctx * upos);
      copy(y.v_cache, x.v_cache, lay.v_cache / ctx * upos);
      copy(y.raw_keys, x.raw_keys, lay.raw_keys / ctx * upos);
      copy(y.block_keys, x.block_keys, lay.block_keys / blocks * full_blocks);
    } else {
      copy(y.gdn_conv, x.gdn_conv, lay.gdn_conv_state);
      copy(y.gdn_state, x.gdn_state, lay.gdn_state);
    }
  }
  copy(b.context, a.context, context_bytes(cfg_));
  if (to == slot_) {
    position_ = pos;
  } else {
    b.position = pos;
  }
  if (to == 0) {  // the decode graph reads slot 0's position on the device
    I.host_slot0_position = pos;
    FN_CUDA_CHECK(cudaMemcpyAsync(I.position, &I.host_slot0_position, sizeof(int64_t),
                                  cudaMemcpyHostToDevice, I.stream));
  }
  FN_CUDA_CHECK(cudaStreamSynchronize(I.stream));
}

void CudaModel::set_position_for_benchmark(int64_t position) {
  FN_REQUIRE(position >= 0 && position < opt_.ctx_size, Usage,
             "benchmark position {} is outside the context [0, {})", position, opt_.ctx_size);
  if (slot_ == 0) {  // the decode graph reads slot 0's position on the device
    FN_CUDA_CHECK(cudaMemcpyAsync(impl_->position, &position, sizeof(int64_t),
                                  cudaMemcpyHostToDevice, impl_->stream));
    FN_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  }
  position_ = position;
}

StepChoices CudaModel::last_choices() const {
  const Impl& I = *impl_;
  FN_REQUIRE(I.choice_log != nullptr, Usage, "last_choices needs CudaModelOptions::record_choices");
  int64_t n_qsa = 0;
  for (const DevLayer& d : I.layers) n_qsa += d.qsa ? 1 : 0;
  std::vector<int32_t> log(static_cast<std::size_t>(choice_log_ints(cfg_, n_qsa)));
  FN_CUDA_CHECK(cudaStreamSynchronize(I.stream));
  FN_CUDA_CHECK(
      cudaMemcpy(log.data(), I.choice_log, log.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  return choices_from_log(cfg_, n_qsa, log.data());
}

int64_t model_detail::choice_log_ints(const ModelConfig& c, int64_t qsa_layers) {
  const int64_t topk = c.indexer_budget / c.indexer_compress_ratio;
  return c.num_hidden_layers * c.num_experts_per_tok + qsa_layers * (topk + 4);
}

StepChoices model_detail::choices_from_log(const ModelConfig& c, int64_t qsa_layers,
                                           const int32_t* log) {
  const int64_t k = c.num_experts_per_tok, L = c.num_hidden_layers;
  const int64_t topk = c.indexer_budget / c.indexer_compress_ratio;
  StepChoices out;
  for (int64_t l = 0; l < L; ++l) out.router.emplace_back(log + l * k, log + (l + 1) * k);
  for (int64_t q = 0; q < qsa_layers; ++q) {
    const int32_t* e = log + L * k + q * (topk + 4);
    const int32_t count = e[topk], blocks = e[topk + 1];
    FN_CHECK(count >= 0 && count <= topk, "QSA layer {}: selected block count {} outside [0, {}]",
             q, count, topk);
    out.indexer.emplace_back();
    if (blocks > topk) out.indexer.back().assign(e, e + count);
  }
  return out;
}

void CudaModel::check_step_errors(int32_t token, int slot) {
  Impl& I = *impl_;
  const int32_t flag = I.host_flag[slot];
  if (flag == 0) return;
  FN_CUDA_CHECK(cudaMemsetAsync(I.error_flag, 0, sizeof(int32_t), I.stream));
  switch (flag) {
    case 1:
      FN_THROW(Usage, "token id {} is outside the vocabulary [0, {})", token, cfg_.vocab_size);
    case 2:
    case 4:
      FN_THROW(Format,
               "the model produced non-finite values (flag {}) at position {}: the checkpoint's "
               "weights hold NaN/Inf or overflow",
               flag, position_);
    default:
      FN_THROW(Internal, "decode step error flag {} at position {}", flag, position_);
  }
}

std::span<const float> CudaModel::forward(int32_t token) {
  Impl& I = *impl_;
  if (slot_ != 0) {  // the decode graph holds slot 0's states: another slot runs a batched step
    const int64_t slot = slot_;
    return forward_batch(std::span<const int64_t>(&slot, 1), std::span<const int32_t>(&token, 1));
  }
  FN_REQUIRE(token >= 0 && token < cfg_.vocab_size, Usage,
             "token id {} is outside the vocabulary [0, {})", token, cfg_.vocab_size);
  FN_REQUIRE(position_ < opt_.ctx_size, Usage,
             "the context is full: position {} needs more than -c/--ctx-size {} tokens", position_,
             opt_.ctx_size);
  I.host_token[0] = token;
  FN_CUDA_CHECK(
      cudaMemcpyAsync(I.token, I.host_token, sizeof(int32_t), cudaMemcpyHostToDevice, I.stream));
  if (opt_.use_graph) {
    if (!I.logits_graph) {
      I.logits_graph = capture_graph(I.stream, [&] { I.encode_step(cfg_, opt_, nullptr); });
      ++I.captures;
    }
    FN_CUDA_CHECK(cudaGraphLaunch(I.logits_graph, I.stream));
  } else {
    I.encode_step(cfg_, opt_, nullptr);
  }
  const int64_t V = cfg_.vocab_size;
  FN_CUDA_CHECK(cudaMemcpyAsync(I.host_logits, I.logits, sizeof(float) * V, cudaMemcpyDeviceToHost,
                                I.stream));
  FN_CUDA_CHECK(cudaMemcpyAsync(I.host_flag, I.error_flag, sizeof(int32_t), cudaMemcpyDeviceToHost,
                                I.stream));
  FN_CUDA_CHECK(cudaStreamSynchronize(I.stream));
  if (opt_.all_reduce) opt_.all_reduce->check_health();
  check_step_errors(token);
  for (int64_t v = 0; v < V; ++v) {
    FN_REQUIRE(std::isfinite(I.host_logits[v]), Format,
               "the model produced a non-finite logit ({} for token {}) at position {}: the "
               "checkpoint's weights hold NaN/Inf or overflow",
               I.host_logits[v], v, position_);
  }
  ++position_;
  return {I.host_logits, static_cast<std::size_t>(V)};
}

DeviceSamplingParams device_sampling_params(const SamplingParams& sampling, uint64_t seed) {
  DeviceSamplingParams dp;
  dp.temperature = static_cast<float>(sampling.temperature);
  dp.top_k = static_cast<int>(sampling.top_k);
  dp.top_p = static_cast<float>(sampling.top_p);
  dp.min_p = static_cast<float>(sampling.min_p);
  dp.seed = seed;
  dp.repetition_penalty = sampling.repetition_penalty;
  dp.presence_penalty = sampling.presence_penalty;
  dp.frequency_penalty = sampling.frequency_penalty;
  dp.repeat_last_n = sampling.repeat_last_n;
  return dp;
}

void CudaModel::prepare_sampling(const SamplingParams& sampling, uint64_t seed,
                                 int64_t top_logprobs) {
  Impl& I = *impl_;
  DeviceSamplingParams dp = device_sampling_params(sampling, seed);
  if (penalties_active(dp)) dp.window = penalty_window(0);  // the decode graph's slot
  const auto drop = [](cudaGraphExec_t& g) {
    if (g) {
      FN_CUDA_CHECK(cudaGraphExecDestroy(g));
      g = nullptr;
    }
  };
  const bool same =
      I.history != nullptr && dp.temperature == I.sample_graph_params.temperature &&
      dp.top_k == I.sample_graph_params.top_k && dp.top_p == I.sample_graph_params.top_p &&
      dp.min_p == I.sample_graph_params.min_p && dp.seed == I.sample_graph_params.seed &&
      dp.repetition_penalty == I.sample_graph_params.repetition_penalty &&
      dp.presence_penalty == I.sample_graph_params.presence_penalty &&
      dp.frequency_penalty == I.sample_graph_params.frequency_penalty &&
      dp.repeat_last_n == I.sample_graph_params.repeat_last_n &&
      dp.window.tokens == I.sample_graph_params.window.tokens;
  if (!same) {
    drop(I.sample_graph);
    drop(I.profile_graph);
    drop(I.logprobs_graph);
    const std::size_t need = sample_workspace_bytes(cfg_.vocab_size, dp);
    if (need > I.sample_ws_bytes) {
      I.sample_ws = I.arena.alloc(need, "sampling workspace");
      I.sample_ws_bytes = need;
    }
    if (I.history == nullptr) {
      I.history_capacity = opt_.ctx_size + 1;
      I.history = I.arena.alloc_n<int32_t>(I.history_capacity, "token history");
    }
    I.sample_graph_params = dp;
  }
  if (top_logprobs < 0) return;
  if (I.top_lp_ws == nullptr) {
    const std::size_t need = top_logprobs_workspace_bytes(cfg_.vocab_size);
    I.top_lp_ws = I.arena.alloc(need, "top log-probs workspace");
    I.top_lp_ws_bytes = need;
  }
  if (I.top_lp == nullptr) I.top_lp = I.arena.alloc_n<TopLogprobsOut>(1, "top log-probs");
  if (I.host_top_lp == nullptr)
    FN_CUDA_CHECK(
        cudaMallocHost(reinterpret_cast<void**>(&I.host_top_lp), 2 * sizeof(TopLogprobsOut)));
  if (I.logprobs_graph_k != top_logprobs) {
    drop(I.logprobs_graph);
    I.logprobs_graph_k = top_logprobs;
  }
}

void model_detail::require_steps(const ModelConfig& c, int32_t token, bool count_ok, int64_t count,
                                 const char* doing, const char* unit, int64_t position,
                                 int64_t ctx_size) {
  FN_REQUIRE(token >= 0 && token < c.vocab_size, Usage,
             "token id {} is outside the vocabulary [0, {})", token, c.vocab_size);
  FN_REQUIRE(count_ok && position + count <= ctx_size, Usage,
             "{} {} {} from position {} needs more than -c/--ctx-size {} tokens", doing, count,
             unit, position, ctx_size);
}

DevicePenaltyWindow CudaModel::penalty_window(int64_t slot) {
  Impl& I = *impl_;
  FN_CHECK(slot >= 0 && slot < slot_count(), "penalty window of slot {} outside [0, {})", slot,
           slot_count());
  DevicePenaltyWindow& w = I.slots[static_cast<std::size_t>(slot)].penalty;
  if (w.tokens == nullptr) {  // one block, zeroed by the arena: the count (0), then the ring
    w.capacity = opt_.ctx_size + 1;
    auto* block = static_cast<std::byte*>(I.arena.alloc_state(
        256 + static_cast<std::size_t>(w.capacity) * sizeof(int32_t), "sampling penalty window"));
    w.count = reinterpret_cast<int64_t*>(block);
    w.tokens = reinterpret_cast<int32_t*>(block + 256);
  }
  return w;
}

void CudaModel::load_penalty_window(int64_t slot, std::span<const int32_t> tokens) {
  Impl& I = *impl_;
  const DevicePenaltyWindow w = penalty_window(slot);
  const auto n = static_cast<int64_t>(tokens.size());
  // Accepted id k lives at k % capacity: the last `capacity` ids, in at most two runs. Pageable
  // host sources: each copy has read its source when it returns (CUDA's staging rule).
  for (int64_t k = n - std::min(n, w.capacity); k < n;) {
    const int64_t at = k % w.capacity;
    const int64_t run = std::min(n - k, w.capacity - at);
    FN_CUDA_CHECK(cudaMemcpyAsync(w.tokens + at, tokens.data() + k,
                                  static_cast<std::size_t>(run) * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, I.stream));
    k += run;
  }
  FN_CUDA_CHECK(cudaMemcpyAsync(w.count, &n, sizeof(int64_t), cudaMemcpyHostToDevice, I.stream));
}

std::vector<int32_t> CudaModel::decode(int32_t token, int64_t count, const SamplingParams& sampling,
                                       uint64_t seed, const std::function<bool(int32_t)>& on_token,
                                       int64_t top_logprobs, std::vector<TokenLogprobs>* logprobs,
                                       std::span<const int32_t> history) {
  Impl& I = *impl_;
  FN_CHECK(top_logprobs >= -1 && top_logprobs <= kMaxTopLogprobs,
           "top log-probs k {} outside [-1, {}]", top_logprobs, kMaxTopLogprobs);
  FN_CHECK(top_logprobs < 0 || logprobs != nullptr,
           "top log-probs requested without a vector to append them to");
  require_slot0("decode()");
  require_steps(cfg_, token, count >= 0, count, "decoding", "tokens", position_, opt_.ctx_size);
  prepare_sampling(sampling, seed, top_logprobs);
  // The penalty window starts from the caller's accepted ids; the graph adds each sampled id.
  if (penalties_active(I.sample_graph_params)) load_penalty_window(0, history);
  // The sampler's step counter indexes the history: restart it for this call.
  FN_CUDA_CHECK(cudaMemsetAsync(I.sample_step, 0, sizeof(int64_t), I.stream));
  I.host_token[0] = token;
  FN_CUDA_CHECK(
      cudaMemcpyAsync(I.token, I.host_token, sizeof(int32_t), cudaMemcpyHostToDevice, I.stream));
  // Without top log-probs the step is exactly the sampling graph; with them, a graph of its own.
  const bool want_lp = top_logprobs >= 0;
  cudaGraphExec_t& graph = want_lp ? I.logprobs_graph : I.sample_graph;
  if (opt_.use_graph && !graph) {
    graph = capture_graph(I.stream,
                          [&] { I.encode_step(cfg_, opt_, &I.sample_graph_params, top_logprobs); });
    ++I.captures;
  }

  // Step i's id lands in pinned slot i % 2 (host_token[1 + slot], its error flag in
  // host_flag[slot], its log-probs in host_top_lp[slot]) and event ev[slot] marks it. With the
  // graph, step i + 1 is queued before the host waits for step i (the lookahead), so the GPU does
  // not idle while the host wakes, takes the id and launches again; it reads the id step i leaves
  // on the device. Eagerly the host encodes each step itself, one at a time.
  const bool ahead = opt_.use_graph;
  struct Events {
    cudaEvent_t e[2] = {nullptr, nullptr};
    ~Events() {
      for (cudaEvent_t x : e)
        if (x) cudaEventDestroy(x);
    }
  } ev;
  for (cudaEvent_t& e : ev.e) FN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  const auto enqueue = [&](int64_t i) {
    const int slot = static_cast<int>(i & 1);
    if (opt_.use_graph) {
      FN_CUDA_CHECK(cudaGraphLaunch(graph, I.stream));
    } else {
      I.encode_step(cfg_, opt_, &I.sample_graph_params, top_logprobs);
    }
    FN_CUDA_CHECK(cudaMemcpyAsync(I.host_token + 1 + slot, I.token, sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, I.stream));
    FN_CUDA_CHECK(cudaMemcpyAsync(I.host_flag + slot, I.error_flag, sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, I.stream));
    if (want_lp)
      FN_CUDA_CHECK(cudaMemcpyAsync(I.host_top_lp + slot, I.top_lp, sizeof(TopLogprobsOut),
                                    cudaMemcpyDeviceToHost, I.stream));
    FN_CUDA_CHECK(cudaEventRecord(ev.e[slot], I.stream));
  };
  int64_t queued = 0, taken = 0;  // steps launched, steps counted in position_
  // Waits for step i (= taken), which fed `fed`: its position counts, its errors throw, its
  // log-probs are appended, its id returns.
  const auto take = [&](int64_t i, int32_t fed) {
    const int slot = static_cast<int>(i & 1);
    FN_CUDA_CHECK(cudaEventSynchronize(ev.e[slot]));
    ++position_;
    ++taken;
    check_step_errors(fed, slot);
    const int32_t id = I.host_token[1 + slot];
    if (want_lp) {
      const TopLogprobsOut& r = I.host_top_lp[slot];
      const auto k = static_cast<std::size_t>(top_logprobs);
      logprobs->push_back(TokenLogprobs{r.logprob, std::vector<int32_t>(r.top_ids, r.top_ids + k),
                                        std::vector<double>(r.top_logprobs, r.top_logprobs + k)});
    }
    return id;
  };
  // A step queued ahead still runs when the loop leaves early (a stop: it has fed the stop id;
  // or an exception from a check or from on_token): its position counts, so position() matches
  // the device's states. Not waited for: later work on the stream follows it, and its error flag
  // stays set for the next step's check.
  struct CountQueued {
    CudaModel& m;
    const int64_t& queued;
    const int64_t& taken;
    ~CountQueued() { m.position_ += queued - taken; }
  } count_queued{*this, queued, taken};

  std::vector<int32_t> out;
  out.reserve(static_cast<std::size_t>(count));
  int32_t fed = token;
  if (count > 0) enqueue(queued++);
  for (int64_t i = 0; i < count; ++i) {
    if (ahead && queued < count) enqueue(queued++);
    const int32_t id = take(i, fed);
    out.push_back(id);
    fed = id;
    if (on_token && !on_token(id)) break;  // a step queued ahead counts (count_queued)
    if (!ahead && queued < count) enqueue(queued++);
  }
  if (opt_.all_reduce) opt_.all_reduce->check_health();
  return out;
}

}  // namespace fn
