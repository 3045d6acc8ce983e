// CpuModel (see cpu_model.h): loading one rank's slices and the decode step of docs/model.md §C.10.
#include "core/cpu_model.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>

#include "core/checkpoint.h"
#include "core/codecs.h"
#include "core/cpu_ops.h"
#include "core/error.h"
#include "core/log.h"
#include "core/model_tensors.h"
#include "core/ngram.h"
#include "core/rank_slices.h"
#include "core/shard_plan.h"

namespace fn {

namespace {

constexpr std::string_view kPrefix = "model.language_model.";

// ---- weights in their checkpoint dtypes ------------------------------------------------------

// The bytes of one tensor slice, shared by the matrices that view into it.
using Bytes = std::shared_ptr<const std::vector<std::byte>>;

// A row-major matrix stored as BF16, F16 or F32 (a view at `offset` bytes into a shared buffer).
class StoredMatrix final : public cpu::RowMatrix {
 public:
  StoredMatrix(Bytes buf, std::size_t offset, DType dtype, int64_t rows, int64_t cols)
      : buf_(std::move(buf)), offset_(offset), dtype_(dtype), rows_(rows), cols_(cols) {
    FN_CHECK(offset_ + static_cast<std::size_t>(rows * cols) * dtype_size(dtype) <= buf_->size(),
             "StoredMatrix [{}, {}] at {} overruns a {}-byte buffer", rows, cols, offset_,
             buf_->size());
    FN_CHECK(dtype == DType::BF16 || dtype == DType::F16 || dtype == DType::F32,
             "StoredMatrix: unsupported dtype {}", dtype_name(dtype));
  }
  int64_t rows() const noexcept override { return rows_; }
  int64_t cols() const noexcept override { return cols_; }
  void read_row(int64_t r, float* out) const override {
    const std::byte* p =
        buf_->data() + offset_ + static_cast<std::size_t>(r * cols_) * dtype_size(dtype_);
    if (dtype_ == DType::F32) {
      std::memcpy(out, p, sizeof(float) * static_cast<std::size_t>(cols_));
      return;
    }
    // Copy the 16-bit codes out first (no aliasing through the byte buffer), then widen.
    thread_local std::vector<uint16_t> bits;
    bits.resize(static_cast<std::size_t>(cols_));
    std::memcpy(bits.data(), p, 2 * static_cast<std::size_t>(cols_));
    if (dtype_ == DType::BF16) {
      // bfloat16 is the top half of a float: exact, the same as bf16_to_float (codecs.h).
      for (int64_t c = 0; c < cols_; ++c)
        out[c] = std::bit_cast<float>(static_cast<uint32_t>(bits[c]) << 16);
    } else {
      for (int64_t c = 0; c < cols_; ++c) out[c] = fp16_to_float(bits[c]);
    }
  }

 private:
  Bytes buf_;
  std::size_t offset_;
  DType dtype_;
  int64_t rows_, cols_;
};

// An NVFP4 matrix (docs/model.md §B.4): packed E2M1 codes [rows, cols/2], E4M3 block scales
// [rows, cols/16], one FP32 global scale (weight_scale_2, a multiplier).
class Nvfp4Matrix final : public cpu::RowMatrix {
 public:
  Nvfp4Matrix(Bytes packed, Bytes scales, float global_scale, int64_t rows, int64_t cols)
      : packed_(std::move(packed)),
        scales_(std::move(scales)),
        global_(global_scale),
        rows_(rows),
        cols_(cols) {
    FN_CHECK(cols % 16 == 0 && packed_->size() == static_cast<std::size_t>(rows * cols / 2) &&
                 scales_->size() == static_cast<std::size_t>(rows * cols / 16),
             "Nvfp4Matrix [{}, {}]: {} packed bytes, {} scales", rows, cols, packed_->size(),
             scales_->size());
  }
  int64_t rows() const noexcept override { return rows_; }
  int64_t cols() const noexcept override { return cols_; }
  void read_row(int64_t r, float* out) const override {
    const auto* codes = reinterpret_cast<const uint8_t*>(packed_->data()) + r * cols_ / 2;
    const auto* sc = reinterpret_cast<const uint8_t*>(scales_->data()) + r * cols_ / 16;
    dequant_nvfp4_row(codes, sc, global_, cols_, out);
  }

 private:
  Bytes packed_, scales_;
  float global_;
  int64_t rows_, cols_;
};

using Slice = WeightSlice;

std::vector<float> to_f32(const Slice& s) {
  return slice_to_f32(s);
}

// The CPU model's view of RankSliceReader: slices as row matrices or FP32 vectors.
class Loader {
 public:
  Loader(const Checkpoint& ck, const ShardPlan& plan, int rank, bool bare)
      : reader_(ck, plan, rank, bare) {}
  std::string stored_name(std::string_view name) const { return reader_.stored_name(name); }
  Slice read(const std::string& name) { return reader_.read(name); }
  Slice read(const std::string& name, int64_t rows, int64_t cols) {
    return reader_.read(name, rows, cols);
  }
  std::unique_ptr<cpu::RowMatrix> matrix(const std::string& name, int64_t rows, int64_t cols) {
    Slice s = read(name, rows, cols);
    return std::make_unique<StoredMatrix>(s.bytes, 0, s.dtype, rows, cols);
  }
  std::vector<float> vec(const std::string& name, int64_t n) { return to_f32(read(name, n, 1)); }
  uint64_t bytes() const noexcept { return reader_.bytes(); }

