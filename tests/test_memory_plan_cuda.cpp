// core/memory_plan's QSA workspace estimate (recomputed without CUDA) against the workspace the
// CUDA launcher really asks for (cuda/kernels/qsa.h qsa_decode_workspace_bytes, a pure host function: no
// GPU needed), for every rank of the real geometry at TP 1, 2, 4 and 8.
#include <doctest/doctest.h>

#include <cstdint>

#include "core/config.h"
#include "core/memory_plan.h"
#include "cuda/kernels/qsa.h"

TEST_CASE(
    "memory plan: the QSA workspace estimate equals qsa_decode_workspace_bytes on every "
    "rank of the real geometry") {
  const fn::ModelConfig c = fn::load_model_config(FN_SOURCE_DIR "/configs/qwen3.8-flash-next.json");
  for (int tp : {1, 2, 4, 8}) {
    for (int r = 0; r < tp; ++r) {
      for (int64_t t : {int64_t{1}, int64_t{3}, int64_t{4}, int64_t{100}, int64_t{2051},
                        int64_t{2052}, int64_t{8192}, int64_t{65536}, int64_t{262144}}) {
        CAPTURE(tp);
        CAPTURE(r);
        CAPTURE(t);
        // The launch shape of cuda/model/cuda_model.cpp's qsa_shape for this rank.
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
