// safetensors reader and writer: every malformed header rejected with a Format error naming the
// file and tensor, slice reads byte-exact against a full read, writer -> reader round trips.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "checkpoint_test_util.h"
#include "core/safetensors.h"
#include "core/safetensors_writer.h"

using fn::DType;
using fn::ErrorKind;
using fn::SafetensorsFile;
using fn::SafetensorsWriter;
using fn::testing::check_error;
using fn::testing::raw_safetensors;
using fn::testing::TempDir;
using fn::testing::write_file;

namespace {

// The names in `dir`, sorted.
std::vector<std::string> dir_entries(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Opens a file made of `header` (JSON text) and `data`, expecting a Format error naming the file
// and each of `parts`.
void expect_bad_header(const std::string& header, const std::string& data,
                       std::vector<std::string> parts) {
  TempDir dir;
  const auto path = dir / "bad.safetensors";
  write_file(path, raw_safetensors(header, data));
  parts.push_back(path.string());
  check_error([&] { SafetensorsFile::open(path); }, ErrorKind::Format, parts);
}

// Byte i of tensor `salt` is (i * 7 + salt) mod 256: every slice is distinguishable.
SafetensorsWriter::Fill pattern(int salt) {
  return [salt](std::span<std::byte> b) {
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::byte>((i * 7 + salt) & 0xFF);
  };
}

std::vector<std::byte> full(const SafetensorsFile& f, const fn::TensorInfo& t) {
  std::vector<std::byte> out(t.nbytes());
  f.read_all(t, out.data());
  return out;
}

}  // namespace

TEST_CASE("safetensors: a file shorter than 8 bytes is rejected") {
  TempDir dir;
  const auto path = dir / "short.safetensors";
  write_file(path, std::string("\x02\x00\x00\x00\x00", 5));
  check_error([&] { SafetensorsFile::open(path); }, ErrorKind::Format,
              {path.string(), "shorter than the 8-byte"});
  write_file(path, "");
  check_error([&] { SafetensorsFile::open(path); }, ErrorKind::Format, {path.string()});
}

TEST_CASE("safetensors: a missing file is an Io error naming it") {
  TempDir dir;
  const auto path = dir / "nope.safetensors";
  check_error([&] { SafetensorsFile::open(path); }, ErrorKind::Io, {path.string()});
}

TEST_CASE("safetensors: a header length past the end of the file is rejected") {
  TempDir dir;
  const auto path = dir / "long.safetensors";
  write_file(path, raw_safetensors("{}", "", 3));
  check_error([&] { SafetensorsFile::open(path); }, ErrorKind::Format,
              {path.string(), "past the end of the file"});
}

TEST_CASE("safetensors: an absurdly large header length is rejected") {
  TempDir dir;
  const auto path = dir / "huge.safetensors";
  write_file(path, raw_safetensors("{}", "", 1ull << 40));
  check_error([&] { SafetensorsFile::open(path); }, ErrorKind::Format, {path.string(), "100 MB"});
  write_file(path, raw_safetensors("{}", "", UINT64_MAX - 1));
  check_error([&] { SafetensorsFile::open(path); }, ErrorKind::Format, {path.string(), "100 MB"});
}

TEST_CASE("safetensors: a header that is not JSON is rejected") {
  expect_bad_header("{\"a\": {\"dtype\": ", "", {"not valid JSON"});
  expect_bad_header(std::string("{\"a\":\0}", 7), "", {"not valid JSON"});
}

TEST_CASE("safetensors: a header that is not a JSON object is rejected") {
  expect_bad_header("[1, 2, 3]", "", {"not an object"});
  expect_bad_header("42      ", "", {"not an object"});
}

TEST_CASE("safetensors: a duplicate tensor name in the header is rejected") {
  expect_bad_header(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},)"
                    R"( "w": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}})",
                    "abcd", {"'w' twice"});
}

TEST_CASE("safetensors: __metadata__ must be an object of strings") {
  expect_bad_header(R"({"__metadata__": [1]})", "", {"__metadata__", "not an object"});
  expect_bad_header(R"({"__metadata__": {"format": 1}})", "", {"__metadata__", "format"});
}

