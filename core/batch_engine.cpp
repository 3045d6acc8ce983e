// BatchEngine (core/batch_engine.h): continuous batching over a backend's sequence slots.
#include "core/batch_engine.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "core/error.h"
#include "core/stop_text.h"

namespace fn {

namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Wire codes of the per-step broadcast: {token, kContinue or 1 + FinishReason} per sequence,
// as generate()'s host path sends them for one.
constexpr int32_t kContinue = 0;

}  // namespace

// One admitted sequence. Not movable: its StopText refers to its request's hooks and stops.
struct BatchEngine::Seq {
  explicit Seq(BatchRequest req)
      : r(std::move(req)),
        sampler(r.options.sampling),
        stop_text(r.options.stop_strings, r.hooks) {}
  Seq(const Seq&) = delete;
  Seq& operator=(const Seq&) = delete;

  BatchRequest r;
  Sampler sampler;
  StopText stop_text;
  int64_t slot = 0;
  int64_t order = 0;      // admission number: the prefill order
  int64_t prefilled = 0;  // prompt tokens run so far
  // Sampled on the device (Backend::sample_batch, penalties and all; stop strings are matched in
  // decide() as for the host rows): the prompt but its last token is prefilled, the last one is
  // fed by the first decode step, as generate()'s device path does; `steps` counts the ids
  // sampled (the RNG position).
  bool on_device = false;
  int64_t steps = 0;
  int64_t prefill_target() const {
    return static_cast<int64_t>(r.prompt.size()) - (on_device ? 1 : 0);
  }
  std::optional<int32_t> pending;  // the sampled id to feed at the next decode step
  GenerationResult out;
  Clock::time_point t0, t_prev;
};

BatchEngine::BatchEngine(Backend& backend, Collectives& coll, const BatchEngineOptions& o)
    : backend_(backend), coll_(coll), capacity_(o.max_batch), budget_(o.prefill_budget) {
  FN_CHECK(o.max_batch >= 1 && o.max_batch <= backend.slot_count(),
           "BatchEngine: max_batch {} outside [1, {}] (the backend's slots)", o.max_batch,
           backend.slot_count());
  FN_CHECK(o.prefill_budget >= 1, "BatchEngine: prefill budget {} < 1", o.prefill_budget);
  slots_.resize(static_cast<std::size_t>(capacity_));
}

BatchEngine::~BatchEngine() = default;

int64_t BatchEngine::running() const noexcept {
  return static_cast<int64_t>(
      std::count_if(slots_.begin(), slots_.end(), [](const auto& s) { return s != nullptr; }));
}

void BatchEngine::admit(BatchRequest r) {
  const GenerateOptions& go = r.options;
  check_context(static_cast<int64_t>(r.prompt.size()), go.max_new_tokens, go.ctx_size);
  check_top_logprobs(go.top_logprobs);
  FN_REQUIRE(go.stop_strings.empty() || coll_.rank() != 0 || r.hooks.feed, Usage,
             "--stop needs a tokenizer to match text; this model directory has none");
  const auto free_it =
      std::find_if(slots_.begin(), slots_.end(), [](const auto& s) { return s == nullptr; });
  FN_CHECK(free_it != slots_.end(), "BatchEngine::admit: all {} slots are busy", capacity_);
  auto seq = std::make_unique<Seq>(std::move(r));  // validates the sampling parameters
  seq->slot = free_it - slots_.begin();
  seq->order = admitted_++;
  for (const int32_t t : seq->r.prompt) seq->sampler.accept(t);
  seq->out.n_prompt_tokens = static_cast<int64_t>(seq->r.prompt.size());
  if (capacity_ > 1) {
    seq->on_device = backend_.capabilities().batch_sampling &&
                     device_sampling_supported(seq->r.options) && seq->r.options.top_logprobs < 0;
    backend_.select_slot(seq->slot);
    backend_.reset();
    seq->t0 = Clock::now();
    if (seq->prefill_target() == 0) seq->pending = seq->r.prompt.back();
  }
  *free_it = std::move(seq);
}

