#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>

#include "core/config.h"
#include "core/error.h"
#include "cuda/common/real_shape.h"

namespace {

using nlohmann::json;
const char* kReal = FN_SOURCE_DIR "/configs/qwen3.8-flash-next.json";
const char* kTiny = FN_SOURCE_DIR "/configs/tiny.json";

json read(const char* path) {
  std::ifstream in(path);
  return json::parse(in);
}

/// Parses `j` and returns the Format error message ("" when it parsed).
std::string format_error(const json& j) {
  try {
    fn::parse_model_config(j, "config.json");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Format);
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, std::string_view part) {
  return s.find(part) != std::string::npos;
}

std::filesystem::path temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / ("fn_test_config_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

void write(const std::filesystem::path& p, const std::string& text) {
  std::ofstream(p) << text;
}

const std::vector<std::string> kRadixExcludes = {"model.embed_tokens",
                                                 "mtp.*",
                                                 "model.mtp.*",
                                                 "*.self_attn.*",
                                                 "*.linear_attn.*",
                                                 "*.mlp.gate*",
                                                 "*.mlp.shared_expert.*",
                                                 "*.mlp.shared_expert_gate*",
                                                 "*hyper_connection*",
                                                 "*.ple.*",
                                                 "model.visual.*",
                                                 "model.language_model.embed_tokens",
                                                 "lm_head"};

}  // namespace

TEST_CASE(
    "config: the real Qwen3.8-Flash-Next config parses with the values of docs/model.md A.2/A.3") {
  const fn::ModelConfig c = fn::load_model_config(kReal);
  CHECK(c.vocab_size == 248320);
  CHECK(c.hidden_size == 2560);
  CHECK(c.num_hidden_layers == 48);
  CHECK(c.num_gdn_layers() == 36);
  CHECK(c.num_qsa_layers() == 12);
  for (int64_t l = 0; l < 48; ++l) CHECK(c.is_qsa(l) == (l % 4 == 3));
  CHECK(c.num_attention_heads == 24);
  CHECK(c.num_key_value_heads == 2);
  CHECK(c.head_dim == 256);
  CHECK(c.max_position_embeddings == 262144);
  CHECK(c.rope_theta == 1e7);
  CHECK(c.partial_rotary_factor == 0.25);
  CHECK(c.rope_type == "default");
  CHECK(c.rotary_dim() == 64);
  CHECK(c.q_proj_rows() == 12288);
  CHECK(c.kv_proj_rows() == 512);
  CHECK(c.o_proj_cols() == 6144);
  CHECK(c.gdn_key_dim() == 2048);
  CHECK(c.gdn_value_dim() == 6144);
  CHECK(c.gdn_conv_dim() == 10240);
  CHECK(c.hc_width() == 10240);
  CHECK(c.indexer_proj_rows() == 640);
  CHECK(c.qsa_max_attended() == 2051);
  CHECK(c.output_gate_type == fn::GateActivation::Sigmoid);
  CHECK(c.num_experts == 512);
  CHECK(c.num_experts_per_tok == 10);
  CHECK(c.moe_intermediate_size == 640);
  CHECK(c.shared_expert_intermediate_size == 640);
  CHECK(c.norm_topk_prob);
  CHECK(c.hc_count == 4);
  CHECK(c.hc_lowrank == 320);
  CHECK(c.ple_layer_ids == std::vector<int64_t>{2});
  CHECK(c.ple_layer_indices() == std::vector<int64_t>{1});
  CHECK(c.ple_rank(1) == 0);
  CHECK(c.ple_rank(2) == -1);
  CHECK(c.ngram_heads() == 16);
  CHECK(c.ngram_head_dim() == 160);
  CHECK(c.ngram_table_rows() == 320001536);
  CHECK(c.split_ngram_parts == 128);
  CHECK(c.ple_conv_dilation() == 3);
  CHECK(c.seed == 1234);  // absent from the file: class default
  CHECK(c.eos_token_id == std::vector<int64_t>{248044});
  CHECK(c.ple_eos() == 248044);
  CHECK(c.bos_token_id == 248044);
  CHECK(!c.pad_token_id);
  CHECK(!c.tie_word_embeddings);
  CHECK(c.ple_embedding_dtype == "float8_e4m3fn");
}

TEST_CASE(
    "config: the CUDA kernels' compile-time shape (cuda/common/real_shape.h) is the real "
    "config's") {
  const fn::ModelConfig c = fn::load_model_config(kReal);
  CHECK(c.hidden_size == fn::real_shape::kHidden);
  CHECK(c.hc_lowrank == fn::real_shape::kHcRank);
  CHECK(c.linear_key_head_dim == fn::real_shape::kGdnHeadDim);
  CHECK(c.linear_value_head_dim == fn::real_shape::kGdnHeadDim);
  CHECK(c.linear_conv_kernel_dim == fn::real_shape::kGdnConvKernel);
  CHECK(c.num_experts == fn::real_shape::kNumExperts);
  CHECK(c.num_experts_per_tok == fn::real_shape::kTopK);
  CHECK(c.moe_intermediate_size == fn::real_shape::kMoeInter);
  CHECK(c.num_attention_heads / c.num_key_value_heads == fn::real_shape::kQsaQPerKv);
  CHECK(c.head_dim == fn::real_shape::kQsaHeadDim);
}

TEST_CASE("config: the tiny config parses with the values of docs/model.md G.3") {
  const fn::ModelConfig c = fn::load_model_config(kTiny);
  CHECK(c.vocab_size == 512);
  CHECK(c.hidden_size == 64);
  CHECK(c.num_gdn_layers() == 3);
  CHECK(c.num_qsa_layers() == 1);
  CHECK(c.is_qsa(3));
  CHECK(c.rotary_dim() == 8);
  CHECK(c.q_proj_rows() == 256);
  CHECK(c.gdn_conv_dim() == 2 * 32 + 96);
  CHECK(c.hc_width() == 256);
  CHECK(c.ngram_heads() == 8);
  CHECK(c.ngram_head_dim() == 8);
  CHECK(c.ngram_table_rows() == 8216);
  CHECK(c.ple_eos() == 7);
  CHECK(c.indexer_proj_rows() == 48);
  CHECK(c.qsa_max_attended() == 11);
  CHECK(c.moe_intermediate_size % 16 == 0);
  CHECK(c.hidden_size % 16 == 0);
}

TEST_CASE("config: a bare qwen4_exp_text config parses like the text_config of the wrapped form") {
  json j = read(kReal);
  json text = j["text_config"];
  const fn::ModelConfig a = fn::parse_model_config(j, "config.json");
  const fn::ModelConfig b = fn::parse_model_config(text, "config.json");
  CHECK(a.layer_types == b.layer_types);
  CHECK(a.ngram_table_rows() == b.ngram_table_rows());
  CHECK(a.eos_token_id == b.eos_token_id);
  CHECK(a.rope_theta == b.rope_theta);
}

TEST_CASE("config: the config traps of docs/model.md F.1.21 and the defaults of G.1 are honoured") {
  json j = read(kReal);
  auto& t = j["text_config"];
  SUBCASE("absent output_gate_type falls back to hidden_act (silu)") {
    t.erase("output_gate_type");
    CHECK(fn::parse_model_config(j, "x").output_gate_type == fn::GateActivation::Silu);
  }
  SUBCASE("absent split_ngram_parts is 512") {
    t.erase("split_ngram_parts");
    CHECK(fn::parse_model_config(j, "x").split_ngram_parts == 512);
  }
  SUBCASE("an explicit seed changes the multiplier base") {
    t["seed"] = 42;
    CHECK(fn::parse_model_config(j, "x").seed == 42);
  }
  SUBCASE("eos_token_id as a list keeps the list; PLE uses the first") {
    t["eos_token_id"] = {248046, 248044};
    const auto c = fn::parse_model_config(j, "x");
    CHECK(c.eos_token_id == std::vector<int64_t>{248046, 248044});
    CHECK(c.ple_eos() == 248046);
  }
  SUBCASE("eos_token_id only at the top level is used") {
    t.erase("eos_token_id");
    j["eos_token_id"] = 248044;
    CHECK(fn::parse_model_config(j, "x").ple_eos() == 248044);
  }
  SUBCASE("qwen_sparse_attention is accepted as well as full_attention") {
    t["layer_types"][3] = "qwen_sparse_attention";
    CHECK(fn::parse_model_config(j, "x").is_qsa(3));
  }
  SUBCASE("absent layer_types: every full_attention_interval-th layer is QSA") {
    t.erase("layer_types");
    const auto c = fn::parse_model_config(j, "x");
    CHECK(c.num_qsa_layers() == 12);
    CHECK(c.is_qsa(47));
    CHECK(!c.is_qsa(46));
  }
  SUBCASE("ple_layer_ids are sorted and deduplicated") {
    t["ple_layer_ids"] = {6, 2, 6};
    const auto c = fn::parse_model_config(j, "x");
    CHECK(c.ple_layer_ids == std::vector<int64_t>{2, 6});
    CHECK(c.ple_layer_indices() == std::vector<int64_t>{1, 5});
    CHECK(c.ple_rank(5) == 1);
  }
  SUBCASE("absent ple_embed_dim is hidden_size") {
    t.erase("ple_embed_dim");
    CHECK(fn::parse_model_config(j, "x").ple_embed_dim == 2560);
  }
  SUBCASE("absent rope_parameters: legacy rope_theta, factor 1.0") {
    t.erase("rope_parameters");
    t.erase("partial_rotary_factor");
    t["rope_theta"] = 500000.0;
    t["indexer_head_dim"] = 256;
    const auto c = fn::parse_model_config(j, "x");
    CHECK(c.rope_theta == 500000.0);
    CHECK(c.rotary_dim() == 256);
  }
  SUBCASE("a top-level tie_word_embeddings decides, as in HF") {
    j["tie_word_embeddings"] = true;
    CHECK(fn::parse_model_config(j, "x").tie_word_embeddings);
  }
}

TEST_CASE("config: every invalid config is rejected with a message naming the field") {
  json j = read(kReal);
  auto& t = j["text_config"];
  std::string want;
  SUBCASE("missing required field") {
    t.erase("hidden_size");
    want = "config.json: missing required field text_config.hidden_size";
  }
  SUBCASE("missing required field (bare form)") {
    json bare = t;
    bare.erase("num_experts");
    j = bare;
    want = "config.json: missing required field num_experts";
  }
  SUBCASE("missing model_type") {
    j.erase("model_type");
    want = "missing required field model_type";
  }
  SUBCASE("unknown model_type") {
    j["model_type"] = "qwen3_next";
    want = "model_type must be \"qwen4_exp\" or \"qwen4_exp_text\", got \"qwen3_next\"";
  }
  SUBCASE("text_config of the wrong type") {
    j["text_config"] = 3;
    want = "text_config must be an object";
  }
  SUBCASE("integer field of the wrong type") {
    t["hidden_size"] = "2560";
    want = "text_config.hidden_size must be an integer, got \"2560\" (string)";
  }
  SUBCASE("integer field given as a float") {
    t["num_hidden_layers"] = 48.5;
    want = "text_config.num_hidden_layers must be an integer";
  }
  SUBCASE("boolean field of the wrong type") {
    t["norm_topk_prob"] = 1;
    want = "text_config.norm_topk_prob must be a boolean";
  }
  SUBCASE("num_experts zero") {
    t["num_experts"] = 0;
    want = "config.json: text_config.num_experts must be in [1, 1024], got 0";
  }
  SUBCASE("num_experts past the router's limit (a hostile count sized host tables)") {
    t["num_experts"] = int64_t{1000000000000};
    want = "config.json: text_config.num_experts must be in [1, 1024], got 1000000000000";
  }
  SUBCASE("num_hidden_layers past 1024 (10^6 layers took all host memory before)") {
    t["num_hidden_layers"] = 1000000;
    t.erase("layer_types");
    want = "config.json: text_config.num_hidden_layers must be at most 1024, got 1000000";
  }
  SUBCASE("num_hidden_layers below 1 is named as such, not as a layer_types mismatch") {
    t["num_hidden_layers"] = -1;
    want = "config.json: text_config.num_hidden_layers must be > 0, got -1";
  }
  SUBCASE("hidden_size past 2^20 (2^62 overflowed the byte counts)") {
    t["hidden_size"] = int64_t{1} << 62;
    want =
        "config.json: text_config.hidden_size must be at most 1048576 (2^20), got "
        "4611686018427387904";
  }
  SUBCASE("max_position_embeddings past 2^24") {
    t["max_position_embeddings"] = int64_t{1} << 40;
    want =
        "text_config.max_position_embeddings must be at most 16777216 (2^24), got "
        "1099511627776";
  }
  SUBCASE("heads_per_ngram past 1024") {
    t["heads_per_ngram"] = 4096;
    want = "text_config.heads_per_ngram must be at most 1024, got 4096";
  }
  SUBCASE("top-k above num_experts") {
    t["num_experts_per_tok"] = 513;
    want = "text_config.num_experts_per_tok must be in [1, num_experts = 512], got 513";
  }
  SUBCASE("vocab_size past 32-bit token ids") {
    t["vocab_size"] = int64_t{1} << 31;
    want = "text_config.vocab_size must be in [1, 2^31 - 1] (token ids are 32-bit), got 2147483648";
  }
  SUBCASE("intermediate size zero") {
    t["moe_intermediate_size"] = 0;
    want = "text_config.moe_intermediate_size must be > 0, got 0";
  }
  SUBCASE("hc_count one") {
    t["hc_count"] = 1;
    want = "text_config.hc_count must be > 1, got 1";
  }
  SUBCASE("unknown rope_type") {
    t["rope_parameters"]["rope_type"] = "yarn";
    want = "text_config.rope_parameters.rope_type 'yarn' is not supported";
  }
  SUBCASE("unknown legacy rope_scaling type") {
    t["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}};
    want = "text_config.rope_scaling.rope_type 'yarn' is not supported";
  }
  SUBCASE("unknown layer type") {
    t["layer_types"][5] = "sliding_attention";
    want = "text_config.layer_types[5] must be";
  }
  SUBCASE("layer_types of the wrong length") {
    t["layer_types"].erase(t["layer_types"].size() - 1);
    want = "text_config.layer_types has 47 entries but num_hidden_layers is 48";
  }
  SUBCASE("unknown output_gate_type") {
    t["output_gate_type"] = "relu";
    want = "text_config.output_gate_type must be \"sigmoid\" or \"silu\", got \"relu\"";
  }
  SUBCASE("one indexer field missing") {
    t.erase("indexer_budget");
    want = "missing required field text_config.indexer_budget";
  }
  SUBCASE("indexer_kv_heads not 1") {
    t["indexer_kv_heads"] = 2;
    want = "text_config.indexer_kv_heads must be 1, got 2";
  }
  SUBCASE("indexer budget not a multiple of the ratio") {
    t["indexer_budget"] = 2050;
    want = "text_config.indexer_budget must be a multiple of indexer_compress_ratio (4)";
  }
  SUBCASE("indexer head narrower than the rotary dims") {
    t["indexer_head_dim"] = 32;
    want = "text_config.indexer_head_dim must be >= rotary_dim (64), got 32";
  }
  SUBCASE("PLE layer id zero") {
    t["ple_layer_ids"] = {0};
    want = "text_config.ple_layer_ids must be one-indexed layer ids in [1, 48], got 0";
  }
  SUBCASE("PLE layer on a QSA layer") {
    t["ple_layer_ids"] = {4};
    want = "text_config.ple_layer_ids names layer 4 (index 3), which must be linear_attention";
  }
  SUBCASE("PLE embed dim not a multiple of the n-gram heads") {
    t["ple_embed_dim"] = 2568;
    want =
        "text_config.ple_embed_dim must be a multiple of (ngram_size - 1) * heads_per_ngram = 16";
  }
  SUBCASE("PLE without eos_token_id") {
    t.erase("eos_token_id");
    want = "missing required field text_config.eos_token_id (the PLE n-gram hash needs it)";
  }
  SUBCASE("eos_token_id of the wrong type") {
    t["eos_token_id"] = json::array({"</s>"});
    want = "text_config.eos_token_id[0] must be an integer";
  }
  SUBCASE("eos_token_id outside the vocabulary") {
    t["eos_token_id"] = 248320;
    want = "text_config.eos_token_id must be in [0, vocab_size = 248320), got 248320";
  }
  SUBCASE("bos_token_id and pad_token_id outside the vocabulary") {
    SUBCASE("bos") {
      t["bos_token_id"] = -5;
      want = "text_config.bos_token_id must be in [0, vocab_size = 248320), got -5";
    }
    SUBCASE("pad") {
      t["pad_token_id"] = 248320;
      want = "text_config.pad_token_id must be in [0, vocab_size = 248320), got 248320";
    }
  }
  SUBCASE("split_ngram_parts not dividing the table") {
    t["split_ngram_parts"] = 100;
    want = "text_config.split_ngram_parts (100) must divide the n-gram table rows (320001536)";
  }
  SUBCASE("unknown ple_embedding_dtype") {
    t["ple_embedding_dtype"] = "int4";
    want = "text_config.ple_embedding_dtype must be \"float8_e4m3fn\" or \"bfloat16\"";
  }
  SUBCASE("heads not a multiple of KV heads") {
    t["num_key_value_heads"] = 5;
    want = "text_config.num_attention_heads must be a multiple of num_key_value_heads (5)";
  }
  SUBCASE("unsupported hidden_act") {
    t["hidden_act"] = "gelu";
    t["output_gate_type"] = "sigmoid";
    want = "text_config.hidden_act must be \"silu\"";
  }
  const std::string msg = format_error(j);
  INFO(msg);
  CHECK(contains(msg, want));
}

TEST_CASE("config: file errors name the file (absent file is Io, bad JSON is Format)") {
  auto dir = temp_dir("files");
  try {
    fn::load_model_config(dir);
    FAIL("no throw");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Io);
    CHECK(contains(e.what(), "config.json: cannot open file"));
  }
  write(dir / "config.json", "{\"model_type\": ");
  try {
    fn::load_model_config(dir);
    FAIL("no throw");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Format);
    CHECK(contains(e.what(), "config.json: not valid JSON"));
  }
  write(dir / "config.json", "[1, 2]");
  CHECK_THROWS_WITH_AS(fn::load_model_config(dir),
                       doctest::Contains("the top level must be a JSON object"), fn::Error);
  std::filesystem::remove_all(dir);
}