 private:
  RankSliceReader reader_;
};

}  // namespace

// ---- model structure -------------------------------------------------------------------------

struct CpuModel::Hc {
  std::vector<float> norm;                 // [W]
  std::unique_ptr<cpu::RowMatrix> down;    // [r, W]
  std::unique_ptr<cpu::RowMatrix> up;      // [W, r]
  std::unique_ptr<cpu::RowMatrix> inject;  // [S, W] or null (final mixer)
};

struct CpuModel::Matrices {
  std::unique_ptr<cpu::RowMatrix> embed;    // [V, D] replicated
  std::unique_ptr<cpu::RowMatrix> lm_head;  // [V/tp, D]
};

namespace {

struct Gdn {
  std::unique_ptr<cpu::RowMatrix> qkv, z, a, b, out;  // local rows / cols
  std::vector<float> A_log, dt_bias, conv, norm;      // [Hv_l], [Hv_l], [C_l, K], [dv]
  std::vector<float> conv_state;                      // [C_l, K-1] pre-conv qkv, oldest first
  std::vector<float> S;                               // [Hv_l, dk, dv] FP32 recurrent state
};

struct Qsa {
  std::unique_ptr<cpu::RowMatrix> q, k, v, o, idx;
  std::vector<float> q_norm, k_norm, iq_norm, ik_norm;
  std::vector<float> K, V;        // [T, Hkv_l * hd]: K after k_norm and RoPE
  std::vector<float> raw_keys;    // [T, ihd] indexer keys before norm and RoPE
  std::vector<float> block_keys;  // [T / ratio, ihd] pooled, normed, roped at the block start
};

struct Expert {
  std::unique_ptr<cpu::RowMatrix> gate, up, down;  // [I_l, D], [I_l, D], [D, I_l]
};

struct Moe {
  std::unique_ptr<cpu::RowMatrix> router;                // [E, D]
  std::unique_ptr<cpu::RowMatrix> s_gate, s_up, s_down;  // shared expert slices
  std::vector<float> shared_expert_gate;                 // [D]
  std::vector<Expert> experts;                           // [E]
};

// One 2-D n-gram table shard held by this rank: full-table rows [first_row, first_row + rows).
struct NgramShard {
  int64_t first_row = 0;
  int64_t rows = 0;
  Slice data;  // [rows, head_dim] F8_E4M3 or BF16
};

struct Ple {
  std::unique_ptr<cpu::RowMatrix> key, value;
  std::vector<float> norm_key, norm_query, norm_conv, conv;
  NgramConstants consts;
  std::vector<NgramShard> shards;
  float scale = 1.0f;             // FP8 table: the BF16 weight_scale; BF16 table: 1
  std::vector<float> conv_state;  // [W, (K-1)*dilation]
  std::vector<int64_t> context;   // last ngram_size-1 raw ids, oldest first
};

}  // namespace

struct CpuModel::Layer {
  int index = 0;
  bool qsa = false;
  std::unique_ptr<Ple> ple;
  Hc attn_hc, mlp_hc;
  Gdn gdn;
  Qsa attn;
  Moe moe;
};

// ---- loading ---------------------------------------------------------------------------------

struct CpuModel::Saved {
  struct LayerState {
    std::vector<float> ple_conv, gdn_conv, gdn_S, K, V, raw_keys, block_keys;
    std::vector<int64_t> ple_context;
  };
  int64_t position = 0;
  std::vector<LayerState> layers;
};

struct CpuModel::Slot {
  Saved state;
  bool fresh = true;
};

CpuModel::CpuModel(ModelConfig cfg, Collectives& coll)
    : cfg_(std::move(cfg)), coll_(coll), tp_rank_(coll.rank()), tp_size_(coll.size()) {
  slots_.resize(1);
  slots_[0].fresh = false;  // the load resets the one sequence
}

CpuModel::~CpuModel() = default;

void CpuModel::swap_state(Saved& st) {
  std::swap(position_, st.position);
  st.layers.resize(layers_.size());
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    Layer& L = *layers_[i];
    Saved::LayerState& x = st.layers[i];
    if (L.ple) {
      L.ple->conv_state.swap(x.ple_conv);
      L.ple->context.swap(x.ple_context);
    }
    L.gdn.conv_state.swap(x.gdn_conv);
    L.gdn.S.swap(x.gdn_S);
    L.attn.K.swap(x.K);
    L.attn.V.swap(x.V);
    L.attn.raw_keys.swap(x.raw_keys);
    L.attn.block_keys.swap(x.block_keys);
  }
}

int64_t CpuModel::slot_count() const noexcept {
  return static_cast<int64_t>(slots_.size());
}

void CpuModel::set_slot_count(int64_t count) {
  FN_CHECK(count >= 1 && slot_ < count, "set_slot_count({}) with slot {} selected", count, slot_);
  const std::size_t n = static_cast<std::size_t>(count);
  slots_.resize(n);
}

void CpuModel::select_slot(int64_t slot) {
  FN_CHECK(slot >= 0 && slot < slot_count(), "slot {} outside [0, {})", slot, slot_count());
  if (slot == slot_) return;
  swap_state(slots_[static_cast<std::size_t>(slot_)].state);  // park the current sequence
  Slot& next = slots_[static_cast<std::size_t>(slot)];
  swap_state(next.state);
  slot_ = slot;
  if (next.fresh) {
    next.fresh = false;
    reset();
  }
}

