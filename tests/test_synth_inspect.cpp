// fngen synth + fngen inspect: a synthesized checkpoint validates against its config, is
// reproducible from its seed, has the documented value ranges, and every way a checkpoint can
// disagree with its config is reported naming the tensor.
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <vector>

#include "core/checkpoint.h"
#include "core/codecs.h"
#include "core/inspect.h"
#include "core/ngram.h"
#include "core/safetensors_writer.h"
#include "core/synth.h"
#include "tests/checkpoint_test_util.h"

namespace fs = std::filesystem;
using fn::testing::TempDir;
using nlohmann::json;

namespace {

const fs::path kTinyConfig = fs::path(FN_SOURCE_DIR) / "configs/tiny.json";
const std::string kPrefix = "model.language_model.";

fn::SynthResult synth_into(const fs::path& out, uint64_t seed,
                           const fs::path& config = kTinyConfig) {
  fn::SynthOptions o;
  o.config = config;
  o.out = out;
  o.seed = seed;
  return fn::synth_checkpoint(o);
}

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

void write_json(const fs::path& p, const json& j) {
  std::ofstream out(p, std::ios::trunc);
  out << j.dump(2);
}

// Rewrites the shard file holding `victim` through the reader and writer: `victim` is dropped
// (replacement absent) or rewritten with another dtype/shape; the index follows.
void rewrite_tensor(const fs::path& dir, const std::string& victim, std::optional<fn::DType> dtype,
                    std::vector<int64_t> shape = {}) {
  json index = read_json(dir / "model.safetensors.index.json");
  const std::string file = index["weight_map"][victim];
  const fs::path path = dir / file;
  fs::path moved = dir / (file + ".orig");
  fs::rename(path, moved);
  {
    const fn::SafetensorsFile src = fn::SafetensorsFile::open(moved);
    fn::SafetensorsWriter w;
    for (const auto& t : src.tensors()) {
      if (t.name == victim) {
        if (!dtype) continue;
        w.add(t.name, *dtype, shape.empty() ? t.shape : shape,
              [](std::span<std::byte> b) { std::fill(b.begin(), b.end(), std::byte{0}); });
        continue;
      }
      const auto bytes = src.bytes(t);
      w.add(t.name, t.dtype, t.shape,
            [bytes](std::span<std::byte> b) { std::copy(bytes.begin(), bytes.end(), b.begin()); });
    }
    w.write(path);
  }
  fs::remove(moved);
  if (!dtype) {
    index["weight_map"].erase(victim);
    write_json(dir / "model.safetensors.index.json", index);
  }
}

std::string inspect_error(const fs::path& dir) {
  try {
    fn::inspect_checkpoint(dir, 1, 64);
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Format);
    return e.what();
  }
  FAIL("inspect accepted a bad checkpoint");
  return "";
}

}  // namespace

TEST_CASE("synth: the tiny checkpoint validates against its config and inspect reports it") {
  TempDir tmp;
  const fs::path dir = tmp / "tiny";
  const fn::SynthResult r = synth_into(dir, 3);
  const fn::ModelConfig cfg = fn::load_model_config(dir);
  const auto expected = fn::expected_tensors(cfg, fn::load_quant_config(dir));
  CHECK(r.tensors == expected.size() + 2);  // + one vision and one MTP tensor to skip
  CHECK(r.files >= 3);

  const fn::InspectReport rep = fn::inspect_checkpoint(dir, 2, 100);
  CHECK(rep.validation.ok());
  CHECK(rep.validation.matched == expected.size());
  CHECK(rep.validation.skipped_vision == 1);
  CHECK(rep.validation.skipped_mtp == 1);
  CHECK(rep.files == r.files);
  CHECK(rep.checkpoint_bytes + 8 * r.files < r.bytes);  // headers are on top of tensor bytes
  REQUIRE(rep.weight_bytes_per_rank.size() == 2);
  CHECK(rep.weight_bytes_per_rank[0] == rep.weight_bytes_per_rank[1]);
  // Both ranks together hold every byte once, plus the replicated ones twice.
  uint64_t text_bytes = 0;
  for (const auto& t : expected) text_bytes += t.nbytes();
  CHECK(rep.weight_bytes_per_rank[0] < text_bytes);
  CHECK(2 * rep.weight_bytes_per_rank[0] > text_bytes);
  CHECK(rep.groups.at("moe.experts/U8").tensors == 4 * 8 * 3);
  const json j = fn::inspect_json(rep);
  CHECK(j["ranks"].size() == 2);
  CHECK(j["validation"]["matched"] == expected.size());
  const std::string text = fn::format_inspect_text(rep);
  CHECK(text.find("4 (3 Gated DeltaNet, 1 QSA; PLE at layer index 1)") != std::string::npos);
}

