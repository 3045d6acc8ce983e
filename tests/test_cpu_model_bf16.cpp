// CpuModel's unquantized paths (fused BF16 experts `mlp.experts.gate_up_proj` / `down_proj` of the
// BF16 release, docs/model.md §B.1, and a BF16 n-gram table) give bit-identical logits to the NVFP4
// + FP8 paths when they hold exactly the same values. Built from g3_tiny: every NVFP4 global scale
// is set to 2^-12 so each dequantised expert weight (E2M1 x E4M3 x 2^-12, at most 6 significant
// bits) is exact in BF16; the FP8 n-gram rows times the power-of-two BF16 scale are exact too
// (checked below). tp_size 1 and 2 (the fused tensors' FusedGateUpRows / column split).
#include <doctest/doctest.h>
#include <mpi.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include <unistd.h>

#include "comm/mpi_check.h"
#include "comm/mpi_collectives.h"
#include "core/codecs.h"
#include "core/cpu_model.h"
#include "core/safetensors.h"
#include "core/safetensors_writer.h"
#include "test_cpu_fixture.h"

namespace fs = std::filesystem;

namespace {

struct Tensor {
  fn::DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};
using TensorMap = std::map<std::string, Tensor>;

TensorMap read_all(const std::string& dir) {
  TensorMap m;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    const fn::SafetensorsFile f = fn::SafetensorsFile::open(entry.path());
    for (const fn::TensorInfo& t : f.tensors()) {
      const auto b = f.bytes(t);
      m[t.name] = Tensor{t.dtype, t.shape, std::vector<std::byte>(b.begin(), b.end())};
    }
  }
  return m;
}

// Writes one model.safetensors (no index) plus the given config.json.
void write_all(const TensorMap& m, const fs::path& dst, const nlohmann::json& config,
               bool copy_quant, const std::string& src) {
  fs::remove_all(dst);
  fs::create_directories(dst);
  std::ofstream(dst / "config.json") << config.dump(1);
  fs::copy_file(fs::path(src) / "generation_config.json", dst / "generation_config.json");
  if (copy_quant)
    fs::copy_file(fs::path(src) / "hf_quant_config.json", dst / "hf_quant_config.json");
  fn::SafetensorsWriter w;
  for (const auto& [name, t] : m) {
    const std::vector<std::byte>* bytes = &t.bytes;
    w.add(name, t.dtype, t.shape, [bytes](std::span<std::byte> out) {
      std::memcpy(out.data(), bytes->data(), out.size());
    });
  }
  w.write(dst / "model.safetensors");
}

void put_f32(Tensor& t, float v) {
  std::memcpy(t.bytes.data(), &v, 4);
}

uint16_t exact_bf16(float v) {
  const uint16_t b = fn::float_to_bf16(v);
  REQUIRE(fn::bf16_to_float(b) == v);  // the premise of the test: no rounding
  return b;
}

std::vector<float> logits_of(const fs::path& dir, const std::vector<int32_t>& tokens,
                             fn::Collectives& coll) {
  auto model = fn::CpuModel::load(dir, coll);
  std::vector<float> out;
  for (int32_t t : tokens) {
    const auto l = model->forward(t);
    out.insert(out.end(), l.begin(), l.end());
  }
  return out;
}

}  // namespace