void CpuModel::save_state(Saved& st) const {
  st.position = position_;
  st.layers.resize(layers_.size());
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const Layer& L = *layers_[i];
    Saved::LayerState& x = st.layers[i];
    if (L.ple) {
      x.ple_conv = L.ple->conv_state;
      x.ple_context = L.ple->context;
    }
    x.gdn_conv = L.gdn.conv_state;
    x.gdn_S = L.gdn.S;
    x.K = L.attn.K;
    x.V = L.attn.V;
    x.raw_keys = L.attn.raw_keys;
    x.block_keys = L.attn.block_keys;
  }
}

void CpuModel::load_state(const Saved& st) {
  position_ = st.position;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    Layer& L = *layers_[i];
    const Saved::LayerState& x = st.layers[i];
    if (L.ple) {
      L.ple->conv_state = x.ple_conv;
      L.ple->context = x.ple_context;
    }
    L.gdn.conv_state = x.gdn_conv;
    L.gdn.S = x.gdn_S;
    L.attn.K = x.K;
    L.attn.V = x.V;
    L.attn.raw_keys = x.raw_keys;
    L.attn.block_keys = x.block_keys;
  }
}

void CpuModel::snapshot() {
  if (!saved_) saved_ = std::make_unique<Saved>();
  save_state(*saved_);
}

void CpuModel::restore() {
  FN_CHECK(saved_ != nullptr, "restore() before any snapshot()");
  load_state(*saved_);
}

void CpuModel::copy_slot(int64_t from, int64_t to) {
  FN_CHECK(from >= 0 && from < slot_count() && to >= 0 && to < slot_count() && from != to,
           "copy_slot({}, {}) with {} slots", from, to, slot_count());
  const int64_t was = slot_;
  Saved copy;
  select_slot(from);
  save_state(copy);
  select_slot(to);
  load_state(copy);
  select_slot(was);
}

std::unique_ptr<CpuModel> CpuModel::load(const std::filesystem::path& dir, Collectives& coll) {
  OpenedModel om = open_model(dir, coll.size());
  ModelConfig& cfg = om.config;
  FN_REQUIRE(!cfg.has_ple() || cfg.ple_embed_dim == cfg.hidden_size, Format,
             "{}: ple_embed_dim {} != hidden_size {} is not supported by the CPU backend",
             cfg.source, cfg.ple_embed_dim, cfg.hidden_size);
  FN_REQUIRE(cfg.output_gate_type == GateActivation::Sigmoid, Format,
             "{}: output_gate_type must be sigmoid for qwen4_exp (docs/model.md §F.1.2)",
             cfg.source);
  const QuantConfig& quant = om.quant;
  const bool ngram_fp8 = quant.ngram_fp8(cfg);
  std::unique_ptr<CpuModel> model(new CpuModel(cfg, coll));
  model->load_weights(om.checkpoint, om.plan, om.bare_layout, quant.quantized(), ngram_fp8);
  model->reset();
  FN_LOG_INFO("cpu model: {} layers, rank {}/{} holds {:.1f} MiB of weights",
              model->cfg_.num_hidden_layers, model->tp_rank_, model->tp_size_,
              static_cast<double>(model->weight_bytes_) / (1 << 20));
  return model;
}

