// Mutation test: 20,000 seeded random byte mutations (bit flips, overwrites, truncations,
// extensions; mostly in the safetensors headers, some in the index JSON) of a valid two-shard
// checkpoint. Each mutant is opened and every tensor read through every slice API: the only
// acceptable outcomes are success or an fn::Error. Runs under ASan+UBSan in scripts/test.sh.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <random>

#include "checkpoint_test_util.h"
#include "core/checkpoint.h"
#include "core/safetensors_writer.h"

using fn::Checkpoint;
using fn::DType;
using fn::SafetensorsWriter;
using fn::testing::TempDir;
using fn::testing::write_file;

namespace {

constexpr int kMutants = 20000;
constexpr uint64_t kSeed = 20261130;

SafetensorsWriter::Fill pattern(int salt) {
  return [salt](std::span<std::byte> b) {
    for (std::size_t i = 0; i < b.size(); ++i)
      b[i] = static_cast<std::byte>((i * 13 + salt) & 0xFF);
  };
}

// Opens the checkpoint and reads every tensor whole, by rows, by block and by expert.
void open_and_read_all(const std::filesystem::path& dir) {
  const Checkpoint ck = Checkpoint::open(dir);
  std::vector<std::byte> buf;
  for (const std::string& name : ck.tensor_names()) {
    const fn::TensorInfo& t = ck.info(name);
    buf.assign(t.nbytes() + 1, std::byte{0});
    ck.read_all(name, buf.data());
    const auto view = ck.file_of(name).bytes(t);
    if (view.size() != t.nbytes()) FN_THROW(Internal, "view size of '{}'", name);
    const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    if (rows > 0) {
      ck.read_rows(name, rows - 1, 1, buf.data());
      ck.read_rows(name, 0, rows, buf.data());
    }
    if (!t.shape.empty() && rows > 0) ck.read_index0(name, rows / 2, buf.data());
    if (t.shape.size() == 2 && rows > 0 && t.shape[1] > 0) {
      ck.read_block(name, rows / 2, rows - rows / 2, t.shape[1] / 2, t.shape[1] - t.shape[1] / 2,
                    buf.data());
    }
  }
}

// Header length of a safetensors image (0 if it has fewer than 8 bytes).
uint64_t header_len(const std::string& img) {
  if (img.size() < 8) return 0;
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(img[i])) << (8 * i);
  return n;
}

// Applies one random mutation to `img`. `hot_end` bounds the region most mutations hit (the
// 8-byte length plus the JSON header, or the whole index).
void mutate(std::string& img, uint64_t hot_end, std::mt19937_64& rng) {
  static const char kInteresting[] = {'0', '1', '9', '-', '.',  'e',  '"',    '{',    '}', '[',
                                      ']', ',', ':', ' ', '\\', '\0', '\x7f', '\xff', 'U', 'F'};
  auto pick = [&](uint64_t n) { return n == 0 ? 0 : rng() % n; };
  auto pos = [&] {
    if (img.empty()) return uint64_t{0};
    const uint64_t hot = std::min<uint64_t>(hot_end, img.size());
    return (rng() % 10 < 8 && hot > 0) ? pick(hot) : pick(img.size());
  };
  switch (rng() % 10) {
    case 0:
    case 1:
    case 2:  // flip one bit
      if (!img.empty()) img[pos()] ^= static_cast<char>(1u << (rng() % 8));
      break;
    case 3:
    case 4:
    case 5:  // overwrite one byte with a syntax-relevant character
      if (!img.empty()) img[pos()] = kInteresting[rng() % sizeof(kInteresting)];
      break;
    case 6:  // overwrite one byte with a random value
      if (!img.empty()) img[pos()] = static_cast<char>(rng() & 0xFF);
      break;
    case 7:  // overwrite a byte of the 8-byte length (or the index's start)
      if (!img.empty()) img[pick(std::min<uint64_t>(8, img.size()))] = static_cast<char>(rng());
      break;
    case 8:  // truncate
      img.resize(rng() % 4 == 0 ? pick(img.size() + 1)
                                : img.size() - pick(std::min<uint64_t>(16, img.size()) + 1));
      break;
    default:  // extend with random bytes
      for (uint64_t i = 0, n = 1 + pick(24); i < n; ++i) img.push_back(static_cast<char>(rng()));
      break;
  }
}

}  // namespace