TEST_CASE("synth: the same seed gives identical bytes and another seed different ones") {
  TempDir tmp;
  synth_into(tmp / "a", 11);
  synth_into(tmp / "b", 11);
  synth_into(tmp / "c", 12);
  const auto a = fn::testing::read_file(tmp / "a" / "model-bf16-00002.safetensors");
  CHECK(a == fn::testing::read_file(tmp / "b" / "model-bf16-00002.safetensors"));
  CHECK(a != fn::testing::read_file(tmp / "c" / "model-bf16-00002.safetensors"));
}

TEST_CASE("synth: weights follow the documented distributions") {
  TempDir tmp;
  const fs::path dir = tmp / "tiny";
  synth_into(dir, 5);
  const fn::Checkpoint ck = fn::Checkpoint::open(dir);
  const fn::ModelConfig cfg = fn::load_model_config(dir);

  SUBCASE("a BF16 linear has sigma 1/sqrt(fan-in)") {
    const std::string name = kPrefix + "layers.0.linear_attn.in_proj_qkv.weight";
    const auto& info = ck.info(name);
    std::vector<uint16_t> w(static_cast<std::size_t>(info.numel()));
    ck.read_all(name, w.data());
    double ss = 0;
    for (uint16_t b : w) ss += std::pow(fn::bf16_to_float(b), 2);
    const double sigma = std::sqrt(ss / static_cast<double>(w.size()));
    CHECK(sigma == doctest::Approx(1.0 / std::sqrt(64.0)).epsilon(0.05));
  }
  SUBCASE("a dequantized NVFP4 expert has sigma close to 1/sqrt(K)") {
    const std::string base = kPrefix + "layers.2.mlp.experts.5.gate_proj.";
    const int64_t rows = cfg.moe_intermediate_size, k = cfg.hidden_size;
    std::vector<uint8_t> packed(static_cast<std::size_t>(rows * k / 2));
    std::vector<uint8_t> scales(static_cast<std::size_t>(rows * k / 16));
    float global = 0;
    ck.read_all(base + "weight", packed.data());
    ck.read_all(base + "weight_scale", scales.data());
    ck.read_all(base + "weight_scale_2", &global);
    std::vector<float> row(static_cast<std::size_t>(k));
    double ss = 0;
    for (int64_t r = 0; r < rows; ++r) {
      fn::dequant_nvfp4_row(packed.data() + r * k / 2, scales.data() + r * k / 16, global, k,
                            row.data());
      for (float v : row) ss += double(v) * v;
    }
    const double sigma = std::sqrt(ss / double(rows * k));
    CHECK(sigma == doctest::Approx(1.0 / std::sqrt(double(k))).epsilon(0.1));
  }
  SUBCASE("the PLE I64 buffers hold the constants of docs/model.md §C.4") {
    const fn::NgramConstants k = fn::ngram_constants(cfg, 0);
    std::vector<int64_t> mult(3);
    ck.read_all(kPrefix + "layers.1.ple.ple_embedding.layer_multipliers", mult.data());
    CHECK(mult == std::vector<int64_t>{4295158889763781, 17440218147737327, 1270917961434445});
    CHECK(mult == k.multipliers);
  }
  SUBCASE("the FP8 n-gram table holds no NaN code and a positive BF16 scale") {
    const std::string name = kPrefix + "layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight";
    const auto& info = ck.info(name);
    std::vector<uint8_t> codes(static_cast<std::size_t>(info.numel()));
    ck.read_all(name, codes.data());
    for (uint8_t c : codes) REQUIRE((c & 0x7F) != 0x7F);
    uint16_t scale = 0;
    ck.read_all(kPrefix + "layers.1.ple.ple_embedding.ngram_embedding.weight_scale", &scale);
    CHECK(fn::bf16_to_float(scale) == doctest::Approx(std::sqrt(3.0) / 448.0).epsilon(0.01));
  }
}