void CpuModel::load_weights(const Checkpoint& ck, const ShardPlan& plan, bool bare,
                            bool experts_nvfp4, bool ngram_fp8) {
  const ModelConfig& c = cfg_;
  const int tp = tp_size_, r = tp_rank_;
  Loader ld(ck, plan, r, bare);
  const std::string p(kPrefix);
  const int64_t D = c.hidden_size, W = c.hc_width(), R = c.hc_lowrank, S = c.hc_count;

  auto load_hc = [&](Hc& hc, const std::string& base, bool inject) {
    hc.norm = ld.vec(base + ".hc_norm.weight", W);
    hc.down = ld.matrix(base + ".input_mix_weight_down.weight", R, W);
    hc.up = ld.matrix(base + ".input_mix_weight_up.weight", W, R);
    if (inject) hc.inject = ld.matrix(base + ".block_inject_weight.weight", S, W);
  };

  top_ = std::make_unique<Matrices>();
  top_->embed = ld.matrix(p + "embed_tokens.weight", c.vocab_size, D);
  top_->lm_head = ld.matrix("lm_head.weight", c.vocab_size / tp, D);
  final_mixer_ = std::make_unique<Hc>();
  load_hc(*final_mixer_, p + "hyper_connection_mixer", false);

  // Local geometry (docs/model.md §E.2).
  const RankDims rd = rank_dims(c, tp, r);
  const int64_t Hv_l = rd.linear_v_heads, dv = c.linear_value_head_dim;
  const int64_t conv_l = rd.gdn_conv_dim, Kc = c.linear_conv_kernel_dim;
  const int64_t Hq_l = rd.q_heads, hd = c.head_dim, Hkv_l = rd.kv_heads;
  const int64_t I_l = rd.moe_inter, Is_l = rd.shared_inter;

  for (int64_t li = 0; li < c.num_hidden_layers; ++li) {
    auto L = std::make_unique<Layer>();
    L->index = static_cast<int>(li);
    L->qsa = c.is_qsa(li);
    const std::string lp = fmt::format("{}layers.{}.", p, li);
    const int ple_rank = c.ple_rank(li);
    if (ple_rank >= 0) {
      auto ple = std::make_unique<Ple>();
      const std::string pp = lp + "ple.";
      const std::string ep = pp + "ple_embedding.";
      const int64_t P = c.ple_embed_dim;
      ple->key = ld.matrix(pp + "key_proj.weight", W, P);
      ple->value = ld.matrix(pp + "value_proj.weight", D, P);
      ple->norm_key = ld.vec(pp + "norm_key.weight", W);
      ple->norm_query = ld.vec(pp + "norm_query.weight", W);
      ple->norm_conv = ld.vec(pp + "norm_conv.weight", W);
      ple->conv = to_f32(ld.read(pp + "conv1d.weight", W, c.ple_conv_kernel_size));
      ple->consts = ngram_constants(c, ple_rank);
      // The stored I64 buffers must equal the config's hash constants (docs/model.md §B.2).
      auto check_i64 = [&](const std::string& name, const std::vector<int64_t>& want) {
        const Slice s = ld.read(name, static_cast<int64_t>(want.size()), 1);
        std::vector<int64_t> got(want.size());
        std::memcpy(got.data(), s.bytes->data(), want.size() * sizeof(int64_t));
        for (std::size_t i = 0; i < want.size(); ++i)
          FN_REQUIRE(got[i] == want[i], Format,
                     "{}: '{}'[{}] is {}, the config gives {} (config drift?)", ck.dir().string(),
                     ld.stored_name(name), i, got[i], want[i]);
      };
      check_i64(ep + "layer_multipliers", ple->consts.multipliers);
      check_i64(ep + "ngram_heads_vocab_sizes", ple->consts.head_sizes);
      check_i64(ep + "ngram_heads_offsets", ple->consts.head_offsets);
      const int64_t rows_per_shard = ple->consts.table_rows / c.split_ngram_parts;
      const int64_t hdn = c.ngram_head_dim();
      for (int64_t s = 0; s < c.split_ngram_parts; ++s) {
        Slice sl = ld.read(fmt::format("{}ngram_embedding.shard_{}.weight", ep, s));
        if (sl.rows == 0) continue;  // another rank's shard
        FN_CHECK(sl.rows == rows_per_shard && sl.cols == hdn, "n-gram shard {} is [{}, {}]", s,
                 sl.rows, sl.cols);
        ple->shards.push_back(NgramShard{s * rows_per_shard, rows_per_shard, std::move(sl)});
      }
      if (ngram_fp8) {
        const Slice sc = ld.read(ep + "ngram_embedding.weight_scale", 1, 1);
        ple->scale = scalar_to_float(sc.dtype, sc.bytes->data());
      }
      L->ple = std::move(ple);
    }
    load_hc(L->attn_hc, lp + "attn_hyper_connection", true);
    load_hc(L->mlp_hc, lp + "mlp_hyper_connection", true);
    if (L->qsa) {
      Qsa& a = L->attn;
      const std::string ap = lp + "self_attn.";
      const int64_t ihd = c.indexer_head_dim;
      a.q = ld.matrix(ap + "q_proj.weight", Hq_l * 2 * hd, D);
      a.k = ld.matrix(ap + "k_proj.weight", Hkv_l * hd, D);
      a.v = ld.matrix(ap + "v_proj.weight", Hkv_l * hd, D);
      a.o = ld.matrix(ap + "o_proj.weight", D, Hq_l * hd);
      a.q_norm = ld.vec(ap + "q_norm.weight", hd);
      a.k_norm = ld.vec(ap + "k_norm.weight", hd);
      a.idx = ld.matrix(ap + "indexer.index_qk_proj.weight", c.indexer_proj_rows(), D);
      a.iq_norm = ld.vec(ap + "indexer.q_layernorm.weight", ihd);
      a.ik_norm = ld.vec(ap + "indexer.k_layernorm.weight", ihd);
    } else {
      Gdn& g = L->gdn;
      const std::string gp = lp + "linear_attn.";
      g.qkv = ld.matrix(gp + "in_proj_qkv.weight", conv_l, D);
      g.z = ld.matrix(gp + "in_proj_z.weight", Hv_l * dv, D);
      g.a = ld.matrix(gp + "in_proj_a.weight", Hv_l, D);
      g.b = ld.matrix(gp + "in_proj_b.weight", Hv_l, D);
      g.out = ld.matrix(gp + "out_proj.weight", D, Hv_l * dv);
      g.A_log = ld.vec(gp + "A_log", Hv_l);
      g.dt_bias = ld.vec(gp + "dt_bias", Hv_l);
      g.conv = to_f32(ld.read(gp + "conv1d.weight", conv_l, Kc));
      g.norm = ld.vec(gp + "norm.weight", dv);
    }
    Moe& m = L->moe;
    const std::string mp = lp + "mlp.";
    m.router = ld.matrix(mp + "gate.weight", c.num_experts, D);
    m.s_gate = ld.matrix(mp + "shared_expert.gate_proj.weight", Is_l, D);
    m.s_up = ld.matrix(mp + "shared_expert.up_proj.weight", Is_l, D);
    m.s_down = ld.matrix(mp + "shared_expert.down_proj.weight", D, Is_l);
    m.shared_expert_gate = to_f32(ld.read(mp + "shared_expert_gate.weight", 1, D));
    m.experts.resize(static_cast<std::size_t>(c.num_experts));
    if (experts_nvfp4) {
      auto nvfp4 = [&](const std::string& base, int64_t rows, int64_t cols) {
        const Slice w = ld.read(base + ".weight", rows, cols / 2);
        const Slice sc = ld.read(base + ".weight_scale", rows, cols / 16);
        const Slice g2 = ld.read(base + ".weight_scale_2", 1, 1);
        const float global = scalar_to_float(g2.dtype, g2.bytes->data());
        return std::make_unique<Nvfp4Matrix>(w.bytes, sc.bytes, global, rows, cols);
      };
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string ep = fmt::format("{}experts.{}.", mp, e);
        Expert& x = m.experts[static_cast<std::size_t>(e)];
        x.gate = nvfp4(ep + "gate_proj", I_l, D);
        x.up = nvfp4(ep + "up_proj", I_l, D);
        x.down = nvfp4(ep + "down_proj", D, I_l);
      }
    } else {
      // Fused BF16 experts: gate_up [E, 2I, D] viewed [E*2I, D], each expert's gate rows then up
      // rows of this rank; down [E, D, I] viewed [E*D, I], this rank's columns.
      const int64_t E = c.num_experts;
      const Slice gu = ld.read(mp + "experts.gate_up_proj", E * 2 * I_l, D);
      const Slice dn = ld.read(mp + "experts.down_proj", E * D, I_l);
      const std::size_t es = dtype_size(gu.dtype);
      for (int64_t e = 0; e < E; ++e) {
        Expert& x = m.experts[static_cast<std::size_t>(e)];
        const std::size_t base = static_cast<std::size_t>(e * 2 * I_l * D) * es;
        x.gate = std::make_unique<StoredMatrix>(gu.bytes, base, gu.dtype, I_l, D);
        x.up = std::make_unique<StoredMatrix>(
            gu.bytes, base + static_cast<std::size_t>(I_l * D) * es, gu.dtype, I_l, D);
        x.down = std::make_unique<StoredMatrix>(
            dn.bytes, static_cast<std::size_t>(e * D * I_l) * es, dn.dtype, D, I_l);
      }
    }
    layers_.push_back(std::move(L));
  }
  weight_bytes_ = ld.bytes();
}

