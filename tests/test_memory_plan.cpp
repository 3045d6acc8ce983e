// core/memory_plan: the CUDA backend's per-rank device memory on the real geometry
// (configs/qwen3.8-flash-next.json) at TP 1, 2 and 4 and 8K / 64K / 256K tokens, against sizes
// computed here by hand from docs/model.md (§A.3, §B.2, §C.0, §E.2), not from the function; the
// refusal message of require_fits; the memory table of `fngen inspect`; the device layout
// (core/device_layout.h) the CUDA model's arena is built from, piece by piece.
#include <doctest/doctest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <map>
#include <string>

#include "core/config.h"
#include "core/device_layout.h"
#include "core/error.h"
#include "core/inspect.h"
#include "core/memory_plan.h"
#include "core/shard_plan.h"

namespace {

using nlohmann::json;
const char* kReal = FN_SOURCE_DIR "/configs/qwen3.8-flash-next.json";
const char* kTiny = FN_SOURCE_DIR "/configs/tiny.json";
constexpr uint64_t kGiB = uint64_t{1} << 30;

struct Model {
  fn::ModelConfig cfg;
  fn::QuantConfig quant;
};

const Model& real_model() {
  static const Model m = [] {
    std::ifstream in(kReal);
    const json j = json::parse(in);
    return Model{fn::parse_model_config(j, kReal),
                 fn::parse_quantization_config(j["quantization_config"], kReal)};
  }();
  return m;
}

const fn::ShardPlan& real_plan(int tp) {
  static std::map<int, fn::ShardPlan> plans;
  auto it = plans.find(tp);
  if (it == plans.end())
    it = plans.emplace(tp, fn::ShardPlan::build(real_model().cfg, real_model().quant, tp)).first;
  return it->second;
}

// The real geometry, written out from docs/model.md §A.2/§A.3 (not read from the config).
constexpr uint64_t D = 2560, V = 248320, E = 512, I = 640, Is = 640, W = 4 * 2560, R = 320, S = 4;
constexpr uint64_t Hq = 24, Hkv = 2, hd = 256, ni = 4, ihd = 128, ratio = 4;
constexpr uint64_t Hk = 16, Hv = 48, dk = 128, dv = 128, conv_dim = 10240, K = 4;
constexpr uint64_t n_layers = 48, n_qsa = 12, n_gdn = 36;
constexpr uint64_t P = 2560, ple_k = 4, dilation = 3, ngram_rows = 320001536, ngram_hd = 160;
constexpr uint64_t BF16 = 2, F32 = 4;

// Weight bytes per family one rank holds on the device at TP `tp` (docs/model.md §B.2 shapes and
// dtypes, §E.2 splits; 1-D norm/conv/A_log/dt_bias and the NVFP4 global scales as FP32;
// input_scale, the I64 buffers and the n-gram weight_scale not on the device).
std::map<std::string, uint64_t> hand_weights(uint64_t tp) {
  const uint64_t hkv_l = tp <= Hkv ? Hkv / tp : 1;
  std::map<std::string, uint64_t> w;
  w["embed"] = V * D * BF16;  // replicated
  w["lm_head"] = V / tp * D * BF16;
  const uint64_t hc_inject = W * BF16 + R * W * BF16 + S * W * BF16 + W * R * BF16;
  const uint64_t hc_final = W * BF16 + R * W * BF16 + W * R * BF16;
  w["hc"] = n_layers * 2 * hc_inject + hc_final;
  w["moe.router"] = n_layers * E * D * BF16;
  w["moe.shared"] = n_layers * (3 * (Is / tp) * D * BF16 + D * BF16);
  const uint64_t il = I / tp;
  const uint64_t per_expert = 2 * il * (D / 2) + 2 * il * (D / 16)  // gate, up: codes + scales
                              + D * (il / 2) + D * (il / 16)        // down: codes + scales
                              + 3 * F32;                            // weight_scale_2 × 3
  w["moe.experts"] = n_layers * E * per_expert;
  const uint64_t gdn_layer = conv_dim / tp * D * BF16 + Hv * dv / tp * D * BF16 +
                             2 * (Hv / tp) * D * BF16 + D * (Hv * dv / tp) * BF16 +
                             2 * (Hv / tp) * F32 + conv_dim / tp * K * F32 + dv * F32;
  w["gdn"] = n_gdn * gdn_layer;
  const uint64_t qsa_layer = Hq * 2 * hd / tp * D * BF16 + 2 * hkv_l * hd * D * BF16 +
                             D * (Hq * hd / tp) * BF16 + 2 * hd * F32 + (ni + 1) * ihd * D * BF16 +
                             2 * ihd * F32;
  w["qsa"] = n_qsa * qsa_layer;
  w["ple"] = S * D * P * BF16 + D * P * BF16 + 3 * W * F32 + W * ple_k * F32;
  w["ple.ngram"] = ngram_rows / tp * ngram_hd * 1;  // FP8 rows of the rank's shards
  return w;
}

struct HandStates {
  uint64_t kv, indexer, gdn, gdn_conv, ple_conv;
};

HandStates hand_states(uint64_t tp, uint64_t ctx) {
  const uint64_t hkv_l = tp <= Hkv ? Hkv / tp : 1;
  HandStates s{};
  s.kv = n_qsa * ctx * hkv_l * hd * BF16 * 2;                       // K and V
  s.indexer = n_qsa * (ctx * ihd * F32 + ctx / ratio * ihd * F32);  // raw + pooled keys
  s.gdn = n_gdn * (Hv / tp) * dk * dv * F32;
  s.gdn_conv = n_gdn * ((2 * Hk * dk + Hv * dv) / tp) * (K - 1) * F32;
  s.ple_conv = W * (ple_k - 1) * dilation * F32;
  return s;
}

uint64_t sum(const std::map<std::string, uint64_t>& m) {
  uint64_t n = 0;
  for (const auto& [k, v] : m) n += v;
  return n;
}

}  // namespace