TEST_CASE("safetensors: a tensor entry that is not an object is rejected") {
  expect_bad_header(R"({"w": [0, 2]})", "ab", {"tensor 'w'", "not an object"});
}

TEST_CASE("safetensors: an unknown dtype is rejected naming the tensor") {
  expect_bad_header(R"({"w": {"dtype": "F7", "shape": [2], "data_offsets": [0, 2]}})", "ab",
                    {"tensor 'w'", "unknown dtype 'F7'"});
  expect_bad_header(R"({"w": {"dtype": "bf16", "shape": [1], "data_offsets": [0, 2]}})", "ab",
                    {"tensor 'w'", "unknown dtype"});
}

TEST_CASE("safetensors: a missing or non-string dtype is rejected") {
  expect_bad_header(R"({"w": {"shape": [2], "data_offsets": [0, 2]}})", "ab",
                    {"tensor 'w'", "no dtype"});
  expect_bad_header(R"({"w": {"dtype": 3, "shape": [2], "data_offsets": [0, 2]}})", "ab",
                    {"tensor 'w'", "dtype is a JSON number"});
}

TEST_CASE("safetensors: a missing or non-array shape is rejected") {
  expect_bad_header(R"({"w": {"dtype": "U8", "data_offsets": [0, 2]}})", "ab",
                    {"tensor 'w'", "no shape"});
  expect_bad_header(R"({"w": {"dtype": "U8", "shape": 2, "data_offsets": [0, 2]}})", "ab",
                    {"tensor 'w'", "not an array"});
}

TEST_CASE("safetensors: a negative or non-integer shape entry is rejected") {
  expect_bad_header(R"({"w": {"dtype": "U8", "shape": [-2], "data_offsets": [0, 2]}})", "ab",
                    {"tensor 'w'", "negative"});
  expect_bad_header(R"({"w": {"dtype": "U8", "shape": [2.0], "data_offsets": [0, 2]}})", "ab",
                    {"tensor 'w'", "not an integer"});
  expect_bad_header(R"({"w": {"dtype": "U8", "shape": ["2"], "data_offsets": [0, 2]}})", "ab",
                    {"tensor 'w'", "not an integer"});
}

TEST_CASE("safetensors: a shape whose element count overflows is rejected") {
  expect_bad_header(
      R"({"w": {"dtype": "U8", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", "",
      {"tensor 'w'", "overflows"});
  expect_bad_header(
      R"({"w": {"dtype": "U8", "shape": [18446744073709551615], "data_offsets": [0, 0]}})", "",
      {"tensor 'w'", "too large"});
  // Fits in elements, overflows in bytes (2^62 F32 elements).
  expect_bad_header(
      R"({"w": {"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 0]}})", "",
      {"tensor 'w'", "overflows"});
}

TEST_CASE("safetensors: missing data_offsets or data_offsets that are not a pair are rejected") {
  expect_bad_header(R"({"w": {"dtype": "U8", "shape": [2]}})", "ab",
                    {"tensor 'w'", "no data_offsets"});
  expect_bad_header(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 1, 2]}})", "ab",
                    {"tensor 'w'", "not a pair"});
  expect_bad_header(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": "0,2"}})", "ab",
                    {"tensor 'w'", "not a pair"});
}

TEST_CASE("safetensors: negative data_offsets are rejected") {
  expect_bad_header(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [-1, 1]}})", "ab",
                    {"tensor 'w'", "negative"});
  expect_bad_header(R"({"w": {"dtype": "U8", "shape": [0], "data_offsets": [0, -0]}})", "",
                    {"tensor 'w'", "negative"});
}

TEST_CASE("safetensors: data_offsets that are not integers are rejected") {
  expect_bad_header(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2.5]}})", "ab",
                    {"tensor 'w'", "not an integer"});
  expect_bad_header(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, "2"]}})", "ab",
                    {"tensor 'w'", "not an integer"});
  expect_bad_header(
      R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 18446744073709551616]}})", "ab",
      {"tensor 'w'", "not an integer"});
}

TEST_CASE("safetensors: data_offsets out of order are rejected") {
  expect_bad_header(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [2, 0]}})", "ab",
                    {"tensor 'w'", "out of order"});
}