void CpuModel::reset() {
  const ModelConfig& c = cfg_;
  const int tp = tp_size_;
  position_ = 0;
  const RankDims rd = rank_dims(c, tp, tp_rank_);
  const int64_t Hv_l = rd.linear_v_heads, conv_l = rd.gdn_conv_dim;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  for (auto& L : layers_) {
    if (L->ple) {
      Ple& ple = *L->ple;
      ple.conv_state.assign(static_cast<std::size_t>(c.hc_width() * (c.ple_conv_kernel_size - 1) *
                                                     c.ple_conv_dilation()),
                            0.0f);
      ple.context.assign(static_cast<std::size_t>(c.ngram_size - 1), ple.consts.eos);
    }
    if (L->qsa) {
      L->attn.K.clear();
      L->attn.V.clear();
      L->attn.raw_keys.clear();
      L->attn.block_keys.clear();
    } else {
      L->gdn.conv_state.assign(static_cast<std::size_t>(conv_l * (c.linear_conv_kernel_dim - 1)),
                               0.0f);
      L->gdn.S.assign(static_cast<std::size_t>(Hv_l * dk * dv), 0.0f);
    }
  }
}

uint64_t CpuModel::state_bytes() const noexcept {
  uint64_t n = 0;
  for (const auto& L : layers_) {
    if (L->ple) n += (L->ple->conv_state.size() * sizeof(float)) + L->ple->context.size() * 8;
    n += (L->gdn.conv_state.size() + L->gdn.S.size()) * sizeof(float);
    n += (L->attn.K.size() + L->attn.V.size() + L->attn.raw_keys.size() +
          L->attn.block_keys.size()) *
         sizeof(float);
  }
  return n;
}

// ---- the decode step -------------------------------------------------------------------------

namespace {
// (k-th largest - (k+1)-th largest) / max |v|; +inf when v has no more than k values.
double relative_topk_gap(std::vector<float> v, int64_t k) {
  if (static_cast<int64_t>(v.size()) <= k || k < 1) return HUGE_VAL;
  double scale = 0;
  for (float x : v) scale = std::max(scale, std::abs(static_cast<double>(x)));
  std::nth_element(v.begin(), v.begin() + k, v.end(), std::greater<float>());
  const float next = v[static_cast<std::size_t>(k)];
  const float kth = *std::min_element(v.begin(), v.begin() + k);
  return scale > 0 ? (static_cast<double>(kth) - next) / scale : 0.0;
}
}  // namespace