TEST_CASE("memory plan: the real geometry has 12 QSA and 36 GDN layers, as the formulas assume") {
  const fn::ModelConfig& c = real_model().cfg;
  CHECK(c.num_qsa_layers() == static_cast<int64_t>(n_qsa));
  CHECK(c.num_gdn_layers() == static_cast<int64_t>(n_gdn));
  CHECK(c.gdn_conv_dim() == static_cast<int64_t>(conv_dim));
  CHECK(c.ngram_table_rows() == static_cast<int64_t>(ngram_rows));
  CHECK(c.ple_layer_ids.size() == 1);
}

TEST_CASE("memory plan: per-layer KV at 262,144 tokens and TP=1 is 512 MiB, 6 GiB over 12 layers") {
  // 262144 tokens × 2 KV heads × 256 × 2 B, for K and for V.
  const uint64_t per_layer = 262144ull * 2 * 256 * 2 * 2;
  CHECK(per_layer == 512ull << 20);
  const fn::MemoryPlan m = fn::plan_device_memory(real_model().cfg, real_plan(1), 0, 262144);
  CHECK(m.kv_cache == 12 * per_layer);
  CHECK(m.kv_cache == 6 * kGiB);
  // Indexer: raw keys 262144 × 128 × 4 B (128 MiB) + pooled 65536 × 128 × 4 B (32 MiB) per layer.
  CHECK(m.indexer_cache == 12ull * (128 + 32) * (1 << 20));
  // GDN: [48, 128, 128] FP32 = 3 MiB per layer; conv [10240, 3] FP32 = 120 KiB per layer.
  CHECK(m.gdn_state == 36ull * 3 * (1 << 20));
  CHECK(m.gdn_conv_state == 36ull * 120 * 1024);
  // PLE conv: [10240, 9] FP32 = 360 KiB.
  CHECK(m.ple_conv_state == 360ull * 1024);
}

