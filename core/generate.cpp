// Generation loop: prefill, sample/decode with stop handling and timing (core/generate.h).
#include "core/generate.h"

#include <unistd.h>
#include <cstdio>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/error.h"
#include "core/stop_text.h"

namespace fn {

namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

void finish_generation_stats(GenerationResult& r) {
  r.tpot = latency_stats(r.itl_ms);
  double itl_sum = 0;
  for (double v : r.itl_ms) itl_sum += v;
  r.decode_tokens_per_s = itl_sum > 0 ? static_cast<double>(r.itl_ms.size()) * 1e3 / itl_sum : 0;
  r.prefill_tokens_per_s =
      r.prefill_ms > 0 ? static_cast<double>(r.n_prompt_tokens) * 1e3 / r.prefill_ms : 0;
}

namespace {

// Wire codes of the per-step broadcast: {token, kContinue or 1 + FinishReason}.
constexpr int32_t kContinue = 0;

// Runs `prompt` on `backend`: Backend::prefill, or forward() per token with stepwise_prefill.
// Returns the last token's logits for PrefillOutput::Last, else an empty span.
std::span<const float> run_prompt(Backend& backend, std::span<const int32_t> prompt,
                                  PrefillOutput output, bool stepwise) {
  if (!stepwise) return backend.prefill(prompt, output);
  std::span<const float> logits;
  for (int32_t t : prompt) logits = backend.forward(t);
  return output == PrefillOutput::Last ? logits : std::span<const float>();
}

bool is_stop_id(const GenerateOptions& options, int32_t t) {
  return std::find(options.stop_token_ids.begin(), options.stop_token_ids.end(),
                   static_cast<int64_t>(t)) != options.stop_token_ids.end();
}

}  // namespace

const char* finish_reason_name(FinishReason r) noexcept {
  switch (r) {
    case FinishReason::Eos:
      return "eos";
    case FinishReason::Stop:
      return "stop";
    case FinishReason::Length:
      return "length";
  }
  return "?";
}

LatencyStats latency_stats(std::span<const double> ms) {
  LatencyStats s;
  s.count = static_cast<int64_t>(ms.size());
  if (ms.empty()) return s;
  std::vector<double> x(ms.begin(), ms.end());
  std::sort(x.begin(), x.end());
  double sum = 0;
  for (double v : x) sum += v;
  s.mean = sum / static_cast<double>(x.size());
  auto pct = [&x](double q) {
    const double h = static_cast<double>(x.size() - 1) * q;
    const auto lo = static_cast<std::size_t>(std::floor(h));
    const std::size_t hi = std::min(lo + 1, x.size() - 1);
    return x[lo] + (h - static_cast<double>(lo)) * (x[hi] - x[lo]);
  };
  s.p50 = pct(0.50);
  s.p90 = pct(0.90);
  s.p99 = pct(0.99);
  s.max = x.back();
  return s;
}

void check_context(int64_t prompt_len, int64_t max_new_tokens, int64_t ctx_size) {
  FN_REQUIRE(prompt_len > 0, Usage, "the prompt is empty (0 tokens): give at least one token");
  FN_REQUIRE(max_new_tokens > 0, Usage, "-n/--max-new-tokens must be > 0, got {}", max_new_tokens);
  // A prompt that leaves no room (prompt_len >= ctx_size) is bad input, as a batch record: the
  // message names the prompt alone, since no -n would help. A prompt with room that -n overruns
  // is a flag mistake (usage).
  FN_REQUIRE(prompt_len < ctx_size, Format,
             "the prompt ({} token{}) {} the context size -c/--ctx-size {}: it leaves no room for "
             "a generated token",
             prompt_len, prompt_len == 1 ? "" : "s", prompt_len > ctx_size ? "exceeds" : "fills",
             ctx_size);
  FN_REQUIRE(prompt_len + max_new_tokens <= ctx_size, Usage,
             "the prompt ({} token{}) plus -n/--max-new-tokens ({}) is {} tokens, more than the "
             "context size -c/--ctx-size {}",
             prompt_len, prompt_len == 1 ? "" : "s", max_new_tokens, prompt_len + max_new_tokens,
             ctx_size);
}

namespace {

// generate() with the host sampler: forward() per generated token, rank 0's decision broadcast.
GenerationResult generate_on_host(Backend& backend, Collectives& coll,
                                  std::span<const int32_t> prompt, const GenerateOptions& options,
                                  const TextHooks& hooks) {
  const bool root = coll.rank() == 0;
  GenerationResult r;
  r.n_prompt_tokens = static_cast<int64_t>(prompt.size());
  Sampler sampler(options.sampling);
  for (int32_t t : prompt) sampler.accept(t);
  StopText stop_text(options.stop_strings, hooks);

  const auto t0 = Clock::now();
  std::span<const float> logits =
      run_prompt(backend, prompt, PrefillOutput::Last, options.stepwise_prefill);
  const auto t_prefill = Clock::now();
  r.prefill_ms = ms_between(t0, t_prefill);
  auto t_prev = t0;
  FinishReason finish = FinishReason::Length;
  for (;;) {
    int32_t msg[2] = {sampler.sample(logits), kContinue};
    if (root) {
      const int32_t tok = msg[0];
      const auto n_after = static_cast<int64_t>(r.token_ids.size()) + 1;
      if (!options.ignore_eos && is_stop_id(options, tok)) {
        msg[1] = 1 + static_cast<int32_t>(FinishReason::Eos);
      } else {
        if (hooks.feed && stop_text.add(hooks.feed(tok))) {
          msg[1] = 1 + static_cast<int32_t>(FinishReason::Stop);
        } else if (n_after >= options.max_new_tokens) {
          msg[1] = 1 + static_cast<int32_t>(FinishReason::Length);
        }
      }
    }
    coll.broadcast(msg, sizeof(msg), 0);
    if (options.top_logprobs >= 0)
      r.logprobs.push_back(token_logprobs(logits, msg[0], options.top_logprobs));
    const auto t_tok = Clock::now();
    if (r.token_ids.empty()) {
      r.ttft_ms = ms_between(t0, t_tok);
    } else {
      r.itl_ms.push_back(ms_between(t_prev, t_tok));
    }
    t_prev = t_tok;
    r.token_ids.push_back(msg[0]);
    if (msg[1] != kContinue) {
      finish = static_cast<FinishReason>(msg[1] - 1);
      break;
    }
    sampler.accept(msg[0]);
    logits = backend.forward(msg[0]);
  }
  r.finish = finish;
  r.e2e_ms = ms_between(t0, t_prev);
  if (root) {
    if (finish != FinishReason::Stop) {
      if (hooks.finish && !stop_text.add(hooks.finish())) stop_text.flush();
      if (!hooks.finish) stop_text.flush();
    }
    r.text = stop_text.take_text();
  }
  finish_generation_stats(r);
  return r;
}

// generate() with sampling on the device: prompt[0 .. n-2] prefilled, then Backend::decode from
// the last prompt token, the whole prompt starting the penalty window. Each id reaches on_token
// before decode() reports the next one, so a stop (id or string) ends the ids exactly there,
// however far the device ran ahead. Stop strings are matched on rank 0's text: its decision is
// broadcast per token (4 bytes) so that every rank leaves decode() after the same id.
GenerationResult generate_on_device(Backend& backend, Collectives& coll,
                                    std::span<const int32_t> prompt, const GenerateOptions& options,
                                    const TextHooks& hooks) {
  const bool root = coll.rank() == 0;
  const bool match_text = !options.stop_strings.empty();
  GenerationResult r;
  r.n_prompt_tokens = static_cast<int64_t>(prompt.size());
  StopText stop_text(options.stop_strings, hooks);
  const auto t0 = Clock::now();
  if (prompt.size() > 1)
    run_prompt(backend, prompt.first(prompt.size() - 1), PrefillOutput::None,
               options.stepwise_prefill);
  r.prefill_ms = ms_between(t0, Clock::now());  // the last prompt token runs in the first step
  auto t_prev = t0;
  FinishReason finish = FinishReason::Length;
  const auto on_token = [&](int32_t id) {
    const auto t = Clock::now();
    if (r.token_ids.empty()) {
      r.ttft_ms = ms_between(t0, t);
    } else {
      r.itl_ms.push_back(ms_between(t_prev, t));
    }
    t_prev = t;
    r.token_ids.push_back(id);
    // The ids are the same on every rank, so the stop-id decision needs no broadcast.
    if (!options.ignore_eos && is_stop_id(options, id)) {
      finish = FinishReason::Eos;
      return false;
    }
    int32_t stop = 0;
    if (root && hooks.feed && stop_text.add(hooks.feed(id))) stop = 1;
    if (match_text) coll.broadcast(&stop, sizeof(stop), 0);
    if (stop != 0) {
      finish = FinishReason::Stop;
      return false;
    }
    return true;
  };
  backend.decode(prompt.back(), options.max_new_tokens, options.sampling, options.sampling.seed,
                 on_token, options.top_logprobs, &r.logprobs, prompt);
  r.finish = finish;
  r.e2e_ms = ms_between(t0, t_prev);
  if (root) {  // as the host path: a stop string's text is final
    if (finish != FinishReason::Stop) {
      if (hooks.finish && !stop_text.add(hooks.finish())) stop_text.flush();
      if (!hooks.finish) stop_text.flush();
    }
    r.text = stop_text.take_text();
  }
  finish_generation_stats(r);
  return r;
}

}  // namespace

bool device_sampling_supported(const GenerateOptions& options) {
  return !options.host_sampling;
}

bool samples_on_device(const Backend& backend, const GenerateOptions& options) {
  return backend.capabilities().device_decode && device_sampling_supported(options);
}

void check_top_logprobs(int64_t top_logprobs) {
  FN_REQUIRE(top_logprobs == -1 || (top_logprobs >= 0 && top_logprobs <= kMaxTopLogprobs), Usage,
             "--logprobs must be in [0, {}] (the alternatives reported per token), got {}",
             kMaxTopLogprobs, top_logprobs);
}

GenerationResult generate(Backend& backend, Collectives& coll, std::span<const int32_t> prompt,
                          const GenerateOptions& options, const TextHooks& hooks) {
  check_context(static_cast<int64_t>(prompt.size()), options.max_new_tokens, options.ctx_size);
  check_top_logprobs(options.top_logprobs);
  FN_REQUIRE(options.stop_strings.empty() || coll.rank() != 0 || hooks.feed, Usage,
             "--stop needs a tokenizer to match text; this model directory has none");
  return samples_on_device(backend, options)
             ? generate_on_device(backend, coll, prompt, options, hooks)
             : generate_on_host(backend, coll, prompt, options, hooks);
}

double current_rss_mib() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  long pages_total = 0, pages_resident = 0;
  const int n = std::fscanf(f, "%ld %ld", &pages_total, &pages_resident);
  std::fclose(f);
  if (n != 2) return 0;
  return static_cast<double>(pages_resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) /
         (1024.0 * 1024.0);
}

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: kilobytes
}

std::vector<double> gather_peak_rss_mib(Collectives& coll) {
  // MiB as float: exact to 1/64 MiB below 256 GiB, plenty for a report.
  const float mine = static_cast<float>(peak_rss_mib());
  std::vector<float> all(static_cast<std::size_t>(coll.size()));
  coll.all_gather(&mine, 1, all.data());
  return {all.begin(), all.end()};
}

}  // namespace fn