std::span<const float> CpuModel::forward(int32_t token) {
  const ModelConfig& c = cfg_;
  FN_REQUIRE(token >= 0 && token < c.vocab_size, Usage,
             "token id {} is outside the vocabulary [0, {})", token, c.vocab_size);
  const int64_t D = c.hidden_size, S = c.hc_count, W = c.hc_width();
  const float eps = static_cast<float>(c.rms_norm_eps);

  margins_ = DecisionMargins{};
  choices_.router.clear();
  choices_.indexer.clear();
  residuals_.clear();
  // C.1: embedding, widened to hc_count identical streams.
  std::vector<float> H(static_cast<std::size_t>(W));
  top_->embed->read_row(token, H.data());
  for (int64_t s = 1; s < S; ++s) std::copy_n(H.data(), D, H.data() + s * D);

  std::vector<float> m(static_cast<std::size_t>(D)), y(static_cast<std::size_t>(D));
  std::vector<float> iota(static_cast<std::size_t>(S));
  for (auto& Lp : layers_) {
    Layer& L = *Lp;
    if (L.ple) {
      ple_step(L, token, H.data());  // C.4: added before the attention-side HC read
      residuals_.push_back(H);
    }
    cpu::hc_read(H.data(), S, D, L.attn_hc.norm.data(), *L.attn_hc.down, *L.attn_hc.up,
                 L.attn_hc.inject.get(), eps, m.data(), iota.data());
    if (L.qsa) {
      qsa_step(L, m.data(), y.data());
    } else {
      gdn_step(L, m.data(), y.data());
    }
    cpu::hc_inject(H.data(), S, D, iota.data(), y.data());
    residuals_.push_back(H);
    cpu::hc_read(H.data(), S, D, L.mlp_hc.norm.data(), *L.mlp_hc.down, *L.mlp_hc.up,
                 L.mlp_hc.inject.get(), eps, m.data(), iota.data());
    moe_step(L, m.data(), y.data());
    cpu::hc_inject(H.data(), S, D, iota.data(), y.data());
    residuals_.push_back(H);
  }
  // C.8: final mixer (no inject), lm_head on this rank's vocabulary rows, gathered.
  cpu::hc_read(H.data(), S, D, final_mixer_->norm.data(), *final_mixer_->down, *final_mixer_->up,
               nullptr, eps, m.data(), nullptr);
  const int64_t V_l = top_->lm_head->rows();
  logits_local_.resize(static_cast<std::size_t>(V_l));
  logits_.resize(static_cast<std::size_t>(c.vocab_size));
  cpu::gemv(*top_->lm_head, m.data(), logits_local_.data());
  coll_.all_gather(logits_local_.data(), static_cast<std::size_t>(V_l), logits_.data());
  // Garbage weights (NaN/Inf bytes pass every dtype and shape check) must not reach the sampler
  // as a vague internal error: say where they surfaced. The logits are all-gathered, the same on
  // every rank, so every rank stops here with this same error: marked so, rank 0 alone prints it
  // and every rank ends with its exit code instead of through MPI_Abort (apps/main.cpp).
  const auto bad =
      std::find_if(logits_.begin(), logits_.end(), [](float l) { return !std::isfinite(l); });
  if (bad != logits_.end()) [[unlikely]] {
    Error e(ErrorKind::Format,
            fmt::format("the model produced a non-finite logit ({} for token {}) at position {}: "
                        "the checkpoint's weights hold NaN/Inf or overflow",
                        *bad, bad - logits_.begin(), position_),
            __FILE__, __LINE__);
    e.set_on_every_rank();
    throw e;
  }
  ++position_;
  return logits_;
}

std::span<const float> CpuModel::prefill(std::span<const int32_t> tokens) {
  FN_REQUIRE(!tokens.empty(), Usage, "prefill: the prompt has no tokens");
  std::span<const float> logits;
  for (int32_t t : tokens) logits = forward(t);
  return logits;
}

void CpuModel::ple_step(Layer& L, int32_t token, float* H) {
  const ModelConfig& c = cfg_;
  Ple& ple = *L.ple;
  const int64_t n_heads = c.ngram_heads(), hdn = c.ngram_head_dim(), P = c.ple_embed_dim;
  // C.4 ids, then step 1: gather the rows this rank holds; the others contribute 0.
  std::vector<int64_t> ids(static_cast<std::size_t>(n_heads));
  ngram_ids(ple.consts, ple.context, token, ids);
  std::vector<float> E(static_cast<std::size_t>(P), 0.0f);
  for (int64_t h = 0; h < n_heads; ++h) {
    const int64_t id = ids[static_cast<std::size_t>(h)];
    for (const NgramShard& sh : ple.shards) {
      if (id < sh.first_row || id >= sh.first_row + sh.rows) continue;
      const std::size_t es = dtype_size(sh.data.dtype);
      const std::byte* row =
          sh.data.bytes->data() + static_cast<std::size_t>((id - sh.first_row) * hdn) * es;
      for (int64_t j = 0; j < hdn; ++j) {
        // FP8: bf16(fp8) is exact, times the BF16 scale, in FP32 (docs/model.md §B.5).
        E[static_cast<std::size_t>(h * hdn + j)] =
            scalar_to_float(sh.data.dtype, row + j * es) * ple.scale;
      }
    }
  }
  coll_.all_reduce_sum(E.data(), E.size());
  cpu::PleWeights w{ple.key.get(),          ple.value.get(),      ple.norm_key.data(),
                    ple.norm_query.data(),  ple.norm_conv.data(), ple.conv.data(),
                    c.ple_conv_kernel_size, c.ple_conv_dilation()};
  std::vector<float> gamma(static_cast<std::size_t>(c.hc_count));
  cpu::ple_apply(E.data(), w, c.hc_count, P, static_cast<float>(c.rms_norm_eps),
                 ple.conv_state.data(), H, gamma.data());
  for (float g : gamma) margins_.ple_gamma = std::min(margins_.ple_gamma, std::fabs(double{g}));
  // The context keeps raw ids: (c0, c1) <- (c1, x_t).
  ple.context.erase(ple.context.begin());
  ple.context.push_back(token);
}