TEST_CASE("safetensors: data_offsets past the end of the data section are rejected") {
  expect_bad_header(R"({"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})", "abc",
                    {"tensor 'w'", "past the end"});
}

TEST_CASE("safetensors: a byte size that disagrees with shape times dtype size is rejected") {
  expect_bad_header(R"({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 3]}})", "abc",
                    {"tensor 'w'", "BF16 [3] needs 6"});
}

TEST_CASE("safetensors: overlapping data_offsets are rejected") {
  expect_bad_header(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                    R"( "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}})",
                    "abcdef", {"tensor 'b'", "overlaps tensor 'a'"});
}

TEST_CASE("safetensors: a gap between tensors is rejected") {
  expect_bad_header(R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},)"
                    R"( "b": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]}})",
                    "abcde", {"tensor 'b'", "gap"});
  expect_bad_header(R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}})", "abc",
                    {"tensor 'a'", "gap"});
}

TEST_CASE("safetensors: bytes after the last tensor are rejected") {
  expect_bad_header(R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})", "abc",
                    {"trailing"});
}

TEST_CASE("safetensors: a hand-written valid file parses, out-of-order entries sorted by offset") {
  TempDir dir;
  const auto path = dir / "ok.safetensors";
  // Entries listed out of offset order; a scalar, a zero-size tensor and metadata.
  write_file(path,
             raw_safetensors(R"({"b": {"dtype": "F32", "shape": [], "data_offsets": [2, 6]},)"
                             R"( "a": {"dtype": "I16", "shape": [1], "data_offsets": [0, 2]},)"
                             R"( "z": {"dtype": "F64", "shape": [0, 3], "data_offsets": [6, 6]},)"
                             R"( "__metadata__": {"format": "pt"}})",
                             std::string("\x01\x02\x00\x00\x80\x3f", 6)));
  const auto f = SafetensorsFile::open(path);
  REQUIRE(f.tensors().size() == 3);
  CHECK(f.tensors()[0].name == "a");
  CHECK(f.tensors()[1].name == "b");
  CHECK(f.metadata().at("format") == "pt");
  const auto* b = f.find("b");
  REQUIRE(b != nullptr);
  CHECK(b->numel() == 1);
  CHECK(b->nbytes() == 4);
  float v = 0;
  f.read_all(*b, &v);
  CHECK(v == 1.0f);
  int16_t a = 0;
  f.read_rows(*f.find("a"), 0, 1, &a);
  CHECK(a == 0x0201);
  CHECK(f.find("z")->numel() == 0);
  CHECK(f.find("missing") == nullptr);
  CHECK(f.data_size() == 6);
}

TEST_CASE("safetensors: writer output round-trips through the reader with the on-disk layout") {
  TempDir dir;
  const auto path = dir / "rt.safetensors";
  SafetensorsWriter w;
  w.set_metadata("format", "pt");
  w.add("z.first", DType::BF16, {3, 5}, pattern(1));
  w.add("a.second", DType::U8, {7}, pattern(2));
  w.add("scalar", DType::F32, {}, [](std::span<std::byte> b) {
    const float v = 2.5f;
    std::memcpy(b.data(), &v, 4);
  });
  w.add("i64", DType::I64, {2, 2}, pattern(3));
  w.add("empty", DType::F8_E4M3, {0}, pattern(4));
  const uint64_t written = w.write(path);
  CHECK(written == std::filesystem::file_size(path));
  // The staging file was renamed into place: the directory holds the file alone.
  CHECK(dir_entries(dir.path()) == std::vector<std::string>{"rt.safetensors"});

  const std::string raw = fn::testing::read_file(path);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= uint64_t(uint8_t(raw[i])) << (8 * i);
  CHECK(header_len % 8 == 0);
  CHECK(raw.size() == 8 + header_len + 30 + 7 + 4 + 32);
  // Tensors are contiguous in insertion order: z.first's 30 bytes come first.
  CHECK(uint8_t(raw[8 + header_len]) == 1);
  CHECK(uint8_t(raw[8 + header_len + 30]) == 2);

  const auto f = SafetensorsFile::open(path);
  CHECK(f.metadata().at("format") == "pt");
  const auto* t = f.find("z.first");
  REQUIRE(t);
  CHECK(t->dtype == DType::BF16);
  CHECK(t->shape == std::vector<int64_t>{3, 5});
  CHECK(t->begin == 0);
  CHECK(t->end == 30);
  CHECK(f.find("a.second")->begin == 30);
  const auto bytes = f.bytes(*t);
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    CHECK(std::to_integer<int>(bytes[i]) == int((i * 7 + 1) & 0xFF));
  }
  float s = 0;
  f.read_all(*f.find("scalar"), &s);
  CHECK(s == 2.5f);
  CHECK(f.find("empty")->nbytes() == 0);
  CHECK(f.find("i64")->dtype == DType::I64);
}

