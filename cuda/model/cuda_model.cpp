// CudaModel (see cuda_model.h): device weights, sequence state, and the decode step of MODEL.md
// §C.10 as a chain of cuda/ launches, captured once per mode as a CUDA graph.
//
// Per token (one graph): embed -> for each layer { [PLE: n-gram gather, all-reduce, key/value
// GEMV, apply] ; HC read ; GDN or QSA (stacked input GEMV, mixer kernel, output GEMV, all-reduce)
// ; HC inject ; HC read ; MoE (router+shared-gate GEMV, top-k, NVFP4 gate-up, down, shared
// expert, combine, all-reduce) ; HC inject } -> final mixer -> lm_head (vocab slice) -> scatter +
// all-reduce (= all-gather) -> [sample -> next token id] -> n-gram context and position advance.
#include "cuda/model/cuda_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>

#include "cuda/common/cuda_check.h"
#include "comm/device_all_reduce.h"
#include "core/codecs.h"
#include "core/error.h"
#include "core/log.h"
#include "core/memory_plan.h"
#include "core/ngram.h"
#include "core/progress.h"
#include "core/rank_slices.h"
#include "core/shard_plan.h"
#include "cuda/model/cuda_model_impl.h"
#include "cuda/kernels/decode_ops.h"
#include "cuda/kernels/gdn.h"
#include "cuda/kernels/gemv_bf16.h"
#include "cuda/kernels/hc.h"
#include "cuda/kernels/moe_nvfp4.h"
#include "cuda/kernels/moe_shared.h"
#include "cuda/kernels/ple.h"
#include "cuda/kernels/qsa.h"
#include "cuda/kernels/sample.h"
#include "cuda/kernels/step_kernels.h"
#include "cuda/kernels/weight_fill.h"

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
  void fill(const std::string& name, int64_t rows, int64_t cols, DType dtype, Init init,
            void* dst) override {
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
    launch_random_fill(p, nullptr);
    bytes_ += static_cast<uint64_t>(p.count) * dtype_size(dtype);
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
  const ShardPlan& plan_;
  int rank_;
  uint64_t seed_;
  uint64_t bytes_ = 0;
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
             "{}: output_gate_type must be sigmoid for qwen4_exp (MODEL.md §F.1.2)", c.source);
  FN_REQUIRE(c.hc_count == 4, Format, "{}: hc_count {} is not supported by the CUDA backend (4)",
             c.source, c.hc_count);
  FN_REQUIRE(c.hidden_size <= 2560, Format,
             "{}: hidden_size {} exceeds the CUDA HC read's limit (2560: 8 partials, cuda/kernels/hc.h)",
             c.source, c.hidden_size);
}

// The shape fields of the QSA launch for this model and rank (pointers left null).
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

namespace {}  // namespace

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

namespace {

// Builds every device weight and state of the model from `src`.
struct Builder {
  const ModelConfig& c;
  const CudaModelOptions& o;
  WeightSource& src;
  CheckpointSource* ck;  // non-null for the checkpoint path (n-gram shards are read raw)
  DeviceArena& arena;
  bool ngram_fp8;

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
    auto* rows = arena.alloc_n<uint8_t>(
        std::max<int64_t>(d.row_count * hdn, 1) * static_cast<int64_t>(dtype_size(tdt)),
        "n-gram table rows");
    for (std::size_t i = 0; i < held.size(); ++i) {
      const std::string name = fmt::format("{}ngram_embedding.shard_{}.weight", ep, held[i]);
      src.fill(name, rows_per_shard, hdn, tdt, Init::Embed,
               rows + static_cast<int64_t>(i) * rows_per_shard * hdn *
                          static_cast<int64_t>(dtype_size(tdt)));
    }
    d.rows = rows;
    d.scale = ngram_fp8 ? src.scalar(ep + "ngram_embedding.weight_scale", std::sqrt(3.0f) / 448.0f)
                        : 1.0f;
  }
};

}  // namespace

