// prefill_flops (core/flops.h) on configs/qwen3.8-flash-next.json against values computed by
// hand from docs/model.md's shapes (D 2560, W 10240, r 320; 36 GDN layers of 16 key / 48 value
// heads of 128; 12 QSA layers of 24 query / 2 KV heads of 256 and 4 indexer heads of 128, 512
// blocks of 4 in the budget; 512 experts, top 10, widths 640; one PLE layer; vocab 248,320).
#include <doctest/doctest.h>

#include <string>

#include "core/config.h"
#include "core/error.h"
#include "core/flops.h"

namespace {

fn::ModelConfig real() {
  return fn::load_model_config(FN_SOURCE_DIR "/configs/qwen3.8-flash-next.json");
}

}  // namespace

TEST_CASE("prefill_flops: one token at position 0, the last row's logits") {
  const fn::PrefillFlops f = fn::prefill_flops(real(), 0, 1, 1);
  // hc: 48 layers x 2 reads x (2·10240·320·2 + 2·4·10240) + the final mixer's 2·10240·320·2.
  CHECK(f.of("hc") == 48.0 * 2 * (13107200 + 81920) + 13107200);
  // gdn: 36 x (2·2560·16480 + 2·6144·2560 + 7·48·128·128).
  CHECK(f.of("gdn") == 36.0 * (84377600 + 31457280 + 5505024));
  // qsa: 12 x (2·2560·13952 + 2·6144·2560 + 4·24·256 x 1 visible token); no complete block.
  CHECK(f.of("qsa") == 12.0 * (71434240 + 31457280 + 24576));
  CHECK(f.of("router") == 48.0 * 2 * 2560 * 512);
  CHECK(f.of("moe_routed") == 48.0 * 10 * 6 * 2560 * 640);
  CHECK(f.of("shared_expert") == 48.0 * (6 * 2560 * 640 + 2 * 2560));
  CHECK(f.of("ple") == 2.0 * 2560 * 10240 + 2.0 * 2560 * 2560);
  CHECK(f.of("lm_head") == 2.0 * 2560 * 248320);
  CHECK(f.of("not a family") == 0);
  CHECK(fn::prefill_flops(real(), 0, 1, 0).of("lm_head") == 0);
}

TEST_CASE("prefill_flops: QSA attends every visible token up to 512 blocks, then the budget") {
  const fn::ModelConfig c = real();
  const double proj = 12.0 * (71434240 + 31457280);
  // Position 2050: 2051 visible tokens, 512 complete blocks: all 2051 attended.
  CHECK(fn::prefill_flops(c, 2050, 1, 0).of("qsa") == proj + 12.0 * (24576 * 2051 + 1024 * 512));
  // Position 2051: 2052 tokens, 513 blocks: 512 blocks of 4 plus an empty tail.
  CHECK(fn::prefill_flops(c, 2051, 1, 0).of("qsa") == proj + 12.0 * (24576 * 2048 + 1024 * 513));
  // Position 2053: 2054 tokens, 513 blocks and a tail of 2.
  CHECK(fn::prefill_flops(c, 2053, 1, 0).of("qsa") == proj + 12.0 * (24576 * 2050 + 1024 * 513));
  // A pass is the sum of its tokens.
  CHECK(fn::prefill_flops(c, 2050, 4, 0).of("qsa") ==
        doctest::Approx(fn::prefill_flops(c, 2050, 1, 0).of("qsa") +
                        fn::prefill_flops(c, 2051, 1, 0).of("qsa") +
                        fn::prefill_flops(c, 2052, 1, 0).of("qsa") +
                        fn::prefill_flops(c, 2053, 1, 0).of("qsa"))
            .epsilon(1e-15));
}

TEST_CASE("prefill_flops: an 8,192-token prompt is about 105 TFLOP, most of it experts and GDN") {
  const fn::PrefillFlops f = fn::prefill_flops(real(), 0, 8192, 1);
  // The routed experts: 8192 x 48 x 10 x 6 x 2560 x 640 exactly.
  CHECK(f.of("moe_routed") == 38654705664000.0);
  CHECK(f.total() == doctest::Approx(104.798e12).epsilon(1e-5));
  CHECK_THROWS_AS(fn::prefill_flops(real(), 0, 4, 5), fn::Error);
  CHECK_THROWS_AS(fn::prefill_flops(real(), -1, 4, 1), fn::Error);
}
