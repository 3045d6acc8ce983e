// Hashing and comparing the per-step router/indexer choices across ranks (see choice_check.h).
#include "core/choice_check.h"

#include <fmt/format.h>

#include <cstring>
#include <string>

#include "core/error.h"

namespace fn {

namespace {

constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull;
constexpr uint64_t kFnvPrime = 0x100000001b3ull;

void mix_bytes(uint64_t& h, const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) {
    h ^= b[i];
    h *= kFnvPrime;
  }
}

void mix_lists(uint64_t& h, const std::vector<std::vector<int32_t>>& lists) {
  const uint64_t count = lists.size();
  mix_bytes(h, &count, sizeof count);
  for (const auto& l : lists) {
    const uint64_t n = l.size();
    mix_bytes(h, &n, sizeof n);
    mix_bytes(h, l.data(), l.size() * sizeof(int32_t));
  }
}

}  // namespace

uint64_t hash_choices(const std::vector<std::vector<int32_t>>& router,
                      const std::vector<std::vector<int32_t>>& indexer) noexcept {
  uint64_t h = kFnvOffset;
  mix_lists(h, router);
  mix_lists(h, indexer);
  return h;
}

void require_same_choices(Collectives& coll, uint64_t hash, int64_t step) {
  const int n = coll.size();
  if (n == 1) return;
  // The collectives move floats: send the hash as four 16-bit pieces (exact in FP32).
  float mine[4];
  for (int i = 0; i < 4; ++i) mine[i] = static_cast<float>((hash >> (16 * i)) & 0xffffu);
  std::vector<float> all(static_cast<std::size_t>(4 * n));
  coll.all_gather(mine, 4, all.data());
  std::vector<uint64_t> hashes(static_cast<std::size_t>(n));
  bool same = true;
  for (int r = 0; r < n; ++r) {
    uint64_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint64_t>(all[4 * r + i]) << (16 * i);
    hashes[r] = v;
    same &= v == hashes[0];
  }
  if (same) return;
  std::string list;
  for (int r = 0; r < n; ++r)
    list += fmt::format("{}rank {}: {:016x}", r ? ", " : "", r, hashes[r]);
  FN_THROW(Internal,
           "the tensor-parallel ranks disagree on the router/indexer choices of decode step {} "
           "(hashes {})",
           step, list);
}

}  // namespace fn
