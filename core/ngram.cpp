#include "core/ngram.h"

#include "core/error.h"

namespace fn {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

bool is_prime(int64_t n) {
  if (n < 2) return false;
  if (n % 2 == 0) return n == 2;
  for (int64_t d = 3; d * d <= n; d += 2) {
    if (n % d == 0) return false;
  }
  return true;
}

int64_t floor_mod(int64_t a, int64_t m) {
  int64_t r = a % m;
  return r < 0 ? r + m : r;
}

int64_t wrap_mul(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
}

}  // namespace

uint64_t splitmix64(uint64_t v) noexcept {
  v += kGolden;
  v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9ULL;
  v = (v ^ (v >> 27)) * 0x94D049BB133111EBULL;
  return v ^ (v >> 31);
}

std::vector<int64_t> ngram_multipliers(const ModelConfig& cfg, int ple_layer_rank) {
  FN_CHECK(cfg.vocab_size > 0 && ple_layer_rank >= 0, "vocab {} rank {}", cfg.vocab_size,
           ple_layer_rank);
  uint64_t half = static_cast<uint64_t>(INT64_MAX / cfg.vocab_size) / 2;
  if (half < 1) half = 1;
  uint64_t base =
      static_cast<uint64_t>(cfg.seed) + 10007ULL * static_cast<uint64_t>(ple_layer_rank);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < cfg.ngram_size; ++i) {
    uint64_t v = splitmix64(base + kGolden * static_cast<uint64_t>(i + 1));
    out.push_back(static_cast<int64_t>(2 * (v % half) + 1));
  }
  return out;
}

std::vector<int64_t> ngram_head_sizes(const ModelConfig& cfg, int ple_layer_rank) {
  const int64_t heads = cfg.ngram_heads();
  const int64_t skip = static_cast<int64_t>(ple_layer_rank) * heads;
  std::vector<int64_t> out;
  int64_t n = cfg.ngram_vocab_size_base - 1;
  int64_t found = 0;
  while (static_cast<int64_t>(out.size()) < heads) {
    ++n;
    if (!is_prime(n)) continue;
    if (found++ >= skip) out.push_back(n);
  }
  return out;
}

std::vector<int64_t> ngram_head_offsets(const ModelConfig& cfg, int ple_layer_rank) {
  std::vector<int64_t> sizes = ngram_head_sizes(cfg, ple_layer_rank);
  std::vector<int64_t> out;
  int64_t sum = 0;
  for (int64_t s : sizes) {
    out.push_back(sum);
    sum += s;
  }
  return out;
}

int64_t ngram_padded_rows(const ModelConfig& cfg, int ple_layer_rank) {
  int64_t sum = 0;
  for (int64_t s : ngram_head_sizes(cfg, ple_layer_rank)) sum += s;
  const int64_t m = cfg.make_ngram_vocab_size_divisible_by;
  return (sum + m - 1) / m * m;
}

NgramConstants ngram_constants(const ModelConfig& cfg, int ple_layer_rank) {
  NgramConstants k;
  k.multipliers = ngram_multipliers(cfg, ple_layer_rank);
  k.head_sizes = ngram_head_sizes(cfg, ple_layer_rank);
  k.head_offsets = ngram_head_offsets(cfg, ple_layer_rank);
  k.table_rows = ngram_padded_rows(cfg, ple_layer_rank);
  k.heads_per_ngram = cfg.heads_per_ngram;
  k.eos = cfg.ple_eos();
  return k;
}

void ngram_ids(const NgramConstants& k, std::span<const int64_t> context, int64_t token,
               std::span<int64_t> ids) {
  const std::size_t n = k.multipliers.size();
  FN_CHECK(context.size() + 1 == n, "context of {} ids for ngram_size {}", context.size(), n);
  FN_CHECK(ids.size() >= k.head_sizes.size(), "ids has room for {} of {}", ids.size(),
           k.head_sizes.size());
  // s[0] = current token, s[j] = token j back, EOS once an EOS has been met looking back.
  int64_t mix = wrap_mul(token, k.multipliers[0]);
  bool behind_eos = false;
  std::size_t head = 0;
  for (std::size_t j = 1; j < n; ++j) {
    int64_t s = behind_eos ? k.eos : context[context.size() - j];
    if (s == k.eos) behind_eos = true;
    mix ^= wrap_mul(s, k.multipliers[j]);
    for (int64_t i = 0; i < k.heads_per_ngram; ++i, ++head) {
      ids[head] = floor_mod(mix, k.head_sizes[head]) + k.head_offsets[head];
    }
  }
}

void ngram_ids(const NgramConstants& k, int64_t c0, int64_t c1, int64_t token, int64_t* ids) {
  const int64_t ctx[2] = {c0, c1};
  ngram_ids(k, std::span<const int64_t>(ctx, 2), token,
            std::span<int64_t>(ids, k.head_sizes.size()));
}

}  // namespace fn
