// CudaModel's load (see cuda_model.h): the weight sources (a checkpoint's rank slices or random
// values generated on the device), the checks of what this backend runs, the kernel plan, and
// the arena build of every weight, state and activation buffer.
#include "cuda/model/cuda_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>

#include "comm/device_all_reduce.h"
#include "core/codecs.h"
#include "core/error.h"
#include "core/log.h"
#include "core/memory_plan.h"
#include "core/ngram.h"
#include "core/progress.h"
#include "core/rank_slices.h"
#include "core/shard_plan.h"
#include "cuda/common/cuda_check.h"
#include "cuda/kernels/gdn.h"
#include "cuda/kernels/hc.h"
#include "cuda/kernels/moe_nvfp4.h"
#include "cuda/kernels/moe_shared.h"
#include "cuda/kernels/ple.h"
#include "cuda/kernels/qsa.h"
#include "cuda/kernels/weight_fill.h"
#include "cuda/model/cuda_model_impl.h"
#include "cuda/model/kernel_plan.h"

namespace fn {

using namespace model_detail;

namespace model_detail {

constexpr std::string_view kPrefix = "model.language_model.";

// ---- weight sources -----------------------------------------------------------------------------

// What a random weight should look like (core/synth.h's rules).
enum class Init { Linear, LmHead, Embed, NormOnePlus, NormPlain, Conv, ALog, DtBias };

// Where the device weights come from: a checkpoint (this rank's slices) or random values.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // Fills dst (device) with the rank's [rows, cols] slice of `name` stored as `dtype`.
  virtual void fill(const std::string& name, int64_t rows, int64_t cols, DType dtype, Init init,
                    void* dst) = 0;
  // fill() into pinned host memory `dst` (the host-resident n-gram table): the same bytes.
  virtual void fill_host(const std::string& name, int64_t rows, int64_t cols, DType dtype,
                         Init init, std::byte* dst) = 0;
  // The rank's slice of a small tensor widened to FP32 on the host ([n] elements).
  virtual std::vector<float> vec(const std::string& name, int64_t n, Init init) = 0;
  // A scalar (weight_scale_2, the n-gram weight_scale).
  virtual float scalar(const std::string& name, float random_value) = 0;
  // Rows of `name` this rank holds (n-gram shards: 0 for another rank's shard).
  virtual int64_t held_rows(const std::string& name) = 0;
  virtual uint64_t bytes() const = 0;
};

// Rows of `name` the shard plan gives `rank` (0 for another rank's n-gram shard).
int64_t rows_held(const ShardPlan& plan, int rank, const std::string& name) {
  int64_t rows = 0;
  for (const SliceBlock& b : plan.shard(plan.index(name), rank).blocks) rows += b.row_count;
  return rows;
}

class CheckpointSource final : public WeightSource {
 public:
  CheckpointSource(const OpenedModel& om, int rank)
      : reader_(om.checkpoint, om.plan, rank, om.bare_layout),
        plan_(om.plan),
        rank_(rank),
        progress_("loading weights", om.plan.weight_bytes(rank), rank == 0) {}
  ~CheckpointSource() override {
    if (stream_) cudaStreamSynchronize(stream_);
    for (int i = 0; i < 2; ++i) {
      if (event_[i]) cudaEventDestroy(event_[i]);
      if (staging_[i]) cudaFreeHost(staging_[i]);
    }
    if (stream_) cudaStreamDestroy(stream_);
  }
  // Slices up to kStagingBytes go through two pinned buffers in turn: the disk read of one
  // slice overlaps the host-to-device copy of the previous one. Larger slices (embedding,
  // lm_head, n-gram shards) are read whole and copied synchronously.
  void fill(const std::string& name, int64_t rows, int64_t cols, DType dtype, Init,
            void* dst) override {
    const std::size_t bytes = static_cast<std::size_t>(rows * cols) * dtype_size(dtype);
    if (bytes <= kStagingBytes) {
      if (!stream_) start_staging();
      const int i = next_;
      next_ ^= 1;
      FN_CUDA_CHECK(cudaEventSynchronize(event_[i]));  // the copy out of buffer i is done
      const DType got = reader_.read_into(name, rows, cols, staging_[i], kStagingBytes);
      FN_CHECK(got == dtype, "'{}' is {}, the CUDA backend expects {}", name, dtype_name(got),
               dtype_name(dtype));
      FN_CUDA_CHECK(cudaMemcpyAsync(dst, staging_[i], bytes, cudaMemcpyHostToDevice, stream_));
      FN_CUDA_CHECK(cudaEventRecord(event_[i], stream_));
      progress_.add(bytes);
      return;
    }
    const WeightSlice s = reader_.read(name, rows, cols);
    FN_CHECK(s.dtype == dtype, "'{}' is {}, the CUDA backend expects {}", name, dtype_name(s.dtype),
             dtype_name(dtype));
    FN_CUDA_CHECK(cudaMemcpy(dst, s.bytes->data(), s.bytes->size(), cudaMemcpyHostToDevice));
    progress_.add(s.bytes->size());
  }
  // Reads the slice straight into pinned host memory (no second host copy).
  void fill_host(const std::string& name, int64_t rows, int64_t cols, DType dtype, Init,
                 std::byte* dst) override {
    const std::size_t bytes = static_cast<std::size_t>(rows * cols) * dtype_size(dtype);
    const DType got = reader_.read_into(name, rows, cols, dst, bytes);
    FN_CHECK(got == dtype, "'{}' is {}, the CUDA backend expects {}", name, dtype_name(got),
             dtype_name(dtype));
    progress_.add(bytes);
  }
  // Waits for the last staged copies and writes the final progress line.
  void finish() {
    if (stream_) FN_CUDA_CHECK(cudaStreamSynchronize(stream_));
    progress_.finish();
  }
  std::vector<float> vec(const std::string& name, int64_t n, Init) override {
    const WeightSlice s = reader_.read(name, n, 1);
    progress_.add(s.bytes->size());
    return slice_to_f32(s);
  }
  float scalar(const std::string& name, float) override {
    const WeightSlice s = reader_.read(name, 1, 1);
    progress_.add(s.bytes->size());
    return scalar_to_float(s.dtype, s.bytes->data());
  }
  int64_t held_rows(const std::string& name) override { return rows_held(plan_, rank_, name); }
  uint64_t bytes() const override { return reader_.bytes(); }
  // The raw slice (n-gram shards, conv taps, I64 buffers).
  WeightSlice read(const std::string& name) {
    WeightSlice s = reader_.read(name);
    progress_.add(s.bytes->size());
    return s;
  }