TEST_CASE("safetensors: a tensor larger than the write buffer is written whole") {
  TempDir dir;
  const auto path = dir / "big.safetensors";
  SafetensorsWriter w;
  w.add("small", DType::U8, {3}, pattern(5));
  w.add("big", DType::U8, {9 << 20}, pattern(6));  // 9 MB > the 8 MB staging buffer
  w.add("tail", DType::U8, {5}, pattern(7));
  w.add("big_zero", DType::U8, {(9 << 20) - 8}, nullptr);  // reuses the big buffer: still zeros
  w.add("small_zero", DType::U8, {16}, nullptr);
  w.write(path);
  const auto f = SafetensorsFile::open(path);
  const auto big = f.bytes(*f.find("big"));
  REQUIRE(big.size() == 9u << 20);
  bool ok = true;
  for (std::size_t i = 0; i < big.size(); ++i) {
    ok = ok && std::to_integer<int>(big[i]) == int((i * 7 + 6) & 0xFF);
  }
  CHECK(ok);
  CHECK(std::to_integer<int>(f.bytes(*f.find("tail"))[4]) == int((4 * 7 + 7) & 0xFF));
  for (const char* name : {"big_zero", "small_zero"}) {
    const auto z = f.bytes(*f.find(name));
    CHECK(std::all_of(z.begin(), z.end(), [](std::byte b) { return b == std::byte{0}; }));
  }
}

TEST_CASE("safetensors: row, block and expert slices equal the same bytes of a full read") {
  TempDir dir;
  const auto path = dir / "slices.safetensors";
  SafetensorsWriter w;
  w.add("w2d", DType::BF16, {6, 10}, pattern(11));
  w.add("nvfp4", DType::U8, {8, 12}, pattern(12));
  w.add("experts", DType::F32, {4, 3, 5}, pattern(13));
  w.add("vec", DType::I64, {9}, pattern(14));
  w.add("scalar", DType::F32, {}, pattern(15));
  w.write(path);
  const auto f = SafetensorsFile::open(path);

  const auto& t = *f.find("w2d");
  const auto all = full(f, t);
  std::vector<std::byte> rows(3 * 10 * 2);
  f.read_rows(t, 2, 3, rows.data());
  CHECK(std::memcmp(rows.data(), all.data() + 2 * 20, rows.size()) == 0);

  std::vector<std::byte> block(4 * 3 * 2);
  f.read_block(t, 1, 4, 6, 3, block.data());
  for (int r = 0; r < 4; ++r) {
    CHECK(std::memcmp(block.data() + r * 6, all.data() + (1 + r) * 20 + 6 * 2, 6) == 0);
  }
  std::vector<std::byte> whole_rows(2 * 20);
  f.read_block(t, 4, 2, 0, 10, whole_rows.data());
  CHECK(std::memcmp(whole_rows.data(), all.data() + 80, 40) == 0);

  // NVFP4 packed weight: a column is one byte (two E2M1 codes).
  const auto& q = *f.find("nvfp4");
  const auto qall = full(f, q);
  std::vector<std::byte> qb(8 * 4);
  f.read_block(q, 0, 8, 8, 4, qb.data());
  for (int r = 0; r < 8; ++r)
    CHECK(std::memcmp(qb.data() + r * 4, qall.data() + r * 12 + 8, 4) == 0);

  const auto& e = *f.find("experts");
  const auto eall = full(f, e);
  std::vector<std::byte> one(3 * 5 * 4);
  f.read_index0(e, 2, one.data());
  CHECK(std::memcmp(one.data(), eall.data() + 2 * 60, 60) == 0);

  const auto& v = *f.find("vec");
  const auto vall = full(f, v);
  std::vector<std::byte> vs(3 * 8);
  f.read_rows(v, 6, 3, vs.data());
  CHECK(std::memcmp(vs.data(), vall.data() + 48, 24) == 0);

  const auto& s = *f.find("scalar");
  std::vector<std::byte> sv(4);
  f.read_rows(s, 0, 1, sv.data());
  CHECK(std::memcmp(sv.data(), full(f, s).data(), 4) == 0);
  // The mapped view matches pread.
  CHECK(std::memcmp(f.bytes(t).data(), all.data(), all.size()) == 0);
}