TEST_CASE("synth: --layers keeps the first layers with the real widths and drops later PLE ids") {
  TempDir tmp;
  json j = read_json(kTinyConfig);
  j["text_config"]["ple_layer_ids"] = json::array({2, 4});
  j["text_config"]["layer_types"] = {"linear_attention", "linear_attention", "linear_attention",
                                     "linear_attention"};
  write_json(tmp / "cfg.json", j);
  fn::SynthOptions o;
  o.config = tmp / "cfg.json";
  o.out = tmp / "out";
  o.layers = 2;
  o.ngram_vocab_base = 500;
  fn::synth_checkpoint(o);
  const fn::ModelConfig cfg = fn::load_model_config(tmp / "out");
  CHECK(cfg.num_hidden_layers == 2);
  CHECK(cfg.layer_types.size() == 2);
  CHECK(cfg.ple_layer_ids == std::vector<int64_t>{2});
  CHECK(cfg.ngram_vocab_size_base == 500);
  CHECK(cfg.hidden_size == 64);
  CHECK(fn::inspect_checkpoint(tmp / "out", 1, 16).validation.ok());
}

TEST_CASE("synth: bad options fail before anything is written") {
  TempDir tmp;
  fn::SynthOptions o;
  o.config = kTinyConfig;
  o.out = tmp / "out";
  o.layers = 5;
  CHECK_THROWS_AS(fn::synth_checkpoint(o), fn::Error);
  CHECK_FALSE(fs::exists(tmp / "out"));
  CHECK_FALSE(fs::exists(tmp / "out.partial"));

  // synth_checkpoint(o) must throw an fn::Error of `kind` whose message contains `text`.
  auto expect_error = [](const fn::SynthOptions& opt, fn::ErrorKind kind, const std::string& text) {
    try {
      fn::synth_checkpoint(opt);
      FAIL("accepted: expected an error containing '" << text << "'");
    } catch (const fn::Error& e) {
      CHECK(e.kind() == kind);
      CHECK_MESSAGE(std::string(e.what()).find(text) != std::string::npos, e.what());
    }
  };
  json j = read_json(kTinyConfig);
  j["text_config"]["num_experts"] = 0;
  write_json(tmp / "bad.json", j);
  o.config = tmp / "bad.json";
  o.layers = 0;
  expect_error(o, fn::ErrorKind::Format, "num_experts");
  CHECK_FALSE(fs::exists(tmp / "out"));

  fs::create_directories(tmp / "full");
  fn::testing::write_file(tmp / "full" / "x", "x");
  o.config = kTinyConfig;
  // Each kind of existing --out gets its own message: a non-empty directory, and a plain file.
  o.out = tmp / "full";
  expect_error(o, fn::ErrorKind::Usage, "is a directory that is not empty");
  o.out = tmp / "full" / "x";
  expect_error(o, fn::ErrorKind::Usage, "exists and is not a directory");
  CHECK(fn::testing::read_file(tmp / "full" / "x") == "x");  // left as it was
}

TEST_CASE("inspect: a missing tensor is reported by name") {
  TempDir tmp;
  synth_into(tmp / "m", 1);
  const std::string victim = kPrefix + "layers.0.linear_attn.in_proj_z.weight";
  rewrite_tensor(tmp / "m", victim, std::nullopt);
  const std::string msg = inspect_error(tmp / "m");
  CHECK(msg.find(victim) != std::string::npos);
  CHECK(msg.find("missing") != std::string::npos);
}

TEST_CASE("inspect: a missing NVFP4 scale tensor is reported by name") {
  TempDir tmp;
  synth_into(tmp / "m", 1);
  const std::string victim = kPrefix + "layers.3.mlp.experts.6.down_proj.weight_scale_2";
  rewrite_tensor(tmp / "m", victim, std::nullopt);
  CHECK(inspect_error(tmp / "m").find(victim) != std::string::npos);
}

