#include <doctest/doctest.h>

#include <array>
#include <vector>

#include "core/config.h"
#include "core/ngram.h"

namespace {
fn::ModelConfig real() {
  return fn::load_model_config(FN_SOURCE_DIR "/configs/qwen3.8-flash-next.json");
}
fn::ModelConfig tiny() {
  return fn::load_model_config(FN_SOURCE_DIR "/configs/tiny.json");
}
using V = std::vector<int64_t>;
}  // namespace

TEST_CASE("ngram: splitmix64 matches the reference generator's first outputs") {
  // splitmix64 state 0: the published first outputs of the reference generator (Vigna).
  CHECK(fn::splitmix64(0) == 0xE220A8397B1DCDAFULL);
  CHECK(fn::splitmix64(0x9E3779B97F4A7C15ULL) == 0x6E789E6AA1B965F4ULL);
}

TEST_CASE(
    "ngram: real-model multipliers, head sizes, offsets and rows are those of docs/model.md C.4") {
  const fn::ModelConfig c = real();
  CHECK(fn::ngram_multipliers(c, 0) == V{23703573157769, 20109073645365, 8052911324071});
  CHECK(fn::ngram_head_sizes(c, 0) == V{20000003, 20000023, 20000033, 20000047, 20000059, 20000063,
                                        20000069, 20000077, 20000081, 20000093, 20000107, 20000147,
                                        20000153, 20000159, 20000161, 20000171});
  CHECK(fn::ngram_head_offsets(c, 0) == V{0, 20000003, 40000026, 60000059, 80000106, 100000165,
                                          120000228, 140000297, 160000374, 180000455, 200000548,
                                          220000655, 240000802, 260000955, 280001114, 300001275});
  CHECK(fn::ngram_padded_rows(c, 0) == 320001536);
  CHECK(c.ngram_table_rows() == 320001536);
  CHECK(c.ngram_table_rows() / c.split_ngram_parts == 2500012);
}

TEST_CASE("ngram: the two real-model id test vectors of docs/model.md C.4") {
  const fn::ModelConfig c = real();
  const fn::NgramConstants k = fn::ngram_constants(c, 0);
  CHECK(k.eos == 248044);
  std::array<int64_t, 16> ids{};
  fn::ngram_ids(k, 248044, 248044, 9707, ids.data());
  CHECK(std::vector<int64_t>(ids.begin(), ids.end()) ==
        V{16410909, 39682429, 55103279, 60931720, 87006904, 116506179, 131512017, 152932897,
          169641436, 182022480, 209277433, 237891023, 256841529, 277007269, 290665954, 300984276});
  fn::ngram_ids(k, 11, 248044, 1234, ids.data());
  CHECK(std::vector<int64_t>(ids.begin(), ids.end()) ==
        V{3266289, 31842795, 49880168, 71331483, 96474550, 118988757, 123509793, 150937574,
          179212937, 187581286, 200233969, 236168836, 243277540, 271617309, 294670876, 311989426});
}

TEST_CASE("ngram: context (11, EOS) hashes like (EOS, EOS) because everything behind EOS is EOS") {
  const fn::NgramConstants k = fn::ngram_constants(real(), 0);
  std::array<int64_t, 16> a{}, b{}, c{};
  fn::ngram_ids(k, 11, 248044, 1234, a.data());
  fn::ngram_ids(k, 248044, 248044, 1234, b.data());
  CHECK(a == b);
  // Without EOS in the context the trigram heads see c0: (11, 5) differs from (12, 5) there only.
  fn::ngram_ids(k, 11, 5, 1234, a.data());
  fn::ngram_ids(k, 12, 5, 1234, c.data());
  for (int h = 0; h < 8; ++h) CHECK(a[h] == c[h]);
  int differ = 0;
  for (int h = 8; h < 16; ++h) differ += a[h] != c[h];
  CHECK(differ == 8);
  // A current token equal to EOS does not change the shift of the context.
  fn::ngram_ids(k, 11, 5, 248044, a.data());
  const int64_t ctx[2] = {11, 5};
  std::array<int64_t, 16> d{};
  fn::ngram_ids(k, std::span<const int64_t>(ctx, 2), 248044, d);
  CHECK(a == d);
}

TEST_CASE(
    "ngram: ids hand-computed from the constants (bigram and trigram mix, floor-mod, offsets)") {
  const fn::NgramConstants k = fn::ngram_constants(real(), 0);
  std::array<int64_t, 16> ids{};
  const int64_t s0 = 100, s1 = 200, s2 = 300;
  fn::ngram_ids(k, s2, s1, s0, ids.data());
  const int64_t b = (s0 * k.multipliers[0]) ^ (s1 * k.multipliers[1]);
  const int64_t g = b ^ (s2 * k.multipliers[2]);
  for (int h = 0; h < 16; ++h) {
    const int64_t mix = h < 8 ? b : g;
    CHECK(ids[h] == mix % k.head_sizes[h] + k.head_offsets[h]);
    CHECK(ids[h] >= k.head_offsets[h]);
    CHECK(ids[h] < k.head_offsets[h] + k.head_sizes[h]);
    CHECK(ids[h] < k.table_rows);
  }
}

TEST_CASE("ngram: tiny config constants are those of docs/model.md G.3") {
  const fn::ModelConfig c = tiny();
  CHECK(fn::ngram_multipliers(c, 0) == V{4295158889763781, 17440218147737327, 1270917961434445});
  CHECK(fn::ngram_head_sizes(c, 0) == V{1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049});
  CHECK(fn::ngram_head_offsets(c, 0) == V{0, 1009, 2022, 3041, 4062, 5093, 6126, 7165});
  CHECK(7165 + 1049 == 8214);
  CHECK(fn::ngram_padded_rows(c, 0) == 8216);
  const fn::NgramConstants k = fn::ngram_constants(c, 0);
  CHECK(k.eos == 7);
  std::array<int64_t, 8> ids{};
  fn::ngram_ids(k, 7, 7, 500, ids.data());
  for (int h = 0; h < 8; ++h) CHECK(ids[h] < 8216);
}

TEST_CASE("ngram: a second PLE layer uses the next 16 primes and base seed + 10007") {
  fn::ModelConfig c = tiny();
  const V first = fn::ngram_head_sizes(c, 0);
  const V second = fn::ngram_head_sizes(c, 1);
  CHECK(second.front() == 1051);  // the prime after 1049
  CHECK(second.size() == 8);
  fn::ModelConfig shifted = c;
  shifted.seed = c.seed + 10007;
  CHECK(fn::ngram_multipliers(c, 1) == fn::ngram_multipliers(shifted, 0));
  CHECK(fn::ngram_multipliers(c, 1) != fn::ngram_multipliers(c, 0));
}