 private:
  void start_staging() {
    // A blocking stream: ordered after the arena's cudaMemset of each fresh block (legacy
    // default stream), so a zero fill can never land after the weights.
    FN_CUDA_CHECK(cudaStreamCreate(&stream_));
    for (int i = 0; i < 2; ++i) {
      FN_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&staging_[i]), kStagingBytes));
      FN_CUDA_CHECK(cudaEventCreateWithFlags(&event_[i], cudaEventDisableTiming));
      FN_CUDA_CHECK(cudaEventRecord(event_[i], stream_));
    }
  }

  static constexpr std::size_t kStagingBytes = std::size_t{64} << 20;
  RankSliceReader reader_;
  const ShardPlan& plan_;
  int rank_;
  ProgressLine progress_;
  cudaStream_t stream_ = nullptr;
  std::byte* staging_[2] = {nullptr, nullptr};
  cudaEvent_t event_[2] = {nullptr, nullptr};
  int next_ = 0;
};

uint64_t name_hash(std::string_view s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (char c : s) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

class RandomSource final : public WeightSource {
 public:
  RandomSource(const ShardPlan& plan, int rank, uint64_t seed)
      : plan_(plan), rank_(rank), seed_(seed) {}
  ~RandomSource() override {
    if (scratch_) cudaFree(scratch_);
  }
  void fill(const std::string& name, int64_t rows, int64_t cols, DType dtype, Init init,
            void* dst) override {
    launch_random_fill(params(name, rows, cols, dtype, init, dst), nullptr);
    bytes_ += static_cast<uint64_t>(rows * cols) * dtype_size(dtype);
  }
  // The device fill's values, generated in kScratchBytes pieces on the device (RandomFillParams::
  // first) and copied out: the host table holds the bytes fill() would give the device table.
  void fill_host(const std::string& name, int64_t rows, int64_t cols, DType dtype, Init init,
                 std::byte* dst) override {
    const int64_t count = rows * cols, size = static_cast<int64_t>(dtype_size(dtype));
    const int64_t piece = static_cast<int64_t>(kScratchBytes) / size;
    if (!scratch_) FN_CUDA_CHECK(cudaMalloc(&scratch_, kScratchBytes));
    for (int64_t first = 0; first < count; first += piece) {
      RandomFillParams p = params(name, rows, cols, dtype, init, scratch_);
      p.first = first;
      p.count = std::min(piece, count - first);
      launch_random_fill(p, nullptr);
      // Legacy default stream: after the fill, before the next piece overwrites the scratch.
      FN_CUDA_CHECK(cudaMemcpy(dst + first * size, scratch_,
                               static_cast<std::size_t>(p.count * size), cudaMemcpyDeviceToHost));
    }
    bytes_ += static_cast<uint64_t>(count * size);
  }
  // The fill of the whole [rows, cols] slice of `name` into dst.
  RandomFillParams params(const std::string& name, int64_t rows, int64_t cols, DType dtype,
                          Init init, void* dst) const {
    RandomFillParams p;
    p.dst = dst;
    p.count = rows * cols;
    p.dtype = dtype;
    p.seed = seed_;
    // A replicated tensor gets the same values on every rank (the router and the HC then choose
    // alike on all ranks, as with real weights); a sharded one differs per rank.
    const bool replicated = plan_.shard(plan_.index(name), rank_).replicated;
    p.stream = name_hash(name) + (replicated ? 0 : static_cast<uint64_t>(rank_) + 1);
    if (dtype == DType::U8) {
      p.kind = RandomFill::E2M1Codes;
    } else if (dtype == DType::F8_E4M3) {
      p.kind = name.find("ngram") != std::string::npos ? RandomFill::E4M3Uniform
                                                       : RandomFill::E4M3NearOne;
    } else {
      const float a = bound(init, cols);
      p.lo = init == Init::NormPlain ? 0.9f : -a;
      p.hi = init == Init::NormPlain ? 1.1f : a;
    }
    return p;
  }
  std::vector<float> vec(const std::string& name, int64_t n, Init init) override {
    std::vector<float> v(static_cast<std::size_t>(n));
    const uint64_t base = seed_ ^ name_hash(name);
    uint64_t i = 0;
    for (auto& x : v) {
      const uint64_t z = splitmix64(base + 0x9e3779b97f4a7c15ull * ++i);
      const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
      switch (init) {
        case Init::NormOnePlus:
          x = -0.1f + 0.2f * u;
          break;
        case Init::NormPlain:
          x = 0.9f + 0.2f * u;
          break;
        case Init::ALog:
          x = std::log(1.0f + 15.0f * u);
          break;
        case Init::DtBias:
          x = -0.5f + u;
          break;
        case Init::Conv:
          x = (2 * u - 1) * std::sqrt(3.0f / 4.0f);
          break;
        default:
          x = (2 * u - 1) * std::sqrt(3.0f / static_cast<float>(n));
          break;
      }
    }
    return v;
  }
  float scalar(const std::string&, float random_value) override { return random_value; }
  int64_t held_rows(const std::string& name) override { return rows_held(plan_, rank_, name); }
  uint64_t bytes() const override { return bytes_; }

 private:
  static float bound(Init init, int64_t fan_in) {
    const float s3 = std::sqrt(3.0f);
    switch (init) {
      case Init::Linear:
        return s3 / std::sqrt(static_cast<float>(fan_in));
      case Init::LmHead:
        return 4 * s3 / std::sqrt(static_cast<float>(fan_in));
      case Init::Embed:
        return s3;
      case Init::Conv:
        return s3 / 2;
      default:
        return 0.1f;
    }
  }
  static constexpr std::size_t kScratchBytes = std::size_t{64} << 20;
  const ShardPlan& plan_;
  int rank_;
  uint64_t seed_;
  uint64_t bytes_ = 0;
  void* scratch_ = nullptr;  // device, kScratchBytes: fill_host's pieces
};

// Upload of a host FP32 vector.
float* upload_f32(DeviceArena& arena, const std::vector<float>& v, const char* what) {
  float* d = arena.alloc_n<float>(static_cast<int64_t>(v.size()), what);
  FN_CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}

}  // namespace model_detail

CudaModel::CudaModel(ModelConfig cfg, const CudaModelOptions& options)
    : cfg_(std::move(cfg)), opt_(options), impl_(std::make_unique<Impl>()) {}

CudaModel::~CudaModel() {
  if (impl_ && impl_->stream) cudaStreamSynchronize(impl_->stream);
}

