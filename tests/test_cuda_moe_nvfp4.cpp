// GPU tests of the NVFP4 routed-expert kernels (cuda/kernels/moe_nvfp4.h): the FP32-FMA kernels
// and, on sm_90+, the bulk-copy gate+up kernel (bulk = true: every share and chunk shape, exact and
// bounded), against host references
// built from core/codecs.h (dequant_nvfp4_row) and core/cpu_ops.h (silu): exact sums with
// power-of-two scales, random codes within the derived FP32 bound, real shapes at TP=1, 2 and 4,
// the tiny fixtures' shapes (cols 16 and 48: the 16-code path), row counts that are not a multiple
// of 8, invalid expert ids, +-0.5 codes with subnormal scales, graph replay with expert ids
// changed in device memory, and the bulk kernel over tokens side by side (bitwise each alone).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/codecs.h"
#include "core/cpu_ops.h"
#include "core/error.h"
#include "cuda/common/nvfp4_bits.h"
#include "cuda/kernels/moe_nvfp4.h"
#include "cuda/kernels/moe_nvfp4_bulk.h"
#include "tests/cuda_test_util.h"

namespace {

using fn::test::DeviceArray;

// One projection of a stack of experts in host memory (the device layout of Nvfp4Experts).
struct HostExperts {
  int num_experts;
  int64_t rows, cols;
  std::vector<uint8_t> packed;  // [E, rows, cols/2]
  std::vector<uint8_t> scales;  // [E, rows, cols/16]
  std::vector<float> gscale;    // [E, per_expert]
  int per_expert;               // 2 for gate+up, 1 for down
};

// Random codes (all 16 E2M1 codes), block scales and global scales. `exact`: block scales in
// {0.5, 1, 2} and global scales powers of two, so every dot of small-integer inputs is exact.
HostExperts make_experts(int num_experts, int64_t rows, int64_t cols, int per_expert, bool exact,
                         uint64_t seed) {
  HostExperts h{num_experts, rows, cols, {}, {}, {}, per_expert};
  std::mt19937_64 rng(seed);
  h.packed.resize(size_t(num_experts) * rows * cols / 2);
  h.scales.resize(size_t(num_experts) * rows * cols / 16);
  h.gscale.resize(size_t(num_experts) * per_expert);
  for (auto& b : h.packed) b = uint8_t(rng());
  const uint8_t pow2[] = {0x30, 0x38, 0x40};  // E4M3 0.5, 1, 2
  for (auto& s : h.scales) {
    if (exact) {
      s = pow2[rng() % 3];
    } else {
      const unsigned r = rng() % 64;
      // Mostly normal scales 2^-3 .. 2^3 (both signs of mantissa), a few subnormal codes.
      s = r == 0 ? uint8_t(1 + rng() % 7) : uint8_t(0x20 + rng() % 0x30);
    }
  }
  for (auto& g : h.gscale)
    g = exact ? std::ldexp(1.0f, int(rng() % 3) - 1)
              : std::ldexp(1.0f + float(rng() % 1000) / 1000.0f, -8);
  return h;
}

struct DeviceExperts {
  DeviceArray<uint8_t> packed, scales;
  DeviceArray<float> gscale;
  fn::Nvfp4Experts view;
  explicit DeviceExperts(const HostExperts& h)
      : packed(h.packed), scales(h.scales), gscale(h.gscale) {
    fn::test::to_decode_layout(packed);  // the host copy h keeps the checkpoint's layout
    view.packed = packed.ptr;
    view.scales = scales.ptr;
    view.global_scale = gscale.ptr;
    view.num_experts = h.num_experts;
    view.rows = h.rows;
    view.cols = h.cols;
  }
};

// Dequantized row (exact FP32 values: e2m1 * e4m3 block scale; the global scale is applied by the
// caller) through the CPU codec, independent of the GPU's bit tricks.
std::vector<float> dequant_row(const HostExperts& h, int e, int64_t r) {
  std::vector<float> out(h.cols);
  const size_t row = size_t(e) * h.rows + r;
  fn::dequant_nvfp4_row(h.packed.data() + row * h.cols / 2, h.scales.data() + row * h.cols / 16,
                        1.0f, h.cols, out.data());
  return out;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = fn::float_to_bf16(v[i]);
  return b;
}

// Codes per lane work unit of the kernels: 32, or 16 when cols is an odd multiple of 16.
int64_t unit_codes(int64_t cols) {
  return cols % 32 == 0 ? 32 : 16;
}

int log2i(int t) {
  int l = 0;
  while ((1 << l) < t) ++l;
  return l;
}

// Rounding depth of one product in the kernels: 16-term block chain, the block scale multiply and
// the two-block add, the lane's chain over its vectors, the team reduction, the final multiplies.
int depth(int64_t vectors_per_lane, int team) {
  return 16 + 3 + int(vectors_per_lane) + std::min(log2i(team), 5) + (team > 32 ? team / 32 : 0) +
         3;
}

// The bulk gate+up kernel: one m16n8k16 MMA adds 16 exact products to its FP32 accumulator C.
// Model (conservative, covering the tensor core's alignment and truncation of the products'
// significands and its truncating normalisation): each MMA errs by at most 36 FP32 units (2^-24)
// times the sum of the magnitudes of its 16 terms and C, i.e. 36 rounding levels of depth.
constexpr int kMmaDepth = 36;

int ceil_div(int64_t a, int64_t b) {
  return int((a + b - 1) / b);
}

// Rounding depth of a gate or up output of the FP32 kernel: the lane's path (as depth() above).
int gate_up_depth(int64_t cols, int team) {
  const int64_t units = cols / unit_codes(cols);
  return depth(ceil_div(units, team), team);
}

// Rounding depth of a down output of the FP32 kernel (before the optional accumulate): the lane's
// path, + the weight * gs and * f roundings.
int down_depth(int top_k, int64_t inter, int team) {
  const int64_t units = top_k * (inter / unit_codes(inter));
  return depth(ceil_div(units, team), team) + 2;
}

// The bulk gate+up kernel (cuda/kernels/moe_nvfp4_bulk.cu): per chunk, warp and 128-column group
// one MMA chain (8 MMAs), the warp's groups added, then the 10 warps' partials in order, the global
// scale.
int bulk_gate_up_depth(int64_t cols) {
  const int per_warp = ceil_div(ceil_div(cols, 128), 10);
  return kMmaDepth * 8 + per_warp + 10 + 1;
}

// Team widths the FP32 kernels accept.
std::vector<int> teams() {
  std::vector<int> t;
  for (int v = 8; v <= 256; v *= 2) t.push_back(v);
  return t;
}

struct GateUpRef {
  std::vector<double> gu, gu_bound, h, h_bound;  // gu: [top_k, 2I]; h: [top_k, I]
};

GateUpRef gate_up_reference(const HostExperts& w, const std::vector<int32_t>& ids,
                            const std::vector<float>& x, int depth_levels) {
  const int64_t inter = w.rows / 2;
  const int k = int(ids.size());
  GateUpRef r;
  r.gu.assign(size_t(k) * 2 * inter, 0.0);
  r.gu_bound.assign(r.gu.size(), 0.0);
  r.h.assign(size_t(k) * inter, 0.0);
  r.h_bound.assign(r.h.size(), 0.0);
  const double gamma = fn::test::gamma_fp32(depth_levels);
  for (int j = 0; j < k; ++j) {
    const int e = ids[j];
    if (e < 0 || e >= w.num_experts) continue;  // contributes zeros
    for (int64_t row = 0; row < 2 * inter; ++row) {
      const auto wr = dequant_row(w, e, row);
      const double gs = w.gscale[size_t(e) * 2 + (row < inter ? 0 : 1)];
      double s = 0, a = 0;
      for (int64_t c = 0; c < w.cols; ++c) {
        s += double(wr[c]) * x[c];
        a += std::fabs(double(wr[c]) * x[c]);
      }
      r.gu[size_t(j) * 2 * inter + row] = s * gs;
      r.gu_bound[size_t(j) * 2 * inter + row] = gamma * a * gs;
    }
    for (int64_t i = 0; i < inter; ++i) {
      const double g = r.gu[size_t(j) * 2 * inter + i], u = r.gu[size_t(j) * 2 * inter + inter + i];
      const double eg = r.gu_bound[size_t(j) * 2 * inter + i];
      const double eu = r.gu_bound[size_t(j) * 2 * inter + inter + i];
      const double sg = g / (1.0 + std::exp(-g));
      const double hv = sg * u;
      // |silu'| <= 1.1; expf + divide + multiply in FP32: <= 8 roundings of h; then BF16.
      const double e32 = 1.1 * eg * std::fabs(u) + (std::fabs(sg) + 1.1 * eg) * eu +
                         8 * fn::test::kFp32Unit * std::fabs(hv);
      r.h[size_t(j) * inter + i] = hv;
      r.h_bound[size_t(j) * inter + i] = e32 + fn::test::kBf16Unit * (std::fabs(hv) + e32);
    }
  }
  return r;
}

struct GateUpOut {
  std::vector<float> gu, h;
};

GateUpOut run_gate_up(const DeviceExperts& w, const std::vector<int32_t>& ids,
                      const std::vector<float>& x, int team, bool bulk = false,
                      const fn::Nvfp4Experts* down_prefetch = nullptr) {
  const int64_t inter = w.view.rows / 2;
  DeviceArray<int32_t> d_ids(ids);
  DeviceArray<uint16_t> d_x(to_bf16(x));
  DeviceArray<uint16_t> d_h(ids.size() * inter);
  DeviceArray<float> d_gu(ids.size() * 2 * inter);
  FN_CUDA_CHECK(cudaMemset(d_h.ptr, 0xff, d_h.n * 2));
  FN_CUDA_CHECK(cudaMemset(d_gu.ptr, 0xff, d_gu.n * 4));
  fn::MoeGateUpParams p;
  p.experts = w.view;
  p.expert_ids = d_ids.ptr;
  p.top_k = int(ids.size());
  p.x = d_x.ptr;
  p.h = d_h.ptr;
  p.gate_up_out = d_gu.ptr;
  p.team_threads = team;
  p.bulk = bulk;
  if (down_prefetch != nullptr) p.down_prefetch = *down_prefetch;
  fn::launch_moe_gate_up_nvfp4(p, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  GateUpOut out{d_gu.download(), {}};
  for (uint16_t b : d_h.download()) out.h.push_back(fn::bf16_to_float(b));
  return out;
}

// y[d] = sum_j rw[j] * gs[e_j] * (W_down[e_j] h_j)[d] in FP64, plus its bound.
void down_reference(const HostExperts& w, const std::vector<int32_t>& ids,
                    const std::vector<float>& rw, const std::vector<float>& h, int depth_levels,
                    const std::vector<float>* y0, std::vector<double>& y,
                    std::vector<double>& bound) {
  const int k = int(ids.size());
  const int64_t inter = w.cols;
  y.assign(w.rows, 0.0);
  bound.assign(w.rows, 0.0);
  const double gamma = fn::test::gamma_fp32(depth_levels);
  for (int j = 0; j < k; ++j) {
    const int e = ids[j];
    if (e < 0 || e >= w.num_experts) continue;
    const double f = double(rw[j]) * w.gscale[e];
    for (int64_t d = 0; d < w.rows; ++d) {
      const auto wr = dequant_row(w, e, d);
      double s = 0, a = 0;
      for (int64_t c = 0; c < inter; ++c) {
        s += double(wr[c]) * h[size_t(j) * inter + c];
        a += std::fabs(double(wr[c]) * h[size_t(j) * inter + c]);
      }
      y[d] += s * f;
      bound[d] += gamma * a * std::fabs(f);
    }
  }
  if (y0 != nullptr)
    for (int64_t d = 0; d < w.rows; ++d) {
      y[d] += (*y0)[d];
      bound[d] += fn::test::kFp32Unit * (std::fabs(y[d]) + bound[d]);
    }
}

std::vector<float> run_down(const DeviceExperts& w, const std::vector<int32_t>& ids,
                            const std::vector<float>& rw, const std::vector<float>& h, int team,
                            const std::vector<float>* y0, bool fixed_shape = true) {
  DeviceArray<int32_t> d_ids(ids);
  DeviceArray<float> d_rw(rw);
  DeviceArray<uint16_t> d_h(to_bf16(h));
  DeviceArray<float> d_y(w.view.rows);
  if (y0 != nullptr)
    d_y.upload(*y0);
  else
    FN_CUDA_CHECK(cudaMemset(d_y.ptr, 0xff, d_y.n * 4));
  fn::MoeDownParams p;
  p.experts = w.view;
  p.expert_ids = d_ids.ptr;
  p.routing_weights = d_rw.ptr;
  p.top_k = int(ids.size());
  p.h = d_h.ptr;
  p.y = d_y.ptr;
  p.accumulate = y0 != nullptr;
  p.team_threads = team;
  p.fixed_shape = fixed_shape;
  fn::launch_moe_down_nvfp4(p, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  return d_y.download();
}

std::vector<float> random_ints(size_t n, int lo, int hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = float(d(rng));
  return v;
}

std::vector<float> random_bf16(size_t n, float sigma, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = fn::bf16_to_float(fn::float_to_bf16(d(rng)));
  return v;
}

int sm_count() {
  int dev = 0, sms = 0;
  FN_CUDA_CHECK(cudaGetDevice(&dev));
  FN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

}  // namespace

TEST_CASE("cuda moe nvfp4: gate and up sums are exact with power-of-two scales, every team width") {
  const HostExperts w = make_experts(12, 2 * 96, 2560, 2, true, 1);
  const DeviceExperts dw(w);
  const std::vector<int32_t> ids = {11, 0, 5, 5, 7};  // repeated and extreme ids
  const auto x = random_ints(2560, -4, 4, 2);
  for (int team : teams()) {
    const GateUpRef ref = gate_up_reference(w, ids, x, gate_up_depth(2560, team));
    const auto got = run_gate_up(dw, ids, x, team);
    const auto c = fn::test::compare_bounded(got.gu, ref.gu, std::vector<double>(ref.gu.size(), 0));
    CHECK_MESSAGE(c.wrong == 0, "FP32 kernel", " team ", team, ": ", c.describe());
    const auto ch = fn::test::compare_bounded(got.h, ref.h, ref.h_bound);
    CHECK_MESSAGE(ch.wrong == 0, "FP32 kernel", " team ", team, " h: ", ch.describe());
  }
}

TEST_CASE("cuda moe nvfp4: gate+up SwiGLU on the real shapes (TP=1, 2 and 4) within the bound") {
  for (int64_t inter : {640, 320, 160}) {
    const HostExperts w = make_experts(64, 2 * inter, 2560, 2, false, 10 + inter);
    const DeviceExperts dw(w);
    const std::vector<int32_t> ids = {63, 17, 2, 40, 0, 33, 8, 51, 12, 29};
    const auto x = random_bf16(2560, 1.0f, 3 + inter);
    const int team = fn::plan_moe_gate_up_team(10, inter, 2560, sm_count());
    const GateUpRef ref = gate_up_reference(w, ids, x, gate_up_depth(2560, team));
    const auto got = run_gate_up(dw, ids, x, 0);
    const auto c = fn::test::compare_bounded(got.gu, ref.gu, ref.gu_bound);
    CHECK_MESSAGE(c.wrong == 0, "FP32 kernel", " I ", inter, " gate/up: ", c.describe());
    const auto ch = fn::test::compare_bounded(got.h, ref.h, ref.h_bound);
    CHECK_MESSAGE(ch.wrong == 0, "FP32 kernel", " I ", inter, " h: ", ch.describe());
    MESSAGE("FP32 kernel I ", inter, ": worst gate/up error / bound ", c.worst_ratio);
  }
}

TEST_CASE("cuda moe nvfp4: bulk gate+up sums are exact with power-of-two scales, every split") {
  if (!fn::moe_gate_up_bulk_supported(10, 640, 2560)) {
    MESSAGE("bulk kernel: not on this device (sm_90+ only)");
    return;
  }
  // Shares of one CTA per SM that start and end inside experts, chunks of fewer than 8 rows at
  // expert boundaries (I = 20, 3), fewer pairs than SMs * 8 (grid shrinks), K = 256 .. 2560.
  struct Shape {
    int64_t inter, cols;
    std::vector<int32_t> ids;
  };
  const std::vector<Shape> shapes = {{96, 2560, {11, 0, 5, 5, 7}},
                                     {20, 2560, {3, 9, 1, 10, 2, 4, 6, 8, 0, 7}},
                                     {3, 1280, {2, 1}},
                                     {640, 2560, {11, 10, 9, 8, 7, 6, 5, 4, 3, 2}},
                                     {40, 256, {0, 1, 2, 3, 4, 5, 6}}};
  for (const Shape& sh : shapes) {
    const HostExperts w = make_experts(12, 2 * sh.inter, sh.cols, 2, true, 70 + sh.inter);
    const DeviceExperts dw(w);
    const auto x = random_ints(size_t(sh.cols), -4, 4, 71 + sh.inter);
    const GateUpRef ref = gate_up_reference(w, sh.ids, x, bulk_gate_up_depth(sh.cols));
    const auto got = run_gate_up(dw, sh.ids, x, 0, true);
    const auto c = fn::test::compare_bounded(got.gu, ref.gu, std::vector<double>(ref.gu.size(), 0));
    CHECK_MESSAGE(c.wrong == 0, "bulk I ", sh.inter, " K ", sh.cols, ": ", c.describe());
    const auto ch = fn::test::compare_bounded(got.h, ref.h, ref.h_bound);
    CHECK_MESSAGE(ch.wrong == 0, "bulk I ", sh.inter, " K ", sh.cols, " h: ", ch.describe());
    // Bitwise the same on a second run (fixed order, no atomics).
    const auto again = run_gate_up(dw, sh.ids, x, 0, true);
    CHECK(std::memcmp(again.gu.data(), got.gu.data(), got.gu.size() * 4) == 0);
  }
}

TEST_CASE("cuda moe nvfp4: bulk gate+up on the real shapes (TP=1, 2 and 4) within the bound") {
  if (!fn::moe_gate_up_bulk_supported(10, 640, 2560)) {
    MESSAGE("bulk kernel: not on this device (sm_90+ only)");
    return;
  }
  for (int64_t inter : {640, 320, 160}) {
    const HostExperts w = make_experts(64, 2 * inter, 2560, 2, false, 10 + inter);
    const DeviceExperts dw(w);
    const std::vector<int32_t> ids = {63, 17, 2, 40, 0, 33, 8, 51, 12, 29};
    const auto x = random_bf16(2560, 1.0f, 3 + inter);
    const GateUpRef ref = gate_up_reference(w, ids, x, bulk_gate_up_depth(2560));
    const auto got = run_gate_up(dw, ids, x, 0, true);
    const auto c = fn::test::compare_bounded(got.gu, ref.gu, ref.gu_bound);
    CHECK_MESSAGE(c.wrong == 0, "bulk I ", inter, " gate/up: ", c.describe());
    const auto ch = fn::test::compare_bounded(got.h, ref.h, ref.h_bound);
    CHECK_MESSAGE(ch.wrong == 0, "bulk I ", inter, " h: ", ch.describe());
    const int t32 = fn::plan_moe_gate_up_team(10, inter, 2560, sm_count());
    const GateUpRef tight = gate_up_reference(w, ids, x, gate_up_depth(2560, t32));
    MESSAGE("bulk I ", inter, ": worst gate/up error / own bound ", c.worst_ratio,
            ", / the FP32 kernel's bound ",
            fn::test::compare_bounded(got.gu, tight.gu, tight.gu_bound).worst_ratio);
    // The L2 prefetch of the selected experts' down weights is a hint: the same bits.
    const HostExperts wd = make_experts(64, 2560, inter, 1, false, 20 + inter);
    const DeviceExperts dwd(wd);
    const auto pre = run_gate_up(dw, ids, x, 0, true, &dwd.view);
    CHECK(pre.gu == got.gu);
    CHECK(pre.h == got.h);
  }
}

TEST_CASE("cuda moe nvfp4: bulk gate+up over tokens side by side is each token alone, bitwise") {
  if (!fn::moe_gate_up_bulk_supported(10, 640, 2560)) {
    MESSAGE("bulk kernel: not on this device (sm_90+ only)");
    return;
  }
  const int64_t inter = 640, K = 2560;
  const int top_k = 10;
  const HostExperts w = make_experts(64, 2 * inter, K, 2, false, 140);
  const DeviceExperts dw(w);
  // 64 tokens take more than one launch (the routes' partials must fit a CTA's shared memory):
  // the split is exercised, not only the one-grid case.
  const int64_t per = fn::detail::bulk_tokens_per_launch(top_k, inter, K, sm_count(), 64);
  MESSAGE("bulk gate+up: ", per, " tokens per launch");
  CHECK(per < 64);
  std::mt19937_64 rng(141);
  for (const int64_t tokens : {int64_t{2}, int64_t{5}, int64_t{16}, int64_t{64}}) {
    CAPTURE(tokens);
    std::vector<int32_t> ids(size_t(tokens * top_k));
    for (auto& e : ids) e = int32_t(rng() % 64);
    ids[3] = -1;  // an invalid id: that route's h is 0, the others as alone
    std::vector<float> x;
    for (int64_t b = 0; b < tokens; ++b) {
      const auto xb = random_bf16(size_t(K), 1.0f, 150 + uint64_t(b));
      x.insert(x.end(), xb.begin(), xb.end());
    }
    DeviceArray<int32_t> d_ids(ids);
    DeviceArray<uint16_t> d_x(to_bf16(x));
    DeviceArray<uint16_t> d_h(ids.size() * inter);
    DeviceArray<float> d_gu(ids.size() * 2 * inter);
    FN_CUDA_CHECK(cudaMemset(d_h.ptr, 0xff, d_h.n * 2));
    fn::MoeGateUpParams p;
    p.experts = dw.view;
    p.expert_ids = d_ids.ptr;
    p.top_k = top_k;
    p.x = d_x.ptr;
    p.h = d_h.ptr;
    p.gate_up_out = d_gu.ptr;
    p.bulk = true;
    p.tokens = tokens;
    fn::launch_moe_gate_up_nvfp4(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> h = d_h.download();
    const std::vector<float> gu = d_gu.download();
    int64_t differ = 0;
    for (int64_t b = 0; b < tokens; ++b) {
      const std::vector<int32_t> tid(ids.begin() + b * top_k, ids.begin() + (b + 1) * top_k);
      const std::vector<float> xb(x.begin() + b * K, x.begin() + (b + 1) * K);
      const auto alone = run_gate_up(dw, tid, xb, 0, true);
      for (int64_t e = 0; e < top_k * inter; ++e)
        differ += fn::bf16_to_float(h[size_t(b * top_k * inter + e)]) != alone.h[size_t(e)];
      for (int64_t e = 0; e < top_k * 2 * inter; ++e) {
        const float a = gu[size_t(b * top_k * 2 * inter + e)], c = alone.gu[size_t(e)];
        differ += std::memcmp(&a, &c, 4) != 0;
      }
    }
    CHECK(differ == 0);
    for (int64_t i = 0; i < inter; ++i) CHECK(h[size_t(3 * inter + i)] == 0);
  }
  // The down prefetch names one token's experts: refused with several tokens.
  const HostExperts wd = make_experts(64, K, inter, 1, false, 142);
  const DeviceExperts dwd(wd);
  DeviceArray<int32_t> d_ids(std::vector<int32_t>(2 * top_k, 1));
  DeviceArray<uint16_t> d_x(to_bf16(random_bf16(size_t(2 * K), 1.0f, 143)));
  DeviceArray<uint16_t> d_h(size_t(2 * top_k * inter));
  fn::MoeGateUpParams p;
  p.experts = dw.view;
  p.expert_ids = d_ids.ptr;
  p.top_k = top_k;
  p.x = d_x.ptr;
  p.h = d_h.ptr;
  p.bulk = true;
  p.tokens = 2;
  p.down_prefetch = dwd.view;
  CHECK_THROWS_AS(fn::launch_moe_gate_up_nvfp4(p, nullptr), fn::Error);
}

TEST_CASE("cuda moe nvfp4: bulk gate+up: +-0.5 codes, subnormal scales, invalid ids, bad shapes") {
  if (!fn::moe_gate_up_bulk_supported(10, 640, 2560)) {
    MESSAGE("bulk kernel: not on this device (sm_90+ only)");
    return;
  }
  // +-0.5 codes (BF16 subnormals after the decode) with E4M3 subnormal scales: exact.
  HostExperts w = make_experts(6, 2 * 24, 512, 2, true, 120);
  std::mt19937_64 rng(121);
  for (auto& b : w.packed) b = uint8_t((rng() & 1 ? 0x1 : 0x9) | (rng() & 1 ? 0x10 : 0x90));
  for (auto& sc : w.scales) sc = uint8_t(rng() % 8 == 0 ? 0x08 : 1 + rng() % 7);
  const DeviceExperts dw(w);
  const auto x = random_ints(512, -64, 64, 122);
  {
    const std::vector<int32_t> ids = {5, 1, 2, 0};
    const GateUpRef ref = gate_up_reference(w, ids, x, bulk_gate_up_depth(512));
    const auto got = run_gate_up(dw, ids, x, 0, true);
    const auto c = fn::test::compare_bounded(got.gu, ref.gu, std::vector<double>(ref.gu.size(), 0));
    CHECK_MESSAGE(c.wrong == 0, "bulk +-0.5: ", c.describe());
    double mag = 0;
    for (double v : ref.gu) mag += std::fabs(v);
    CHECK(mag > 0);
  }
  // Ids outside [0, 6): h = 0 for those, the others right.
  {
    const std::vector<int32_t> ids = {-1, 2, 6, 1 << 30, 4};
    const auto got = run_gate_up(dw, ids, x, 0, true);
    for (int j : {0, 2, 3})
      for (int i = 0; i < 24; ++i) CHECK(got.h[size_t(j) * 24 + i] == 0.0f);
    const GateUpRef ref = gate_up_reference(w, ids, x, bulk_gate_up_depth(512));
    CHECK(fn::test::compare_bounded(got.h, ref.h, ref.h_bound).wrong == 0);
    const std::vector<int32_t> none = {-5, 6, 7};
    for (float v : run_gate_up(dw, none, x, 0, true).h) CHECK(v == 0.0f);
    // The down weights' prefetch skips the invalid ids (no access outside the experts).
    const HostExperts wd = make_experts(6, 512, 32, 1, true, 127);
    const DeviceExperts dwd(wd);
    const auto pre = run_gate_up(dw, ids, x, 0, true, &dwd.view);
    CHECK(pre.h == got.h);
    // Down experts of another count, or of I not a multiple of 32, are refused.
    const HostExperts wd7 = make_experts(7, 512, 32, 1, true, 128);
    const DeviceExperts dwd7(wd7);
    CHECK_THROWS_AS(run_gate_up(dw, ids, x, 0, true, &dwd7.view), fn::Error);
    const HostExperts wd48 = make_experts(6, 512, 48, 1, true, 129);
    const DeviceExperts dwd48(wd48);
    CHECK_THROWS_AS(run_gate_up(dw, ids, x, 0, true, &dwd48.view), fn::Error);
  }
  // Graph replay of the bulk kernel: the graph test case below runs both gate+up kernels.
  // A share whose partials would not fit in shared memory (64 x 8192 row pairs) is not taken.
  CHECK(!fn::moe_gate_up_bulk_supported(64, 8192, 2560));
  // Shapes the kernel does not take are refused, not run: K not a multiple of 256, K > 2560.
  for (int64_t cols : {int64_t(2576), int64_t(5120)}) {
    const HostExperts bad = make_experts(2, 16, cols, 2, true, 125);
    const DeviceExperts dbad(bad);
    CHECK(!fn::moe_gate_up_bulk_supported(1, 8, cols));
    CHECK_THROWS_AS(run_gate_up(dbad, {0}, random_ints(size_t(cols), -1, 1, 126), 0, true),
                    fn::Error);
  }
}

TEST_CASE("cuda moe nvfp4: the down projection sums experts exactly with power-of-two weights") {
  const HostExperts w = make_experts(9, 2560, 640, 1, true, 20);
  const DeviceExperts dw(w);
  const std::vector<int32_t> ids = {8, 3, 0, 3};
  const std::vector<float> rw = {0.5f, 0.25f, 0.125f, 0.125f};
  const auto h = random_ints(ids.size() * 640, -4, 4, 21);
  for (int team : teams()) {
    std::vector<double> want, bound;
    down_reference(w, ids, rw, h, down_depth(4, 640, team), nullptr, want, bound);
    const auto got = run_down(dw, ids, rw, h, team, nullptr);
    const auto c = fn::test::compare_bounded(got, want, std::vector<double>(want.size(), 0));
    CHECK_MESSAGE(c.wrong == 0, "FP32 kernel", " team ", team, ": ", c.describe());
  }
}

TEST_CASE("cuda moe nvfp4: the down projection on the real shapes (TP=1, 2 and 4), accumulating") {
  for (int64_t inter : {640, 320, 160}) {
    const HostExperts w = make_experts(64, 2560, inter, 1, false, 30 + inter);
    const DeviceExperts dw(w);
    const std::vector<int32_t> ids = {5, 63, 0, 22, 41, 7, 19, 36, 50, 11};
    std::vector<float> rw = {0.21f, 0.15f, 0.12f, 0.1f, 0.09f, 0.08f, 0.07f, 0.06f, 0.06f, 0.06f};
    const auto h = random_bf16(ids.size() * inter, 0.5f, 31 + inter);
    const auto y0 = random_bf16(2560, 0.3f, 32 + inter);
    const int team = fn::plan_moe_down_team(10, inter, 2560, sm_count());
    for (const std::vector<float>* init : {static_cast<const std::vector<float>*>(nullptr), &y0}) {
      std::vector<double> want, bound;
      down_reference(w, ids, rw, h, down_depth(10, inter, team), init, want, bound);
      const auto got = run_down(dw, ids, rw, h, 0, init);
      const auto c = fn::test::compare_bounded(got, want, bound);
      CHECK_MESSAGE(c.wrong == 0, "FP32 kernel", " I ", inter, " accumulate ", init != nullptr,
                    ": ", c.describe());
      // The runtime-shape instance (at I = 640 with 32-lane teams the launch above ran the
      // compile-time-shape one): the same bits.
      const auto rt = run_down(dw, ids, rw, h, 0, init, false);
      CHECK_MESSAGE(std::memcmp(rt.data(), got.data(), got.size() * 4) == 0,
                    "runtime-shape instance I ", inter, " accumulate ", init != nullptr);
      MESSAGE("FP32 kernel I ", inter, " accumulate ", init != nullptr, ": worst error / bound ",
              c.worst_ratio);
    }
  }
}

TEST_CASE("cuda moe nvfp4: cols = 16 and 48 (odd multiples of 16) are exact, every team width") {
  // The tiny fixtures at TP=2: moe_intermediate_size 32 / 2 = 16 columns for the down projection
  // (one block scale per row); gate+up over 48 columns takes the same 16-code path.
  const HostExperts dn = make_experts(8, 64, 16, 1, true, 70);
  const HostExperts gu = make_experts(8, 2 * 16, 48, 2, true, 71);
  const DeviceExperts ddn(dn), dgu(gu);
  const std::vector<int32_t> ids = {7, 0, 3, 3};
  const std::vector<float> rw = {0.5f, 0.25f, 0.125f, 0.125f};
  const auto h = random_ints(ids.size() * 16, -4, 4, 72);
  const auto x = random_ints(48, -4, 4, 73);
  for (int team : teams()) {
    const GateUpRef ref = gate_up_reference(gu, ids, x, gate_up_depth(48, team));
    std::vector<double> want, bound;
    down_reference(dn, ids, rw, h, down_depth(4, 16, team), nullptr, want, bound);
    const auto y = run_down(ddn, ids, rw, h, team, nullptr);
    const auto c = fn::test::compare_bounded(y, want, std::vector<double>(want.size(), 0));
    CHECK_MESSAGE(c.wrong == 0, "FP32 kernel", " down team ", team, ": ", c.describe());
    const auto got = run_gate_up(dgu, ids, x, team);
    const auto cg =
        fn::test::compare_bounded(got.gu, ref.gu, std::vector<double>(ref.gu.size(), 0));
    CHECK_MESSAGE(cg.wrong == 0, "FP32 kernel", " gate/up team ", team, ": ", cg.describe());
    const auto ch = fn::test::compare_bounded(got.h, ref.h, ref.h_bound);
    CHECK_MESSAGE(ch.wrong == 0, "FP32 kernel", " h team ", team, ": ", ch.describe());
  }
}

TEST_CASE("cuda moe nvfp4: lanes with more units than they hold in registers loop, exactly") {
  // FP32 kernel, team 8: gate+up over 2560 columns gives each lane 10 units (chunks of 3), over 720
  // (an odd multiple of 16: the 16-code path) 6; the down projection over 10 experts x 112 columns
  // 9 units per lane (chunks of 7), over 10 x 640 columns 25.
  const std::vector<int32_t> ids = {3, 0, 5, 1, 5, 2, 4, 0, 1, 3};
  const std::vector<float> rw = {0.5f, 0.25f, 0.125f, 0.125f, 0.5f, 0.25f, 1.0f, 2.0f, 0.5f, 0.25f};
  const int team = 8;
  for (int64_t cols : {2560, 720}) {
    const HostExperts gu = make_experts(6, 2 * 24, cols, 2, true, 90 + cols);
    const DeviceExperts dgu(gu);
    const auto x = random_ints(size_t(cols), -4, 4, 91 + cols);
    const GateUpRef ref = gate_up_reference(gu, ids, x, gate_up_depth(cols, team));
    const auto got = run_gate_up(dgu, ids, x, team);
    const auto c = fn::test::compare_bounded(got.gu, ref.gu, std::vector<double>(ref.gu.size(), 0));
    CHECK_MESSAGE(c.wrong == 0, "FP32 kernel", " cols ", cols, ": ", c.describe());
  }
  for (int64_t inter : {112, 640}) {
    const HostExperts dn = make_experts(6, 40, inter, 1, true, 92 + inter);
    const DeviceExperts ddn(dn);
    const auto h = random_ints(ids.size() * inter, -4, 4, 93 + inter);
    std::vector<double> want, bound;
    down_reference(dn, ids, rw, h, down_depth(10, inter, team), nullptr, want, bound);
    const auto y = run_down(ddn, ids, rw, h, team, nullptr);
    const auto c = fn::test::compare_bounded(y, want, std::vector<double>(want.size(), 0));
    CHECK_MESSAGE(c.wrong == 0, "FP32 kernel", " I ", inter, ": ", c.describe());
  }
}

TEST_CASE("cuda moe nvfp4: the widest staged activations (12,288 values) are exact") {
  // The FP32 kernels stage x (gate+up, behind its 1 KB scale table) or all of h (down) with 16
  // bytes of padding per unit: at 12,288 values 54-61 KB, past the default 48 KB of dynamic shared
  // memory; both kernels, both unit widths (32 and 16 codes), against the exact sums.
  const std::vector<int32_t> ids = {3, 0, 5, 1};
  const std::vector<float> rw = {0.5f, 0.25f, 2.0f, 1.0f};
  for (int64_t cols : {12288, 12288 - 16}) {
    const HostExperts gu = make_experts(6, 2 * 8, cols, 2, true, 120 + cols);
    const DeviceExperts dgu(gu);
    const auto x = random_ints(size_t(cols), -4, 4, 121 + cols);
    const GateUpRef ref = gate_up_reference(gu, ids, x, gate_up_depth(cols, 32));
    const auto got = run_gate_up(dgu, ids, x, 0, false);
    const auto c = fn::test::compare_bounded(got.gu, ref.gu, std::vector<double>(ref.gu.size(), 0));
    CHECK_MESSAGE(c.wrong == 0, "gate/up cols ", cols, ": ", c.describe());
  }
  for (int64_t inter : {3072, 3072 - 16}) {
    const HostExperts dn = make_experts(6, 24, inter, 1, true, 122 + inter);
    const DeviceExperts ddn(dn);
    const auto h = random_ints(ids.size() * inter, -4, 4, 123 + inter);
    std::vector<double> want, bound;
    down_reference(dn, ids, rw, h, 0, nullptr, want, bound);
    const auto y = run_down(ddn, ids, rw, h, 0, nullptr, false);
    const auto c = fn::test::compare_bounded(y, want, std::vector<double>(want.size(), 0));
    CHECK_MESSAGE(c.wrong == 0, "down I ", inter, ": ", c.describe());
  }
}

TEST_CASE("cuda moe nvfp4: the tiny fixtures' shapes (hidden 64, I = 32 and 16) within the bound") {
  for (int64_t inter : {32, 16}) {
    const HostExperts gu = make_experts(8, 2 * inter, 64, 2, false, 80 + inter);
    const HostExperts dn = make_experts(8, 64, inter, 1, false, 81 + inter);
    const DeviceExperts dgu(gu), ddn(dn);
    const std::vector<int32_t> ids = {6, 1, 4};
    const std::vector<float> rw = {0.5f, 0.3f, 0.2f};
    const auto x = random_bf16(64, 1.0f, 82 + inter);
    const int tg = fn::plan_moe_gate_up_team(3, inter, 64, sm_count());
    const GateUpRef ref = gate_up_reference(gu, ids, x, gate_up_depth(64, tg));
    const auto got = run_gate_up(dgu, ids, x, 0);
    const auto c = fn::test::compare_bounded(got.gu, ref.gu, ref.gu_bound);
    CHECK_MESSAGE(c.wrong == 0, "FP32 kernel", " I ", inter, " gate/up: ", c.describe());
    const auto ch = fn::test::compare_bounded(got.h, ref.h, ref.h_bound);
    CHECK_MESSAGE(ch.wrong == 0, "FP32 kernel", " I ", inter, " h: ", ch.describe());
    // The down projection on the kernel's own h, plain and accumulating.
    const auto y0 = random_bf16(64, 0.3f, 83 + inter);
    const int td = fn::plan_moe_down_team(3, inter, 64, sm_count());
    for (const std::vector<float>* init : {static_cast<const std::vector<float>*>(nullptr), &y0}) {
      std::vector<double> want, bound;
      down_reference(dn, ids, rw, got.h, down_depth(3, inter, td), init, want, bound);
      const auto y = run_down(ddn, ids, rw, got.h, 0, init);
      const auto cd = fn::test::compare_bounded(y, want, bound);
      CHECK_MESSAGE(cd.wrong == 0, "FP32 kernel", " I ", inter, " down, accumulate ",
                    init != nullptr, ": ", cd.describe());
    }
  }
}

TEST_CASE("cuda moe nvfp4: row counts that are not a multiple of 8 leave no row out, exactly") {
  // The tensor-core kernels work on tiles of 8 rows: I = 20 gate/up row pairs (2.5 tiles per
  // expert) over 48 columns, and a down projection with 44 output rows over 10 x 16 columns
  // (chunks of 4 units spanning up to 4 experts), plain and accumulating.
  const std::vector<int32_t> ids = {2, 5, 0, 5, 1, 3, 4, 0, 2, 1};
  const std::vector<float> rw = {0.5f, 0.25f, 0.125f, 1.0f, 2.0f, 0.5f, 0.25f, 4.0f, 0.5f, 0.125f};
  const HostExperts gu = make_experts(6, 2 * 20, 48, 2, true, 100);
  const HostExperts dn = make_experts(6, 44, 16, 1, true, 101);
  const DeviceExperts dgu(gu), ddn(dn);
  const auto x = random_ints(48, -4, 4, 102);
  const auto h = random_ints(ids.size() * 16, -4, 4, 103);
  const auto y0 = random_ints(44, -8, 8, 104);
  for (int team : teams()) {
    const GateUpRef ref = gate_up_reference(gu, ids, x, gate_up_depth(48, team));
    const auto got = run_gate_up(dgu, ids, x, team);
    const auto c = fn::test::compare_bounded(got.gu, ref.gu, std::vector<double>(ref.gu.size(), 0));
    CHECK_MESSAGE(c.wrong == 0, "FP32 kernel", " gate/up team ", team, ": ", c.describe());
    const auto ch = fn::test::compare_bounded(got.h, ref.h, ref.h_bound);
    CHECK_MESSAGE(ch.wrong == 0, "FP32 kernel", " h team ", team, ": ", ch.describe());
    for (const std::vector<float>* init : {static_cast<const std::vector<float>*>(nullptr), &y0}) {
      std::vector<double> want, bound;
      down_reference(dn, ids, rw, h, down_depth(10, 16, team), init, want, bound);
      const auto y = run_down(ddn, ids, rw, h, team, init);
      const auto cd = fn::test::compare_bounded(y, want, std::vector<double>(want.size(), 0));
      CHECK_MESSAGE(cd.wrong == 0, "FP32 kernel", " down team ", team, " accumulate ",
                    init != nullptr, ": ", cd.describe());
    }
  }
}

TEST_CASE("cuda moe nvfp4: +-0.5 codes and subnormal block scales are exact (no flush to zero)") {
  // Every weight is +0.5 or -0.5 (E2M1 0x1 / 0x9: the BF16 subnormal patterns of the decode) with
  // block scales among the E4M3 subnormals 2^-9 .. 7 * 2^-9 and 2^-6 (0x08): products down to
  // 2^-10 * x, all exact; a flushed code or scale would change the integer-valued sums.
  for (const bool gate_up : {true, false}) {
    HostExperts w =
        gate_up ? make_experts(4, 2 * 24, 96, 2, true, 110) : make_experts(4, 40, 96, 1, true, 111);
    std::mt19937_64 rng(112);
    for (auto& b : w.packed) b = uint8_t((rng() & 1 ? 0x1 : 0x9) | (rng() & 1 ? 0x10 : 0x90));
    for (auto& sc : w.scales) sc = uint8_t(rng() % 8 == 0 ? 0x08 : 1 + rng() % 7);
    const DeviceExperts dw(w);
    const std::vector<int32_t> ids = {3, 1, 2};
    const auto x = random_ints(gate_up ? 96 : ids.size() * 96, -64, 64, 113);
    const int team = 16;
    if (gate_up) {
      const GateUpRef ref = gate_up_reference(w, ids, x, gate_up_depth(96, team));
      const auto got = run_gate_up(dw, ids, x, team);
      const auto c =
          fn::test::compare_bounded(got.gu, ref.gu, std::vector<double>(ref.gu.size(), 0));
      CHECK_MESSAGE(c.wrong == 0, "FP32 kernel", " gate/up: ", c.describe());
      // Every output is nonzero-able: the reference is not trivially zero.
      double mag = 0;
      for (double v : ref.gu) mag += std::fabs(v);
      CHECK(mag > 0);
    } else {
      const std::vector<float> rw = {0.5f, 1.0f, 0.25f};
      std::vector<double> want, bound;
      down_reference(w, ids, rw, x, down_depth(3, 96, team), nullptr, want, bound);
      const auto y = run_down(dw, ids, rw, x, team, nullptr);
      const auto c = fn::test::compare_bounded(y, want, std::vector<double>(want.size(), 0));
      CHECK_MESSAGE(c.wrong == 0, "FP32 kernel", " down: ", c.describe());
    }
  }
}

TEST_CASE("cuda moe nvfp4: expert ids outside [0, num_experts) contribute zero") {
  const HostExperts gu = make_experts(4, 2 * 32, 64, 2, true, 40);
  const HostExperts dn = make_experts(4, 96, 32, 1, true, 41);
  const DeviceExperts dgu(gu), ddn(dn);
  const std::vector<int32_t> ids = {-1, 2, 4, 1 << 30};
  const auto x = random_ints(64, -3, 3, 42);
  const std::vector<float> rw = {1.0f, 0.5f, 1.0f, 1.0f};
  const auto h = random_ints(ids.size() * 32, -3, 3, 43);
  const auto y0 = random_ints(96, -3, 3, 44);
  {
    const int team = 8;
    const auto got = run_gate_up(dgu, ids, x, team);
    for (int j : {0, 2, 3})
      for (int i = 0; i < 32; ++i) CHECK(got.h[size_t(j) * 32 + i] == 0.0f);
    const GateUpRef ref = gate_up_reference(gu, ids, x, gate_up_depth(64, team));
    CHECK(fn::test::compare_bounded(got.h, ref.h, ref.h_bound).wrong == 0);
    for (const std::vector<float>* init : {static_cast<const std::vector<float>*>(nullptr), &y0}) {
      std::vector<double> want, bound;
      down_reference(dn, ids, rw, h, down_depth(4, 32, team), init, want, bound);
      const auto y = run_down(ddn, ids, rw, h, team, init);
      CHECK_MESSAGE(
          fn::test::compare_bounded(y, want, std::vector<double>(want.size(), 0)).wrong == 0,
          "FP32 kernel", " accumulate ", init != nullptr);
    }
  }
  // All ids invalid: h = 0, and y = 0 (or y0 untouched when accumulating).
  const std::vector<int32_t> none = {-5, 4, 7, -1};
  {
    const auto got = run_gate_up(dgu, none, x, 0);
    for (float v : got.h) CHECK(v == 0.0f);
    const auto y = run_down(ddn, none, rw, h, 0, &y0);
    CHECK(std::memcmp(y.data(), y0.data(), y.size() * 4) == 0);
  }
}

TEST_CASE("cuda moe nvfp4: a captured graph follows expert ids changed in device memory, bitwise") {
  const HostExperts gu = make_experts(32, 2 * 320, 2560, 2, false, 50);
  const HostExperts dn = make_experts(32, 2560, 320, 1, false, 51);
  const DeviceExperts dgu(gu), ddn(dn);
  const auto x = random_bf16(2560, 1.0f, 52);
  DeviceArray<uint16_t> d_x(to_bf16(x));
  DeviceArray<int32_t> d_ids(10);
  DeviceArray<float> d_rw(10);
  DeviceArray<uint16_t> d_h(10 * 320);
  DeviceArray<float> d_y(2560);
  fn::MoeGateUpParams pg;
  pg.experts = dgu.view;
  pg.expert_ids = d_ids.ptr;
  pg.top_k = 10;
  pg.x = d_x.ptr;
  pg.h = d_h.ptr;
  fn::MoeDownParams pd;
  pd.experts = ddn.view;
  pd.expert_ids = d_ids.ptr;
  pd.routing_weights = d_rw.ptr;
  pd.top_k = 10;
  pd.h = d_h.ptr;
  pd.y = d_y.ptr;
  CHECK(!pg.bulk);  // the default: the FP32 kernels
  const std::vector<std::vector<int32_t>> id_sets = {{0, 1, 2, 3, 4, 5, 6, 7, 8, 9},
                                                     {31, 30, 7, 19, 3, 22, 14, 9, 27, 1}};
  const std::vector<float> rw = {0.3f, 0.2f, 0.1f, 0.1f, 0.06f, 0.06f, 0.06f, 0.04f, 0.04f, 0.04f};
  d_rw.upload(rw);

  cudaStream_t stream;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // The FP32 gate+up, then (sm_90+ only) the bulk gate+up; the FP32 down after either.
  const int kinds = fn::moe_gate_up_bulk_supported(10, 640, 2560) ? 2 : 1;
  for (int kind = 0; kind < kinds; ++kind) {
    const bool bulk = kind == 1;
    const char* name = bulk ? "bulk gate+up" : "FP32 kernels";
    pg.bulk = bulk;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    fn::launch_moe_gate_up_nvfp4(pg, stream);
    fn::launch_moe_down_nvfp4(pd, stream);
    FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (const auto& ids : id_sets) {
      d_ids.upload(ids);
      FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      FN_CUDA_CHECK(cudaStreamSynchronize(stream));
      const auto y_graph = d_y.download();
      std::vector<float> h_graph;
      for (uint16_t b : d_h.download()) h_graph.push_back(fn::bf16_to_float(b));
      // Eager launches with the same ids: bitwise the same.
      fn::launch_moe_gate_up_nvfp4(pg, stream);
      fn::launch_moe_down_nvfp4(pd, stream);
      FN_CUDA_CHECK(cudaStreamSynchronize(stream));
      const auto y_eager = d_y.download();
      CHECK_MESSAGE(std::memcmp(y_graph.data(), y_eager.data(), y_graph.size() * 4) == 0, name);
      std::vector<float> h_eager;
      for (uint16_t b : d_h.download()) h_eager.push_back(fn::bf16_to_float(b));
      CHECK_MESSAGE(std::memcmp(h_graph.data(), h_eager.data(), h_graph.size() * 4) == 0, name);
      // And right: the references on the graph's own h.
      const int tg = fn::plan_moe_gate_up_team(10, 320, 2560, sm_count());
      const GateUpRef gref =
          gate_up_reference(gu, ids, x, bulk ? bulk_gate_up_depth(2560) : gate_up_depth(2560, tg));
      const auto ch = fn::test::compare_bounded(h_graph, gref.h, gref.h_bound);
      CHECK_MESSAGE(ch.wrong == 0, name, " h: ", ch.describe());
      const int td = fn::plan_moe_down_team(10, 320, 2560, sm_count());
      std::vector<double> want, bound;
      down_reference(dn, ids, rw, h_graph, down_depth(10, 320, td), nullptr, want, bound);
      const auto c = fn::test::compare_bounded(y_graph, want, bound);
      CHECK_MESSAGE(c.wrong == 0, name, ": ", c.describe());
    }
    FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
    FN_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  FN_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("cuda moe nvfp4: the launchers reject bad shapes, alignment and team sizes") {
  const HostExperts gu = make_experts(2, 64, 64, 2, true, 60);
  const DeviceExperts dgu(gu);
  DeviceArray<int32_t> ids(std::vector<int32_t>{0});
  DeviceArray<uint16_t> x(64), h(32);
  fn::MoeGateUpParams p;
  p.experts = dgu.view;
  p.expert_ids = ids.ptr;
  p.top_k = 1;
  p.x = x.ptr;
  p.h = h.ptr;
  fn::launch_moe_gate_up_nvfp4(p, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  auto bad = p;
  bad.experts.cols = 40;  // not a multiple of 16 (one block scale)
  CHECK_THROWS_AS(fn::launch_moe_gate_up_nvfp4(bad, nullptr), fn::Error);
  bad = p;
  bad.experts.rows = 63;  // gate and up must pair up
  CHECK_THROWS_AS(fn::launch_moe_gate_up_nvfp4(bad, nullptr), fn::Error);
  bad = p;
  bad.x = x.ptr + 1;
  CHECK_THROWS_AS(fn::launch_moe_gate_up_nvfp4(bad, nullptr), fn::Error);
  bad = p;
  bad.team_threads = 12;
  CHECK_THROWS_AS(fn::launch_moe_gate_up_nvfp4(bad, nullptr), fn::Error);
  bad = p;
  bad.team_threads = 16;  // the FP32 kernel takes 16
  fn::launch_moe_gate_up_nvfp4(bad, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  bad = p;
  bad.top_k = 0;
  CHECK_THROWS_AS(fn::launch_moe_gate_up_nvfp4(bad, nullptr), fn::Error);
  bad = p;
  bad.experts.cols = 12288 + 16;  // x staged in shared memory: at most 48 KB of FP32
  CHECK_THROWS_AS(fn::launch_moe_gate_up_nvfp4(bad, nullptr), fn::Error);
  fn::MoeDownParams d;
  d.experts = dgu.view;
  d.expert_ids = ids.ptr;
  d.routing_weights = nullptr;  // missing
  d.top_k = 1;
  d.h = h.ptr;
  DeviceArray<float> y(64);
  d.y = y.ptr;
  CHECK_THROWS_AS(fn::launch_moe_down_nvfp4(d, nullptr), fn::Error);
  DeviceArray<float> rw(std::vector<float>{1.0f});
  DeviceArray<uint16_t> h64(64);
  d.routing_weights = rw.ptr;
  d.h = h64.ptr;
  fn::launch_moe_down_nvfp4(d, nullptr);  // valid: 1 x 64 columns
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  d.team_threads = 8;
  fn::launch_moe_down_nvfp4(d, nullptr);  // the FP32 kernel takes 8
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  d.team_threads = 0;
  d.top_k = 193;  // 193 x 64 columns of h staged as FP32: over 48 KB
  CHECK_THROWS_AS(fn::launch_moe_down_nvfp4(d, nullptr), fn::Error);
}

TEST_CASE(
    "cuda moe nvfp4: the load-time decode layout matches the host permutation, word by word") {
  // 64 MiB + 12 bytes of random codes: 16.8 M words, more than the 65,535 x 256 threads of one
  // pass, so the grid-stride loop runs; every word must come out as nvfp4::to_decode_layout says.
  std::mt19937_64 rng(91);
  std::vector<uint8_t> codes((size_t{64} << 20) + 12);
  for (auto& b : codes) b = uint8_t(rng());
  DeviceArray<uint8_t> dev(codes);
  fn::test::to_decode_layout(dev);
  const std::vector<uint8_t> got = dev.download();
  int64_t wrong = 0;
  for (size_t i = 0; i < codes.size(); i += 4) {
    uint32_t w = 0, g = 0;
    std::memcpy(&w, codes.data() + i, 4);
    std::memcpy(&g, got.data() + i, 4);
    if (g != fn::nvfp4::to_decode_layout(w) || fn::nvfp4::from_decode_layout(g) != w) ++wrong;
  }
  CHECK(wrong == 0);
  // Bad arguments are refused before any launch.
  CHECK_THROWS_AS(fn::nvfp4_codes_to_decode_layout(nullptr, 16, nullptr), fn::Error);
  CHECK_THROWS_AS(fn::nvfp4_codes_to_decode_layout(dev.ptr + 2, 16, nullptr), fn::Error);
  CHECK_THROWS_AS(fn::nvfp4_codes_to_decode_layout(dev.ptr, 18, nullptr), fn::Error);
  CHECK_THROWS_AS(fn::nvfp4_codes_to_decode_layout(dev.ptr, 0, nullptr), fn::Error);
}