std::vector<BatchOutput> BatchEngine::step() {
  std::vector<BatchOutput> out;
  if (capacity_ == 1) {  // one sequence: generate() as for a lone prompt
    std::unique_ptr<Seq>& s = slots_[0];
    if (!s) return out;
    backend_.select_slot(0);
    backend_.reset();
    out.push_back({s->r.key, generate(backend_, coll_, s->r.prompt, s->r.options, s->r.hooks)});
    s.reset();
    return out;
  }

  // The step's tokens to decide, in this order: the first tokens of the prompts that completed
  // here, then one token per decoding sequence.
  std::vector<Seq*> decided;
  std::vector<int32_t> ids;
  const auto take = [&](Seq& s, std::span<const float> logits) {
    const int32_t id = s.sampler.sample(logits);
    if (s.r.options.top_logprobs >= 0)
      s.out.logprobs.push_back(token_logprobs(logits, id, s.r.options.top_logprobs));
    decided.push_back(&s);
    ids.push_back(id);
  };

  // Prefill within the budget, oldest admission first.
  std::vector<Seq*> waiting;
  for (auto& s : slots_)
    if (s && s->prefilled < s->prefill_target()) waiting.push_back(s.get());
  std::sort(waiting.begin(), waiting.end(),
            [](const Seq* a, const Seq* b) { return a->order < b->order; });
  int64_t budget = budget_;
  for (Seq* s : waiting) {
    if (budget == 0) break;
    const int64_t target = s->prefill_target();
    const int64_t n = std::min(budget, target - s->prefilled);
    const bool last = s->prefilled + n == target;
    backend_.select_slot(s->slot);
    const std::span<const int32_t> chunk =
        std::span<const int32_t>(s->r.prompt)
            .subspan(static_cast<std::size_t>(s->prefilled), static_cast<std::size_t>(n));
    const PrefillOutput want = last && !s->on_device ? PrefillOutput::Last : PrefillOutput::None;
    std::span<const float> logits;
    if (s->r.options.stepwise_prefill) {
      for (const int32_t t : chunk) logits = backend_.forward(t);
    } else {
      logits = backend_.prefill(chunk, want);
    }
    s->prefilled += n;
    budget -= n;
    if (!last) continue;
    s->out.prefill_ms = ms_between(s->t0, Clock::now());
    if (s->on_device) {
      s->pending = s->r.prompt.back();  // its first id comes from the decode step
    } else {
      take(*s, logits);  // its first id is fed at the next step
    }
  }

  // One decode step over every sequence with a token to feed, in slot order: those sampled on
  // the host in one forward_batch, those sampled on the device in one sample_batch.
  for (const bool device : {false, true}) {
    std::vector<Seq*> decoding;
    std::vector<int64_t> slot_ids;
    std::vector<int32_t> feed;
    std::vector<SlotSampling> sampling;
    for (auto& s : slots_) {
      if (!s || !s->pending || s->on_device != device) continue;
      decoding.push_back(s.get());
      slot_ids.push_back(s->slot);
      feed.push_back(*s->pending);
      // The prompt starts the slot's penalty window at step 0 (the backend keeps it after).
      if (device) sampling.push_back({s->r.options.sampling, s->steps, s->r.prompt});
    }
    if (decoding.empty()) continue;
    if (device) {
      const std::vector<int32_t> got = backend_.sample_batch(slot_ids, feed, sampling);
      for (std::size_t i = 0; i < decoding.size(); ++i) {
        decoding[i]->pending.reset();
        ++decoding[i]->steps;
        decided.push_back(decoding[i]);
        ids.push_back(got[i]);
      }
    } else {
      const std::span<const float> rows = backend_.forward_batch(slot_ids, feed);
      const auto V = static_cast<std::size_t>(backend_.info().vocab_size);
      for (std::size_t i = 0; i < decoding.size(); ++i) {
        decoding[i]->pending.reset();
        take(*decoding[i], rows.subspan(i * V, V));
      }
    }
  }
  if (!decided.empty()) decide(decided, ids, out);
  return out;
}

// Rank 0 checks each sampled id against its sequence's stop ids, stop strings and length and
// broadcasts {id, code} for all of them; every rank then records the ids and finishes the same
// sequences (as generate()'s host path does for one).
void BatchEngine::decide(std::vector<Seq*>& seqs, std::vector<int32_t>& ids,
                         std::vector<BatchOutput>& out) {
  const bool root = coll_.rank() == 0;
  std::vector<int32_t> msg(2 * seqs.size(), kContinue);
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    msg[2 * i] = ids[i];
    if (!root) continue;
    Seq& s = *seqs[i];
    const GenerateOptions& go = s.r.options;
    const int32_t tok = ids[i];
    const auto n_after = static_cast<int64_t>(s.out.token_ids.size()) + 1;
    const bool stop_id = std::find(go.stop_token_ids.begin(), go.stop_token_ids.end(),
                                   static_cast<int64_t>(tok)) != go.stop_token_ids.end();
    if (!go.ignore_eos && stop_id) {
      msg[2 * i + 1] = 1 + static_cast<int32_t>(FinishReason::Eos);
    } else if (s.r.hooks.feed && s.stop_text.add(s.r.hooks.feed(tok))) {
      msg[2 * i + 1] = 1 + static_cast<int32_t>(FinishReason::Stop);
    } else if (n_after >= go.max_new_tokens) {
      msg[2 * i + 1] = 1 + static_cast<int32_t>(FinishReason::Length);
    }
  }
  coll_.broadcast(msg.data(), msg.size() * sizeof(int32_t), 0);
  const auto t = Clock::now();
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    Seq& s = *seqs[i];
    GenerationResult& r = s.out;
    const int32_t tok = msg[2 * i];
    if (r.token_ids.empty()) {
      r.ttft_ms = ms_between(s.t0, t);
    } else {
      r.itl_ms.push_back(ms_between(s.t_prev, t));
    }
    s.t_prev = t;
    r.token_ids.push_back(tok);
    if (msg[2 * i + 1] == kContinue) {
      s.sampler.accept(tok);
      s.pending = tok;
      continue;
    }
    r.finish = static_cast<FinishReason>(msg[2 * i + 1] - 1);
    r.e2e_ms = ms_between(s.t0, s.t_prev);
    if (root) {
      const TextHooks& h = s.r.hooks;
      if (r.finish != FinishReason::Stop) {
        if (h.finish && !s.stop_text.add(h.finish())) s.stop_text.flush();
        if (!h.finish) s.stop_text.flush();
      }
      r.text = s.stop_text.take_text();
    }
    finish_generation_stats(r);
    out.push_back({s.r.key, std::move(r)});
    slots_[static_cast<std::size_t>(s.slot)].reset();
  }
  std::sort(out.begin(), out.end(),
            [](const BatchOutput& a, const BatchOutput& b) { return a.key < b.key; });
}

}  // namespace fn