TEST_CASE("safetensors: out-of-range slices are usage errors naming the tensor") {
  TempDir dir;
  const auto path = dir / "oob.safetensors";
  SafetensorsWriter w;
  w.add("w2d", DType::BF16, {6, 10}, pattern(1));
  w.add("vec", DType::F32, {4}, pattern(2));
  w.add("scalar", DType::F32, {}, pattern(3));
  w.write(path);
  const auto f = SafetensorsFile::open(path);
  std::vector<std::byte> buf(1024);
  const auto& t = *f.find("w2d");
  check_error([&] { f.read_rows(t, 5, 2, buf.data()); }, ErrorKind::Usage, {"'w2d'"});
  check_error([&] { f.read_rows(t, -1, 1, buf.data()); }, ErrorKind::Usage, {"'w2d'"});
  check_error([&] { f.read_rows(t, 0, -1, buf.data()); }, ErrorKind::Usage, {"'w2d'"});
  check_error([&] { f.read_block(t, 0, 1, 8, 3, buf.data()); }, ErrorKind::Usage, {"'w2d'"});
  check_error([&] { f.read_block(t, 0, 7, 0, 1, buf.data()); }, ErrorKind::Usage, {"'w2d'"});
  check_error([&] { f.read_block(t, 0, 1, -1, 1, buf.data()); }, ErrorKind::Usage, {"'w2d'"});
  check_error([&] { f.read_block(t, INT64_MAX, 2, 0, 1, buf.data()); }, ErrorKind::Usage,
              {"'w2d'"});
  check_error([&] { f.read_index0(t, 6, buf.data()); }, ErrorKind::Usage, {"'w2d'"});
  check_error([&] { f.read_block(*f.find("vec"), 0, 1, 0, 1, buf.data()); }, ErrorKind::Usage,
              {"'vec'", "2-D"});
  check_error([&] { f.read_index0(*f.find("scalar"), 0, buf.data()); }, ErrorKind::Usage,
              {"'scalar'"});
  // A TensorInfo from elsewhere is refused, not read at its offsets.
  fn::TensorInfo foreign = t;
  check_error([&] { f.read_all(foreign, buf.data()); }, ErrorKind::Usage, {"'w2d'"});
}

TEST_CASE("safetensors: the writer leaves no partial file when a fill throws") {
  TempDir dir;
  const auto path = dir / "fail.safetensors";
  SafetensorsWriter w;
  w.add("ok", DType::U8, {4}, pattern(1));
  w.add("boom", DType::U8, {4}, [](std::span<std::byte>) { FN_THROW(Internal, "fill failed"); });
  CHECK_THROWS_AS(w.write(path), fn::Error);
  CHECK_FALSE(std::filesystem::exists(path));
  CHECK(dir_entries(dir.path()).empty());  // nor its staging file
}

TEST_CASE("safetensors: the writer reports an unwritable path as an Io error naming it") {
  TempDir dir;
  const auto path = dir / "no_such_dir" / "x.safetensors";
  SafetensorsWriter w;
  w.add("ok", DType::U8, {4}, pattern(1));
  check_error([&] { w.write(path); }, ErrorKind::Io,
              {"cannot create the staging file", "x.safetensors.partial."});
}