namespace {

// Checks the model and options this backend runs; throws Usage/Format naming the field.
void check_supported(const ModelConfig& c, const CudaModelOptions& o, bool experts_nvfp4) {
  FN_REQUIRE(o.tp_size >= 1 && o.tp_rank >= 0 && o.tp_rank < o.tp_size, Internal,
             "tp_rank {} of tp_size {}", o.tp_rank, o.tp_size);
  FN_REQUIRE(o.tp_size == 1 || o.all_reduce != nullptr, Internal, "tp_size {} needs an all-reduce",
             o.tp_size);
  FN_REQUIRE(o.ctx_size >= 1 && o.ctx_size <= c.max_position_embeddings, Usage,
             "-c/--ctx-size {} is outside [1, max_position_embeddings = {}] of {}", o.ctx_size,
             c.max_position_embeddings, c.source);
  FN_REQUIRE(experts_nvfp4, Format,
             "{}: the CUDA backend runs NVFP4 routed experts only (this checkpoint stores BF16 "
             "experts; use --backend cpu)",
             c.source);
  FN_REQUIRE(!c.has_ple() || c.ple_embed_dim == c.hidden_size, Format,
             "{}: ple_embed_dim {} != hidden_size {} is not supported", c.source, c.ple_embed_dim,
             c.hidden_size);
  FN_REQUIRE(c.output_gate_type == GateActivation::Sigmoid, Format,
             "{}: output_gate_type must be sigmoid for qwen4_exp (docs/model.md §F.1.2)", c.source);
  FN_REQUIRE(c.hc_count == 4, Format, "{}: hc_count {} is not supported by the CUDA backend (4)",
             c.source, c.hc_count);
  FN_REQUIRE(
      c.hidden_size <= 2560, Format,
      "{}: hidden_size {} exceeds the CUDA HC read's limit (2560: 8 partials, cuda/kernels/hc.h)",
      c.source, c.hidden_size);
  // The shared expert's down launch (cuda/kernels/moe_shared.h) takes 8..8192 rows per rank, a
  // multiple of 8.
  const int64_t is_l = c.shared_expert_intermediate_size / o.tp_size;
  FN_REQUIRE(is_l % 8 == 0 && is_l >= 8 && is_l <= 8192, Format,
             "{}: shared_expert_intermediate_size {} at TP={} gives {} rows per rank; the CUDA "
             "backend needs a multiple of 8 in [8, 8192]",
             c.source, c.shared_expert_intermediate_size, o.tp_size, is_l);
}

}  // namespace

QsaDecodeParams model_detail::qsa_layer(const ModelConfig& c, const CudaModelOptions& o,
                                        const DevQsa& a) {
  QsaDecodeParams q = qsa_shape(c, o);
  q.q_norm = a.q_norm;
  q.k_norm = a.k_norm;
  q.iq_norm = a.iq_norm;
  q.ik_norm = a.ik_norm;
  q.k_cache = a.k_cache;
  q.v_cache = a.v_cache;
  q.raw_keys = a.raw_keys;
  q.block_keys = a.block_keys;
  return q;
}

// Declared in cuda_model_impl.h (the prefill shares it).
QsaDecodeParams model_detail::qsa_shape(const ModelConfig& c, const CudaModelOptions& o) {
  const RankDims d = rank_dims(c, o.tp_size, o.tp_rank);
  QsaDecodeParams q;
  q.ctx_size = o.ctx_size;
  q.num_q_heads = static_cast<int>(d.q_heads);
  q.num_kv_heads = static_cast<int>(d.kv_heads);
  q.q_head_first = static_cast<int>(d.q_head_first);
  q.q_per_kv = static_cast<int>(d.q_per_kv);
  q.kv_head_first = static_cast<int>(d.kv_head_first);
  q.head_dim = static_cast<int>(c.head_dim);
  q.rotary_dim = static_cast<int>(c.rotary_dim());
  q.rope_theta = c.rope_theta;
  q.indexer_heads = static_cast<int>(c.indexer_n_heads);
  q.indexer_head_dim = static_cast<int>(c.indexer_head_dim);
  q.ratio = static_cast<int>(c.indexer_compress_ratio);
  q.block_topk = static_cast<int>(c.indexer_budget / c.indexer_compress_ratio);
  q.eps = static_cast<float>(c.rms_norm_eps);
  return q;
}

NgramGatherParams model_detail::ngram_gather_params(const ModelConfig& c, const DevPle& pl) {
  NgramGatherParams ng;
  ng.ngram_size = static_cast<int>(c.ngram_size);
  FN_CHECK(pl.consts.multipliers.size() <= 8 && pl.consts.head_sizes.size() <= 32,
           "n-gram constants exceed the kernel's limits");
  ng.num_multipliers = static_cast<int>(pl.consts.multipliers.size());
  std::copy(pl.consts.multipliers.begin(), pl.consts.multipliers.end(), ng.multipliers);
  ng.num_heads = static_cast<int>(pl.consts.head_sizes.size());
  std::copy(pl.consts.head_sizes.begin(), pl.consts.head_sizes.end(), ng.head_sizes);
  std::copy(pl.consts.head_offsets.begin(), pl.consts.head_offsets.end(), ng.head_offsets);
  ng.heads_per_ngram = static_cast<int>(pl.consts.heads_per_ngram);
  ng.rows = pl.rows;
  ng.first_row = pl.first_row;
  ng.row_count = pl.row_count;
  ng.fp8 = pl.fp8;
  ng.scale = pl.scale;
  ng.head_dim = static_cast<int>(c.ngram_head_dim());
  ng.eos = pl.consts.eos;
  return ng;
}

PleApplyParams model_detail::ple_apply_params(const ModelConfig& c, const DevPle& pl) {
  PleApplyParams pa;
  pa.norm_key = pl.norm_key;
  pa.norm_query = pl.norm_query;
  pa.norm_conv = pl.norm_conv;
  pa.conv = pl.conv;
  pa.conv_state = pl.conv_state;
  pa.hc_count = static_cast<int>(c.hc_count);
  pa.dim = c.ple_embed_dim;
  pa.conv_kernel = static_cast<int>(c.ple_conv_kernel_size);
  pa.dilation = static_cast<int>(c.ple_conv_dilation());
  pa.eps = static_cast<float>(c.rms_norm_eps);
  return pa;
}

namespace model_detail {

// Builds every device weight and state of the model from `src`.
struct Builder {
  const ModelConfig& c;
  const CudaModelOptions& o;
  WeightSource& src;
  CheckpointSource* ck;  // non-null for the checkpoint path (n-gram shards are read raw)
  DeviceArena& arena;
  bool ngram_fp8;
  // Non-null: the n-gram tables go to pinned, device-mapped host memory; each allocation is
  // appended here (the owner frees them with cudaFreeHost).
  std::vector<void*>* ngram_host = nullptr;

  const std::string p = std::string(kPrefix);