void CudaModel::Impl::build(const ModelConfig& c, const CudaModelOptions& o, WeightSource& src,
                            CheckpointSource* ck, bool ngram_fp8) {
  if (o.stream) {
    stream = o.stream;
  } else {
    FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    own_stream = true;
  }
  Builder b{c, o, src, ck, arena, ngram_fp8};
  const std::string& p = b.p;
  const int tp = o.tp_size, r = o.tp_rank;
  const int64_t D = c.hidden_size, W = c.hc_width(), R = c.hc_lowrank, S = c.hc_count;
  const int64_t V = c.vocab_size, E = c.num_experts, k = c.num_experts_per_tok;
  const RankDims rd = rank_dims(c, tp, r);
  const int64_t Hk_l = rd.linear_k_heads, Hv_l = rd.linear_v_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const int64_t conv_l = rd.gdn_conv_dim, Kc = c.linear_conv_kernel_dim;
  const int64_t Hq_l = rd.q_heads, hd = c.head_dim, Hkv_l = rd.kv_heads;
  const int64_t I_l = rd.moe_inter, Is_l = rd.shared_inter;
  const int64_t ihd = c.indexer_head_dim;
  const int64_t T = o.ctx_size;

  {
    auto* e = arena.alloc_n<uint16_t>(V * D, "embed_tokens");
    src.fill(p + "embed_tokens.weight", V, D, DType::BF16, Init::Embed, e);
    embed = e;
  }
  v_local = V / tp;
  v_first = r * v_local;
  lm_head = b.stack({{"lm_head.weight", v_local, Init::LmHead}}, D, "lm_head");
  final_hc = b.hc(p + "hyper_connection_mixer", false);

  int64_t max_in_rows = 0, max_mix = 0;
  layers.resize(static_cast<std::size_t>(c.num_hidden_layers));
  for (int64_t li = 0; li < c.num_hidden_layers; ++li) {
    DevLayer& L = layers[static_cast<std::size_t>(li)];
    const std::string lp = fmt::format("{}layers.{}.", p, li);
    L.qsa = c.is_qsa(li);
    const int ple_rank = c.ple_rank(li);
    if (ple_rank >= 0) {
      L.has_ple = true;
      b.ple(L.ple, lp, ple_rank);
      L.ple.conv_state = arena.state_n<float>(
          W * (c.ple_conv_kernel_size - 1) * c.ple_conv_dilation(), "PLE conv state");
      state_blocks.emplace_back(L.ple.conv_state, sizeof(float) * W * (c.ple_conv_kernel_size - 1) *
                                                      c.ple_conv_dilation());
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
      a.iq_norm = b.vec(ap + "indexer.q_layernorm.weight", ihd, Init::NormOnePlus);
      a.ik_norm = b.vec(ap + "indexer.k_layernorm.weight", ihd, Init::NormOnePlus);
      a.k_cache = arena.state_n<uint16_t>(T * Hkv_l * hd, "K cache");
      a.v_cache = arena.state_n<uint16_t>(T * Hkv_l * hd, "V cache");
      a.raw_keys = arena.state_n<float>(T * ihd, "indexer raw keys");
      a.block_keys = arena.state_n<float>(std::max<int64_t>(T / c.indexer_compress_ratio, 1) * ihd,
                                          "indexer block keys");
      max_in_rows = std::max(max_in_rows, a.in_rows);
      max_mix = std::max(max_mix, Hq_l * hd);
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
        std::vector<float> conv = ck ? slice_to_f32(ck->read(gp + "conv1d.weight"))
                                     : src.vec(gp + "conv1d.weight", conv_l * Kc, Init::Conv);
        FN_CHECK(static_cast<int64_t>(conv.size()) == conv_l * Kc, "GDN conv1d has {} taps",
                 conv.size());
        g.conv = upload_f32(arena, conv, "GDN conv");
      }
      g.conv_state = arena.state_n<float>(conv_l * (Kc - 1), "GDN conv state");
      g.S = arena.state_n<float>(Hv_l * dk * dv, "GDN recurrent state");
      // The head counters, then the overlapped projection's two join words.
      g.counters = arena.state_n<unsigned int>(Hv_l + Hk_l + 2, "GDN counters");
      g.o_scratch = arena.state_n<float>(Hv_l * dv, "GDN output");
      state_blocks.emplace_back(g.conv_state, sizeof(float) * conv_l * (Kc - 1));
      state_blocks.emplace_back(g.S, sizeof(float) * Hv_l * dk * dv);
      max_in_rows = std::max(max_in_rows, g.in_rows);
      max_mix = std::max(max_mix, Hv_l * dv);
    }
    DevMoe& mo = L.moe;
    const std::string mp = lp + "mlp.";
    mo.router = b.stack({{mp + "gate.weight", E}, {mp + "shared_expert_gate.weight", 1}}, D,
                        "router + shared expert gate");
    mo.s_gate_up = b.stack({{mp + "shared_expert.gate_proj.weight", Is_l},
                            {mp + "shared_expert.up_proj.weight", Is_l}},
                           D, "shared expert gate/up");
    mo.s_down = b.stack({{mp + "shared_expert.down_proj.weight", D}}, Is_l, "shared expert down");
    mo.gate_up = b.experts(mp, true, I_l);
    mo.down = b.experts(mp, false, I_l);
  }
  weight_bytes = arena.held() - arena.state_held();
  router_mailbox = arena.state_n<float>(E, "router mailbox");

  // Activations and step scalars.
  Carver sizing(nullptr);
  auto carve = [&](Carver& cv) {
    H = cv.take<float>(W);
    H_alt = cv.take<float>(W);
    t = cv.take<float>(hc_down_splits(S, D) * (R + S));
    sumsq = cv.take<float>(hc_down_splits(S, D));
    m = cv.take<float>(D);
    m_bf16 = cv.take<uint16_t>(D);
    iota = cv.take<float>(S);
    proj = cv.take<float>(max_in_rows);
    mix_out = cv.take<uint16_t>(max_mix);
    y = cv.take<float>(D);
    ys = cv.take<float>(D);
    rl = cv.take<float>(E + 1);
    ids = cv.take<int32_t>(k);
    rw = cv.take<float>(k);
    h = cv.take<uint16_t>(k * I_l);
    sgu = cv.take<float>(2 * Is_l);
    sh = cv.take<uint16_t>(Is_l);
    e_ng = cv.take<float>(c.has_ple() ? c.ple_embed_dim : 1);
    kvp = cv.take<float>(c.has_ple() ? S * c.ple_embed_dim + D : 1);
    logits_local = cv.take<float>(v_local);
    logits = cv.take<float>(V);
    token = cv.take<int32_t>(1);
    position = cv.take<int64_t>(1);
    context = cv.take<int64_t>(std::max<int64_t>(c.ngram_size - 1, 1));
    error_flag = cv.take<int32_t>(1);
    sample_step = cv.take<int64_t>(1);
  };
  carve(sizing);
  Carver real(static_cast<std::byte*>(arena.alloc(sizing.used(), "activations")));
  carve(real);
  for (DevLayer& L : layers) {
    if (!L.qsa) continue;
    const QsaDecodeParams shape = qsa_shape(c, o);
    L.attn.workspace = arena.alloc(qsa_decode_workspace_bytes(shape), "QSA workspace");
  }
  if (o.keep_residuals)
    residuals = arena.alloc_n<float>(
        (2 * c.num_hidden_layers + static_cast<int64_t>(c.ple_layer_ids.size())) * W,
        "debug residuals");
  if (o.record_choices) {
    int64_t n_qsa = 0;
    for (const DevLayer& L : layers) n_qsa += L.qsa ? 1 : 0;
    choice_log = arena.alloc_n<int32_t>(
        c.num_hidden_layers * k + n_qsa * (c.indexer_budget / c.indexer_compress_ratio + 4),
        "choice log");
  }
  if (o.replay_choices) {
    int64_t n_qsa = 0;
    for (const DevLayer& L : layers) n_qsa += L.qsa ? 1 : 0;
    forced_router = arena.alloc_n<int32_t>(c.num_hidden_layers * k, "forced router ids");
    forced_blocks = arena.alloc_n<int32_t>(
        std::max<int64_t>(n_qsa, 1) * (c.indexer_budget / c.indexer_compress_ratio),
        "forced indexer blocks");
  }
  FN_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_logits), sizeof(float) * V));
  FN_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_token), sizeof(int32_t) * 3));
  FN_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_flag), sizeof(int32_t) * 2));
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  require_prefill_fits(c, o, layers, v_local);
  reset_state(c);
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