TEST_CASE("safetensors: the writer refuses duplicate, reserved and negative declarations") {
  SafetensorsWriter w;
  w.add("a", DType::U8, {1}, pattern(1));
  check_error([&] { w.add("a", DType::U8, {1}, pattern(1)); }, ErrorKind::Usage, {"'a'"});
  check_error([&] { w.add("__metadata__", DType::U8, {1}, pattern(1)); }, ErrorKind::Usage,
              {"__metadata__"});
  check_error([&] { w.add("neg", DType::U8, {-1}, pattern(1)); }, ErrorKind::Usage, {"'neg'"});
  check_error([&] { w.add("big", DType::F32, {INT64_MAX / 2}, pattern(1)); }, ErrorKind::Usage,
              {"'big'"});
  CHECK(w.size() == 1);
}

TEST_CASE("safetensors: a moved file keeps its mapping and tensors") {
  TempDir dir;
  const auto path = dir / "mv.safetensors";
  SafetensorsWriter w;
  w.add("t", DType::U8, {16}, pattern(9));
  w.write(path);
  auto a = SafetensorsFile::open(path);
  const auto want = full(a, *a.find("t"));
  SafetensorsFile b = std::move(a);
  CHECK(b.path() == path);
  CHECK(std::memcmp(b.bytes(*b.find("t")).data(), want.data(), 16) == 0);
  auto c = SafetensorsFile::open(path);
  c = std::move(b);
  CHECK(std::memcmp(c.bytes(*c.find("t")).data(), want.data(), 16) == 0);
}

namespace {

// Pages of `path` in the page cache (mincore over a fresh read-only mapping).
std::size_t resident_pages(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  const std::size_t size = std::filesystem::file_size(path);
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  REQUIRE(m != MAP_FAILED);
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((size + page - 1) / page);
  REQUIRE(::mincore(m, size, vec.data()) == 0);
  ::munmap(m, size);
  ::close(fd);
  std::size_t n = 0;
  for (unsigned char v : vec) n += v & 1u;
  return n;
}

}  // namespace

TEST_CASE("safetensors: slice reads bring only the touched pages of a file into memory") {
  // In the build tree (a disk-backed filesystem, where clean pages can be evicted; tmpfs keeps
  // every page resident and would make this measurement meaningless).
  TempDir dir(std::filesystem::path(FN_BINARY_DIR));
  const auto path = dir / "pages.safetensors";
  SafetensorsWriter w;
  w.add("w", DType::U8, {1024, 16384}, pattern(3));  // 16 MB, 4 pages per row
  w.write(path);
  {
    const int fd = ::open(path.c_str(), O_RDONLY);
    REQUIRE(fd >= 0);
    REQUIRE(::fsync(fd) == 0);
    REQUIRE(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0);
    ::close(fd);
  }
  const std::size_t total = std::filesystem::file_size(path) / 4096;
  INFO("file pages: " << total);
  REQUIRE(resident_pages(path) <= 2);  // eviction worked

  const auto f = SafetensorsFile::open(path);
  const auto& t = *f.find("w");
  std::vector<std::byte> block(2 * 64), row(16384), all(t.nbytes());
  f.read_block(t, 100, 2, 4096, 64, block.data());
  f.read_index0(t, 700, row.data());
  // Header page + one page per block row + the 4 pages of row 700, with slack for the header
  // spanning a page boundary: far below the 4096 pages of the tensor.
  const std::size_t after = resident_pages(path);
  CHECK(after >= 7);
  CHECK(after <= 10);
  f.read_all(t, all.data());
  CHECK(std::memcmp(block.data(), all.data() + 100 * 16384 + 4096, 64) == 0);
  CHECK(std::memcmp(block.data() + 64, all.data() + 101 * 16384 + 4096, 64) == 0);
  CHECK(std::memcmp(row.data(), all.data() + 700 * 16384, 16384) == 0);
  // A column shard (the right half of every row) spans more than one 8 MiB coalesced read.
  const int64_t rows = t.shape[0];
  REQUIRE(rows * 16384 > (8 << 20));
  std::vector<std::byte> half(static_cast<std::size_t>(rows) * 8192);
  f.read_block(t, 0, rows, 8192, 8192, half.data());
  bool equal = true;
  for (int64_t r = 0; r < rows; ++r)
    equal &= std::memcmp(half.data() + r * 8192, all.data() + r * 16384 + 8192, 8192) == 0;
  CHECK(equal);
  CHECK(resident_pages(path) >= total - 1);
}