  // A stacked BF16 matrix: the parts' rows one after another (all with `cols` columns).
  struct Part {
    std::string name;
    int64_t rows;
    Init init = Init::Linear;
  };
  const uint16_t* stack(const std::vector<Part>& parts, int64_t cols, const char* what,
                        int64_t* rows_out = nullptr) {
    int64_t rows = 0;
    for (const Part& q : parts) rows += q.rows;
    auto* d = arena.alloc_n<uint16_t>(rows * cols, what);
    int64_t r = 0;
    for (const Part& q : parts) {
      src.fill(q.name, q.rows, cols, DType::BF16, q.init, d + r * cols);
      r += q.rows;
    }
    if (rows_out) *rows_out = rows;
    return d;
  }
  float* vec(const std::string& name, int64_t n, Init init) {
    return upload_f32(arena, src.vec(name, n, init), "a 1-D weight");
  }

  DevHc hc(const std::string& base, bool inject) {
    const int64_t W = c.hc_width(), R = c.hc_lowrank, S = c.hc_count;
    DevHc h;
    auto* nw = arena.alloc_n<uint16_t>(W, "hc_norm");
    src.fill(base + ".hc_norm.weight", W, 1, DType::BF16, Init::NormOnePlus, nw);
    h.norm = nw;
    std::vector<Part> parts{{base + ".input_mix_weight_down.weight", R}};
    if (inject) parts.push_back({base + ".block_inject_weight.weight", S});
    h.down_inj = stack(parts, W, "HC down/inject", &h.down_rows);
    h.up = stack({{base + ".input_mix_weight_up.weight", W}}, R, "HC up");
    return h;
  }

  Nvfp4Experts experts(const std::string& mp, bool gate_up, int64_t I_l) {
    const int64_t D = c.hidden_size, E = c.num_experts;
    const int64_t rows = gate_up ? 2 * I_l : D, cols = gate_up ? D : I_l;
    auto* packed = arena.alloc_n<uint8_t>(E * rows * cols / 2, "NVFP4 expert codes");
    auto* scales = arena.alloc_n<uint8_t>(E * rows * cols / 16, "NVFP4 block scales");
    const int nproj = gate_up ? 2 : 1;
    std::vector<float> gs(static_cast<std::size_t>(E * nproj));
    for (int64_t e = 0; e < E; ++e) {
      for (int j = 0; j < nproj; ++j) {
        const char* proj = gate_up ? (j == 0 ? "gate_proj" : "up_proj") : "down_proj";
        const std::string base = fmt::format("{}experts.{}.{}", mp, e, proj);
        const int64_t prow = gate_up ? I_l : D;
        const int64_t r0 = e * rows + j * I_l;
        src.fill(base + ".weight", prow, cols / 2, DType::U8, Init::Linear, packed + r0 * cols / 2);
        src.fill(base + ".weight_scale", prow, cols / 16, DType::F8_E4M3, Init::Linear,
                 scales + r0 * cols / 16);
        gs[static_cast<std::size_t>(e * nproj + j)] =
            src.scalar(base + ".weight_scale_2", 1.0f / (2.93f * std::sqrt(static_cast<float>(D))));
      }
    }
    // The kernels read the codes in the decode layout (Nvfp4Experts). On the legacy default
    // stream: after the fills (the random fill runs on it; the checkpoint's staging stream is a
    // blocking one), and before anything else touches the buffer.
    nvfp4_codes_to_decode_layout(packed, E * rows * cols / 2, nullptr);
    Nvfp4Experts x;
    x.packed = packed;
    x.scales = scales;
    x.global_scale = upload_f32(arena, gs, "NVFP4 global scales");
    x.num_experts = static_cast<int>(E);
    x.rows = rows;
    x.cols = cols;
    return x;
  }