void CudaModel::Impl::encode_step(const ModelConfig& c, const CudaModelOptions& o,
                                  const DeviceSamplingParams* sampling) {
  const int tp = o.tp_size;
  const int64_t D = c.hidden_size, R = c.hc_lowrank, S = c.hc_count, W = c.hc_width();
  const int64_t V = c.vocab_size, E = c.num_experts, k = c.num_experts_per_tok;
  const RankDims rd = rank_dims(c, tp, o.tp_rank);
  const int64_t Hv_l = rd.linear_v_heads, dv = c.linear_value_head_dim;
  const int64_t Hq_l = rd.q_heads, hd = c.head_dim;
  const int64_t Is_l = rd.shared_inter;
  const float eps = static_cast<float>(c.rms_norm_eps);
  cudaStream_t s = stream;
  // CudaModelOptions::bench_skip: launch kind `bit` is left out (knockout benchmarks only).
  auto on = [&](StepLaunch bit) { return ((o.bench_skip >> static_cast<int>(bit)) & 1u) == 0; };
  auto fixed = [&](FixedShapeKernel bit) {
    return ((o.fixed_shape_kernels >> static_cast<int>(bit)) & 1) != 0;
  };
  auto all_reduce = [&](float* buf, int64_t count) {
    if (tp > 1) {
      mark(StepFamily::AllReduce);
      o.all_reduce->all_reduce_sum(buf, buf, static_cast<std::size_t>(count), DType::F32, s);
    }
  };
  // The residual H lives in H or H_alt: where fold_inject (below) holds, an HC inject is not
  // launched but folded into the next HC read's down pass, which writes the injected residual to
  // the other buffer (hc.h HcDownParams::inject_y). `pending`: an inject waits for the next read
  // (its debug-residual slot in pending_slot); settle() launches it alone (before a PLE apply).
  float* Hc = H;
  bool pending = false;
  int64_t n_injects = 0, pending_slot = 0;
  auto keep_residual = [&](int64_t slot) {
    if (residuals)
      FN_CUDA_CHECK(cudaMemcpyAsync(residuals + slot * W, Hc, sizeof(float) * W,
                                    cudaMemcpyDeviceToDevice, s));
  };
  // The HC read (hc.h): the split-K down/inject GEMV against H * (1 + w) with partial squares,
  // then the mix (norm scales, t, G, N -> m). m_out_bf16: the BF16 copy of m for the NVFP4 routed
  // experts (MLP side only), or nullptr.
  auto hc_read = [&](const DevHc& hc, float* iota_out, uint16_t* m_out_bf16) {
    mark(StepFamily::Hc);
    HcDownParams down;
    down.H = Hc;
    down.norm = hc.norm;
    down.weight = hc.down_inj;
    down.rows = hc.down_rows;
    down.hc_count = static_cast<int>(S);
    down.hidden = D;
    down.t_partial = t;
    down.sumsq = sumsq;
    if (pending) {
      down.inject_iota = iota;
      down.inject_y = y;
      down.H_out = Hc == H ? H_alt : H;
    }
    down.fixed_shape = fixed(FixedShapeKernel::HcDown);
    if (on(StepLaunch::HcDown)) launch_hc_down(down, s);
    if (pending) {
      Hc = down.H_out;
      pending = false;
      keep_residual(pending_slot);
    }
    HcMixParams mx;
    mx.w_up = hc.up;
    mx.t = t;
    mx.sumsq = sumsq;
    mx.t_splits = hc_down_splits(S, D);
    mx.t_stride = hc.down_rows;
    mx.H = Hc;
    mx.norm = hc.norm;
    mx.eps = eps;
    mx.m = m;
    mx.m_bf16 = m_out_bf16;
    mx.iota = iota_out;
    mx.hc_count = static_cast<int>(S);
    mx.hidden = D;
    mx.rank = R;
    mx.fixed_shape = fixed(FixedShapeKernel::HcMix);
    if (on(StepLaunch::HcMix)) launch_hc_mix(mx, s);
  };
  auto settle = [&]() {
    if (!pending) return;
    mark(StepFamily::Hc);
    HcInjectParams hi;
    hi.H = Hc;
    hi.iota = iota;
    hi.y = y;
    hi.hc_count = static_cast<int>(S);
    hi.hidden = D;
    if (on(StepLaunch::HcInject)) launch_hc_inject(hi, s);
    pending = false;
    keep_residual(pending_slot);
  };
  // Folded only behind an all-reduce (TP > 1): at TP = 1 the separate inject measured faster
  // (cuda_model_bench, depth 8192: 5.879 ms/token unfused vs 5.975 folded), because the short
  // inject kernel is the window in which the down pass's blocks become resident and stage their
  // weights; behind the big GEMV that produces y the folded down pass has no such window. The
  // all-reduce kernel gives it one (TP = 2: 4.930 -> 4.886 ms/token folded).
  const bool fold_inject = o.fused_step && (o.fold_hc_inject < 0 ? tp > 1 : o.fold_hc_inject > 0);
  // The shared expert's fused launches (cuda/kernels/moe_shared.h): the router GEMV + top-k + shared
  // gate/up in one, SwiGLU + shared down + combine in one; same bits as the separate launches.
  // The fused down needs I a multiple of 8 (every real shape; not every tiny fixture's slice).
  const bool fused_shared = o.fused_step && Is_l % 8 == 0 && Is_l <= 8192;
  const bool moe_bulk_gu =
      o.moe_bulk && moe_gate_up_bulk_supported(static_cast<int>(k), rd.moe_inter, D);
  const bool moe_bulk_dn =
      o.moe_bulk_down && moe_down_bulk_supported(static_cast<int>(k), rd.moe_inter, D);
  auto inject = [&]() {
    pending = true;
    pending_slot = n_injects++;
    if (!fold_inject) settle();
  };

  mark(StepFamily::Other);
  EmbedParams ep;
  ep.table = embed;
  ep.vocab = V;
  ep.hidden = D;
  ep.token = token;
  ep.H = Hc;
  ep.hc_count = static_cast<int>(S);
  ep.error_flag = error_flag;
  launch_embed(ep, s);

  // CudaModelOptions::l2_prefetch: an HC read's weights, prefetched into L2 by the routed gate+up
  // launch before it (cuda/common/l2_prefetch.h).
  // mask bit 0: W_dn (+ inject rows) and the norm; bit 1: W_up.
  auto prefetch_hc = [&](L2Prefetch& l, const DevHc& hc, int mask) {
    if ((mask & 1) != 0) {
      l.add(hc.down_inj, static_cast<uint64_t>(hc.down_rows) * W * sizeof(uint16_t));
      l.add(hc.norm, static_cast<uint64_t>(W) * sizeof(uint16_t));
    }
    if ((mask & 2) != 0) l.add(hc.up, static_cast<uint64_t>(W) * R * sizeof(uint16_t));
  };

  const bool qsa_overlap = o.qsa_overlap_in_proj && o.qsa_select_mailbox &&
                           on(StepLaunch::InProj) && on(StepLaunch::Attention);
  const bool gdn_overlap = o.gdn_overlap_z && on(StepLaunch::InProj) &&
                           on(StepLaunch::Recurrence) && on(StepLaunch::OutProj);
  int64_t layer_index = 0, qsa_index = 0;
  for (DevLayer& L : layers) {
    const DevHc& next_hc = layer_index + 1 < static_cast<int64_t>(layers.size())
                               ? layers[static_cast<size_t>(layer_index) + 1].attn_hc
                               : final_hc;
    if (L.has_ple) {
      settle();  // the residual the PLE adds to must hold the last block's inject
      mark(StepFamily::Ple);
      DevPle& pl = L.ple;
      NgramGatherParams ng = ngram_gather_params(c, pl);
      ng.token = token;
      ng.context = context;
      ng.out = e_ng;
      launch_ngram_gather(ng, s);
      all_reduce(e_ng, c.ple_embed_dim);
      mark(StepFamily::Ple);
      launch_gemv_bf16(pl.kv_proj, S * c.ple_embed_dim + D, c.ple_embed_dim, e_ng, DType::F32, kvp,
                       DType::F32, s);
      PleApplyParams pa = ple_apply_params(c, pl);
      pa.kv = kvp;
      pa.H = Hc;
      launch_ple_apply(pa, s);
      keep_residual(n_injects++);
    }
    hc_read(L.attn_hc, iota, nullptr);
    if (L.qsa) {
      mark(StepFamily::QsaMixer);
      DevQsa& a = L.attn;
      // The projection inside the QSA launcher, beside the select (qsa_overlap_in_proj), or as
      // one GEMV before it.
      if (on(StepLaunch::InProj) && !qsa_overlap)
        launch_gemv_bf16(a.in_proj, a.in_rows, D, m, DType::F32, proj, DType::F32, s);
      QsaDecodeParams q = qsa_layer(c, o, a);
      q.proj = proj;
      if (qsa_overlap) {
        q.in_proj = a.in_proj;
        q.x = m;
        q.hidden = D;
      }
      q.position = position;
      q.workspace = a.workspace;
      q.out = mix_out;
      if (forced_blocks)
        q.forced_blocks = forced_blocks + qsa_index * (c.indexer_budget / c.indexer_compress_ratio);
      q.bench_skip_select = !on(StepLaunch::QsaSelect);
      q.select_mailbox = o.qsa_select_mailbox;
      if (on(StepLaunch::Attention)) launch_qsa_decode(q, s);
      if (choice_log) {  // the selected blocks, then the counters {count, B, tokens, 0}
        const int64_t topk = c.indexer_budget / c.indexer_compress_ratio;
        const QsaWorkspaceLayout wl = qsa_workspace_layout(q);
        const int64_t n_sel = std::min(topk, o.ctx_size / c.indexer_compress_ratio);
        int32_t* log = choice_log + c.num_hidden_layers * k + qsa_index * (topk + 4);
        const auto* ws = static_cast<const std::byte*>(a.workspace);
        if (n_sel > 0)
          FN_CUDA_CHECK(cudaMemcpyAsync(log, ws + wl.selected, sizeof(int32_t) * n_sel,
                                        cudaMemcpyDeviceToDevice, s));
        FN_CUDA_CHECK(cudaMemcpyAsync(log + topk, ws + wl.counters, sizeof(int32_t) * 4,
                                      cudaMemcpyDeviceToDevice, s));
      }
      ++qsa_index;
      if (on(StepLaunch::OutProj))
        launch_gemv_bf16(a.o, D, Hq_l * hd, mix_out, DType::BF16, y, DType::F32, s);
    } else {
      mark(StepFamily::GdnMixer);
      DevGdn& g = L.gdn;
      if (on(StepLaunch::InProj) && !gdn_overlap)
        launch_gemv_bf16(g.in_proj, g.in_rows, D, m, DType::F32, proj, DType::F32, s);
      GdnDecodeParams gp;
      set_gdn_layer(gp, c, rd, g);
      gp.proj = proj;
      gp.out = mix_out;
      gp.o_scratch = g.o_scratch;
      gp.head_counters = g.counters;
      gp.fixed_shape = fixed(FixedShapeKernel::Recurrence);
      gp.cluster = o.gdn_cluster;
      if (gdn_overlap) {  // the projections inside the GDN launcher, z beside the recurrence
        gp.in_proj = g.in_proj;
        gp.x = m;
        gp.hidden = D;
        gp.out_weight = g.out;
        gp.y = y;
        gp.join = g.counters + Hv_l + rd.linear_k_heads;
      }
      if (on(StepLaunch::Recurrence)) launch_gdn_decode(gp, s);
      if (on(StepLaunch::OutProj) && !gdn_overlap)
        launch_gemv_bf16(g.out, D, Hv_l * dv, mix_out, DType::BF16, y, DType::F32, s);
    }
    all_reduce(y, D);
    inject();

    hc_read(L.mlp_hc, iota, m_bf16);
    mark(StepFamily::Router);
    DevMoe& mo = L.moe;
    if (fused_shared) {  // router + shared gate/up GEMV rows and the top-k: one launch
      RouterSharedGateUpParams rs;
      rs.x = m;
      rs.hidden = D;
      rs.router_weight = mo.router;
      rs.gate_up_weight = mo.s_gate_up;
      rs.inter = Is_l;
      rs.num_experts = static_cast<int>(E);
      rs.top_k = static_cast<int>(k);
      rs.norm_topk_prob = c.norm_topk_prob;
      rs.logits = rl;
      rs.gate_up = sgu;
      rs.ids = ids;
      rs.weights = rw;
      rs.error_flag = error_flag;
      rs.mailbox = router_mailbox;
      rs.bench_skip_topk = !on(StepLaunch::RouterTopK);
      rs.bench_skip_router_rows = !on(StepLaunch::RouterRows);
      rs.bench_skip_shared_rows = !on(StepLaunch::RouterSharedRows);
      rs.fixed_shape = fixed(FixedShapeKernel::Router);
      if (on(StepLaunch::Router)) launch_router_shared_gate_up(rs, s);
    } else {
      launch_gemv_bf16(mo.router, E + 1, D, m, DType::F32, rl, DType::F32, s);
      RouterParams rp;
      rp.logits = rl;
      rp.num_experts = static_cast<int>(E);
      rp.top_k = static_cast<int>(k);
      rp.norm_topk_prob = c.norm_topk_prob;
      rp.ids = ids;
      rp.weights = rw;
      rp.error_flag = error_flag;
      launch_router_topk(rp, s);
    }
    if (forced_router) {
      RouterForceParams rf;
      rf.logits = rl;
      rf.num_experts = static_cast<int>(E);
      rf.top_k = static_cast<int>(k);
      rf.norm_topk_prob = c.norm_topk_prob;
      rf.forced_ids = forced_router + layer_index * k;
      rf.ids = ids;
      rf.weights = rw;
      launch_router_force(rf, s);
    }
    for (int i = 0; i < o.bench_empty_launches; ++i) launch_bench_empty(s);
    if (choice_log)
      FN_CUDA_CHECK(cudaMemcpyAsync(choice_log + layer_index * k, ids, sizeof(int32_t) * k,
                                    cudaMemcpyDeviceToDevice, s));
    ++layer_index;
    mark(StepFamily::RoutedMoe);
    MoeGateUpParams gu;
    gu.experts = mo.gate_up;
    gu.expert_ids = ids;
    gu.top_k = static_cast<int>(k);
    gu.x = m_bf16;  // W4A16: the experts take m rounded to BF16 (DESIGN.md numerics)
    gu.h = h;
    gu.bulk = moe_bulk_gu;
    gu.bench_loads_only = !on(StepLaunch::GateUpMath);
    prefetch_hc(gu.l2_prefetch, next_hc, o.l2_prefetch);  // the next HC read
    if ((o.l2_prefetch & 4) != 0)                         // the shared expert's down matrix
      gu.l2_prefetch.add(mo.s_down, static_cast<uint64_t>(D) * Is_l * sizeof(uint16_t));
    if (moe_bulk_gu && o.moe_down_prefetch) gu.down_prefetch = mo.down;
    MoeDownParams dn;
    dn.experts = mo.down;
    dn.expert_ids = ids;
    dn.routing_weights = rw;
    dn.top_k = static_cast<int>(k);
    dn.h = h;
    dn.y = y;
    dn.bulk = moe_bulk_dn;
    dn.bench_skip_math = !on(StepLaunch::DownMath);
    if (on(StepLaunch::ExpertsGateUp)) launch_moe_gate_up_nvfp4(gu, s);
    dn.fixed_shape = fixed(FixedShapeKernel::ExpertsDown);
    if (on(StepLaunch::ExpertsDown)) launch_moe_down_nvfp4(dn, s);
    mark(StepFamily::SharedExpert);
    if (fused_shared) {  // SwiGLU + shared down GEMV + gated combine: one launch
      SharedDownCombineParams sd;
      sd.weight = mo.s_down;
      sd.hidden = D;
      sd.inter = Is_l;
      sd.gate_up = sgu;
      sd.gate_logit = rl + E;
      sd.y = y;
      if (o.in_proj_prefetch_mb > 0 && layer_index < static_cast<int64_t>(layers.size())) {
        const DevLayer& nx = layers[static_cast<size_t>(layer_index)];  // the next layer
        const uint16_t* w = nx.qsa ? nx.attn.in_proj : nx.gdn.in_proj;
        const int64_t rows = nx.qsa ? nx.attn.in_rows : nx.gdn.in_rows;
        const uint64_t bytes =
            std::min<uint64_t>(static_cast<uint64_t>(rows) * D * sizeof(uint16_t),
                               static_cast<uint64_t>(o.in_proj_prefetch_mb) << 20);
        sd.l2_prefetch.add(w, bytes / 16 * 16);
      }
      if (on(StepLaunch::SharedDown)) launch_shared_down_combine(sd, s);
    } else {
      launch_gemv_bf16(mo.s_gate_up, 2 * Is_l, D, m, DType::F32, sgu, DType::F32, s);
      SwigluParams sw;
      sw.gate_up = sgu;
      sw.h = sh;
      sw.inter = Is_l;
      launch_swiglu(sw, s);
      launch_gemv_bf16(mo.s_down, D, Is_l, sh, DType::BF16, ys, DType::F32, s);
      MoeCombineParams mc;
      mc.y = y;
      mc.y_shared = ys;
      mc.gate_logit = rl + E;
      mc.hidden = D;
      launch_moe_combine(mc, s);
    }
    all_reduce(y, D);
    inject();
  }

  hc_read(final_hc, nullptr, nullptr);
  mark(StepFamily::LmHead);
  if (tp > 1) {
    launch_gemv_bf16(lm_head, v_local, D, m, DType::F32, logits_local, DType::F32, s);
    ScatterLogitsParams sc;
    sc.local = logits_local;
    sc.full = logits;
    sc.v_local = v_local;
    sc.v_first = v_first;
    sc.vocab = V;
    launch_scatter_logits(sc, s);
    all_reduce(logits, V);
    mark(StepFamily::LmHead);
  } else {
    launch_gemv_bf16(lm_head, V, D, m, DType::F32, logits, DType::F32, s);
  }
  if (c.has_ple()) {
    NgramContextAdvanceParams ca;
    ca.context = context;
    ca.ngram_size = static_cast<int>(c.ngram_size);
    ca.token = token;
    launch_ngram_context_advance(ca, s);
  }
  if (sampling) {
    SampleParams sp;
    sp.logits = logits;
    sp.vocab = V;
    sp.sampling = *sampling;
    sp.step = sample_step;
    sp.token_out = token;
    sp.history = history;
    sp.history_capacity = history_capacity;
    sp.workspace = sample_ws;
    sp.workspace_bytes = sample_ws_bytes;
    sp.error_flag = error_flag;
    launch_sample(sp, s);
  }
  StepAdvanceParams adv;
  adv.position = position;
  adv.sample_step = sampling ? sample_step : nullptr;
  launch_step_advance(adv, s);
  mark_end();
}

