// core/memory_plan's QSA workspace estimate (recomputed without CUDA) against the workspace the
// CUDA launcher really asks for (cuda/kernels/qsa.h qsa_decode_workspace_bytes, a pure host
// function: no GPU needed), for every rank of the real geometry at TP 1, 2, 4 and 8 and of the test
// fixtures' shapes: the CUDA model allocates the estimate (core/device_layout.h) and refuses to
// load when it is below the launcher's size.
#include <doctest/doctest.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/config.h"
#include "core/memory_plan.h"
#include "cuda/kernels/qsa.h"

namespace {

// The estimate against the launcher for every rank of `c` at TP `tps` and context sizes `ctxs`.
void check_config(const fn::ModelConfig& c, std::initializer_list<int> tps,
                  std::initializer_list<int64_t> ctxs) {
  for (int tp : tps) {
    for (int r = 0; r < tp; ++r) {
      for (int64_t t : ctxs) {
        CAPTURE(tp);
        CAPTURE(r);
        CAPTURE(t);
        CAPTURE(c.source);
        // The launch shape of the CUDA model's qsa_shape (cuda/model/load.cpp) for this rank.
        const int64_t hkv = c.num_key_value_heads, hq_l = c.num_attention_heads / tp;
        const int64_t hkv_l = tp <= hkv ? hkv / tp : 1;
        fn::QsaDecodeParams q;
        q.ctx_size = t;
        q.num_q_heads = static_cast<int>(hq_l);
        q.num_kv_heads = static_cast<int>(hkv_l);
        q.q_head_first = static_cast<int>(r * hq_l);
        q.q_per_kv = static_cast<int>(c.num_attention_heads / hkv);
        q.kv_head_first = static_cast<int>(tp <= hkv ? r * hkv_l : (int64_t{r} * hkv) / tp);
        q.head_dim = static_cast<int>(c.head_dim);
        q.rotary_dim = static_cast<int>(c.rotary_dim());
        q.rope_theta = c.rope_theta;
        q.indexer_heads = static_cast<int>(c.indexer_n_heads);
        q.indexer_head_dim = static_cast<int>(c.indexer_head_dim);
        q.ratio = static_cast<int>(c.indexer_compress_ratio);
        q.block_topk = static_cast<int>(c.indexer_budget / c.indexer_compress_ratio);
        CHECK(fn::qsa_workspace_estimate(c, tp, t) == fn::qsa_decode_workspace_bytes(q));
      }
    }
  }
}

}  // namespace

TEST_CASE(
    "memory plan: the QSA workspace estimate equals qsa_decode_workspace_bytes on every "
    "rank of the real geometry") {
  check_config(fn::load_model_config(FN_SOURCE_DIR "/configs/qwen3.8-flash-next.json"),
               {1, 2, 4, 8}, {1, 3, 4, 100, 2051, 2052, 8192, 65536, 262144});
}

TEST_CASE(
    "memory plan: the QSA workspace estimate equals qsa_decode_workspace_bytes for the test "
    "fixtures' shapes (the CUDA model allocates the estimate)") {
  for (const char* name : {"g3_tiny", "ple2_long", "tp4"}) {
    const fn::ModelConfig c = fn::load_model_config(
        std::string(FN_SOURCE_DIR "/tests/data/fixtures/") + name + "/config.json");
    check_config(c, {1, 2}, {1, 4, 8, 100, 256, 4096});
  }
  check_config(fn::load_model_config(FN_SOURCE_DIR "/tests/data/fixtures/tp4/config.json"), {4},
               {1, 4, 8, 100, 256, 4096});
}