  void ple(DevPle& d, const std::string& lp, int ple_rank) {
    const int64_t W = c.hc_width(), D = c.hidden_size, P = c.ple_embed_dim, S = c.hc_count;
    const std::string pp = lp + "ple.";
    const std::string ep = pp + "ple_embedding.";
    d.kv_proj = stack({{pp + "key_proj.weight", S * P}, {pp + "value_proj.weight", D}}, P,
                      "PLE key/value projections");
    d.norm_key = vec(pp + "norm_key.weight", W, Init::NormOnePlus);
    d.norm_query = vec(pp + "norm_query.weight", W, Init::NormOnePlus);
    d.norm_conv = vec(pp + "norm_conv.weight", W, Init::NormOnePlus);
    {
      std::vector<float> conv;
      if (ck) {
        conv = slice_to_f32(ck->read(pp + "conv1d.weight"));
      } else {
        conv = src.vec(pp + "conv1d.weight", W * c.ple_conv_kernel_size, Init::Conv);
      }
      FN_CHECK(static_cast<int64_t>(conv.size()) == W * c.ple_conv_kernel_size,
               "PLE conv1d has {} taps", conv.size());
      d.conv = upload_f32(arena, conv, "PLE conv");
    }
    d.consts = ngram_constants(c, ple_rank);
    if (ck) {  // the stored I64 buffers must equal the config's constants
      auto check_i64 = [&](const std::string& name, const std::vector<int64_t>& want) {
        const WeightSlice s = ck->read(name);
        FN_REQUIRE(s.bytes->size() == want.size() * 8, Format, "'{}' holds {} bytes, expected {}",
                   name, s.bytes->size(), want.size() * 8);
        std::vector<int64_t> got(want.size());
        std::memcpy(got.data(), s.bytes->data(), want.size() * sizeof(int64_t));
        for (std::size_t i = 0; i < want.size(); ++i)
          FN_REQUIRE(got[i] == want[i], Format,
                     "'{}'[{}] is {}, the config gives {} (config drift?)", name, i, got[i],
                     want[i]);
      };
      check_i64(ep + "layer_multipliers", d.consts.multipliers);
      check_i64(ep + "ngram_heads_vocab_sizes", d.consts.head_sizes);
      check_i64(ep + "ngram_heads_offsets", d.consts.head_offsets);
    }
    const int64_t rows_per_shard = d.consts.table_rows / c.split_ngram_parts;
    const int64_t hdn = c.ngram_head_dim();
    const DType tdt = ngram_fp8 ? DType::F8_E4M3 : DType::BF16;
    std::vector<int64_t> held;
    for (int64_t s = 0; s < c.split_ngram_parts; ++s) {
      const std::string name = fmt::format("{}ngram_embedding.shard_{}.weight", ep, s);
      if (src.held_rows(name) > 0) held.push_back(s);
    }
    for (std::size_t i = 1; i < held.size(); ++i)
      FN_CHECK(held[i] == held[i - 1] + 1, "rank {} holds non-consecutive n-gram shards",
               o.tp_rank);
    d.fp8 = ngram_fp8;
    d.row_count = static_cast<int64_t>(held.size()) * rows_per_shard;
    d.first_row = held.empty() ? 0 : held.front() * rows_per_shard;
    const int64_t shard_bytes = rows_per_shard * hdn * static_cast<int64_t>(dtype_size(tdt));
    if (ngram_host != nullptr && d.row_count > 0) {
      // Pinned (the GPU reads it by DMA, no staging) and mapped (a device pointer for the gather
      // kernels); portable, so the mapping holds in every context of the process. The shards are
      // read from the files straight into it.
      const std::size_t bytes = static_cast<std::size_t>(shard_bytes) * held.size();
      void* h = nullptr;
      const cudaError_t rc = cudaHostAlloc(&h, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
      if (rc != cudaSuccess) {
        (void)cudaGetLastError();  // the failed allocation is reported here, not at a later check
        FN_THROW(Cuda,
                 "rank {}: cudaHostAlloc of {} bytes of pinned host memory for the n-gram table "
                 "(--ngram-table host) failed: {}: {}",
                 o.tp_rank, bytes, cudaGetErrorName(rc), cudaGetErrorString(rc));
      }
      ngram_host->push_back(h);
      for (std::size_t i = 0; i < held.size(); ++i) {
        const std::string name = fmt::format("{}ngram_embedding.shard_{}.weight", ep, held[i]);
        src.fill_host(name, rows_per_shard, hdn, tdt, Init::Embed,
                      static_cast<std::byte*>(h) + static_cast<int64_t>(i) * shard_bytes);
      }
      void* mapped = nullptr;
      FN_CUDA_CHECK(cudaHostGetDevicePointer(&mapped, h, 0));
      d.rows = static_cast<const uint8_t*>(mapped);
      d.on_host = true;
    } else {
      auto* rows = arena.alloc_n<uint8_t>(
          std::max<int64_t>(d.row_count * hdn, 1) * static_cast<int64_t>(dtype_size(tdt)),
          "n-gram table rows");
      for (std::size_t i = 0; i < held.size(); ++i) {
        const std::string name = fmt::format("{}ngram_embedding.shard_{}.weight", ep, held[i]);
        src.fill(name, rows_per_shard, hdn, tdt, Init::Embed,
                 rows + static_cast<int64_t>(i) * shard_bytes);
      }
      d.rows = rows;
    }
    d.scale = ngram_fp8 ? src.scalar(ep + "ngram_embedding.weight_scale", std::sqrt(3.0f) / 448.0f)
                        : 1.0f;
  }
};

}  // namespace model_detail

namespace {

// --max-batch 0 on cuda: the slots that fit the free memory, at most this many, leaving
// kSlotHeadroom for the run's other allocations (cuBLAS workspace, sampling buffers).
constexpr int64_t kMaxAutoSlots = 64;
constexpr uint64_t kSlotHeadroom = uint64_t{1} << 30;

// A state buffer of `bytes` (DeviceLayout) that reset() zeroes.
template <typename T>
T* sequence_state(DeviceArena& arena, std::vector<std::pair<void*, std::size_t>>& blocks,
                  uint64_t bytes, const char* what) {
  T* p = static_cast<T*>(arena.alloc_state(bytes, what));
  blocks.emplace_back(p, bytes);
  return p;
}

}  // namespace

void CudaModel::Impl::build_layer(Builder& b, const DeviceLayout& lay, int64_t li) {
  const ModelConfig& c = b.c;
  const RankDims rd = rank_dims(c, b.o.tp_size, b.o.tp_rank);
  const int64_t D = c.hidden_size, E = c.num_experts;
  const int64_t Hv_l = rd.linear_v_heads, dv = c.linear_value_head_dim;
  const int64_t conv_l = rd.gdn_conv_dim, Kc = c.linear_conv_kernel_dim;
  const int64_t Hq_l = rd.q_heads, hd = c.head_dim, Hkv_l = rd.kv_heads;
  DevLayer& L = layers[static_cast<std::size_t>(li)];
  const std::string lp = fmt::format("{}layers.{}.", b.p, li);
  L.qsa = c.is_qsa(li);
  const int ple_rank = c.ple_rank(li);
  if (ple_rank >= 0) {
    L.has_ple = true;
    b.ple(L.ple, lp, ple_rank);
    L.ple.conv_state =
        sequence_state<float>(arena, state_blocks, lay.ple_conv_state, "PLE conv state");
  }
  L.attn_hc = b.hc(lp + "attn_hyper_connection", true);
  L.mlp_hc = b.hc(lp + "mlp_hyper_connection", true);
  if (L.qsa) {
    DevQsa& a = L.attn;
    const std::string ap = lp + "self_attn.";
    a.in_proj = b.stack({{ap + "q_proj.weight", Hq_l * 2 * hd},
                         {ap + "k_proj.weight", Hkv_l * hd},
                         {ap + "v_proj.weight", Hkv_l * hd},
                         {ap + "indexer.index_qk_proj.weight", c.indexer_proj_rows()}},
                        D, "QSA projections", &a.in_rows);
    a.o = b.stack({{ap + "o_proj.weight", D}}, Hq_l * hd, "QSA o_proj");
    a.q_norm = b.vec(ap + "q_norm.weight", hd, Init::NormOnePlus);
    a.k_norm = b.vec(ap + "k_norm.weight", hd, Init::NormOnePlus);
    a.iq_norm = b.vec(ap + "indexer.q_layernorm.weight", c.indexer_head_dim, Init::NormOnePlus);
    a.ik_norm = b.vec(ap + "indexer.k_layernorm.weight", c.indexer_head_dim, Init::NormOnePlus);
    a.k_cache = static_cast<uint16_t*>(arena.alloc_state(lay.k_cache, "K cache"));
    a.v_cache = static_cast<uint16_t*>(arena.alloc_state(lay.v_cache, "V cache"));
    a.raw_keys = static_cast<float*>(arena.alloc_state(lay.raw_keys, "indexer raw keys"));
    a.block_keys = static_cast<float*>(arena.alloc_state(lay.block_keys, "indexer block keys"));
    FN_CHECK(a.in_rows <= lay.max_in_rows, "QSA projection of {} rows, the layout's {}", a.in_rows,
             lay.max_in_rows);
  } else {
    DevGdn& g = L.gdn;
    const std::string gp = lp + "linear_attn.";
    g.in_proj = b.stack({{gp + "in_proj_qkv.weight", conv_l},
                         {gp + "in_proj_z.weight", Hv_l * dv},
                         {gp + "in_proj_a.weight", Hv_l},
                         {gp + "in_proj_b.weight", Hv_l}},
                        D, "GDN projections", &g.in_rows);
    g.out = b.stack({{gp + "out_proj.weight", D}}, Hv_l * dv, "GDN out_proj");
    g.A_log = b.vec(gp + "A_log", Hv_l, Init::ALog);
    g.dt_bias = b.vec(gp + "dt_bias", Hv_l, Init::DtBias);
    g.norm = b.vec(gp + "norm.weight", dv, Init::NormPlain);
    {
      std::vector<float> conv = b.ck ? slice_to_f32(b.ck->read(gp + "conv1d.weight"))
                                     : b.src.vec(gp + "conv1d.weight", conv_l * Kc, Init::Conv);
      FN_CHECK(static_cast<int64_t>(conv.size()) == conv_l * Kc, "GDN conv1d has {} taps",
               conv.size());
      g.conv = upload_f32(arena, conv, "GDN conv");
    }
    g.conv_state = sequence_state<float>(arena, state_blocks, lay.gdn_conv_state, "GDN conv state");
    g.S = sequence_state<float>(arena, state_blocks, lay.gdn_state, "GDN recurrent state");
    // The head counters, then the overlapped projection's two join words.
    g.counters = static_cast<unsigned int*>(arena.alloc_state(lay.gdn_counters, "GDN counters"));
    g.o_scratch = static_cast<float*>(arena.alloc_state(lay.gdn_output, "GDN output"));
    FN_CHECK(g.in_rows <= lay.max_in_rows, "GDN projection of {} rows, the layout's {}", g.in_rows,
             lay.max_in_rows);
  }
  DevMoe& mo = L.moe;
  const std::string mp = lp + "mlp.";
  mo.router = b.stack({{mp + "gate.weight", E}, {mp + "shared_expert_gate.weight", 1}}, D,
                      "router + shared expert gate");
  mo.s_gate_up = b.stack({{mp + "shared_expert.gate_proj.weight", rd.shared_inter},
                          {mp + "shared_expert.up_proj.weight", rd.shared_inter}},
                         D, "shared expert gate/up");
  mo.s_down =
      b.stack({{mp + "shared_expert.down_proj.weight", D}}, rd.shared_inter, "shared expert down");
  mo.gate_up = b.experts(mp, true, rd.moe_inter);
  mo.down = b.experts(mp, false, rd.moe_inter);
}

void CudaModel::Impl::carve_activations(const DeviceLayout& lay) {
  auto* base = static_cast<std::byte*>(arena.alloc(lay.activation_bytes, "activations"));
  const auto at = [&]<typename T>(Activation a, T*& out) {
    const ActivationPiece& p = lay.piece(a);
    FN_CHECK(p.element_bytes == static_cast<int64_t>(sizeof(T)), "activation {}: {} B elements",
             p.name, p.element_bytes);
    out = reinterpret_cast<T*>(base + p.offset);
  };
  at(Activation::H, H);
  at(Activation::HAlt, H_alt);
  at(Activation::HcPartials, t);
  at(Activation::HcSumSq, sumsq);
  at(Activation::M, m);
  at(Activation::MBf16, m_bf16);
  at(Activation::Iota, iota);
  at(Activation::Proj, proj);
  at(Activation::MixOut, mix_out);
  at(Activation::Y, y);
  at(Activation::RouterLogits, rl);
  at(Activation::ExpertIds, ids);
  at(Activation::RoutingWeights, rw);
  at(Activation::ExpertH, h);
  at(Activation::SharedGateUp, sgu);
  at(Activation::PleEmbedding, e_ng);
  at(Activation::PleKv, kvp);
  at(Activation::LogitsLocal, logits_local);
  at(Activation::Logits, logits);
  at(Activation::Token, token);
  at(Activation::Position, position);
  at(Activation::Context, context);
  at(Activation::ErrorFlag, error_flag);
  at(Activation::SampleStep, sample_step);
}

void CudaModel::Impl::alloc_test_buffers(const ModelConfig& c, const CudaModelTestOptions& test) {
  int64_t n_qsa = 0;
  for (const DevLayer& L : layers) n_qsa += L.qsa ? 1 : 0;
  const int64_t k = c.num_experts_per_tok;
  const int64_t topk = c.indexer_budget / c.indexer_compress_ratio;
  if (test.keep_residuals)
    residuals = arena.alloc_n<float>(
        (2 * c.num_hidden_layers + static_cast<int64_t>(c.ple_layer_ids.size())) * c.hc_width(),
        "debug residuals");
  if (test.replay_choices) {
    forced_router = arena.alloc_n<int32_t>(c.num_hidden_layers * k, "forced router ids");
    forced_blocks =
        arena.alloc_n<int32_t>(std::max<int64_t>(n_qsa, 1) * topk, "forced indexer blocks");
  }
}

void CudaModel::Impl::build(const ModelConfig& c, const CudaModelOptions& o,
                            const CudaModelTestOptions& test, WeightSource& src,
                            CheckpointSource* ck, bool ngram_fp8, bool ngram_on_host) {
  if (o.stream) {
    stream = o.stream;
  } else {
    FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    own_stream = true;
  }
  plan = plan_kernels(c, o.tp_size);
  if (o.tp_rank == 0) FN_LOG_DEBUG("CUDA kernel plan: {}", describe_kernel_plan(plan));
  const DeviceLayout lay = device_layout(c, o.tp_size, o.tp_rank, o.ctx_size);
  FN_CHECK(hc_down_partials(c.hc_count, c.hidden_size) == hc_down_splits(c.hc_count, c.hidden_size),
           "the HC down pass's partials differ from the device layout's");
  Builder b{c, o, src, ck, arena, ngram_fp8, ngram_on_host ? &ngram_host : nullptr};
  const int64_t V = c.vocab_size, D = c.hidden_size;
  {
    auto* e = arena.alloc_n<uint16_t>(V * D, "embed_tokens");
    src.fill(b.p + "embed_tokens.weight", V, D, DType::BF16, Init::Embed, e);
    embed = e;
  }
  v_local = V / o.tp_size;
  v_first = o.tp_rank * v_local;
  lm_head = b.stack({{"lm_head.weight", v_local, Init::LmHead}}, D, "lm_head");
  final_hc = b.hc(b.p + "hyper_connection_mixer", false);
  layers.resize(static_cast<std::size_t>(c.num_hidden_layers));
  for (int64_t li = 0; li < c.num_hidden_layers; ++li) build_layer(b, lay, li);
  weight_bytes = arena.held() - arena.state_held();
  router_mailbox = static_cast<float*>(arena.alloc_state(lay.router_mailbox, "router mailbox"));
  carve_activations(lay);
  for (DevLayer& L : layers) {
    if (!L.has_ple || !L.ple.on_host) continue;
    L.ple.staged = arena.alloc_n<float>(c.ple_embed_dim, "gathered n-gram rows");
    ngram_host_bytes +=
        static_cast<uint64_t>(L.ple.row_count) * c.ngram_head_dim() * (L.ple.fp8 ? 1 : 2);
    if (ngram_stream == nullptr) {
      FN_CUDA_CHECK(cudaStreamCreateWithFlags(&ngram_stream, cudaStreamNonBlocking));
      FN_CUDA_CHECK(cudaEventCreateWithFlags(&ngram_fork, cudaEventDisableTiming));
      FN_CUDA_CHECK(cudaEventCreateWithFlags(&ngram_join, cudaEventDisableTiming));
    }
  }
  const QsaDecodeParams shape = qsa_shape(c, o);
  for (DevLayer& L : layers) {
    if (!L.qsa) continue;
    FN_CHECK(lay.qsa_workspace >= qsa_decode_workspace_bytes(shape),
             "the device layout's QSA workspace ({} B) is below the launcher's {} B",
             lay.qsa_workspace, qsa_decode_workspace_bytes(shape));
    L.attn.workspace = arena.alloc_state(lay.qsa_workspace, "QSA workspace");
  }
  if (o.record_choices) {
    int64_t n_qsa = 0;
    for (const DevLayer& L : layers) n_qsa += L.qsa ? 1 : 0;
    choice_log = arena.alloc_n<int32_t>(choice_log_ints(c, n_qsa), "choice log");
  }
  alloc_test_buffers(c, test);
  FN_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_logits), sizeof(float) * V));
  FN_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_token), sizeof(int32_t) * 3));
  FN_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_flag), sizeof(int32_t) * 2));
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  require_prefill_fits(c, o, layers, v_local);
  alloc_slots(c, o, lay);
  build_slot_table();
  reset_state(c);
  for (int64_t s = 1; s < static_cast<int64_t>(slots.size()); ++s) reset_slot(c, s);
}