namespace {
// Refuses, before allocating anything, a model + context that does not fit the free device
// memory (core/memory_plan.h), with the per-category bytes in the message.
void require_device_memory(const ModelConfig& c, const ShardPlan& plan, const CudaModelOptions& o) {
  std::size_t free_b = 0, total_b = 0;
  FN_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  int device = 0;
  FN_CUDA_CHECK(cudaGetDevice(&device));
  require_fits(plan_device_memory(c, plan, o.tp_rank, o.ctx_size), free_b,
               fmt::format("rank {} (GPU {})", o.tp_rank, device));
}
}  // namespace

std::unique_ptr<CudaModel> CudaModel::load(const std::filesystem::path& dir,
                                           const CudaModelOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  OpenedModel om = open_model(dir, options.tp_size);
  check_supported(om.config, options, om.quant.quantized());
  require_device_memory(om.config, om.plan, options);
  std::unique_ptr<CudaModel> model(new CudaModel(om.config, options));
  CheckpointSource src(om, options.tp_rank);
  model->impl_->build(model->cfg_, options, src, &src, om.quant.ngram_fp8(om.config));
  src.finish();
  model->stats_.bytes = src.bytes();
  model->stats_.weight_bytes = model->impl_->weight_bytes;
  model->stats_.state_bytes = model->impl_->arena.held() - model->impl_->weight_bytes;
  model->stats_.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return model;
}

