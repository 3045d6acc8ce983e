#include <doctest/doctest.h>

#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <map>
#include <string>

#include "core/config.h"
#include "core/error.h"
#include "core/model_tensors.h"
#include "core/shard_plan.h"

namespace {

using nlohmann::json;
const char* kReal = FN_SOURCE_DIR "/configs/qwen3.8-flash-next.json";
const char* kTiny = FN_SOURCE_DIR "/configs/tiny.json";
const std::string kP = "model.language_model.";

struct Model {
  fn::ModelConfig cfg;
  fn::QuantConfig quant;
};

Model load(const char* path) {
  std::ifstream in(path);
  json j = json::parse(in);
  return {fn::parse_model_config(j, path),
          fn::parse_quantization_config(j["quantization_config"], path)};
}

const Model& real_model() {
  static const Model m = load(kReal);
  return m;
}

/// Plans of the real model, built once per TP size (building one takes a few seconds in Debug).
const fn::ShardPlan& real_plan(int tp) {
  static std::map<int, fn::ShardPlan> plans;
  auto it = plans.find(tp);
  if (it == plans.end()) {
    it = plans.emplace(tp, fn::ShardPlan::build(real_model().cfg, real_model().quant, tp)).first;
  }
  return it->second;
}

/// [rows, cols] view of a shape, computed here independently of the plan.
std::pair<int64_t, int64_t> view(const std::vector<int64_t>& s) {
  if (s.empty()) return {1, 1};
  int64_t rows = 1;
  for (std::size_t i = 0; i + 1 < s.size(); ++i) rows *= s[i];
  return s.size() == 1 ? std::pair<int64_t, int64_t>{s[0], 1}
                       : std::pair<int64_t, int64_t>{rows, s.back()};
}

/// How many ranks must hold each element, from docs/model.md E.2 (not from the plan).
int expected_count(const fn::ExpectedTensor& t, const fn::ModelConfig& c, int tp) {
  using R = fn::TensorRole;
  switch (t.role) {
    case R::Embedding:
    case R::HcNorm:
    case R::HcDown:
    case R::HcUp:
    case R::HcInject:
    case R::Router:
    case R::SharedExpertGate:
    case R::QsaQNorm:
    case R::QsaKNorm:
    case R::IndexerQkProj:
    case R::IndexerQNorm:
    case R::IndexerKNorm:
    case R::GdnNorm:
    case R::PleKeyProj:
    case R::PleValueProj:
    case R::PleNormKey:
    case R::PleNormQuery:
    case R::PleNormConv:
    case R::PleConv:
    case R::PleMultipliers:
    case R::PleHeadSizes:
    case R::PleHeadOffsets:
    case R::PleNgramScale:
    case R::ExpertGlobalScale:
    case R::ExpertInputScale:
      return tp;
    case R::QsaKProj:
    case R::QsaVProj:
      return tp > c.num_key_value_heads ? static_cast<int>(tp / c.num_key_value_heads) : 1;
    default:
      return 1;
  }
}

/// Checks that the ranks' blocks cover every element of tensor `i` exactly `want` times, by
/// counting over the grid of all block boundaries (each grid cell is a set of elements that
/// every block either fully covers or misses). Returns the problem or "".
std::string tiling_problem(const fn::ShardPlan& plan, std::size_t i, int want) {
  const fn::ExpectedTensor& t = plan.tensors()[i];
  const auto [rows, cols] = view(t.shape);
  std::vector<fn::SliceBlock> blocks;
  for (int r = 0; r < plan.tp_size(); ++r) {
    const fn::TensorShard s = plan.shard(i, r);
    if (s.replication != want) {
      return fmt::format("{}: replication {} != {}", t.name, s.replication, want);
    }
    if (s.replicated != (want == plan.tp_size() && plan.tp_size() > 1) && plan.tp_size() > 1 &&
        s.split != fn::SplitKind::KvHeadRows) {
      return fmt::format("{}: replicated flag {}", t.name, s.replicated);
    }
    if (plan.shard_elements(i, r) != s.elements()) {
      return fmt::format("{}: shard_elements {} != {}", t.name, plan.shard_elements(i, r),
                         s.elements());
    }
    blocks.insert(blocks.end(), s.blocks.begin(), s.blocks.end());
  }
  std::vector<int64_t> rb{0, rows}, cb{0, cols};
  for (const auto& b : blocks) {
    if (b.row_begin < 0 || b.col_begin < 0 || b.row_count <= 0 || b.col_count <= 0 ||
        b.row_begin + b.row_count > rows || b.col_begin + b.col_count > cols) {
      return fmt::format("{}: block [{}, +{}) x [{}, +{}) outside [{}, {}]", t.name, b.row_begin,
                         b.row_count, b.col_begin, b.col_count, rows, cols);
    }
    rb.push_back(b.row_begin);
    rb.push_back(b.row_begin + b.row_count);
    cb.push_back(b.col_begin);
    cb.push_back(b.col_begin + b.col_count);
  }
  for (auto* v : {&rb, &cb}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  const std::size_t nc = cb.size() - 1;
  std::vector<int> count((rb.size() - 1) * nc, 0);
  auto idx = [](const std::vector<int64_t>& v, int64_t x) {
    return static_cast<std::size_t>(std::lower_bound(v.begin(), v.end(), x) - v.begin());
  };
  for (const auto& b : blocks) {
    for (std::size_t ri = idx(rb, b.row_begin); ri < idx(rb, b.row_begin + b.row_count); ++ri) {
      for (std::size_t ci = idx(cb, b.col_begin); ci < idx(cb, b.col_begin + b.col_count); ++ci) {
        ++count[ri * nc + ci];
      }
    }
  }
  for (std::size_t k = 0; k < count.size(); ++k) {
    if (count[k] != want) {
      return fmt::format("{}: rows [{}, {}) cols [{}, {}) held {} times, expected {}", t.name,
                         rb[k / nc], rb[k / nc + 1], cb[k % nc], cb[k % nc + 1], count[k], want);
    }
  }
  return "";
}

void check_all_tilings(const fn::ShardPlan& plan, const Model& m, int tp) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < plan.tensors().size(); ++i) {
    const std::string p = tiling_problem(plan, i, expected_count(plan.tensors()[i], m.cfg, tp));
    if (!p.empty() && bad++ < 5) FAIL_CHECK(p);
  }
  CHECK(bad == 0);
}