void CudaModel::Impl::alloc_slots(const ModelConfig& c, const CudaModelOptions& o,
                                  const DeviceLayout& lay) {
  slot_layout = lay;
  const int64_t max_rows = pass_rows(o);
  // The bytes of one more slot, and the free memory less the prefill's pass buffers (allocated
  // at the first prompt), known before any slot is allocated.
  uint64_t per_slot = static_cast<uint64_t>(std::max<int64_t>(c.ngram_size - 1, 1)) * 8;
  for (const DevLayer& L : layers) {
    if (L.has_ple) per_slot += lay.ple_conv_state;
    per_slot += L.qsa ? lay.k_cache + lay.v_cache + lay.raw_keys + lay.block_keys
                      : lay.gdn_conv_state + lay.gdn_state;
  }
  std::size_t free_b = 0, total_b = 0;
  FN_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const uint64_t pass = prefill_buffer_bytes(c, o, layers, v_local);
  int64_t count = o.slots;
  if (count == 0) {  // as many as fit, with kSlotHeadroom left for the run's own allocations
    const uint64_t room = free_b > pass + kSlotHeadroom ? free_b - pass - kSlotHeadroom : 0;
    count = std::clamp<int64_t>(1 + static_cast<int64_t>(room / per_slot), 1,
                                std::min(kMaxAutoSlots, max_rows));
  }
  FN_CHECK(count >= 1, "{} sequence slots", count);
  FN_REQUIRE(count <= max_rows, Usage,
             "--max-batch {} exceeds the rows of one prefill pass (--prefill-chunk {}): a "
             "batched step runs as one pass",
             count, o.prefill_chunk);
  const std::size_t n_layers = layers.size();
  slots.assign(static_cast<std::size_t>(count), DevSlot{});
  DevSlot& first = slots[0];
  first.layers.resize(n_layers);
  first.context = context;
  for (std::size_t li = 0; li < n_layers; ++li) {
    const DevLayer& L = layers[li];
    DevSlotLayer& d = first.layers[li];
    if (L.has_ple) d.ple_conv = L.ple.conv_state;
    if (L.qsa) {
      d.k_cache = L.attn.k_cache;
      d.v_cache = L.attn.v_cache;
      d.raw_keys = L.attn.raw_keys;
      d.block_keys = L.attn.block_keys;
    } else {
      d.gdn_conv = L.gdn.conv_state;
      d.gdn_state = L.gdn.S;
    }
  }
  if (count == 1) return;
  const uint64_t need = per_slot * static_cast<uint64_t>(count - 1);
  FN_REQUIRE(
      need + pass <= free_b, Usage,
      "--max-batch {}: {} more sequence slots of -c/--ctx-size {} tokens need {:.2f} GiB "
      "({:.1f} MiB each) and the prefill's pass buffers {:.2f} GiB, but {:.2f} GiB of device "
      "memory are free after the weights: give a smaller --max-batch, -c/--ctx-size or "
      "--prefill-chunk",
      count, count - 1, o.ctx_size, static_cast<double>(need) / 1073741824.0,
      static_cast<double>(per_slot) / 1048576.0, static_cast<double>(pass) / 1073741824.0,
      static_cast<double>(free_b) / 1073741824.0);
  for (std::size_t si = 1; si < slots.size(); ++si) {
    DevSlot& sl = slots[si];
    sl.layers.resize(n_layers);
    sl.context = static_cast<int64_t*>(arena.alloc_state(
        static_cast<std::size_t>(std::max<int64_t>(c.ngram_size - 1, 1)) * sizeof(int64_t),
        "slot n-gram context"));
    for (std::size_t li = 0; li < n_layers; ++li) {
      const DevLayer& L = layers[li];
      DevSlotLayer& d = sl.layers[li];
      if (L.has_ple)
        d.ple_conv = sequence_state<float>(arena, sl.blocks, lay.ple_conv_state, "PLE conv state");
      if (L.qsa) {
        d.k_cache = static_cast<uint16_t*>(arena.alloc_state(lay.k_cache, "K cache"));
        d.v_cache = static_cast<uint16_t*>(arena.alloc_state(lay.v_cache, "V cache"));
        d.raw_keys = static_cast<float*>(arena.alloc_state(lay.raw_keys, "indexer raw keys"));
        d.block_keys = static_cast<float*>(arena.alloc_state(lay.block_keys, "indexer block keys"));
      } else {
        d.gdn_conv = sequence_state<float>(arena, sl.blocks, lay.gdn_conv_state, "GDN conv state");
        d.gdn_state = sequence_state<float>(arena, sl.blocks, lay.gdn_state, "GDN recurrent state");
      }
    }
  }
  if (o.tp_rank == 0)
    FN_LOG_INFO("cuda: {} sequence slots of {} tokens ({:.1f} MiB of caches and states each{})",
                count, o.ctx_size, static_cast<double>(per_slot) / 1048576.0,
                o.slots == 0 ? ", as many as fit: --max-batch 0" : "");
}