std::unique_ptr<CudaModel> CudaModel::random(const ModelConfig& config, const QuantConfig& quant,
                                             uint64_t seed, const CudaModelOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  check_supported(config, options, quant.quantized());
  const ShardPlan plan = ShardPlan::build(config, quant, options.tp_size);
  require_device_memory(config, plan, options);
  std::unique_ptr<CudaModel> model(new CudaModel(config, options));
  RandomSource src(plan, options.tp_rank, seed);
  model->impl_->build(model->cfg_, options, src, nullptr, quant.ngram_fp8(config));
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  model->stats_.bytes = src.bytes();
  model->stats_.weight_bytes = model->impl_->weight_bytes;
  model->stats_.state_bytes = model->impl_->arena.held() - model->impl_->weight_bytes;
  model->stats_.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return model;
}

}  // namespace fn

namespace fn {

namespace {

// Captures what `encode` enqueues on `stream` into an instantiated graph.
cudaGraphExec_t capture(cudaStream_t stream, const std::function<void()>& encode) {
  FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    encode();
  } catch (...) {
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(stream, &g);
    if (g) cudaGraphDestroy(g);
    throw;
  }
  cudaGraph_t graph = nullptr;
  FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t rc = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  FN_CUDA_CHECK(rc);
  return exec;
}

}  // namespace