TEST_CASE("config: glob matching follows fnmatch (star crosses dots, ? is one character)") {
  CHECK(fn::glob_match("*.mlp.gate*", "model.language_model.layers.3.mlp.gate"));
  CHECK(!fn::glob_match("*.mlp.gate*", "model.language_model.layers.3.mlp.experts.1.gate_proj"));
  CHECK(fn::glob_match("*hyper_connection*", "model.language_model.hyper_connection_mixer.x"));
  CHECK(fn::glob_match("lm_head", "lm_head"));
  CHECK(!fn::glob_match("lm_head", "lm_head2"));
  CHECK(fn::glob_match("layer.?", "layer.7"));
  CHECK(!fn::glob_match("layer.?", "layer.17"));
  CHECK(fn::glob_match("*", ""));
  CHECK(fn::glob_match("a*b*c", "aXXbYYc"));
  CHECK(!fn::glob_match("a*b*c", "aXXbYY"));
}

TEST_CASE("config: the RadixArk quantization config marks only routed experts NVFP4") {
  const json j = read(kReal);
  const fn::QuantConfig q = fn::parse_quantization_config(j["quantization_config"], "config.json");
  CHECK(q.algo == fn::QuantConfig::Algo::Nvfp4);
  CHECK(q.group_size == 16);
  CHECK(q.exclude_modules == kRadixExcludes);
  CHECK(q.producer == "modelopt 0.46.0");
  CHECK(q.is_nvfp4("model.language_model.layers.3.mlp.experts.17.gate_proj"));
  CHECK(q.is_nvfp4("model.language_model.layers.47.mlp.experts.511.down_proj"));
  CHECK(!q.is_nvfp4("model.language_model.layers.3.mlp.gate"));
  CHECK(!q.is_nvfp4("model.language_model.layers.3.mlp.shared_expert.gate_proj"));
  CHECK(!q.is_nvfp4("model.language_model.layers.3.mlp.shared_expert_gate"));
  CHECK(!q.is_nvfp4("model.language_model.layers.0.linear_attn.in_proj_qkv"));
  CHECK(!q.is_nvfp4("model.language_model.layers.3.self_attn.q_proj"));
  CHECK(!q.is_nvfp4("model.language_model.layers.3.attn_hyper_connection.input_mix_weight_up"));
  CHECK(!q.is_nvfp4("model.language_model.layers.1.ple.key_proj"));
  CHECK(!q.is_nvfp4("model.language_model.embed_tokens"));
  CHECK(!q.is_nvfp4("lm_head"));
  CHECK(!q.is_nvfp4("mtp.layers.0.mlp.experts.gate_up_proj"));
  const fn::ModelConfig m = fn::parse_model_config(j, "config.json");
  CHECK(q.ngram_fp8(m));
  fn::ModelConfig no_dtype = m;
  no_dtype.ple_embedding_dtype.reset();
  CHECK(!q.ngram_fp8(no_dtype));
}