void CudaModel::Impl::build_slot_table() {
  const auto n = static_cast<int64_t>(slots.size());
  const auto n_layers = static_cast<int64_t>(layers.size());
  std::vector<void*> host(static_cast<std::size_t>(n_layers * kSlotFields * n), nullptr);
  for (int64_t li = 0; li < n_layers; ++li)
    for (int64_t si = 0; si < n; ++si) {
      const DevSlotLayer& d =
          slots[static_cast<std::size_t>(si)].layers[static_cast<std::size_t>(li)];
      auto put = [&](SlotField f, void* p) {
        host[static_cast<std::size_t>((li * kSlotFields + f) * n + si)] = p;
      };
      put(kSlotGdnState, d.gdn_state);
      put(kSlotGdnConv, d.gdn_conv);
      put(kSlotKCache, d.k_cache);
      put(kSlotVCache, d.v_cache);
      put(kSlotRawKeys, d.raw_keys);
      put(kSlotBlockKeys, d.block_keys);
    }
  slot_table = static_cast<void**>(arena.alloc(host.size() * sizeof(void*), "slot state table"));
  FN_CUDA_CHECK(
      cudaMemcpy(slot_table, host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice));
}

void CudaModel::Impl::reset_slot(const ModelConfig& c, int64_t slot) {
  if (slot == 0) {
    reset_state(c);
    return;
  }
  DevSlot& sl = slots[static_cast<std::size_t>(slot)];
  for (auto& [ptr, bytes] : sl.blocks) FN_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream));
  const std::vector<int64_t> ctx(static_cast<std::size_t>(std::max<int64_t>(c.ngram_size - 1, 1)),
                                 c.has_ple() ? c.ple_eos() : 0);
  FN_CUDA_CHECK(cudaMemcpyAsync(sl.context, ctx.data(), ctx.size() * sizeof(int64_t),
                                cudaMemcpyHostToDevice, stream));
  FN_CUDA_CHECK(cudaStreamSynchronize(stream));
  sl.position = 0;
}