int64_t CudaModel::graph_captures() const noexcept {
  return impl_->captures;
}

void CudaModel::reset() {
  impl_->reset_state(cfg_);
  position_ = 0;
}

void CudaModel::set_position_for_benchmark(int64_t position) {
  FN_REQUIRE(position >= 0 && position < opt_.ctx_size, Usage,
             "benchmark position {} is outside the context [0, {})", position, opt_.ctx_size);
  FN_CUDA_CHECK(cudaMemcpyAsync(impl_->position, &position, sizeof(int64_t), cudaMemcpyHostToDevice,
                                impl_->stream));
  FN_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  position_ = position;
}

std::vector<std::vector<float>> CudaModel::debug_residuals() const {
  const Impl& I = *impl_;
  FN_REQUIRE(I.residuals != nullptr, Usage, "debug_residuals needs keep_residuals");
  const int64_t W = cfg_.hc_width();
  const int64_t n = 2 * cfg_.num_hidden_layers + static_cast<int64_t>(cfg_.ple_layer_ids.size());
  std::vector<float> all(static_cast<std::size_t>(n * W));
  FN_CUDA_CHECK(cudaStreamSynchronize(I.stream));
  FN_CUDA_CHECK(
      cudaMemcpy(all.data(), I.residuals, all.size() * sizeof(float), cudaMemcpyDeviceToHost));
  std::vector<std::vector<float>> out;
  for (int64_t i = 0; i < n; ++i) out.emplace_back(all.begin() + i * W, all.begin() + (i + 1) * W);
  return out;
}