TEST_CASE(
    "memory plan: weights and states of every rank at TP 1, 2 and 4 and 8K/64K/256K tokens "
    "equal the hand-computed sizes") {
  for (int tp : {1, 2, 4}) {
    const std::map<std::string, uint64_t> want_w = hand_weights(static_cast<uint64_t>(tp));
    for (int rank = 0; rank < tp; ++rank) {
      for (int64_t ctx : {int64_t{8192}, int64_t{65536}, int64_t{262144}}) {
        CAPTURE(tp);
        CAPTURE(rank);
        CAPTURE(ctx);
        const fn::MemoryPlan m = fn::plan_device_memory(real_model().cfg, real_plan(tp), rank, ctx);
        CHECK(m.tp_size == tp);
        CHECK(m.tp_rank == rank);
        CHECK(m.ctx_size == ctx);
        CHECK(m.weights == want_w);
        CHECK(m.weight_total() == sum(want_w));
        const HandStates s = hand_states(static_cast<uint64_t>(tp), static_cast<uint64_t>(ctx));
        CHECK(m.kv_cache == s.kv);
        CHECK(m.indexer_cache == s.indexer);
        CHECK(m.gdn_state == s.gdn);
        CHECK(m.gdn_conv_state == s.gdn_conv);
        CHECK(m.ple_conv_state == s.ple_conv);
        CHECK(m.state_total() == s.kv + s.indexer + s.gdn + s.gdn_conv + s.ple_conv);
        CHECK(m.reserve == 0);
        CHECK(m.total() == m.weight_total() + m.state_total() + m.workspace);
      }
    }
  }
}

TEST_CASE(
    "memory plan: device weights are the shard plan's checkpoint bytes minus what stays "
    "off the device plus the FP32 widening") {
  for (int tp : {1, 2, 4}) {
    CAPTURE(tp);
    const uint64_t t = static_cast<uint64_t>(tp);
    const uint64_t off_device = n_layers * E * 3 * F32  // input_scale
                                + (3 + 16 + 16) * 8     // the PLE I64 buffers
                                + BF16;                 // n-gram weight_scale
    // BF16 in the checkpoint, FP32 on the device: 2 more bytes per element.
    const uint64_t widened = n_gdn * (2 * (Hv / t) + conv_dim / t * K + dv) +
                             n_qsa * (2 * hd + 2 * ihd) + (3 * W + W * ple_k);
    const fn::MemoryPlan m = fn::plan_device_memory(real_model().cfg, real_plan(tp), 0, 8192);
    CHECK(m.weight_total() == real_plan(tp).weight_bytes(0) - off_device + 2 * widened);
  }
}

TEST_CASE(
    "memory plan: the workspace estimate is small and grows by the indexer scores and the "
    "token history alone") {
  const fn::ModelConfig& c = real_model().cfg;
  const fn::MemoryPlan a = fn::plan_device_memory(c, real_plan(1), 0, 8192);
  const fn::MemoryPlan b = fn::plan_device_memory(c, real_plan(1), 0, 65536);
  // 8,192 -> 65,536 tokens: per QSA layer the scores grow from 2048 to 16384 FP32 blocks (the
  // selection and attended tokens stay at 512 blocks / 2051 tokens); the int32 history from
  // 8193 to 65537 entries (each piece rounded up to 256 B: 33024 -> 262400 B).
  const uint64_t growth = 12 * (16384 - 2048) * 4 + (262400 - 33024);
  CHECK(b.workspace - a.workspace == growth);
  // At least the full logits + the sampling arrays (28 B × vocab), well under 256 MiB.
  CHECK(a.workspace > 28 * V);
  CHECK(a.workspace < 256ull << 20);
}