std::string gib(uint64_t b) {
  return fmt::format("{:.3f} GiB", static_cast<double>(b) / (1ull << 30));
}

void print_bytes(const char* label, const fn::ShardPlan& plan, const Model& m, int tp,
                 int64_t ctx) {
  for (int r = 0; r < tp; ++r) {
    const fn::TokenBytes tb = fn::bytes_per_token(plan, m.cfg, r, ctx);
    std::string fam;
    for (const auto& [f, b] : plan.weight_bytes_by_family(r)) fam += fmt::format(" {}={}", f, b);
    fmt::print(
        "{} TP={} rank {}: weights {} ({} B;{}); per token at ctx {}: {} B (weights {}, "
        "kv {}, indexer {}, gdn state {}, conv {})\n",
        label, tp, r, gib(plan.weight_bytes(r)), plan.weight_bytes(r), fam, ctx, tb.total(),
        tb.weight_total(), tb.kv_cache, tb.indexer_cache, tb.gdn_state, tb.conv_state);
  }
}

bool same(const fn::SliceBlock& b, int64_t r0, int64_t rn, int64_t c0, int64_t cn) {
  return b.row_begin == r0 && b.row_count == rn && b.col_begin == c0 && b.col_count == cn;
}

}  // namespace

TEST_CASE(
    "shard plan: every real-geometry tensor is tiled exactly once (or tp times if replicated)") {
  for (int tp : {1, 2, 4, 8}) {
    CAPTURE(tp);
    check_all_tilings(real_plan(tp), real_model(), tp);
  }
}

TEST_CASE("shard plan: the BF16 layout (fused experts, BF16 n-gram table) tiles exactly too") {
  Model m = load(kReal);
  m.cfg.ple_embedding_dtype.reset();
  m.quant = fn::QuantConfig{};
  for (int tp : {1, 2, 4, 8}) {
    CAPTURE(tp);
    check_all_tilings(fn::ShardPlan::build(m.cfg, m.quant, tp), m, tp);
  }
  const fn::ShardPlan plan = fn::ShardPlan::build(m.cfg, m.quant, 4);
  const fn::TensorShard s = plan.shard(kP + "layers.0.mlp.experts.gate_up_proj", 1);
  REQUIRE(s.blocks.size() == 1024);
  CHECK(same(s.blocks[0], 160, 160, 0, 2560));        // expert 0 gate rows
  CHECK(same(s.blocks[1], 640 + 160, 160, 0, 2560));  // expert 0 up rows
  CHECK(same(s.blocks[2], 1280 + 160, 160, 0, 2560));
  CHECK(same(plan.shard(kP + "layers.0.mlp.experts.down_proj", 1).blocks.at(0), 0, 512 * 2560, 160,
             160));
}

