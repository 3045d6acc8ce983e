#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <set>
#include <string>

#include "core/config.h"
#include "core/error.h"
#include "core/model_tensors.h"

namespace {

using nlohmann::json;
const char* kReal = FN_SOURCE_DIR "/configs/qwen3.8-flash-next.json";
const char* kTiny = FN_SOURCE_DIR "/configs/tiny.json";

json read(const char* path) {
  std::ifstream in(path);
  return json::parse(in);
}

struct Model {
  fn::ModelConfig cfg;
  fn::QuantConfig quant;
};

Model load(const char* path) {
  json j = read(path);
  return {fn::parse_model_config(j, path),
          fn::parse_quantization_config(j["quantization_config"], path)};
}

const fn::ExpectedTensor& find(const std::vector<fn::ExpectedTensor>& ts, const std::string& n) {
  for (const auto& t : ts) {
    if (t.name == n) return t;
  }
  FAIL("no tensor " << n);
  return ts.front();
}

std::vector<int64_t> shape(std::initializer_list<int64_t> s) {
  return s;
}

std::vector<fn::FoundTensor> as_found(const std::vector<fn::ExpectedTensor>& ts) {
  std::vector<fn::FoundTensor> out;
  for (const auto& t : ts) out.push_back({t.name, t.dtype, t.shape});
  return out;
}

}  // namespace

TEST_CASE(
    "model tensors: the RadixArk NVFP4 export has 296,111 text tensors with its dtype census") {
  const Model m = load(kReal);
  const auto ts = fn::expected_tensors(m.cfg, m.quant);
  CHECK(ts.size() == 296111);  // docs/model.md A.4 / B.1: 296,475 entries − 31 MTP − 333 vision
  std::map<fn::DType, std::size_t> census;
  std::set<std::string> names;
  for (const auto& t : ts) {
    ++census[t.dtype];
    names.insert(t.name);
  }
  CHECK(names.size() == ts.size());
  // B.1 census minus MTP (31 BF16) and vision (333 BF16).
  CHECK(census[fn::DType::BF16] == 1432 - 31 - 333);
  CHECK(census[fn::DType::F32] == 147456);
  CHECK(census[fn::DType::F8_E4M3] == 73856);
  CHECK(census[fn::DType::U8] == 73728);
  CHECK(census[fn::DType::I64] == 3);
  CHECK(census.size() == 5);
}