TEST_CASE(
    "config: hf_quant_config.json is parsed, preferred over config.json and must agree with it") {
  auto dir = temp_dir("hfq");
  json cfg = read(kReal);
  cfg["quantization_config"]["quant_algo"] = "NVFP4";
  write(dir / "config.json", cfg.dump());
  json hf = {{"producer", {{"name", "modelopt"}, {"version", "0.46.0"}}},
             {"quantization",
              {{"quant_algo", "NVFP4"},
               {"group_size", 16},
               {"exclude_modules", kRadixExcludes},
               {"kv_cache_quant_algo", nullptr}}}};
  write(dir / "hf_quant_config.json", hf.dump());
  fn::QuantConfig q = fn::load_quant_config(dir);
  CHECK(q.source == (dir / "hf_quant_config.json").string());
  CHECK(q.algo == fn::QuantConfig::Algo::Nvfp4);
  CHECK(q.exclude_modules.size() == 13);
  CHECK(q.kv_cache_quant_algo.empty());
  // The two files must name the same algorithm (case aside).
  cfg["quantization_config"]["quant_algo"] = "nvfp4";
  write(dir / "config.json", cfg.dump());
  CHECK(fn::load_quant_config(dir).algo == fn::QuantConfig::Algo::Nvfp4);
  cfg["quantization_config"]["quant_algo"] = "FP8";
  write(dir / "config.json", cfg.dump());
  CHECK_THROWS_WITH_AS(fn::load_quant_config(dir),
                       doctest::Contains("quantization_config.quant_algo 'FP8' disagrees with"),
                       fn::Error);
  cfg["quantization_config"]["quant_algo"] = "NVFP4";
  write(dir / "config.json", cfg.dump());
  std::filesystem::remove(dir / "hf_quant_config.json");
  q = fn::load_quant_config(dir);
  CHECK(q.source == (dir / "config.json").string());
  CHECK(q.exclude_modules.size() == 13);
  cfg.erase("quantization_config");
  write(dir / "config.json", cfg.dump());
  q = fn::load_quant_config(dir);
  CHECK(!q.quantized());
  CHECK(!q.is_nvfp4("model.language_model.layers.3.mlp.experts.17.gate_proj"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("config: a MIXED_PRECISION config (nvidia export) is parsed with its quantized_layers") {
  json ql = json::object();
  for (int l = 0; l < 48; ++l) {
    ql[fmt::format("model.language_model.layers.{}.mlp.experts", l)] = {{"quant_algo", "NVFP4"},
                                                                        {"group_size", 16}};
  }
  ql["model.language_model.layers.1.ple.ple_embedding.ngram_embedding"] = {{"quant_algo", "FP8"}};
  ql["mtp.layers.0.mlp.experts"] = {{"quant_algo", "FP8_PB_WO"}, {"group_size", 128}};
  json qc = {{"quant_method", "modelopt"},
             {"quant_algo", "MIXED_PRECISION"},
             {"ignore", {"lm_head", "model.language_model.embed_tokens", "model.visual*"}},
             {"quantized_layers", ql}};
  const fn::QuantConfig q = fn::parse_quantization_config(qc, "config.json");
  CHECK(q.algo == fn::QuantConfig::Algo::MixedPrecision);
  CHECK(q.quantized_layers.size() == 50);
  CHECK(q.is_nvfp4("model.language_model.layers.3.mlp.experts.17.gate_proj"));
  CHECK(!q.is_nvfp4("model.language_model.layers.3.mlp.experts_x.17.gate_proj"));
  CHECK(!q.is_nvfp4("model.language_model.layers.3.mlp.gate"));
  CHECK(!q.is_nvfp4("model.language_model.layers.1.ple.ple_embedding.ngram_embedding"));
  fn::ModelConfig m = fn::load_model_config(kReal);
  m.ple_embedding_dtype.reset();
  CHECK(q.ngram_fp8(m));
  SUBCASE("an FP8 block-scale entry outside mtp is rejected naming it") {
    qc["quantized_layers"]["model.language_model.layers.0.mlp.experts"]["quant_algo"] = "FP8_PB_WO";
    CHECK_THROWS_WITH_AS(
        fn::parse_quantization_config(qc, "config.json"),
        doctest::Contains("quantization_config.quantized_layers.model.language_model.layers.0.mlp."
                          "experts.quant_algo 'FP8_PB_WO' is not supported"),
        fn::Error);
  }
}

TEST_CASE("config: unknown quantization algorithms and methods are rejected naming the field") {
  json qc = read(kReal)["quantization_config"];
  SUBCASE("config.json quant_algo") {
    qc["quant_algo"] = "W4A8_AWQ";
    CHECK_THROWS_WITH_AS(
        fn::parse_quantization_config(qc, "config.json"),
        "config.json: quantization_config.quant_algo 'W4A8_AWQ' is not supported (NVFP4 or "
        "MIXED_PRECISION)",
        fn::Error);
  }
  SUBCASE("config.json quant_method") {
    qc["quant_method"] = "gptq";
    CHECK_THROWS_WITH_AS(fn::parse_quantization_config(qc, "config.json"),
                         doctest::Contains("quantization_config.quant_method 'gptq'"), fn::Error);
  }
  SUBCASE("config.json quant_algo missing") {
    qc.erase("quant_algo");
    CHECK_THROWS_WITH_AS(fn::parse_quantization_config(qc, "config.json"),
                         doctest::Contains("missing required field quantization_config.quant_algo"),
                         fn::Error);
  }
  SUBCASE("hf_quant_config.json quant_algo") {
    json hf = {{"quantization", {{"quant_algo", "FP8"}, {"group_size", 16}}}};
    CHECK_THROWS_WITH_AS(fn::parse_hf_quant_config(hf, "hf_quant_config.json"),
                         doctest::Contains("hf_quant_config.json: quantization.quant_algo 'FP8' is "
                                           "not supported"),
                         fn::Error);
  }
  SUBCASE("hf_quant_config.json group size") {
    json hf = {{"quantization", {{"quant_algo", "NVFP4"}, {"group_size", 32}}}};
    CHECK_THROWS_WITH_AS(fn::parse_hf_quant_config(hf, "hf_quant_config.json"),
                         doctest::Contains("quantization.group_size must be 16, got 32"),
                         fn::Error);
  }
  SUBCASE("exclude_modules of the wrong type") {
    json hf = {{"quantization", {{"quant_algo", "NVFP4"}, {"exclude_modules", "lm_head"}}}};
    CHECK_THROWS_WITH_AS(fn::parse_hf_quant_config(hf, "hf_quant_config.json"),
                         doctest::Contains("quantization.exclude_modules must be a list"),
                         fn::Error);
  }
}

TEST_CASE("config: generation_config.json is optional and its eos ids join the stop set") {
  auto dir = temp_dir("gen");
  fn::GenerationConfig g = fn::load_generation_config(dir);
  CHECK(g.eos_token_id.empty());
  CHECK(!g.temperature);
  write(dir / "generation_config.json",
        R"({"bos_token_id": 248044, "do_sample": true, "eos_token_id": [248046, 248044],
            "pad_token_id": 248044, "temperature": 1.0, "top_k": 20, "top_p": 0.95})");
  g = fn::load_generation_config(dir);
  CHECK(g.eos_token_id == std::vector<int64_t>{248046, 248044});
  CHECK(g.bos_token_id == 248044);
  CHECK(g.pad_token_id == 248044);
  CHECK(g.do_sample == true);
  CHECK(g.temperature == 1.0);
  CHECK(g.top_k == 20);
  CHECK(g.top_p == 0.95);
  CHECK(!g.min_p);
  CHECK(!g.presence_penalty);
  const fn::ModelConfig m = fn::load_model_config(kReal);
  CHECK(fn::stop_token_ids(m, g) == std::vector<int64_t>{248044, 248046});
  write(dir / "generation_config.json", R"({"eos_token_id": 5, "top_k": "20"})");
  CHECK_THROWS_WITH_AS(fn::load_generation_config(dir),
                       doctest::Contains("generation_config.json: top_k must be an integer"),
                       fn::Error);
  write(dir / "generation_config.json", R"({"top_p": 1.5})");
  CHECK_THROWS_WITH_AS(fn::load_generation_config(dir),
                       doctest::Contains("top_p must be in (0, 1], got 1.5"), fn::Error);
  // eos ids outside the model's vocabulary: refused when the vocabulary is given (as
  // config.json's).
  write(dir / "generation_config.json", R"({"eos_token_id": [1, 99999999]})");
  CHECK(fn::load_generation_config(dir).eos_token_id == std::vector<int64_t>{1, 99999999});
  CHECK_THROWS_WITH_AS(
      fn::load_generation_config(dir, 1000),
      doctest::Contains("generation_config.json: eos_token_id must be in [0, vocab_size = 1000), "
                        "got 99999999"),
      fn::Error);
  write(dir / "generation_config.json", R"({"eos_token_id": -1})");
  CHECK_THROWS_AS(fn::load_generation_config(dir, 1000), fn::Error);
  write(dir / "generation_config.json", R"({"eos_token_id": 999})");
  CHECK(fn::load_generation_config(dir, 1000).eos_token_id == std::vector<int64_t>{999});
  std::filesystem::remove_all(dir);
}