TEST_CASE("shard plan: the tiny config tiles exactly, counted element by element") {
  const Model m = load(kTiny);
  for (int tp : {1, 2}) {
    CAPTURE(tp);
    const fn::ShardPlan plan = fn::ShardPlan::build(m.cfg, m.quant, tp);
    for (std::size_t i = 0; i < plan.tensors().size(); ++i) {
      const auto& t = plan.tensors()[i];
      const auto [rows, cols] = view(t.shape);
      std::vector<int> count(static_cast<std::size_t>(rows * cols), 0);
      for (int r = 0; r < tp; ++r) {
        for (const auto& b : plan.shard(i, r).blocks) {
          for (int64_t y = b.row_begin; y < b.row_begin + b.row_count; ++y) {
            for (int64_t x = b.col_begin; x < b.col_begin + b.col_count; ++x) {
              REQUIRE(y < rows);
              REQUIRE(x < cols);
              ++count[static_cast<std::size_t>(y * cols + x)];
            }
          }
        }
      }
      const int want = expected_count(t, m.cfg, tp);
      const bool all = std::all_of(count.begin(), count.end(), [&](int c) { return c == want; });
      if (!all) FAIL_CHECK(t.name << " not covered " << want << " times");
    }
    check_all_tilings(plan, m, tp);
  }
}

TEST_CASE("shard plan: hand-checked slices of the real model at TP=4 (docs/model.md E.2)") {
  const fn::ShardPlan& plan = real_plan(4);
  auto blocks = [&](const std::string& name, int r) { return plan.shard(kP + name, r).blocks; };
  auto qkv = blocks("layers.0.linear_attn.in_proj_qkv.weight", 1);
  REQUIRE(qkv.size() == 3);
  CHECK(same(qkv[0], 512, 512, 0, 2560));
  CHECK(same(qkv[1], 2560, 512, 0, 2560));
  CHECK(same(qkv[2], 5632, 1536, 0, 2560));
  auto conv = blocks("layers.0.linear_attn.conv1d.weight", 1);
  REQUIRE(conv.size() == 3);
  CHECK(same(conv[2], 5632, 1536, 0, 4));
  CHECK(same(blocks("layers.4.linear_attn.in_proj_z.weight", 2).at(0), 3072, 1536, 0, 2560));
  CHECK(same(blocks("layers.4.linear_attn.in_proj_a.weight", 3).at(0), 36, 12, 0, 2560));
  CHECK(same(blocks("layers.4.linear_attn.A_log", 3).at(0), 36, 12, 0, 1));
  CHECK(same(blocks("layers.4.linear_attn.out_proj.weight", 1).at(0), 0, 2560, 1536, 1536));
  CHECK(same(blocks("layers.3.self_attn.q_proj.weight", 2).at(0), 6144, 3072, 0, 2560));
  CHECK(same(blocks("layers.3.self_attn.k_proj.weight", 1).at(0), 0, 256, 0, 2560));
  CHECK(same(blocks("layers.3.self_attn.v_proj.weight", 2).at(0), 256, 256, 0, 2560));
  CHECK(plan.shard(kP + "layers.3.self_attn.k_proj.weight", 2).replication == 2);
  CHECK(same(blocks("layers.3.self_attn.o_proj.weight", 3).at(0), 0, 2560, 4608, 1536));
  CHECK(same(blocks("layers.5.mlp.shared_expert.up_proj.weight", 2).at(0), 320, 160, 0, 2560));
  CHECK(same(blocks("layers.5.mlp.shared_expert.down_proj.weight", 2).at(0), 0, 2560, 320, 160));
  CHECK(same(blocks("layers.5.mlp.experts.9.gate_proj.weight", 1).at(0), 160, 160, 0, 1280));
  CHECK(same(blocks("layers.5.mlp.experts.9.up_proj.weight_scale", 1).at(0), 160, 160, 0, 160));
  CHECK(same(blocks("layers.5.mlp.experts.9.down_proj.weight", 1).at(0), 0, 2560, 80, 80));
  CHECK(same(blocks("layers.5.mlp.experts.9.down_proj.weight_scale", 1).at(0), 0, 2560, 10, 10));
  CHECK(plan.shard(kP + "layers.5.mlp.experts.9.down_proj.weight_scale_2", 1).replicated);
  CHECK(same(plan.shard("lm_head.weight", 3).blocks.at(0), 186240, 62080, 0, 2560));
  CHECK(plan.shard(kP + "embed_tokens.weight", 2).replicated);
  CHECK(plan.shard(kP + "layers.3.self_attn.indexer.index_qk_proj.weight", 2).replicated);
  CHECK(plan.shard(kP + "layers.8.mlp.gate.weight", 2).replicated);
  const std::string ng = "layers.1.ple.ple_embedding.ngram_embedding.";
  CHECK(same(blocks(ng + "shard_40.weight", 1).at(0), 0, 2500012, 0, 160));
  CHECK(blocks(ng + "shard_40.weight", 0).empty());
  CHECK(blocks(ng + "shard_40.weight", 2).empty());
  CHECK(blocks(ng + "shard_127.weight", 3).size() == 1);
  CHECK(plan.shard(kP + ng + "weight_scale", 0).replicated);
  // TP=8: rank 5 uses KV head ⌊2·5/8⌋ = 1, shared by 4 ranks.
  const fn::ShardPlan& p8 = real_plan(8);
  const fn::TensorShard k8 = p8.shard(kP + "layers.3.self_attn.k_proj.weight", 5);
  CHECK(same(k8.blocks.at(0), 256, 256, 0, 2560));
  CHECK(k8.replication == 4);
  CHECK(same(p8.shard(kP + "layers.3.self_attn.k_proj.weight", 3).blocks.at(0), 0, 256, 0, 2560));
}