void CpuModel::gdn_step(Layer& L, const float* m, float* y) {
  const ModelConfig& c = cfg_;
  Gdn& g = L.gdn;
  const RankDims rd = rank_dims(c, tp_size_, tp_rank_);
  const int64_t Hk_l = rd.linear_k_heads, Hv_l = rd.linear_v_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const int64_t key_l = Hk_l * dk, conv_l = g.qkv->rows();
  const float eps = static_cast<float>(c.rms_norm_eps);
  // C.5 step 1: projections of the rank's heads.
  std::vector<float> qkv(static_cast<std::size_t>(conv_l)), z(static_cast<std::size_t>(Hv_l * dv));
  std::vector<float> a(static_cast<std::size_t>(Hv_l)), b(static_cast<std::size_t>(Hv_l));
  cpu::gemv(*g.qkv, m, qkv.data());
  cpu::gemv(*g.z, m, z.data());
  cpu::gemv(*g.b, m, b.data());
  cpu::gemv(*g.a, m, a.data());
  // Step 2: causal conv (K = linear_conv_kernel_dim, dilation 1) + SiLU; the state keeps pre-conv.
  std::vector<float> x(static_cast<std::size_t>(conv_l));
  cpu::causal_conv_step(qkv.data(), g.conv_state.data(), g.conv.data(), conv_l,
                        c.linear_conv_kernel_dim, 1, x.data());
  // Steps 3-6.
  std::vector<float> gg(static_cast<std::size_t>(Hv_l)), beta(static_cast<std::size_t>(Hv_l));
  cpu::gdn_gates(a.data(), b.data(), g.A_log.data(), g.dt_bias.data(), Hv_l, gg.data(),
                 beta.data());
  std::vector<float> o(static_cast<std::size_t>(Hv_l * dv));
  cpu::gdn_recurrent_step(x.data(), x.data() + key_l, x.data() + 2 * key_l, gg.data(), beta.data(),
                          Hk_l, Hv_l, dk, dv, g.S.data(), o.data());
  {  // conditioning of step 7 (DecisionMargins::gdn_head_rms)
    std::vector<double> rms(static_cast<std::size_t>(Hv_l));
    double mean = 0;
    for (int64_t h = 0; h < Hv_l; ++h) {
      double r = 0;
      for (int64_t d = 0; d < dv; ++d) r += double{o[h * dv + d]} * o[h * dv + d];
      rms[h] = std::sqrt(r / static_cast<double>(dv));
      mean += rms[h] / static_cast<double>(Hv_l);
    }
    for (double r : rms)
      if (mean > 0) margins_.gdn_head_rms = std::min(margins_.gdn_head_rms, r / mean);
  }
  // Step 7: gated norm per head (plain weight, sigmoid gate).
  for (int64_t h = 0; h < Hv_l; ++h)
    cpu::gated_rms_norm(o.data() + h * dv, g.norm.data(), z.data() + h * dv, dv, eps,
                        o.data() + h * dv);
  // Step 8: the rank's columns of out_proj, summed over ranks.
  cpu::gemv(*g.out, o.data(), y);
  coll_.all_reduce_sum(y, static_cast<std::size_t>(c.hidden_size));
}