TEST_CASE("inspect: a tensor with the wrong dtype is reported by name") {
  TempDir tmp;
  synth_into(tmp / "m", 1);
  const std::string victim = kPrefix + "layers.2.mlp.gate.weight";
  rewrite_tensor(tmp / "m", victim, fn::DType::F32);
  const std::string msg = inspect_error(tmp / "m");
  CHECK(msg.find(victim) != std::string::npos);
  CHECK(msg.find("F32") != std::string::npos);
}

TEST_CASE("inspect: a shape that disagrees with the config is reported by name") {
  TempDir tmp;
  synth_into(tmp / "m", 1);
  const std::string victim = kPrefix + "layers.3.self_attn.k_proj.weight";
  rewrite_tensor(tmp / "m", victim, fn::DType::BF16, {32, 64});
  const std::string msg = inspect_error(tmp / "m");
  CHECK(msg.find(victim) != std::string::npos);
  CHECK(msg.find("[32, 64]") != std::string::npos);
}

TEST_CASE("inspect: a config that disagrees with the checkpoint names the tensors") {
  TempDir tmp;
  synth_into(tmp / "m", 1);
  json j = read_json(tmp / "m" / "config.json");
  j["text_config"]["moe_intermediate_size"] = 48;
  write_json(tmp / "m" / "config.json", j);
  CHECK(inspect_error(tmp / "m").find("mlp.experts.") != std::string::npos);
}

TEST_CASE("inspect: PLE buffers that differ from the config's constants are reported") {
  TempDir tmp;
  synth_into(tmp / "m", 1);
  json j = read_json(tmp / "m" / "config.json");
  j["text_config"]["seed"] = 99;  // other multipliers
  write_json(tmp / "m" / "config.json", j);
  CHECK(inspect_error(tmp / "m").find("layer_multipliers") != std::string::npos);
}

TEST_CASE("inspect: an unexpected text tensor is reported by name") {
  TempDir tmp;
  synth_into(tmp / "m", 1);
  fn::SafetensorsWriter w;
  w.add(kPrefix + "layers.0.mystery.weight", fn::DType::BF16, {4},
        [](std::span<std::byte> b) { std::fill(b.begin(), b.end(), std::byte{0}); });
  w.write(tmp / "m" / "extra.safetensors");
  json index = read_json(tmp / "m" / "model.safetensors.index.json");
  index["weight_map"][kPrefix + "layers.0.mystery.weight"] = "extra.safetensors";
  write_json(tmp / "m" / "model.safetensors.index.json", index);
  CHECK(inspect_error(tmp / "m").find("mystery") != std::string::npos);
}

TEST_CASE("inspect: the transformers-made fixtures validate (independent layout check)") {
  for (const char* name : {"g3_tiny", "tp4", "ple2_long"}) {
    CAPTURE(name);
    const fs::path dir = fs::path(FN_TEST_DATA_DIR) / "fixtures" / name;
    const fn::InspectReport rep = fn::inspect_checkpoint(dir, 1, 64);
    CHECK(rep.validation.ok());
    CHECK(rep.validation.matched > 400);
  }
}

TEST_CASE("inspect: a config file alone gives the real geometry's per-rank figures") {
  const fs::path cfg = fs::path(FN_SOURCE_DIR) / "configs/qwen3.8-flash-next.json";
  const fn::InspectReport rep = fn::inspect_checkpoint(cfg, 4, 8192);
  CHECK(rep.plan_only);
  REQUIRE(rep.weight_bytes_per_rank.size() == 4);
  // docs/model.md §E.2: about 34 GB per rank at TP=4 with the row-split PLE table (32.0 GiB here,
  // without MTP and vision), and about 3.6 GB read per token.
  const double gib = 1024.0 * 1024 * 1024;
  CHECK(rep.weight_bytes_per_rank[0] / gib == doctest::Approx(32.0).epsilon(0.01));
  CHECK(rep.token_bytes[0].total() / 1e9 == doctest::Approx(3.7).epsilon(0.05));
  // The routed experts: 10 of 512, a quarter of each.
  CHECK(rep.token_bytes[0].weights.at("moe.experts") ==
        rep.weight_bytes_by_family[0].at("moe.experts") * 10 / 512);
}