TEST_CASE("model tensors: real-model names, shapes and dtypes follow docs/model.md B.2") {
  const Model m = load(kReal);
  const auto ts = fn::expected_tensors(m.cfg, m.quant);
  const std::string p = "model.language_model.";
  using fn::DType;
  struct Row {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
  };
  const std::vector<Row> rows = {
      {p + "embed_tokens.weight", DType::BF16, {248320, 2560}},
      {"lm_head.weight", DType::BF16, {248320, 2560}},
      {p + "hyper_connection_mixer.hc_norm.weight", DType::BF16, {10240}},
      {p + "hyper_connection_mixer.input_mix_weight_down.weight", DType::BF16, {320, 10240}},
      {p + "hyper_connection_mixer.input_mix_weight_up.weight", DType::BF16, {10240, 320}},
      {p + "layers.5.attn_hyper_connection.block_inject_weight.weight", DType::BF16, {4, 10240}},
      {p + "layers.5.mlp_hyper_connection.input_mix_weight_up.weight", DType::BF16, {10240, 320}},
      {p + "layers.5.mlp.gate.weight", DType::BF16, {512, 2560}},
      {p + "layers.5.mlp.shared_expert.gate_proj.weight", DType::BF16, {640, 2560}},
      {p + "layers.5.mlp.shared_expert.down_proj.weight", DType::BF16, {2560, 640}},
      {p + "layers.5.mlp.shared_expert_gate.weight", DType::BF16, {1, 2560}},
      {p + "layers.3.mlp.experts.17.gate_proj.weight", DType::U8, {640, 1280}},
      {p + "layers.3.mlp.experts.17.up_proj.weight_scale", DType::F8_E4M3, {640, 160}},
      {p + "layers.3.mlp.experts.17.down_proj.weight", DType::U8, {2560, 320}},
      {p + "layers.3.mlp.experts.17.down_proj.weight_scale", DType::F8_E4M3, {2560, 40}},
      {p + "layers.3.mlp.experts.511.down_proj.weight_scale_2", DType::F32, {}},
      {p + "layers.47.mlp.experts.0.gate_proj.input_scale", DType::F32, {}},
      {p + "layers.0.linear_attn.in_proj_qkv.weight", DType::BF16, {10240, 2560}},
      {p + "layers.0.linear_attn.in_proj_z.weight", DType::BF16, {6144, 2560}},
      {p + "layers.0.linear_attn.in_proj_a.weight", DType::BF16, {48, 2560}},
      {p + "layers.0.linear_attn.in_proj_b.weight", DType::BF16, {48, 2560}},
      {p + "layers.0.linear_attn.out_proj.weight", DType::BF16, {2560, 6144}},
      {p + "layers.0.linear_attn.A_log", DType::BF16, {48}},
      {p + "layers.0.linear_attn.dt_bias", DType::BF16, {48}},
      {p + "layers.0.linear_attn.conv1d.weight", DType::BF16, {10240, 1, 4}},
      {p + "layers.0.linear_attn.norm.weight", DType::BF16, {128}},
      {p + "layers.3.self_attn.q_proj.weight", DType::BF16, {12288, 2560}},
      {p + "layers.3.self_attn.k_proj.weight", DType::BF16, {512, 2560}},
      {p + "layers.3.self_attn.v_proj.weight", DType::BF16, {512, 2560}},
      {p + "layers.3.self_attn.o_proj.weight", DType::BF16, {2560, 6144}},
      {p + "layers.3.self_attn.q_norm.weight", DType::BF16, {256}},
      {p + "layers.3.self_attn.k_norm.weight", DType::BF16, {256}},
      {p + "layers.3.self_attn.indexer.index_qk_proj.weight", DType::BF16, {640, 2560}},
      {p + "layers.3.self_attn.indexer.q_layernorm.weight", DType::BF16, {128}},
      {p + "layers.3.self_attn.indexer.k_layernorm.weight", DType::BF16, {128}},
      {p + "layers.1.ple.key_proj.weight", DType::BF16, {10240, 2560}},
      {p + "layers.1.ple.value_proj.weight", DType::BF16, {2560, 2560}},
      {p + "layers.1.ple.norm_key.weight", DType::BF16, {10240}},
      {p + "layers.1.ple.norm_query.weight", DType::BF16, {10240}},
      {p + "layers.1.ple.norm_conv.weight", DType::BF16, {10240}},
      {p + "layers.1.ple.conv1d.weight", DType::BF16, {10240, 1, 4}},
      {p + "layers.1.ple.ple_embedding.layer_multipliers", DType::I64, {3}},
      {p + "layers.1.ple.ple_embedding.ngram_heads_vocab_sizes", DType::I64, {16}},
      {p + "layers.1.ple.ple_embedding.ngram_heads_offsets", DType::I64, {16}},
      {p + "layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight",
       DType::F8_E4M3,
       {2500012, 160}},
      {p + "layers.1.ple.ple_embedding.ngram_embedding.shard_127.weight",
       DType::F8_E4M3,
       {2500012, 160}},
      {p + "layers.1.ple.ple_embedding.ngram_embedding.weight_scale", DType::BF16, {1}},
  };
  for (const Row& r : rows) {
    INFO(r.name);
    const auto& t = find(ts, r.name);
    CHECK(t.dtype == r.dtype);
    CHECK(t.shape == r.shape);
  }
  const auto& e = find(ts, p + "layers.3.mlp.experts.17.down_proj.weight");
  CHECK(e.role == fn::TensorRole::ExpertWeight);
  CHECK(e.layer == 3);
  CHECK(e.expert == 17);
  CHECK(e.projection == "down_proj");
  CHECK(fn::tensor_family(e.role) == "moe.experts");
  const auto& s = find(ts, p + "layers.1.ple.ple_embedding.ngram_embedding.shard_127.weight");
  CHECK(s.shard == 127);
  CHECK(s.role == fn::TensorRole::PleNgramShard);
  CHECK(fn::tensor_family(find(ts, p + "layers.0.linear_attn.A_log").role) == "gdn");
  CHECK(fn::tensor_family(find(ts, "lm_head.weight").role) == "lm_head");
  // No classic per-layer norms, no final norm, no mixer inject, no PLE on other layers.
  for (const auto& t : ts) {
    CHECK(t.name.find("input_layernorm") == std::string::npos);
    CHECK(t.name != p + "norm.weight");
    CHECK(t.name != p + "hyper_connection_mixer.block_inject_weight.weight");
    if (t.name.find(".ple.") != std::string::npos) CHECK(t.layer == 1);
  }
  // Bytes: routed experts 120.80 B parameters as NVFP4 (A.3): 48·512·3·640·2560/2 bytes of codes.
  uint64_t codes = 0;
  for (const auto& t : ts) {
    if (t.role == fn::TensorRole::ExpertWeight) codes += t.nbytes();
  }
  CHECK(codes == 48ull * 512 * 3 * 640 * 2560 / 2);
}