TEST_CASE("device layout: the activation block of the real geometry at TP=1, piece by piece") {
  const fn::DeviceLayout l = fn::device_layout(real_model().cfg, 1, 0, 8192);
  // Each piece: count x element size, rounded up to 256 B. HC partials: 8 column chunks (4
  // streams x 2 chunks of 1280 columns) of R + S = 324 dots. The projection buffer holds the
  // largest stacked mixer projection: GDN's conv_dim + Hv*dv + 2*Hv = 16480 rows (QSA's 12288 +
  // 1024 + 640 = 13952 is smaller); the mixer output max(Hq*hd, Hv*dv) = 6144 BF16.
  const std::pair<fn::Activation, uint64_t> want[] = {
      {fn::Activation::H, W * F32},
      {fn::Activation::HAlt, W * F32},
      {fn::Activation::HcPartials, 10496},  // 8 * 324 * 4 = 10368 -> 41 * 256
      {fn::Activation::HcSumSq, 256},       // 8 * 4 = 32
      {fn::Activation::M, D * F32},
      {fn::Activation::MBf16, D * BF16},
      {fn::Activation::Iota, 256},    // 4 * 4
      {fn::Activation::Proj, 66048},  // 16480 * 4 = 65920 -> 258 * 256
      {fn::Activation::MixOut, 6144 * BF16},
      {fn::Activation::Y, D * F32},
      {fn::Activation::RouterLogits, 2304},  // 513 * 4 = 2052 -> 9 * 256
      {fn::Activation::ExpertIds, 256},
      {fn::Activation::RoutingWeights, 256},
      {fn::Activation::ExpertH, 10 * I * BF16},
      {fn::Activation::SharedGateUp, 2 * Is * F32},
      {fn::Activation::PleEmbedding, P * F32},
      {fn::Activation::PleKv, (S * P + D) * F32},
      {fn::Activation::LogitsLocal, V * F32},
      {fn::Activation::Logits, V * F32},
      {fn::Activation::Token, 256},
      {fn::Activation::Position, 256},
      {fn::Activation::Context, 256},  // ngram_size - 1 = 2 int64
      {fn::Activation::ErrorFlag, 256},
      {fn::Activation::SampleStep, 256},
  };
  REQUIRE(std::size(want) == static_cast<std::size_t>(fn::kActivationCount));
  uint64_t offset = 0;
  for (const auto& [a, bytes] : want) {
    CAPTURE(l.piece(a).name);
    CHECK(l.piece(a).bytes == bytes);
    CHECK(l.piece(a).offset == offset);
    CHECK(l.piece(a).offset % 256 == 0);
    offset += bytes;
  }
  CHECK(l.activation_bytes == offset);
  CHECK(l.activation_bytes == 2266880);
  CHECK(l.max_in_rows == 16480);
  CHECK(l.max_mix == 6144);
}

TEST_CASE("device layout: per-layer states and scratch of the real geometry at TP 1 and 2") {
  for (const uint64_t tp : {1, 2}) {
    CAPTURE(tp);
    const uint64_t ctx = 8192;
    const fn::DeviceLayout l = fn::device_layout(real_model().cfg, static_cast<int>(tp), 0, 8192);
    const uint64_t hkv_l = tp <= Hkv ? Hkv / tp : 1;
    CHECK(l.qsa_layers == 12);
    CHECK(l.gdn_layers == 36);
    CHECK(l.ple_layers == 1);
    CHECK(l.k_cache == ctx * hkv_l * hd * BF16);
    CHECK(l.v_cache == ctx * hkv_l * hd * BF16);
    CHECK(l.raw_keys == ctx * ihd * F32);
    CHECK(l.block_keys == ctx / ratio * ihd * F32);
    CHECK(l.gdn_state == (Hv / tp) * dk * dv * F32);
    CHECK(l.gdn_conv_state == (conv_dim / tp) * (K - 1) * F32);
    CHECK(l.gdn_counters == (Hv / tp + Hk / tp + 2) * 4);  // head counters + two join words
    CHECK(l.gdn_output == (Hv / tp) * dv * F32);
    CHECK(l.ple_conv_state == W * (ple_k - 1) * dilation * F32);
    CHECK(l.router_mailbox == E * F32);
    CHECK(l.history == (ctx + 1) * 4);
    CHECK(l.sampling_estimate == 24 * V + (1u << 20));
    CHECK(l.qsa_workspace ==
          fn::qsa_workspace_estimate(real_model().cfg, static_cast<int>(tp), 8192));
    // The memory plan's rows are the layout's sums.
    const fn::MemoryPlan m =
        fn::plan_device_memory(real_model().cfg, real_plan(static_cast<int>(tp)), 0, 8192);
    CHECK(m.kv_cache == 12 * (l.k_cache + l.v_cache));
    CHECK(m.indexer_cache == 12 * (l.raw_keys + l.block_keys));
    CHECK(m.gdn_state == 36 * l.gdn_state);
    CHECK(m.gdn_conv_state == 36 * l.gdn_conv_state);
    CHECK(m.ple_conv_state == l.ple_conv_state);
    CHECK(m.workspace == l.activation_bytes + 12 * l.qsa_workspace +
                             36 * (l.gdn_counters + l.gdn_output) + l.router_mailbox + l.history +
                             l.sampling_estimate);
  }
  CHECK(fn::hc_down_partials(4, 2560) == 8);
  CHECK(fn::hc_down_partials(4, 64) == 4);
  CHECK(fn::hc_down_partials(4, 1288) == 8);
  CHECK_THROWS_AS(fn::device_layout(real_model().cfg, 1, 0, 0), fn::Error);
}

