// fn::L2Prefetch and fn::for_each_l2_prefetch_chunk (cuda/common/l2_prefetch.h): which ranges a
// list accepts, and that the parts of a grid cover every byte of every range exactly once, in
// chunks of at most kL2PrefetchChunk bytes, chunk c going to part c % parts.
#include <doctest/doctest.h>

#include <cstdint>
#include <map>
#include <vector>

#include "cuda/common/l2_prefetch.h"

namespace {

// Fake device addresses: only their values matter (nothing is dereferenced).
const void* at(uintptr_t a) {
  return reinterpret_cast<const void*>(a);
}

struct Chunk {
  uintptr_t begin;
  uint32_t bytes;
};

std::vector<Chunk> chunks_of(const fn::L2Prefetch& l, unsigned part, unsigned parts) {
  std::vector<Chunk> out;
  fn::for_each_l2_prefetch_chunk(l, part, parts, [&](const char* p, uint32_t n) {
    out.push_back({reinterpret_cast<uintptr_t>(p), n});
  });
  return out;
}

}  // namespace

TEST_CASE("l2 prefetch: add() keeps aligned ranges of whole 16-byte granules, at most six") {
  fn::L2Prefetch l;
  CHECK_FALSE(l.add(nullptr, 4096));
  CHECK_FALSE(l.add(at(0x1000), 0));
  CHECK_FALSE(l.add(at(0x1008), 4096));  // not 16-byte aligned
  CHECK_FALSE(l.add(at(0x1000), 4104));  // not a multiple of 16 bytes
  CHECK(l.count == 0);
  for (int i = 0; i < fn::L2Prefetch::kMaxRanges; ++i) CHECK(l.add(at(0x100000 * (i + 1)), 16));
  CHECK_FALSE(l.add(at(0x900000), 16));  // full
  CHECK(l.count == fn::L2Prefetch::kMaxRanges);
  for (int i = 0; i < fn::L2Prefetch::kMaxRanges; ++i) CHECK(l.bytes[i] == 16u);
}

TEST_CASE("l2 prefetch: the parts cover every range exactly once in chunks of at most 64 KiB") {
  constexpr uint64_t K = fn::kL2PrefetchChunk;
  REQUIRE(K == 65536);
  // Real weight sizes at TP=1 (an HC read's W_dn 324 x 10240, W_up 10240 x 320 and norm 10240,
  // the router 513 x 2560, all BF16) and edge sizes: one granule, one chunk and a granule.
  const std::vector<uint64_t> sizes = {
      324ull * 10240 * 2, 10240ull * 320 * 2, 10240ull * 2, 513ull * 2560 * 2, 16, K + 16};
  fn::L2Prefetch l;
  uintptr_t base = 0x7f0000000000;
  std::vector<uintptr_t> begins;
  for (uint64_t n : sizes) {
    REQUIRE(l.add(at(base), n));
    begins.push_back(base);
    base += (n + 0xfffff) / 0x100000 * 0x100000 + 0x100000;  // disjoint, 1 MiB apart
  }
  uint64_t want_chunks = 0;
  for (uint64_t n : sizes) want_chunks += (n + K - 1) / K;
  CHECK(want_chunks == 102 + 100 + 1 + 41 + 1 + 2);

  for (unsigned parts : {1u, 3u, 130u, 256u, 800u}) {
    CAPTURE(parts);
    std::map<uintptr_t, uint32_t> seen;  // chunk start -> bytes
    uint64_t issued = 0;
    for (unsigned part = 0; part < parts; ++part) {
      const std::vector<Chunk> cs = chunks_of(l, part, parts);
      for (std::size_t i = 0; i < cs.size(); ++i) {
        CHECK(cs[i].bytes >= 16);
        CHECK(cs[i].bytes <= K);
        CHECK(cs[i].bytes % 16 == 0);
        if (i > 0) CHECK(cs[i].begin > cs[i - 1].begin);       // increasing order within a part
        CHECK(seen.emplace(cs[i].begin, cs[i].bytes).second);  // no chunk issued twice
      }
      issued += cs.size();
    }
    CHECK(issued == want_chunks);
    // Every range is tiled: consecutive chunks from its start to its end, no gap, no overlap.
    for (std::size_t r = 0; r < sizes.size(); ++r) {
      uint64_t off = 0;
      while (off < sizes[r]) {
        const auto it = seen.find(begins[r] + off);
        REQUIRE(it != seen.end());
        CHECK(it->second == (sizes[r] - off < K ? sizes[r] - off : K));
        off += it->second;
      }
      CHECK(off == sizes[r]);
    }
  }
  // Chunk c belongs to part c % parts: with 7 parts, part 2 issues chunks 2, 9, 16, ... — the
  // third, tenth, ... chunk of the first range.
  const std::vector<Chunk> p2 = chunks_of(l, 2, 7);
  REQUIRE(p2.size() >= 2);
  CHECK(p2[0].begin == begins[0] + 2 * K);
  CHECK(p2[1].begin == begins[0] + 9 * K);
  // An empty list issues nothing.
  CHECK(chunks_of(fn::L2Prefetch{}, 0, 1).empty());
}