void CudaModel::Impl::reset_state(const ModelConfig& c) {
  for (auto& [ptr, bytes] : state_blocks) FN_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream));
  const std::vector<int64_t> ctx(static_cast<std::size_t>(std::max<int64_t>(c.ngram_size - 1, 1)),
                                 c.has_ple() ? c.ple_eos() : 0);
  FN_CUDA_CHECK(cudaMemcpyAsync(context, ctx.data(), ctx.size() * sizeof(int64_t),
                                cudaMemcpyHostToDevice, stream));
  FN_CUDA_CHECK(cudaMemsetAsync(position, 0, sizeof(int64_t), stream));
  FN_CUDA_CHECK(cudaMemsetAsync(sample_step, 0, sizeof(int64_t), stream));
  FN_CUDA_CHECK(cudaMemsetAsync(error_flag, 0, sizeof(int32_t), stream));
  router_mailbox_init(router_mailbox, c.num_experts, stream);
  FN_CUDA_CHECK(cudaStreamSynchronize(stream));
}

namespace {
// Places the n-gram table (place_ngram_table on the free device memory; logged on rank 0) and
// refuses, before allocating anything, a model + context that does not fit the free device memory
// (core/memory_plan.h), or a host-resident table the host's MemAvailable cannot hold, with the
// bytes in the message.
NgramPlacement require_device_memory(const ModelConfig& c, const ShardPlan& plan,
                                     const CudaModelOptions& o) {
  std::size_t free_b = 0, total_b = 0;
  FN_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  int device = 0;
  FN_CUDA_CHECK(cudaGetDevice(&device));
  const std::string what = fmt::format("rank {} (GPU {})", o.tp_rank, device);
  const MemoryPlan on_device = plan_device_memory(c, plan, o.tp_rank, o.ctx_size);
  NgramPlacement placed =
      place_ngram_table(o.ngram_table, on_device, free_b, o.gpu_memory_utilization);
  if (!placed.host) {
    require_fits(on_device, free_b, what);
  } else {
    const MemoryPlan on_host = plan_device_memory(c, plan, o.tp_rank, o.ctx_size, true);
    require_fits(on_host, free_b, what);
    // This rank's share against what the host has available now. (At TP > 1 the ranks load
    // side by side without a barrier, so a rank that checks after another one pinned its share
    // sees less; checking the whole table here could refuse a load that fits.)
    require_host_fits(on_host.ngram_host, host_mem_available(), what);
  }
  if (o.tp_rank == 0)
    FN_LOG_INFO("n-gram table: {} ({})", placed.host ? "pinned host memory" : "device memory",
                placed.reason);
  return placed;
}
}  // namespace

std::unique_ptr<CudaModel> CudaModel::load(const std::filesystem::path& dir,
                                           const CudaModelOptions& options) {
  return load_with(dir, options, CudaModelTestOptions{});
}

std::unique_ptr<CudaModel> CudaModel::random(const ModelConfig& config, const QuantConfig& quant,
                                             uint64_t seed, const CudaModelOptions& options) {
  return random_with(config, quant, seed, options, CudaModelTestOptions{});
}

std::unique_ptr<CudaModel> CudaModel::load_with(const std::filesystem::path& dir,
                                                const CudaModelOptions& options,
                                                const CudaModelTestOptions& test) {
  const auto t0 = std::chrono::steady_clock::now();
  OpenedModel om = open_model(dir, options.tp_size);
  check_supported(om.config, options, om.quant.quantized());
  const NgramPlacement placed = require_device_memory(om.config, om.plan, options);
  std::unique_ptr<CudaModel> model(new CudaModel(om.config, options));
  CheckpointSource src(om, options.tp_rank);
  model->impl_->build(model->cfg_, options, test, src, &src, om.quant.ngram_fp8(om.config),
                      placed.host);
  src.finish();
  model->stats_.bytes = src.bytes();
  model->stats_.weight_bytes = model->impl_->weight_bytes;
  model->stats_.state_bytes = model->impl_->arena.held() - model->impl_->weight_bytes;
  model->stats_.ngram_host_bytes = model->impl_->ngram_host_bytes;
  model->stats_.ngram_placement = placed.reason;
  model->stats_.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return model;
}

std::unique_ptr<CudaModel> CudaModel::random_with(const ModelConfig& config,
                                                  const QuantConfig& quant, uint64_t seed,
                                                  const CudaModelOptions& options,
                                                  const CudaModelTestOptions& test) {
  const auto t0 = std::chrono::steady_clock::now();
  const ShardPlan plan = ShardPlan::build(config, quant, options.tp_size);
  check_supported(config, options, quant.quantized());
  const NgramPlacement placed = require_device_memory(config, plan, options);
  std::unique_ptr<CudaModel> model(new CudaModel(config, options));
  RandomSource src(plan, options.tp_rank, seed);
  model->impl_->build(model->cfg_, options, test, src, nullptr, quant.ngram_fp8(config),
                      placed.host);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  model->stats_.bytes = src.bytes();
  model->stats_.weight_bytes = model->impl_->weight_bytes;
  model->stats_.state_bytes = model->impl_->arena.held() - model->impl_->weight_bytes;
  model->stats_.ngram_host_bytes = model->impl_->ngram_host_bytes;
  model->stats_.ngram_placement = placed.reason;
  model->stats_.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return model;
}

}  // namespace fn