TEST_CASE("memory plan: a context below one token is a usage error") {
  CHECK_THROWS_AS(fn::plan_device_memory(real_model().cfg, real_plan(1), 0, 0), fn::Error);
  try {
    fn::plan_device_memory(real_model().cfg, real_plan(1), 0, -3);
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Usage);
    CHECK(std::string(e.what()).find("-c/--ctx-size") != std::string::npos);
  }
}

TEST_CASE(
    "memory plan: require_fits accepts exactly enough free memory and refuses one byte less "
    "with the figures and the remedy") {
  const fn::MemoryPlan m = fn::plan_device_memory(real_model().cfg, real_plan(1), 0, 262144);
  CHECK_NOTHROW(fn::require_fits(m, m.total(), "rank 0 (GPU 0)"));
  CHECK_NOTHROW(fn::require_fits(m, 139 * kGiB, "rank 0 (GPU 0)"));  // an H200 at TP=1
  std::string msg;
  try {
    fn::require_fits(m, m.total() - 1, "rank 0 (GPU 0)");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Usage);
    msg = e.what();
  }
  REQUIRE(!msg.empty());
  CHECK(msg.find("rank 0 (GPU 0): a 262144-token context at TP=1 needs") != std::string::npos);
  CHECK(msg.find("lower -c/--ctx-size or use more GPUs (--tp)") != std::string::npos);
  CHECK(msg.find("(1 B short)") != std::string::npos);

  // 80 GiB free: the hand-computed total, figures named.
  const HandStates s = hand_states(1, 262144);
  const uint64_t weights = sum(hand_weights(1));
  const uint64_t total = weights + s.kv + s.indexer + s.gdn + s.gdn_conv + s.ple_conv + m.workspace;
  msg.clear();
  try {
    fn::require_fits(m, 80 * kGiB, "rank 0 (GPU 0)");
  } catch (const fn::Error& e) {
    msg = e.what();
  }
  REQUIRE(!msg.empty());
  CHECK(msg.find(fmt::format("needs {:.2f} GiB per GPU (weights {:.3f} GiB, KV cache 6.000 GiB, "
                             "indexer keys 1.875 GiB, GDN states 112.22 MiB, PLE conv 360.0 KiB, "
                             "workspace ~",
                             static_cast<double>(total) / kGiB,
                             static_cast<double>(weights) / kGiB)) != std::string::npos);
  CHECK(msg.find("80.00 GiB free") != std::string::npos);

  // TP=4 at 256K fits in 40 GiB; 30 GiB does not; a reserve counts.
  fn::MemoryPlan q = fn::plan_device_memory(real_model().cfg, real_plan(4), 3, 262144);
  CHECK_NOTHROW(fn::require_fits(q, 40 * kGiB, "rank 3"));
  CHECK_THROWS_AS(fn::require_fits(q, 30 * kGiB, "rank 3"), fn::Error);
  const uint64_t before = q.total();
  q.reserve = 1000;
  CHECK(q.total() == before + 1000);
  CHECK_THROWS_AS(fn::require_fits(q, before, "rank 3"), fn::Error);
}