TEST_CASE("model tensors: a BF16 checkpoint has fused experts and a BF16 n-gram table") {
  Model m = load(kReal);
  m.cfg.ple_embedding_dtype.reset();
  const auto ts = fn::expected_tensors(m.cfg, fn::QuantConfig{});
  const std::string p = "model.language_model.";
  CHECK(ts.size() == 1067 + 96 + 128 + 3);
  const auto& gu = find(ts, p + "layers.7.mlp.experts.gate_up_proj");
  CHECK(gu.dtype == fn::DType::BF16);
  CHECK(gu.shape == shape({512, 1280, 2560}));
  CHECK(gu.role == fn::TensorRole::ExpertFusedGateUp);
  CHECK(find(ts, p + "layers.7.mlp.experts.down_proj").shape == shape({512, 2560, 640}));
  const auto& s = find(ts, p + "layers.1.ple.ple_embedding.ngram_embedding.shard_5.weight");
  CHECK(s.dtype == fn::DType::BF16);
  for (const auto& t : ts) {
    CHECK(t.role != fn::TensorRole::PleNgramScale);
    CHECK(t.role != fn::TensorRole::ExpertWeight);
  }
}

TEST_CASE("model tensors: the tiny config's list has per-expert NVFP4 and FP8 n-gram shards") {
  const Model m = load(kTiny);
  const auto ts = fn::expected_tensors(m.cfg, m.quant);
  const std::string p = "model.language_model.";
  // 1 embed + 1 lm_head + 3 mixer + 4 layers × (8 HC + 5 MoE dense) + 3 GDN × 9 + 1 QSA × 9
  // + PLE (6 + 3 + 4 shards + 1 scale) + 4 layers × 8 experts × 3 proj × 4.
  CHECK(ts.size() == 1 + 1 + 3 + 4 * 13 + 27 + 9 + 14 + 4 * 8 * 3 * 4);
  CHECK(find(ts, p + "layers.2.mlp.experts.7.gate_proj.weight").shape == shape({32, 32}));
  CHECK(find(ts, p + "layers.2.mlp.experts.7.gate_proj.weight_scale").shape == shape({32, 4}));
  CHECK(find(ts, p + "layers.2.mlp.experts.7.down_proj.weight").shape == shape({64, 16}));
  CHECK(find(ts, p + "layers.2.mlp.experts.7.down_proj.weight_scale").shape == shape({64, 2}));
  CHECK(find(ts, p + "layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight").shape ==
        shape({2054, 8}));
  CHECK(find(ts, p + "layers.3.self_attn.q_proj.weight").shape == shape({256, 64}));
  CHECK(find(ts, p + "layers.3.self_attn.indexer.index_qk_proj.weight").shape == shape({48, 64}));
  CHECK(find(ts, p + "layers.0.linear_attn.in_proj_qkv.weight").shape == shape({160, 64}));
}

TEST_CASE("model tensors: a quantization that makes a non-expert linear NVFP4 is rejected") {
  Model m = load(kReal);
  auto& ex = m.quant.exclude_modules;
  ex.erase(std::find(ex.begin(), ex.end(), "*.linear_attn.*"));
  CHECK_THROWS_WITH_AS(fn::expected_tensors(m.cfg, m.quant),
                       doctest::Contains("marks 'model.language_model.layers.0.linear_attn."
                                         "in_proj_qkv' as NVFP4"),
                       fn::Error);
  Model m2 = load(kReal);
  m2.quant.exclude_modules.push_back("*.experts.3.*");
  CHECK_THROWS_WITH_AS(fn::expected_tensors(m2.cfg, m2.quant),
                       doctest::Contains("leaves routed expert module "
                                         "'model.language_model.layers.0.mlp.experts.3.gate_proj' "
                                         "unquantized"),
                       fn::Error);
}

TEST_CASE("model tensors: a config with tied embeddings is rejected, not run untied") {
  Model m = load(kReal);
  m.cfg.tie_word_embeddings = true;
  CHECK_THROWS_WITH_AS(fn::expected_tensors(m.cfg, m.quant),
                       doctest::Contains("tie_word_embeddings = true"), fn::Error);
}

