// Sampler: llama.cpp's default chain over FP32 logits (see core/sampler.h for the order).
#include "core/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace fn {

void validate_sampling_params(const SamplingParams& p) {
  FN_REQUIRE(std::isfinite(p.temperature) && p.temperature >= 0.0, Usage,
             "--temp must be a finite value >= 0 (0 = greedy), got {}", p.temperature);
  FN_REQUIRE(p.top_k >= 0, Usage, "--top-k must be >= 0 (0 = off), got {}", p.top_k);
  FN_REQUIRE(p.top_p > 0.0 && p.top_p <= 1.0, Usage, "--top-p must be in (0, 1] (1 = off), got {}",
             p.top_p);
  FN_REQUIRE(p.min_p >= 0.0 && p.min_p <= 1.0, Usage, "--min-p must be in [0, 1] (0 = off), got {}",
             p.min_p);
  FN_REQUIRE(std::isfinite(p.repetition_penalty) && p.repetition_penalty > 0.0, Usage,
             "--repeat-penalty must be > 0 (1 = off), got {}", p.repetition_penalty);
  FN_REQUIRE(p.repeat_last_n >= -1, Usage,
             "--repeat-last-n must be >= -1 (0 = off, -1 = whole context), got {}",
             p.repeat_last_n);
  FN_REQUIRE(std::isfinite(p.presence_penalty), Usage, "--presence-penalty must be finite, got {}",
             p.presence_penalty);
  FN_REQUIRE(std::isfinite(p.frequency_penalty), Usage,
             "--frequency-penalty must be finite, got {}", p.frequency_penalty);
}

int32_t argmax_lowest(std::span<const float> values) {
  FN_CHECK(!values.empty(), "argmax of no values");
  std::size_t best = 0;
  // Skip leading NaNs so that a NaN is chosen only when every value is NaN.
  while (best + 1 < values.size() && std::isnan(values[best])) ++best;
  for (std::size_t i = best + 1; i < values.size(); ++i) {
    if (values[i] > values[best]) best = i;  // strict: ties keep the lower index
  }
  return static_cast<int32_t>(best);
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
  validate_sampling_params(params_);
}

void Sampler::accept(int32_t token) {
  if (params_.repeat_last_n == 0) return;
  window_.push_back(token);
  ++counts_[token];
  if (params_.repeat_last_n > 0 && static_cast<int64_t>(window_.size()) > params_.repeat_last_n) {
    const int32_t old = window_.front();
    window_.pop_front();
    auto it = counts_.find(old);
    if (--it->second == 0) counts_.erase(it);
  }
}

void Sampler::apply_penalties(std::span<float> logits) const {
  const bool penalties = params_.repetition_penalty != 1.0 || params_.presence_penalty != 0.0 ||
                         params_.frequency_penalty != 0.0;
  if (!penalties) return;
  const auto n = static_cast<int64_t>(logits.size());
  for (const auto& [id, count] : counts_) {
    if (id < 0 || id >= n) continue;
    // FP64, each operation rounded on its own (the device sampler, cuda/kernels/sample.h, repeats
    // this arithmetic bit for bit).
    double l = logits[static_cast<std::size_t>(id)];
    l = l <= 0.0 ? l * params_.repetition_penalty : l / params_.repetition_penalty;
    l -= static_cast<double>(count) * params_.frequency_penalty + params_.presence_penalty;
    logits[static_cast<std::size_t>(id)] = static_cast<float>(l);
  }
}

double Sampler::next_uniform() {
  // 53 random bits scaled by 2^-53: exactly representable, in [0, 1), identical everywhere
  // (std::uniform_real_distribution's algorithm is implementation-defined).
  return static_cast<double>(rng_() >> 11) * 0x1.0p-53;
}

int32_t Sampler::sample(std::span<const float> logits) {
  FN_CHECK(!logits.empty(), "sampling from an empty logits vector");
  const auto n = static_cast<int32_t>(logits.size());
  work_.assign(logits.begin(), logits.end());
  last_.clear();

  // 1. Penalties (llama.cpp llama_sampler_penalties_apply).
  apply_penalties(work_);

  // 2. Greedy.
  if (params_.temperature <= 0.0) {
    const int32_t id = argmax_lowest(work_);
    last_.push_back({id, 1.0});
    return id;
  }

  // Candidates: every id with a non-NaN logit (a NaN logit can never be drawn).
  order_.clear();
  order_.reserve(logits.size());
  for (int32_t i = 0; i < n; ++i) {
    if (!std::isnan(work_[static_cast<std::size_t>(i)])) order_.push_back(i);
  }
  if (order_.empty()) {
    last_.push_back({0, 1.0});
    return 0;
  }
  const float* w = work_.data();
  auto before = [w](int32_t a, int32_t b) { return w[a] > w[b] || (w[a] == w[b] && a < b); };

  // 3. Top-k (partial selection, then sorted: decreasing logit, ties by lower id).
  const int64_t k = params_.top_k;
  if (k > 0 && k < static_cast<int64_t>(order_.size())) {
    std::nth_element(order_.begin(), order_.begin() + k - 1, order_.end(), before);
    order_.resize(static_cast<std::size_t>(k));
  }
  std::sort(order_.begin(), order_.end(), before);

  // 4. Top-p on the temperature-1 softmax of the survivors.
  if (params_.top_p < 1.0 && order_.size() > 1) {
    const double max_l = w[order_.front()];
    double total = 0.0;
    for (int32_t id : order_) total += std::exp(static_cast<double>(w[id]) - max_l);
    double cum = 0.0;
    std::size_t keep = order_.size();
    for (std::size_t i = 0; i < order_.size(); ++i) {
      cum += std::exp(static_cast<double>(w[order_[i]]) - max_l) / total;
      if (cum >= params_.top_p) {
        keep = i + 1;
        break;
      }
    }
    order_.resize(keep);
  }

  // 5. Min-p: p >= min_p * p_max  <=>  logit >= max logit + ln(min_p).
  if (params_.min_p > 0.0 && order_.size() > 1) {
    const double threshold = static_cast<double>(w[order_.front()]) + std::log(params_.min_p);
    std::size_t keep = 1;
    while (keep < order_.size() && static_cast<double>(w[order_[keep]]) >= threshold) ++keep;
    order_.resize(keep);
  }

  // 6. Temperature, softmax, draw.
  const double max_l = w[order_.front()];
  double total = 0.0;
  last_.reserve(order_.size());
  for (int32_t id : order_) {
    const double p = std::exp((static_cast<double>(w[id]) - max_l) / params_.temperature);
    last_.push_back({id, p});
    total += p;
  }
  const double target = next_uniform() * total;
  double cum = 0.0;
  int32_t chosen = last_.back().id;
  bool found = false;
  for (auto& c : last_) {
    cum += c.p;
    if (!found && cum > target) {
      chosen = c.id;
      found = true;
    }
    c.p /= total;
  }
  return chosen;
}

}  // namespace fn
