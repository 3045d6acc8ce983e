// RankSliceReader and open_model (see rank_slices.h).
#include "core/rank_slices.h"

#include <algorithm>
#include <cstring>

#include "core/codecs.h"
#include "core/error.h"
#include "core/log.h"
#include "core/model_tensors.h"
#include "core/weight_checks.h"

namespace fn {

namespace {
constexpr std::string_view kPrefix = "model.language_model.";
}  // namespace

float scalar_to_float(DType dtype, const std::byte* p) {
  switch (dtype) {
    case DType::F32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::BF16:
    case DType::F16: {
      uint16_t bits;
      std::memcpy(&bits, p, 2);
      return dtype == DType::BF16 ? bf16_to_float(bits) : fp16_to_float(bits);
    }
    case DType::F8_E4M3:
      return e4m3_to_float(static_cast<uint8_t>(*p));
    default:
      FN_THROW(Internal, "scalar_to_float: dtype {} is not a float type", dtype_name(dtype));
  }
}

std::vector<float> slice_to_f32(const WeightSlice& s) {
  std::vector<float> out(static_cast<std::size_t>(s.rows * s.cols));
  const std::size_t es = dtype_size(s.dtype);
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = scalar_to_float(s.dtype, s.bytes->data() + i * es);
  return out;
}

std::string RankSliceReader::stored_name(std::string_view name) const {
  if (bare_ && name.starts_with(kPrefix))
    return "model." + std::string(name.substr(kPrefix.size()));
  return std::string(name);
}

RankSliceReader::Layout RankSliceReader::layout(const std::string& name) const {
  const std::size_t idx = plan_.index(name);
  const ExpectedTensor& e = plan_.tensors()[idx];
  Layout l;
  l.blocks = plan_.shard(idx, rank_).blocks;
  std::sort(l.blocks.begin(), l.blocks.end(), [](const SliceBlock& a, const SliceBlock& b) {
    return a.row_begin != b.row_begin ? a.row_begin < b.row_begin : a.col_begin < b.col_begin;
  });
  l.stored = stored_name(name);
  l.role = e.role;
  const TensorInfo& info = ck_.info(l.stored);
  FN_REQUIRE(info.dtype == e.dtype, Format, "{}: tensor '{}' is {}, expected {}",
             ck_.dir().string(), l.stored, dtype_name(info.dtype), dtype_name(e.dtype));
  l.dtype = info.dtype;
  if (l.blocks.empty()) return l;
  l.cols = l.blocks.front().col_count;
  for (const SliceBlock& b : l.blocks) {
    FN_CHECK(b.col_begin == l.blocks.front().col_begin && b.col_count == l.cols,
             "shard plan of '{}' mixes column ranges on rank {}", name, rank_);
    l.rows += b.row_count;
  }
  return l;
}

void RankSliceReader::copy(const std::string& name, const Layout& l, std::byte* dst) {
  if (l.blocks.empty()) return;
  const TensorInfo& info = ck_.info(l.stored);
  std::byte* const start = dst;
  const int64_t total_cols = info.shape.size() >= 2 ? info.shape.back() : 1;
  const std::size_t es = dtype_size(info.dtype);
  const int64_t total_rows = total_cols > 0 ? info.numel() / total_cols : 0;
  if (l.blocks.size() == 1 && l.rows == total_rows && l.cols == total_cols) {
    ck_.read_all(l.stored, dst);        // the whole tensor: one pread
  } else if (info.shape.size() == 2) {  // 2-D blocks: one pread per block row
    for (const SliceBlock& b : l.blocks) {
      ck_.read_block(l.stored, b.row_begin, b.row_count, b.col_begin, b.col_count, dst);
      dst += static_cast<std::size_t>(b.row_count * b.col_count) * es;
    }
  } else {
    // Other ranks ([C, 1, K] convs, fused [E, R, C] experts): copy the block rows of the 2-D
    // view out of the read-only mapping (only those pages are touched).
    const std::span<const std::byte> src = ck_.file_of(l.stored).bytes(info);
    for (const SliceBlock& b : l.blocks) {
      for (int64_t r = 0; r < b.row_count; ++r) {
        const std::size_t off =
            static_cast<std::size_t>((b.row_begin + r) * total_cols + b.col_begin) * es;
        const std::size_t n = static_cast<std::size_t>(b.col_count) * es;
        FN_CHECK(off + n <= src.size(), "shard block of '{}' leaves the tensor", name);
        std::memcpy(dst, src.data() + off, n);
        dst += n;
      }
    }
  }
  const std::size_t n = static_cast<std::size_t>(l.rows * l.cols) * es;
  bytes_ += n;
  if (!is_scale_role(l.role)) return;
  const std::span<const std::byte> got(start, n);
  require_possible_scales(l.role, l.stored, l.dtype, got, ck_.dir().string());
  if (l.role == TensorRole::ExpertGlobalScale && l.stored.ends_with("_2")) {
    // "<module>.weight_scale_2" of 0: the block scales "<module>.weight_scale" say whether the
    // tensor had anything to scale.
    const std::string blocks = l.stored.substr(0, l.stored.size() - 2);
    if (const TensorInfo* b = ck_.find(blocks);
        b != nullptr && zero_global_scale_of_nonzero_tensor(scalar_to_float(l.dtype, start),
                                                            ck_.file_of(blocks).bytes(*b))) {
      FN_LOG_WARN(
          "{}: tensor '{}' is 0 while the block scales of '{}' are not: that tensor "
          "dequantizes to all zeros",
          ck_.dir().string(), l.stored, blocks);
    }
  }
}

WeightSlice RankSliceReader::read(const std::string& name) {
  const Layout l = layout(name);
  WeightSlice s;
  s.dtype = l.dtype;
  s.rows = l.rows;
  s.cols = l.cols;
  auto buf = std::make_shared<std::vector<std::byte>>(static_cast<std::size_t>(l.rows * l.cols) *
                                                      dtype_size(l.dtype));
  copy(name, l, buf->data());
  s.bytes = std::move(buf);
  return s;
}

DType RankSliceReader::read_into(const std::string& name, int64_t rows, int64_t cols,
                                 std::byte* dst, std::size_t capacity) {
  const Layout l = layout(name);
  FN_CHECK(l.rows == rows && l.cols == cols,
           "rank {}: slice of '{}' is [{}, {}], the backend expects [{}, {}]", rank_, name, l.rows,
           l.cols, rows, cols);
  FN_CHECK(static_cast<std::size_t>(rows * cols) * dtype_size(l.dtype) <= capacity,
           "slice of '{}' ({} x {} {}) does not fit {} bytes", name, rows, cols,
           dtype_name(l.dtype), capacity);
  copy(name, l, dst);
  return l.dtype;
}

WeightSlice RankSliceReader::read(const std::string& name, int64_t rows, int64_t cols) {
  WeightSlice s = read(name);
  FN_CHECK(s.rows == rows && s.cols == cols,
           "rank {}: slice of '{}' is [{}, {}], the backend expects [{}, {}]", rank_, name, s.rows,
           s.cols, rows, cols);
  return s;
}

OpenedModel open_model(const std::filesystem::path& dir, int tp_size) {
  ModelConfig cfg = load_model_config(dir);
  QuantConfig quant = load_quant_config(dir);
  ShardPlan plan = ShardPlan::build(cfg, quant, tp_size);
  Checkpoint ck = Checkpoint::open(dir);

  // Layout: model.language_model.* (multimodal export) or bare model.* (text-only export).
  const bool bare = ck.find(std::string(kPrefix) + "embed_tokens.weight") == nullptr &&
                    ck.find("model.embed_tokens.weight") != nullptr;
  const std::vector<std::string> names = ck.tensor_names();
  std::vector<std::string> mapped;  // FoundTensor views these names
  mapped.reserve(names.size());
  for (const std::string& n : names) {
    const bool strip = bare && n.starts_with("model.") && skipped_tensor(n) == SkipReason::None;
    mapped.push_back(strip ? std::string(kPrefix) + n.substr(6) : n);
  }
  std::vector<FoundTensor> found;
  found.reserve(names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    const TensorInfo& info = ck.info(names[i]);
    found.push_back(FoundTensor{mapped[i], info.dtype, info.shape});
  }
  require_valid(validate_tensors(plan.tensors(), found), dir.string());
  return OpenedModel{std::move(cfg), std::move(quant), std::move(plan), std::move(ck), bare};
}

}  // namespace fn