TEST_CASE("memory plan: the table has a column per context and the hand-computed KV sizes") {
  const fn::ModelConfig& c = real_model().cfg;
  std::vector<fn::MemoryPlan> cols;
  for (int64_t t : {int64_t{8192}, int64_t{65536}, int64_t{262144}})
    cols.push_back(fn::plan_device_memory(c, real_plan(2), 1, t));
  const std::string s = fn::format_memory_table(cols);
  CHECK(s.find("ctx 8192") != std::string::npos);
  CHECK(s.find("ctx 262144") != std::string::npos);
  // TP=2: one KV head per rank: 12 × T × 256 × 2 B × 2 = 96 MiB at 8K, 3 GiB at 256K.
  CHECK(s.find("96.00 MiB") != std::string::npos);
  CHECK(s.find("3.000 GiB") != std::string::npos);
  for (const char* row : {"moe.experts", "KV cache (BF16)", "indexer keys (FP32)",
                          "GDN state (FP32)", "PLE conv state", "workspace (estimate)", "total"})
    CHECK(s.find(row) != std::string::npos);
  CHECK(fn::format_memory_table({}).empty());
  // Plans of different ranks name the rank in the header.
  cols.push_back(fn::plan_device_memory(c, real_plan(2), 0, 8192));
  CHECK(fn::format_memory_table(cols).find("8192@TP2r0") != std::string::npos);
}

TEST_CASE("memory plan: fngen inspect reports the device memory at --ctx-size, 8K, 64K and 256K") {
  const fn::InspectReport r = fn::inspect_checkpoint(kReal, 2, 1000);
  REQUIRE(r.memory_ctx_sizes == std::vector<int64_t>{1000, 8192, 65536, 262144});
  REQUIRE(r.device_memory.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) {
    REQUIRE(r.device_memory[i].size() == 2);
    for (int rank = 0; rank < 2; ++rank) {
      const HandStates s = hand_states(2, static_cast<uint64_t>(r.memory_ctx_sizes[i]));
      CHECK(r.device_memory[i][rank].kv_cache == s.kv);
      CHECK(r.device_memory[i][rank].weight_total() == sum(hand_weights(2)));
    }
  }
  const json j = fn::inspect_json(r);
  REQUIRE(j.contains("device_memory"));
  CHECK(j["device_memory"].size() == 4);
  CHECK(j["device_memory"][3]["ctx_size"] == 262144);
  CHECK(j["device_memory"][3]["ranks"][1]["kv_cache"] == hand_states(2, 262144).kv);
  CHECK(j["device_memory"][3]["ranks"][1]["tp_rank"] == 1);
  CHECK(j["device_memory"][0]["ranks"][0]["weights"]["embed"] == V * D * BF16);
  const std::string text = fn::format_inspect_text(r);
  CHECK(text.find("device memory per GPU, CUDA backend (TP=2, every rank alike") !=
        std::string::npos);
  CHECK(text.find("ctx 1000") != std::string::npos);
  CHECK(text.find("ctx 262144") != std::string::npos);

  // Without --ctx-size: the default 8192 and the two larger sizes.
  CHECK(fn::inspect_checkpoint(kReal, 1, 0).memory_ctx_sizes ==
        std::vector<int64_t>{8192, 65536, 262144});
  // A model whose max_position_embeddings (4096) is below all three: its default context only.
  const fn::InspectReport tiny = fn::inspect_checkpoint(kTiny, 1, 0);
  CHECK(tiny.memory_ctx_sizes == std::vector<int64_t>{4096});
  CHECK(tiny.device_memory.at(0).at(0).ctx_size == 4096);
}