TEST_CASE(
    "cpu model: fused BF16 experts and a BF16 n-gram table equal NVFP4 + FP8 holding the "
    "same values, at TP=1 and TP=2") {
  const fn::test::RefFixture f = fn::test::load_ref_fixture("g3_tiny");
  std::ifstream cj(f.dir + "/config.json");
  const nlohmann::json config = nlohmann::json::parse(cj);
  const nlohmann::json& tc = config.at("text_config");
  const int64_t L = tc.at("num_hidden_layers"), E = tc.at("num_experts"),
                I = tc.at("moe_intermediate_size"), D = tc.at("hidden_size");
  const std::string p = "model.language_model.layers.";
  int world_rank = 0;
  FN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  const fs::path base = fs::temp_directory_path() / ("fn_cpu_bf16_" + std::to_string(::getpid()) +
                                                     "_r" + std::to_string(world_rank));

  // Variant A: NVFP4 experts with power-of-two global scales, FP8 table (as in the fixture).
  TensorMap a = read_all(f.dir);
  const float g2 = std::ldexp(1.0f, -12);
  for (auto& [name, t] : a)
    if (name.ends_with(".weight_scale_2")) put_f32(t, g2);
  write_all(a, base / "nvfp4", config, true, f.dir);

  // Variant B: the same values as fused BF16 experts and a BF16 table, no quantization config.
  TensorMap b = a;
  for (int64_t l = 0; l < L; ++l) {
    Tensor gu{fn::DType::BF16, {E, 2 * I, D}, std::vector<std::byte>(E * 2 * I * D * 2)};
    Tensor dn{fn::DType::BF16, {E, D, I}, std::vector<std::byte>(E * D * I * 2)};
    auto* gu16 = reinterpret_cast<uint16_t*>(gu.bytes.data());
    auto* dn16 = reinterpret_cast<uint16_t*>(dn.bytes.data());
    for (int64_t e = 0; e < E; ++e) {
      const std::string ep = p + std::to_string(l) + ".mlp.experts." + std::to_string(e) + ".";
      auto dequant = [&](const std::string& proj, int64_t rows, int64_t cols, uint16_t* out) {
        const Tensor& w = a.at(ep + proj + ".weight");
        const Tensor& s = a.at(ep + proj + ".weight_scale");
        std::vector<float> row(static_cast<std::size_t>(cols));
        for (int64_t r = 0; r < rows; ++r) {
          fn::dequant_nvfp4_row(reinterpret_cast<const uint8_t*>(w.bytes.data()) + r * cols / 2,
                                reinterpret_cast<const uint8_t*>(s.bytes.data()) + r * cols / 16,
                                g2, cols, row.data());
          for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = exact_bf16(row[c]);
        }
        for (const char* suffix : {".weight", ".weight_scale", ".weight_scale_2", ".input_scale"})
          b.erase(ep + proj + suffix);
      };
      dequant("gate_proj", I, D, gu16 + e * 2 * I * D);
      dequant("up_proj", I, D, gu16 + e * 2 * I * D + I * D);
      dequant("down_proj", D, I, dn16 + e * D * I);
    }
    b[p + std::to_string(l) + ".mlp.experts.gate_up_proj"] = std::move(gu);
    b[p + std::to_string(l) + ".mlp.experts.down_proj"] = std::move(dn);
  }
  const std::string ng = p + "1.ple.ple_embedding.ngram_embedding.";
  uint16_t scale_bits;
  std::memcpy(&scale_bits, b.at(ng + "weight_scale").bytes.data(), 2);
  const float scale = fn::bf16_to_float(scale_bits);
  b.erase(ng + "weight_scale");
  for (auto& [name, t] : b) {
    if (!name.starts_with(ng + "shard_")) continue;
    REQUIRE(t.dtype == fn::DType::F8_E4M3);
    std::vector<std::byte> out(t.bytes.size() * 2);
    for (std::size_t i = 0; i < t.bytes.size(); ++i) {
      const uint16_t v = exact_bf16(fn::e4m3_to_float(static_cast<uint8_t>(t.bytes[i])) * scale);
      std::memcpy(out.data() + 2 * i, &v, 2);
    }
    t.dtype = fn::DType::BF16;
    t.bytes = std::move(out);
  }
  nlohmann::json config_b = config;
  config_b.erase("quantization_config");
  config_b["text_config"].erase("ple_embedding_dtype");
  write_all(b, base / "bf16", config_b, false, f.dir);

  for (int tp : {1, 2}) {
    CAPTURE(tp);
    MPI_Comm comm;
    FN_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, world_rank / tp, world_rank, &comm));
    fn::MpiCollectives coll(comm);
    const std::vector<float> la = logits_of(base / "nvfp4", f.tokens, coll);
    const std::vector<float> lb = logits_of(base / "bf16", f.tokens, coll);
    CHECK(la == lb);
    // Full-size, finite logits (their values differ from the fixture's reference: the global
    // scales were changed on purpose).
    CHECK(la.size() == f.tokens.size() * static_cast<std::size_t>(f.vocab));
    CHECK(std::isfinite(fn::test::max_abs(la.data(), static_cast<int64_t>(la.size()))));
    MPI_Comm_free(&comm);
  }
  fs::remove_all(base);
}
