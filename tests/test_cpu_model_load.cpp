// CpuModel loading: the bare `model.*` layout gives the same model as `model.language_model.*`;
// a missing tensor and drifted n-gram constants are rejected with the tensor named. The variants
// are rewritten copies of the g3_tiny reference fixture (core/safetensors_writer.h).
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>

#include <unistd.h>

#include "core/collectives.h"
#include "core/cpu_model.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "core/safetensors_writer.h"
#include "test_cpu_fixture.h"

namespace fs = std::filesystem;

namespace {

// Renames (nullopt drops) a tensor; may modify its bytes.
using Rename = std::function<std::optional<std::string>(const std::string&)>;
using Mutate = std::function<void(const std::string&, std::span<std::byte>)>;

// Copies the fixture checkpoint `src` to a fresh temp folder with every tensor renamed/mutated.
fs::path rewrite_checkpoint(const std::string& src, const std::string& tag, const Rename& rename,
                            const Mutate& mutate) {
  const fs::path dst =
      fs::temp_directory_path() / ("fn_cpu_model_load_" + std::to_string(::getpid()) + "_" + tag);
  fs::remove_all(dst);
  fs::create_directories(dst);
  for (const char* f : {"config.json", "hf_quant_config.json", "generation_config.json"})
    fs::copy_file(fs::path(src) / f, dst / f);
  nlohmann::json index;
  index["metadata"] = nlohmann::json::object();
  index["weight_map"] = nlohmann::json::object();
  for (const auto& entry : fs::directory_iterator(src)) {
    if (entry.path().extension() != ".safetensors") continue;
    const fn::SafetensorsFile in = fn::SafetensorsFile::open(entry.path());
    fn::SafetensorsWriter w;
    for (const fn::TensorInfo& t : in.tensors()) {
      const std::optional<std::string> name = rename(t.name);
      if (!name) continue;
      const std::span<const std::byte> bytes = in.bytes(t);
      const std::string old_name = t.name;
      w.add(*name, t.dtype, t.shape, [bytes, old_name, &mutate](std::span<std::byte> out) {
        std::memcpy(out.data(), bytes.data(), bytes.size());
        mutate(old_name, out);
      });
      index["weight_map"][*name] = entry.path().filename().string();
    }
    w.write(dst / entry.path().filename());
  }
  std::ofstream(dst / "model.safetensors.index.json") << index.dump(1);
  return dst;
}

const Rename kSame = [](const std::string& n) { return std::optional<std::string>(n); };
const Mutate kKeep = [](const std::string&, std::span<std::byte>) {};

std::vector<float> first_rows(const fs::path& dir, const fn::test::RefFixture& f, int rows) {
  fn::LocalCollectives local;
  auto model = fn::CpuModel::load(dir, local);
  std::vector<float> out;
  for (int p = 0; p < rows; ++p) {
    const auto l = model->forward(f.tokens[static_cast<std::size_t>(p)]);
    out.insert(out.end(), l.begin(), l.end());
  }
  return out;
}

std::string load_error(const fs::path& dir) {
  fn::LocalCollectives local;
  try {
    (void)fn::CpuModel::load(dir, local);
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Format);
    return e.what();
  }
  FAIL("no throw");
  return {};
}

}  // namespace

TEST_CASE("cpu model: the bare model.* layout loads the same model as model.language_model.*") {
  const fn::test::RefFixture f = fn::test::load_ref_fixture("g3_tiny");
  const std::string prefix = "model.language_model.";
  const fs::path bare = rewrite_checkpoint(
      f.dir, "bare",
      [&](const std::string& n) -> std::optional<std::string> {
        if (n.starts_with(prefix)) return "model." + n.substr(prefix.size());
        return n;
      },
      kKeep);
  const std::vector<float> a = first_rows(f.dir, f, 6);
  const std::vector<float> b = first_rows(bare, f, 6);
  CHECK(a == b);
  fs::remove_all(bare);
}

TEST_CASE("cpu model: a missing text tensor is a format error naming it") {
  const fn::test::RefFixture f = fn::test::load_ref_fixture("g3_tiny");
  const std::string gone = "model.language_model.layers.2.linear_attn.A_log";
  const fs::path dir = rewrite_checkpoint(
      f.dir, "missing",
      [&](const std::string& n) -> std::optional<std::string> {
        if (n == gone) return std::nullopt;
        return n;
      },
      kKeep);
  const std::string msg = load_error(dir);
  MESSAGE(msg);
  CHECK(msg.find(gone) != std::string::npos);
  CHECK(msg.find("missing") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("cpu model: stored n-gram multipliers that disagree with the config are rejected") {
  const fn::test::RefFixture f = fn::test::load_ref_fixture("g3_tiny");
  const std::string name = "model.language_model.layers.1.ple.ple_embedding.layer_multipliers";
  const fs::path dir =
      rewrite_checkpoint(f.dir, "drift", kSame, [&](const std::string& n, std::span<std::byte> b) {
        if (n != name) return;
        int64_t v;
        std::memcpy(&v, b.data(), 8);
        v += 2;
        std::memcpy(b.data(), &v, 8);
      });
  const std::string msg = load_error(dir);
  MESSAGE(msg);
  CHECK(msg.find(name) != std::string::npos);
  fs::remove_all(dir);
}