StepChoices CudaModel::last_choices() const {
  const Impl& I = *impl_;
  FN_REQUIRE(I.choice_log != nullptr, Usage, "last_choices needs CudaModelOptions::record_choices");
  int64_t n_qsa = 0;
  for (const DevLayer& d : I.layers) n_qsa += d.qsa ? 1 : 0;
  std::vector<int32_t> log(static_cast<std::size_t>(choice_log_ints(cfg_, n_qsa)));
  FN_CUDA_CHECK(cudaStreamSynchronize(I.stream));
  FN_CUDA_CHECK(
      cudaMemcpy(log.data(), I.choice_log, log.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  return choices_from_log(cfg_, n_qsa, log.data());
}

int64_t model_detail::choice_log_ints(const ModelConfig& c, int64_t qsa_layers) {
  const int64_t topk = c.indexer_budget / c.indexer_compress_ratio;
  return c.num_hidden_layers * c.num_experts_per_tok + qsa_layers * (topk + 4);
}

StepChoices model_detail::choices_from_log(const ModelConfig& c, int64_t qsa_layers,
                                           const int32_t* log) {
  const int64_t k = c.num_experts_per_tok, L = c.num_hidden_layers;
  const int64_t topk = c.indexer_budget / c.indexer_compress_ratio;
  StepChoices out;
  for (int64_t l = 0; l < L; ++l) out.router.emplace_back(log + l * k, log + (l + 1) * k);
  for (int64_t q = 0; q < qsa_layers; ++q) {
    const int32_t* e = log + L * k + q * (topk + 4);
    const int32_t count = e[topk], blocks = e[topk + 1];
    FN_CHECK(count >= 0 && count <= topk, "QSA layer {}: selected block count {} outside [0, {}]",
             q, count, topk);
    out.indexer.emplace_back();
    if (blocks > topk) out.indexer.back().assign(e, e + count);
  }
  return out;
}

void CudaModel::set_forced_choices(const std::vector<std::vector<int32_t>>& router,
                                   const std::vector<std::vector<int32_t>>& indexer) {
  Impl& I = *impl_;
  FN_REQUIRE(I.forced_router != nullptr, Usage,
             "set_forced_choices needs CudaModelOptions::replay_choices");
  const int64_t k = cfg_.num_experts_per_tok;
  const int64_t topk = cfg_.indexer_budget / cfg_.indexer_compress_ratio;
  FN_REQUIRE(static_cast<int64_t>(router.size()) == cfg_.num_hidden_layers, Usage,
             "{} router choices for {} layers", router.size(), cfg_.num_hidden_layers);
  std::vector<int32_t> r;
  for (const auto& ids : router) {
    FN_REQUIRE(static_cast<int64_t>(ids.size()) == k, Usage, "{} expert ids, top-k is {}",
               ids.size(), k);
    r.insert(r.end(), ids.begin(), ids.end());
  }
  FN_CUDA_CHECK(
      cudaMemcpy(I.forced_router, r.data(), r.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  for (std::size_t q = 0; q < indexer.size(); ++q) {
    if (indexer[q].empty()) continue;
    FN_REQUIRE(static_cast<int64_t>(indexer[q].size()) == topk, Usage,
               "{} indexer blocks, block_topk is {}", indexer[q].size(), topk);
    FN_CUDA_CHECK(cudaMemcpy(I.forced_blocks + static_cast<int64_t>(q) * topk, indexer[q].data(),
                             indexer[q].size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
}

void CudaModel::check_step_errors(int32_t token, int slot) {
  Impl& I = *impl_;
  const int32_t flag = I.host_flag[slot];
  if (flag == 0) return;
  FN_CUDA_CHECK(cudaMemsetAsync(I.error_flag, 0, sizeof(int32_t), I.stream));
  switch (flag) {
    case 1:
      FN_THROW(Usage, "token id {} is outside the vocabulary [0, {})", token, cfg_.vocab_size);
    case 2:
    case 4:
      FN_THROW(Format,
               "the model produced non-finite values (flag {}) at position {}: the checkpoint's "
               "weights hold NaN/Inf or overflow",
               flag, position_);
    default:
      FN_THROW(Internal, "decode step error flag {} at position {}", flag, position_);
  }
}

std::span<const float> CudaModel::forward(int32_t token) {
  Impl& I = *impl_;
  FN_REQUIRE(token >= 0 && token < cfg_.vocab_size, Usage,
             "token id {} is outside the vocabulary [0, {})", token, cfg_.vocab_size);
  FN_REQUIRE(position_ < opt_.ctx_size, Usage,
             "the context is full: position {} needs more than -c/--ctx-size {} tokens", position_,
             opt_.ctx_size);
  I.host_token[0] = token;
  FN_CUDA_CHECK(
      cudaMemcpyAsync(I.token, I.host_token, sizeof(int32_t), cudaMemcpyHostToDevice, I.stream));
  if (opt_.use_graph) {
    if (!I.logits_graph) {
      I.logits_graph = capture(I.stream, [&] { I.encode_step(cfg_, opt_, nullptr); });
      ++I.captures;
    }
    FN_CUDA_CHECK(cudaGraphLaunch(I.logits_graph, I.stream));
  } else {
    I.encode_step(cfg_, opt_, nullptr);
  }
  const int64_t V = cfg_.vocab_size;
  FN_CUDA_CHECK(cudaMemcpyAsync(I.host_logits, I.logits, sizeof(float) * V, cudaMemcpyDeviceToHost,
                                I.stream));
  FN_CUDA_CHECK(cudaMemcpyAsync(I.host_flag, I.error_flag, sizeof(int32_t), cudaMemcpyDeviceToHost,
                                I.stream));
  FN_CUDA_CHECK(cudaStreamSynchronize(I.stream));
  if (opt_.all_reduce) opt_.all_reduce->check_health();
  check_step_errors(token);
  for (int64_t v = 0; v < V; ++v) {
    FN_REQUIRE(std::isfinite(I.host_logits[v]), Format,
               "the model produced a non-finite logit ({} for token {}) at position {}: the "
               "checkpoint's weights hold NaN/Inf or overflow",
               I.host_logits[v], v, position_);
  }
  ++position_;
  return {I.host_logits, static_cast<std::size_t>(V)};
}

void CudaModel::prepare_sampling(const SamplingParams& sampling, uint64_t seed) {
  Impl& I = *impl_;
  DeviceSamplingParams dp;
  dp.temperature = static_cast<float>(sampling.temperature);
  dp.top_k = static_cast<int>(sampling.top_k);
  dp.top_p = static_cast<float>(sampling.top_p);
  dp.min_p = static_cast<float>(sampling.min_p);
  dp.seed = seed;
  const bool same =
      I.history != nullptr && dp.temperature == I.sample_graph_params.temperature &&
      dp.top_k == I.sample_graph_params.top_k && dp.top_p == I.sample_graph_params.top_p &&
      dp.min_p == I.sample_graph_params.min_p && dp.seed == I.sample_graph_params.seed;
  if (same) return;
  for (cudaGraphExec_t* g : {&I.sample_graph, &I.profile_graph}) {
    if (*g) {
      FN_CUDA_CHECK(cudaGraphExecDestroy(*g));
      *g = nullptr;
    }
  }
  const std::size_t need = sample_workspace_bytes(cfg_.vocab_size, dp);
  if (need > I.sample_ws_bytes) {
    I.sample_ws = I.arena.alloc(need, "sampling workspace");
    I.sample_ws_bytes = need;
  }
  if (I.history == nullptr) {
    I.history_capacity = opt_.ctx_size + 1;
    I.history = I.arena.alloc_n<int32_t>(I.history_capacity, "token history");
  }
  I.sample_graph_params = dp;
}

namespace {

// The token fed first must be in the vocabulary and `count` steps from `position` must fit the
// cache (fn::Error(Usage) otherwise, naming -c/--ctx-size); `count_ok` is the caller's lower bound.
void require_steps(const ModelConfig& c, int32_t token, bool count_ok, int64_t count,
                   const char* doing, const char* unit, int64_t position, int64_t ctx_size) {
  FN_REQUIRE(token >= 0 && token < c.vocab_size, Usage,
             "token id {} is outside the vocabulary [0, {})", token, c.vocab_size);
  FN_REQUIRE(count_ok && position + count <= ctx_size, Usage,
             "{} {} {} from position {} needs more than -c/--ctx-size {} tokens", doing, count,
             unit, position, ctx_size);
}

}  // namespace

std::vector<int32_t> CudaModel::decode(int32_t token, int64_t count, const SamplingParams& sampling,
                                       uint64_t seed,
                                       const std::function<bool(int32_t)>& on_token) {
  Impl& I = *impl_;
  require_steps(cfg_, token, count >= 0, count, "decoding", "tokens", position_, opt_.ctx_size);
  prepare_sampling(sampling, seed);
  // The sampler's step counter indexes the history: restart it for this call.
  FN_CUDA_CHECK(cudaMemsetAsync(I.sample_step, 0, sizeof(int64_t), I.stream));
  I.host_token[0] = token;
  FN_CUDA_CHECK(
      cudaMemcpyAsync(I.token, I.host_token, sizeof(int32_t), cudaMemcpyHostToDevice, I.stream));
  if (opt_.use_graph && !I.sample_graph) {
    I.sample_graph = capture(I.stream, [&] { I.encode_step(cfg_, opt_, &I.sample_graph_params); });
    ++I.captures;
  }

  // Step i's id lands in pinned slot i % 2 (host_token[1 + slot], its error flag in
  // host_flag[slot]) and event ev[slot] marks it. With the lookahead (decode_lookahead) step i + 1
  // is queued before the host waits for step i, so the GPU does not idle while the host wakes,
  // takes the id and launches again; it reads the id step i leaves on the device.
  const bool ahead = opt_.use_graph && opt_.decode_lookahead;
  struct Events {
    cudaEvent_t e[2] = {nullptr, nullptr};
    ~Events() {
      for (cudaEvent_t x : e)
        if (x) cudaEventDestroy(x);
    }
  } ev;
  for (cudaEvent_t& e : ev.e) FN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  const auto enqueue = [&](int64_t i) {
    const int slot = static_cast<int>(i & 1);
    if (opt_.use_graph) {
      FN_CUDA_CHECK(cudaGraphLaunch(I.sample_graph, I.stream));
    } else {
      I.encode_step(cfg_, opt_, &I.sample_graph_params);
    }
    FN_CUDA_CHECK(cudaMemcpyAsync(I.host_token + 1 + slot, I.token, sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, I.stream));
    FN_CUDA_CHECK(cudaMemcpyAsync(I.host_flag + slot, I.error_flag, sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, I.stream));
    FN_CUDA_CHECK(cudaEventRecord(ev.e[slot], I.stream));
  };
  int64_t queued = 0, taken = 0;  // steps launched, steps counted in position_
  // Waits for step i (= taken), which fed `fed`: its position counts, its errors throw, its id
  // returns.
  const auto take = [&](int64_t i, int32_t fed) {
    const int slot = static_cast<int>(i & 1);
    FN_CUDA_CHECK(cudaEventSynchronize(ev.e[slot]));
    ++position_;
    ++taken;
    check_step_errors(fed, slot);
    return I.host_token[1 + slot];
  };
  // A step queued ahead still runs when the loop leaves early (a stop: it has fed the stop id;
  // or an exception from a check or from on_token): its position counts, so position() matches
  // the device's states. Not waited for: later work on the stream follows it, and its error flag
  // stays set for the next step's check.
  struct CountQueued {
    CudaModel& m;
    const int64_t& queued;
    const int64_t& taken;
    ~CountQueued() { m.position_ += queued - taken; }
  } count_queued{*this, queued, taken};

  std::vector<int32_t> out;
  out.reserve(static_cast<std::size_t>(count));
  int32_t fed = token;
  if (count > 0) enqueue(queued++);
  for (int64_t i = 0; i < count; ++i) {
    if (ahead && queued < count) enqueue(queued++);
    const int32_t id = take(i, fed);
    out.push_back(id);
    fed = id;
    if (on_token && !on_token(id)) break;  // a step queued ahead counts (count_queued)
    if (!ahead && queued < count) enqueue(queued++);
  }
  if (opt_.all_reduce) opt_.all_reduce->check_health();
  return out;
}

const char* step_family_name(StepFamily f) noexcept {
  switch (f) {
    case StepFamily::Hc:
      return "hc";
    case StepFamily::GdnMixer:
      return "gdn";
    case StepFamily::QsaMixer:
      return "qsa";
    case StepFamily::Router:
      return "router";
    case StepFamily::RoutedMoe:
      return "moe_routed";
    case StepFamily::SharedExpert:
      return "shared_expert";
    case StepFamily::AllReduce:
      return "all_reduce";
    case StepFamily::LmHead:
      return "lm_head";
    case StepFamily::Ple:
      return "ple";
    case StepFamily::Other:
      return "other";
  }
  return "?";
}

StepProfile CudaModel::profile_steps(int32_t token, int64_t count, bool in_graph) {
  Impl& I = *impl_;
  require_steps(cfg_, token, count >= 1, count, "profiling", "steps", position_, opt_.ctx_size);
  SamplingParams greedy;
  greedy.temperature = 0;
  prepare_sampling(greedy, 0);
  Impl::Marks& mk = in_graph ? I.graph_marks : I.eager_marks;
  if (mk.events.empty()) {
    // At most 14 boundaries per layer (PLE, all-reduces, HC, mixer, router, experts, shared).
    const std::size_t n = static_cast<std::size_t>(16 * cfg_.num_hidden_layers + 32);
    mk.events.assign(n, nullptr);
    mk.family.assign(n, 0);
    for (cudaEvent_t& e : mk.events) FN_CUDA_CHECK(cudaEventCreate(&e));
  }
  mk.external = in_graph;
  struct MarksOff {
    Impl& impl;
    ~MarksOff() { impl.marks = nullptr; }
  } marks_off{I};
  FN_CUDA_CHECK(cudaMemsetAsync(I.sample_step, 0, sizeof(int64_t), I.stream));
  I.host_token[0] = token;
  FN_CUDA_CHECK(
      cudaMemcpyAsync(I.token, I.host_token, sizeof(int32_t), cudaMemcpyHostToDevice, I.stream));
  if (in_graph && !I.profile_graph) {
    mk.used = 0;
    I.marks = &mk;
    I.profile_graph = capture(I.stream, [&] { I.encode_step(cfg_, opt_, &I.sample_graph_params); });
    I.marks = nullptr;
    ++I.captures;
  }
  StepProfile out;
  out.in_graph = in_graph;
  int32_t fed = token;
  for (int64_t i = 0; i < count; ++i) {
    if (in_graph) {
      FN_CUDA_CHECK(cudaGraphLaunch(I.profile_graph, I.stream));
    } else {
      mk.used = 0;
      I.marks = &mk;
      I.encode_step(cfg_, opt_, &I.sample_graph_params);
      I.marks = nullptr;
    }
    FN_CUDA_CHECK(cudaMemcpyAsync(I.host_token + 1, I.token, sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, I.stream));
    FN_CUDA_CHECK(cudaMemcpyAsync(I.host_flag, I.error_flag, sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, I.stream));
    FN_CUDA_CHECK(cudaStreamSynchronize(I.stream));
    ++position_;
    check_step_errors(fed);
    fed = I.host_token[1];
    FN_CHECK(mk.used >= 2 && mk.family[mk.used - 1] == kStepFamilyCount,
             "a profiled step recorded {} events", mk.used);
    out.segments = {};
    out.events = static_cast<int64_t>(mk.used);
    for (std::size_t j = 0; j + 1 < mk.used; ++j) {
      float ms = 0;
      FN_CUDA_CHECK(cudaEventElapsedTime(&ms, mk.events[j], mk.events[j + 1]));
      out.ms[static_cast<std::size_t>(mk.family[j])] += ms;
      ++out.segments[static_cast<std::size_t>(mk.family[j])];
    }
    float total = 0;
    FN_CUDA_CHECK(cudaEventElapsedTime(&total, mk.events[0], mk.events[mk.used - 1]));
    out.step_ms += total;
  }
  for (double& v : out.ms) v /= static_cast<double>(count);
  out.step_ms /= static_cast<double>(count);
  out.steps = count;
  if (opt_.all_reduce) opt_.all_reduce->check_health();
  return out;
}

}  // namespace fn