TEST_CASE("safetensors fuzz: 20,000 mutated checkpoints either load or fail with fn::Error") {
  TempDir dir(fn::testing::fast_temp_base());
  {
    SafetensorsWriter a;
    a.set_metadata("format", "pt");
    a.add("experts.0.weight", DType::U8, {4, 8}, pattern(1));
    a.add("experts.0.weight_scale", DType::F8_E4M3, {4, 1}, pattern(2));
    a.add("experts.0.weight_scale_2", DType::F32, {}, pattern(3));
    a.add("norm.weight", DType::BF16, {6}, pattern(4));
    a.write(dir / "model-00001-of-00002.safetensors");
    SafetensorsWriter b;
    b.add("embed.weight", DType::BF16, {3, 5}, pattern(5));
    b.add("ple.layer_multipliers", DType::I64, {3}, pattern(6));
    b.add("fused.experts", DType::F32, {2, 2, 3}, pattern(7));
    b.add("ngram.shard_0.weight", DType::F8_E4M3, {5, 4}, pattern(8));
    b.write(dir / "model-00002-of-00002.safetensors");
  }
  write_file(dir / "model.safetensors.index.json",
             R"({"metadata": {"total_size": 261}, "weight_map": {)"
             R"("experts.0.weight": "model-00001-of-00002.safetensors", )"
             R"("experts.0.weight_scale": "model-00001-of-00002.safetensors", )"
             R"("experts.0.weight_scale_2": "model-00001-of-00002.safetensors", )"
             R"("norm.weight": "model-00001-of-00002.safetensors", )"
             R"("embed.weight": "model-00002-of-00002.safetensors", )"
             R"("ple.layer_multipliers": "model-00002-of-00002.safetensors", )"
             R"("fused.experts": "model-00002-of-00002.safetensors", )"
             R"("ngram.shard_0.weight": "model-00002-of-00002.safetensors"}})");
  const std::vector<std::filesystem::path> targets = {dir / "model-00001-of-00002.safetensors",
                                                      dir / "model-00002-of-00002.safetensors",
                                                      dir / "model.safetensors.index.json"};
  std::vector<std::string> originals;
  for (const auto& p : targets) originals.push_back(fn::testing::read_file(p));
  REQUIRE_NOTHROW(open_and_read_all(dir.path()));  // the pristine checkpoint is valid

  std::mt19937_64 rng(kSeed);
  int loaded = 0, rejected = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kMutants; ++i) {
    const uint64_t r = rng() % 100;
    const std::size_t target = r < 45 ? 0 : r < 85 ? 1 : 2;  // 85% shards, 15% index
    std::string img = originals[target];
    const uint64_t hot = target == 2 ? img.size() : 8 + header_len(img);
    for (uint64_t m = 0, n = 1 + rng() % 3; m < n; ++m) mutate(img, hot, rng);
    write_file(targets[target], img);
    try {
      open_and_read_all(dir.path());
      ++loaded;
    } catch (const fn::Error& e) {
      if (e.kind() == fn::ErrorKind::Internal)
        FAIL("mutant " << i << ": internal error " << e.what());
      ++rejected;
    } catch (const std::exception& e) {
      FAIL("mutant " << i << " (target " << target << "): foreign exception " << e.what());
    } catch (...) {
      FAIL("mutant " << i << " (target " << target << "): unknown exception");
    }
    write_file(targets[target], originals[target]);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE(loaded << " mutants loaded, " << rejected << " rejected, in " << secs << " s");
  CHECK(loaded + rejected == kMutants);
  // Both outcomes must occur, or the mutations are not reaching the parser's decisions.
  CHECK(loaded > 100);
  CHECK(rejected > kMutants / 2);
}