TEST_CASE("shard plan: weights and bytes per token per rank match hand computation (real, TP=4)") {
  const Model& m = real_model();
  const fn::ShardPlan& plan = real_plan(4);
  // One expert: 3 × (codes 640·1280 + scales 640·160) bytes + 6 F32 scalars; TP=4 holds a quarter
  // of the codes and scales and all scalars.
  const uint64_t expert_rank = 3ull * (640 * 1280 + 640 * 160) / 4 + 6 * 4;
  const uint64_t hc_module = 2ull * (10240 + 2 * 320 * 10240 + 4 * 10240);
  const uint64_t hc = 96 * hc_module + 2ull * (10240 + 2 * 320 * 10240);
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    const auto fam = plan.weight_bytes_by_family(r);
    CHECK(fam.at("moe.experts") ==
          expert_rank * 512 * 48);  // 16.99 GB, docs/model.md E.2 "17.0 GB"
    CHECK(fam.at("hc") == hc);      // 1.28 GB
    CHECK(fam.at("embed") == 248320ull * 2560 * 2);
    CHECK(fam.at("lm_head") == 62080ull * 2560 * 2);
    CHECK(fam.at("ple.ngram") == 32ull * 2500012 * 160 + 2);  // 32 FP8 shards + the BF16 scale
    uint64_t sum = 0;
    for (const auto& [f, b] : fam) sum += b;
    CHECK(plan.weight_bytes(r) == sum);

    const fn::TokenBytes tb = fn::bytes_per_token(plan, m.cfg, r, 8192);
    CHECK(tb.weights.at("moe.experts") == expert_rank * 10 * 48);  // 0.33 GB
    CHECK(tb.weights.at("hc") == hc);
    CHECK(tb.weights.at("embed") == 2560 * 2);
    CHECK(tb.weights.at("lm_head") == 62080ull * 2560 * 2);
    CHECK(tb.weights.at("ple.ngram") == 16 * 160 / 4 + 2);  // 4 of the 16 rows, expected
    // KV: one local head, 2051 selected rows read + 1 written, K and V BF16, 12 layers.
    CHECK(tb.kv_cache == 12ull * (2051 + 1) * 256 * 2 * 2);
    // Indexer: 2048 pooled keys + 0 tail + 1 raw write + 5/4 amortized block rows, 256 B each.
    CHECK(tb.indexer_cache == 12ull * (256 * (2048 + 0 + 1) + 320));
    CHECK(tb.gdn_state == 36ull * 12 * 128 * 128 * 4 * 2);
    CHECK(tb.conv_state == 36ull * 2560 * 4 * 2 + 10240 * 4 * 2);
  }
  // Short context: dense attention over all ctx tokens.
  const fn::TokenBytes small = fn::bytes_per_token(plan, m.cfg, 0, 100);
  CHECK(small.kv_cache == 12ull * 101 * 256 * 2 * 2);
  CHECK(small.indexer_cache == 12ull * (256 * (25 + 0 + 1) + 320));
  CHECK_THROWS_AS(fn::bytes_per_token(plan, m.cfg, 0, 0), fn::Error);
}