TEST_CASE("model tensors: vision and MTP tensors are skipped, text tensors are not") {
  CHECK(fn::skipped_tensor("model.visual.blocks.0.attn.qkv.weight") == fn::SkipReason::Vision);
  CHECK(fn::skipped_tensor("mtp.fc_hidden.weight") == fn::SkipReason::Mtp);
  CHECK(fn::skipped_tensor("model.mtp.layers.0.x") == fn::SkipReason::Mtp);
  CHECK(fn::skipped_tensor("model.language_model.embed_tokens.weight") == fn::SkipReason::None);
  CHECK(fn::skipped_tensor("lm_head.weight") == fn::SkipReason::None);
  CHECK(fn::skipped_tensor("model.visualx") == fn::SkipReason::None);
}

TEST_CASE("model tensors: validation accepts the exact list and names each kind of problem") {
  const Model m = load(kTiny);
  const auto ts = fn::expected_tensors(m.cfg, m.quant);
  auto found = as_found(ts);
  const std::vector<int64_t> vis_shape{3, 4};
  found.push_back({"model.visual.patch_embed.proj.weight", fn::DType::BF16, vis_shape});
  found.push_back({"mtp.fc_hidden.weight", fn::DType::BF16, vis_shape});
  fn::ValidationReport ok = fn::validate_tensors(ts, found);
  CHECK(ok.ok());
  CHECK(ok.matched == ts.size());
  CHECK(ok.skipped_vision == 1);
  CHECK(ok.skipped_mtp == 1);
  CHECK_NOTHROW(fn::require_valid(ok, "/ckpt"));

  const std::string p = "model.language_model.";
  const std::vector<int64_t> bad_shape{32, 31};
  std::vector<fn::FoundTensor> bad;
  for (const auto& f : found) {
    if (f.name == p + "layers.0.linear_attn.A_log") continue;  // missing
    fn::FoundTensor g = f;
    if (f.name == p + "layers.2.mlp.experts.7.gate_proj.weight_scale") g.dtype = fn::DType::U8;
    if (f.name == p + "layers.2.mlp.experts.7.gate_proj.weight") g.shape = bad_shape;
    bad.push_back(g);
  }
  const std::string unexpected_name = p + "norm.weight";         // FoundTensor views its name
  bad.push_back({unexpected_name, fn::DType::BF16, vis_shape});  // unexpected
  bad.push_back({"lm_head.weight", fn::DType::BF16, ts.back().shape});  // duplicated
  const fn::ValidationReport r = fn::validate_tensors(ts, bad);
  CHECK(!r.ok());
  CHECK(r.missing == 1);
  CHECK(r.unexpected == 1);
  CHECK(r.wrong_dtype == 1);
  CHECK(r.wrong_shape == 1);
  CHECK(r.duplicates == 1);
  CHECK(r.problems.size() == 5);
  try {
    fn::require_valid(r, "/ckpt");
    FAIL("no throw");
  } catch (const fn::Error& e) {
    const std::string msg = e.what();
    CHECK(e.kind() == fn::ErrorKind::Format);
    CHECK(msg.find("/ckpt: 5 tensor problems (1 missing, 1 unexpected, 1 wrong dtype, 1 wrong "
                   "shape, 1 duplicated)") == 0);
    CHECK(msg.find("missing tensor '" + p + "layers.0.linear_attn.A_log' (BF16 [6])") !=
          std::string::npos);
    CHECK(msg.find("unexpected tensor '" + p + "norm.weight' (BF16 [3, 4])") != std::string::npos);
    CHECK(msg.find("tensor '" + p +
                   "layers.2.mlp.experts.7.gate_proj.weight_scale' has dtype U8, expected "
                   "F8_E4M3") != std::string::npos);
    CHECK(msg.find("tensor '" + p +
                   "layers.2.mlp.experts.7.gate_proj.weight' has shape [32, 31], expected "
                   "[32, 32]") != std::string::npos);
    CHECK(msg.find("tensor 'lm_head.weight' appears more than once") != std::string::npos);
  }
}

TEST_CASE("model tensors: require_valid lists ten problems and counts the rest") {
  const Model m = load(kTiny);
  const auto ts = fn::expected_tensors(m.cfg, m.quant);
  const fn::ValidationReport r = fn::validate_tensors(ts, {});
  CHECK(r.missing == ts.size());
  try {
    fn::require_valid(r, "dir");
    FAIL("no throw");
  } catch (const fn::Error& e) {
    const std::string msg = e.what();
    CHECK(msg.find(fmt::format("dir: {} tensor problems ({} missing", ts.size(), ts.size())) == 0);
    CHECK(msg.find(fmt::format("; ... and {} more", ts.size() - 10)) != std::string::npos);
    CHECK(msg.find("missing tensor 'model.language_model.embed_tokens.weight' (BF16 [512, 64])") !=
          std::string::npos);
  }
}
