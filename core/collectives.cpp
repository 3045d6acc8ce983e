// LocalCollectives (the one-rank group) and agree_on_error (see collectives.h).
#include "core/collectives.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"

namespace fn {

namespace {
std::atomic<double> g_stall_timeout{kDefaultStallTimeoutSeconds};
}  // namespace

void set_stall_timeout(double seconds) {
  FN_REQUIRE(std::isfinite(seconds) && seconds >= 0 && seconds <= kMaxStallTimeoutSeconds, Usage,
             "--stall-timeout must be a number of seconds in [0, {:g}] (0: no bound), got {}",
             kMaxStallTimeoutSeconds, seconds);
  g_stall_timeout.store(seconds);
}

double stall_timeout() noexcept {
  return g_stall_timeout.load();
}

void LocalCollectives::all_reduce_sum(float* /*data*/, std::size_t /*n*/) {}

void LocalCollectives::all_gather(const float* in, std::size_t n_per_rank, float* out) {
  if (n_per_rank > 0) std::memcpy(out, in, n_per_rank * sizeof(float));
}

void LocalCollectives::broadcast(void* /*data*/, std::size_t /*bytes*/, int root) {
  FN_CHECK(root == 0, "broadcast: root {} outside a group of 1", root);
}

namespace {
// 48 bits of the FNV-1a hash of `s` as three 16-bit pieces, each exact in a float.
std::array<float, 3> message_key(const std::string& s) {
  uint64_t h = 14695981039346656037ULL;
  for (const char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
  return {static_cast<float>(h & 0xFFFF), static_cast<float>((h >> 16) & 0xFFFF),
          static_cast<float>((h >> 32) & 0xFFFF)};
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (const int r : ranks) out += fmt::format("{}{}", out.empty() ? "" : ", ", r);
  return out;
}
}  // namespace

void agree_on_error(Collectives& coll, const std::function<void()>& f) {
  std::optional<Error> err;
  try {
    f();
  } catch (const Error& e) {
    err = e;
  } catch (const std::filesystem::filesystem_error& e) {  // a path the file system refuses
    err = Error(ErrorKind::Io, e.what());
  } catch (const std::exception& e) {
    err = Error(ErrorKind::Internal, e.what());
  }
  // Every rank learns every rank's outcome: 1 + its error kind (0: none) and its message's key.
  constexpr std::size_t kSlot = 4;
  const auto n = static_cast<std::size_t>(coll.size());
  std::array<float, kSlot> mine{};
  if (err) {
    const std::array<float, 3> key = message_key(err->what());
    mine = {1.0F + static_cast<float>(err->kind()), key[0], key[1], key[2]};
  }
  std::vector<float> all(n * kSlot);
  coll.all_gather(mine.data(), kSlot, all.data());
  auto slot = [&](int r) { return &all[static_cast<std::size_t>(r) * kSlot]; };
  int first = -1;
  std::vector<int> same, other;  // the other failing ranks, with the first one's message or not
  for (int r = 0; r < coll.size(); ++r) {
    if (slot(r)[0] < 0.5F) continue;
    if (first < 0) {
      first = r;
    } else {
      (std::equal(slot(r), slot(r) + kSlot, slot(first)) ? same : other).push_back(r);
    }
  }
  if (first < 0) return;
  // The first failing rank's message and source location reach every rank.
  std::string text = coll.rank() == first ? std::string(err->what()) + '\n' + err->where() : "";
  uint64_t len = text.size();
  coll.broadcast(&len, sizeof len, first);
  text.resize(len);
  if (len > 0) coll.broadcast(text.data(), len, first);
  const std::size_t cut = text.rfind('\n');
  std::string message = text.substr(0, cut);
  const std::string where = cut == std::string::npos ? std::string() : text.substr(cut + 1);
  // "rank r: " only when the error is not every rank's own.
  const bool everywhere = first == 0 && same.size() + 1 == n;
  if (!everywhere) {
    if (first != 0) message = fmt::format("rank {}: {}", first, message);
    if (!same.empty()) message += fmt::format(" (also on rank(s) {})", rank_list(same));
  }
  if (!other.empty())
    message += fmt::format(" (rank(s) {} failed with other errors)", rank_list(other));
  const auto kind = static_cast<ErrorKind>(static_cast<int>(slot(first)[0] + 0.5F) - 1);
  Error agreed(kind, std::move(message));
  agreed.set_where(where);
  agreed.set_on_every_rank();
  throw agreed;
}

}  // namespace fn