TEST_CASE("shard plan: bytes of a batched step match hand computation (real, TP=4)") {
  const Model& m = real_model();
  const fn::ShardPlan& plan = real_plan(4);
  const uint64_t expert_rank = 3ull * (640 * 1280 + 640 * 160) / 4 + 6 * 4;
  const fn::TokenBytes tb = fn::bytes_per_token(plan, m.cfg, 1, 8192);
  const fn::StepBytes one = fn::bytes_per_step(plan, m.cfg, 1, 8192, 1);
  CHECK(one.total() == tb.total());
  CHECK(one.distinct_experts == doctest::Approx(10.0));
  for (const int64_t b : {8, 32, 64}) {
    CAPTURE(b);
    const fn::StepBytes sb = fn::bytes_per_step(plan, m.cfg, 1, 8192, b);
    const double touched = 1.0 - std::pow(1.0 - 10.0 / 512.0, static_cast<double>(b));
    CHECK(sb.distinct_experts == doctest::Approx(512.0 * touched));
    // Rounded to whole bytes: within one byte of the hand value.
    const double want = static_cast<double>(expert_rank * 512 * 48) * touched;
    CHECK(std::fabs(static_cast<double>(sb.experts) - want) <= 1.0);
    const uint64_t per_seq = 2560 * 2 + (16 * 160 / 4 + 2) + tb.state_total();
    CHECK(sb.per_sequence == per_seq);
    CHECK(sb.shared_weights ==
          tb.weight_total() - expert_rank * 10 * 48 - 2560 * 2 - (16 * 160 / 4 + 2));
    CHECK(sb.total() == sb.shared_weights + sb.experts + per_seq * static_cast<uint64_t>(b));
  }
  // 64 sequences touch about 367.1 of 512 experts per layer (512 (1 - (502/512)^64)).
  CHECK(fn::bytes_per_step(plan, m.cfg, 0, 8192, 64).distinct_experts ==
        doctest::Approx(367.1127).epsilon(1e-6));
  CHECK_THROWS_AS(fn::bytes_per_step(plan, m.cfg, 0, 8192, 0), fn::Error);
}

TEST_CASE("shard plan: bytes per rank for the real geometry at TP 1, 2, 4, 8 (printed)") {
  const Model& m = real_model();
  uint64_t previous = 0;
  for (int tp : {1, 2, 4, 8}) {
    const fn::ShardPlan& plan = real_plan(tp);
    print_bytes("real", plan, m, tp, 8192);
    const uint64_t w = plan.weight_bytes(0);
    for (int r = 1; r < tp; ++r) CHECK(plan.weight_bytes(r) == w);  // the plan is balanced
    if (previous) CHECK(w < previous);
    previous = w;
  }
  const fn::ShardPlan& p1 = real_plan(1);
  // TP=1 holds the whole text checkpoint.
  uint64_t all = 0;
  for (const auto& t : p1.tensors()) all += t.nbytes();
  CHECK(p1.weight_bytes(0) == all);
  const Model tiny = load(kTiny);
  print_bytes("tiny", fn::ShardPlan::build(tiny.cfg, tiny.quant, 2), tiny, 2, 64);
}

TEST_CASE("shard plan: unsupported TP sizes are usage errors naming the constraint") {
  const Model& real = real_model();
  const Model tiny = load(kTiny);
  auto usage = [](const Model& m, int tp) -> std::string {
    try {
      fn::ShardPlan::build(m.cfg, m.quant, tp);
    } catch (const fn::Error& e) {
      CHECK(e.kind() == fn::ErrorKind::Usage);
      return e.what();
    }
    return "";
  };
  CHECK(usage(real, 3) == "tp_size must be 1, 2, 4 or 8, got 3");
  CHECK(usage(real, 16) == "tp_size must be 1, 2, 4 or 8, got 16");
  CHECK(usage(tiny, 4) == "tp_size 4 must divide linear_num_key_heads (2)");
  Model odd = real;
  odd.cfg.moe_intermediate_size = 608;
  CHECK(usage(odd, 4) ==
        "moe_intermediate_size / tp_size (608 / 4) must be a multiple of 16 (one NVFP4 scale "
        "block)");
  Model heads = real;
  heads.cfg.num_attention_heads = 12;
  heads.cfg.num_key_value_heads = 3;
  CHECK(usage(heads, 8) == "tp_size 8 must divide num_attention_heads (12)");
  CHECK(usage(heads, 2) == "tp_size 2 and num_key_value_heads (3) must divide one another");
  CHECK(usage(real, 8).empty());
}