void CpuModel::qsa_step(Layer& L, const float* m, float* y) {
  const ModelConfig& c = cfg_;
  Qsa& a = L.attn;
  const int64_t t = position_;
  const RankDims rd = rank_dims(c, tp_size_, tp_rank_);
  const int64_t hd = c.head_dim, Hq_l = rd.q_heads, Hkv_l = rd.kv_heads;
  const int64_t kv_first = rd.kv_head_first, q_per_kv = rd.q_per_kv;
  const int64_t rot = c.rotary_dim();
  const float eps = static_cast<float>(c.rms_norm_eps);

  // C.6 step 1: per-head interleaved query | gate rows of the rank's heads; its KV heads.
  std::vector<float> P(static_cast<std::size_t>(Hq_l * 2 * hd));
  cpu::gemv(*a.q, m, P.data());
  std::vector<float> q(static_cast<std::size_t>(Hq_l * hd)),
      gate(static_cast<std::size_t>(Hq_l * hd));
  for (int64_t i = 0; i < Hq_l; ++i) {
    std::copy_n(P.data() + i * 2 * hd, hd, q.data() + i * hd);
    std::copy_n(P.data() + i * 2 * hd + hd, hd, gate.data() + i * hd);
  }
  std::vector<float> k(static_cast<std::size_t>(Hkv_l * hd)),
      v(static_cast<std::size_t>(Hkv_l * hd));
  cpu::gemv(*a.k, m, k.data());
  cpu::gemv(*a.v, m, v.data());
  // Steps 2-3: q_norm / k_norm (1 + w) per head, RoPE at t on the first rotary_dim dims.
  for (int64_t i = 0; i < Hq_l; ++i) {
    cpu::rms_norm_1p(q.data() + i * hd, a.q_norm.data(), hd, eps, q.data() + i * hd);
    cpu::rope_neox(q.data() + i * hd, rot, c.rope_theta, t);
  }
  for (int64_t j = 0; j < Hkv_l; ++j) {
    cpu::rms_norm_1p(k.data() + j * hd, a.k_norm.data(), hd, eps, k.data() + j * hd);
    cpu::rope_neox(k.data() + j * hd, rot, c.rope_theta, t);
  }
  // Step 4: append to the KV cache (row t).
  a.K.insert(a.K.end(), k.begin(), k.end());
  a.V.insert(a.V.end(), v.begin(), v.end());

  // Step 5: the indexer (replicated: every rank computes the same selection).
  const int64_t ni = c.indexer_n_heads, ihd = c.indexer_head_dim, ratio = c.indexer_compress_ratio;
  std::vector<float> idx(static_cast<std::size_t>(c.indexer_proj_rows()));
  cpu::gemv(*a.idx, m, idx.data());
  for (int64_t h = 0; h < ni; ++h) {
    cpu::rms_norm_1p(idx.data() + h * ihd, a.iq_norm.data(), ihd, eps, idx.data() + h * ihd);
    cpu::rope_neox(idx.data() + h * ihd, rot, c.rope_theta, t);
  }
  a.raw_keys.insert(a.raw_keys.end(), idx.begin() + ni * ihd, idx.begin() + (ni + 1) * ihd);
  if ((t + 1) % ratio == 0) {  // block b = (t+1)/ratio - 1 just completed: pool, norm, rope
    const int64_t b = (t + 1) / ratio - 1;
    std::vector<float> kb(static_cast<std::size_t>(ihd));
    cpu::indexer_block_key(a.raw_keys.data() + b * ratio * ihd, ratio, ihd, a.ik_norm.data(), eps,
                           rot, c.rope_theta, b * ratio, kb.data());
    a.block_keys.insert(a.block_keys.end(), kb.begin(), kb.end());
  }
  const int64_t B = (t + 1) / ratio;
  std::vector<float> scores(static_cast<std::size_t>(B));
  cpu::indexer_scores(idx.data(), ni, a.block_keys.data(), B, ihd, scores.data());
  margins_.indexer =
      std::min(margins_.indexer, relative_topk_gap(scores, c.indexer_budget / ratio));
  {
    std::vector<int32_t> blocks;
    if (B > c.indexer_budget / ratio) {
      blocks = cpu::top_k(scores.data(), B, c.indexer_budget / ratio);
      std::sort(blocks.begin(), blocks.end());
    }
    choices_.indexer.push_back(std::move(blocks));
  }
  const std::vector<int64_t> tokens =
      cpu::qsa_selected_tokens(scores.data(), t, ratio, c.indexer_budget / ratio);

  // Step 6: attention of the rank's query heads over the selected tokens (GQA).
  std::vector<int32_t> kv_of_q(static_cast<std::size_t>(Hq_l));
  for (int64_t i = 0; i < Hq_l; ++i) {
    const int64_t h = rd.q_head_first + i;
    kv_of_q[static_cast<std::size_t>(i)] = static_cast<int32_t>(h / q_per_kv - kv_first);
    FN_CHECK(
        kv_of_q[static_cast<std::size_t>(i)] >= 0 && kv_of_q[static_cast<std::size_t>(i)] < Hkv_l,
        "query head {} maps to KV head {} outside the rank's [{}, +{})", h, h / q_per_kv, kv_first,
        Hkv_l);
  }
  std::vector<float> att(static_cast<std::size_t>(Hq_l * hd));
  cpu::gqa_attention(q.data(), Hq_l, kv_of_q.data(), a.K.data(), a.V.data(), Hkv_l * hd, hd,
                     tokens.data(), static_cast<int64_t>(tokens.size()),
                     1.0f / std::sqrt(static_cast<float>(hd)), att.data());
  // Step 7: sigmoid output gate, the rank's columns of o_proj, summed over ranks.
  cpu::sigmoid_gate_mul(att.data(), gate.data(), Hq_l * hd, att.data());
  cpu::gemv(*a.o, att.data(), y);
  coll_.all_reduce_sum(y, static_cast<std::size_t>(c.hidden_size));
}

void CpuModel::moe_step(Layer& L, const float* m, float* y) {
  const ModelConfig& c = cfg_;
  Moe& moe = L.moe;
  const int64_t D = c.hidden_size, E = c.num_experts, k = c.num_experts_per_tok;
  // C.7 step 1: router over all experts (replicated), top-k, renormalised.
  std::vector<float> logits(static_cast<std::size_t>(E));
  cpu::gemv(*moe.router, m, logits.data());
  std::vector<int32_t> ids(static_cast<std::size_t>(k));
  std::vector<float> w(static_cast<std::size_t>(k));
  cpu::route_top_k(logits.data(), E, k, c.norm_topk_prob, ids.data(), w.data());
  margins_.router = std::min(margins_.router, relative_topk_gap(logits, k));
  choices_.router.push_back(ids);
  // Step 2: the rank's slice of each selected expert, accumulated in ascending expert id.
  std::vector<int64_t> order(static_cast<std::size_t>(k));
  for (int64_t i = 0; i < k; ++i) order[static_cast<std::size_t>(i)] = i;
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t z) { return ids[x] < ids[z]; });
  std::vector<double> acc(static_cast<std::size_t>(D), 0.0);
  std::vector<float> ye(static_cast<std::size_t>(D));
  for (int64_t i : order) {
    const Expert& x = moe.experts[static_cast<std::size_t>(ids[static_cast<std::size_t>(i)])];
    cpu::swiglu_ffn(*x.gate, *x.up, *x.down, m, ye.data());
    for (int64_t d = 0; d < D; ++d) acc[d] += static_cast<double>(w[i]) * ye[d];
  }
  // Step 3: shared expert slice, scalar sigmoid gate from the full input (replicated).
  cpu::swiglu_ffn(*moe.s_gate, *moe.s_up, *moe.s_down, m, ye.data());
  const float gamma = cpu::sigmoid(cpu::dot(moe.shared_expert_gate.data(), m, D));
  // Step 4: routed + shared partial sums, one all-reduce.
  for (int64_t d = 0; d < D; ++d)
    y[d] = static_cast<float>(acc[d] + static_cast<double>(gamma) * ye[d]);
  coll_.all_reduce_sum(y, static_cast<std::size_t>(D));
}

}  // namespace fn
