// GPU tests of programmatic dependent launch (cuda/common/pdl.h, cuda/common/pdl.cuh): a chain of
// decode-step kernels launched back to back in one stream (HC read: fused norm + down pass and mix,
// BF16 GEMVs on the FP32 block input, GDN, the fused router + shared gate/up + top-k, NVFP4 experts
// on the BF16 copy, the fused SwiGLU + shared down + combine, inject; every step reads what the one
// before wrote, and the GDN state and H carry over from step to step) must give the same bits with
// PDL on as with PDL off (plain stream order, the reference whose kernels the other test_cuda_*
// files check against the CPU oracle), eagerly and replayed from a CUDA graph. A missing or
// misplaced wait would race and change bits.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/pdl.h"
#include "cuda/kernels/decode_ops.h"
#include "cuda/kernels/gdn.h"
#include "cuda/kernels/gemv_bf16.h"
#include "cuda/kernels/hc.h"
#include "cuda/kernels/moe_nvfp4.h"
#include "cuda/kernels/moe_shared.h"
#include "cuda/kernels/weight_fill.h"
#include "tests/cuda_test_util.h"

namespace {

using fn::test::DeviceArray;

// Shapes: hidden 2560 with the real HC (4 streams, rank 320), the real router (512 experts, top
// 10), GDN heads of the TP=2 slice (8 key, 24 value, 128 dims, conv 4), a reduced expert width
// (I 256) and shared expert (I 512).
constexpr int64_t kD = 2560, kE = 512, kI = 256, kIs = 512;
constexpr int64_t kS = 4, kW = kS * kD, kR = 320, kHcRows = kR + kS;
constexpr int kK = 10, kHk = 8, kHv = 24, kDk = 128, kDv = 128, kConvK = 4;
constexpr int64_t kConvDim = 2 * kHk * kDk + kHv * kDv;
constexpr int64_t kProjRows = kConvDim + kHv * kDv + 2 * kHv;

template <typename T>
void fill(DeviceArray<T>& a, fn::RandomFill kind, fn::DType dtype, float lo, float hi,
          uint64_t stream) {
  fn::RandomFillParams p;
  p.dst = a.ptr;
  p.count = static_cast<int64_t>(a.n);
  p.dtype = dtype;
  p.kind = kind;
  p.lo = lo;
  p.hi = hi;
  p.seed = 20261130;
  p.stream = stream;
  fn::launch_random_fill(p, nullptr);
}

void gemv(const DeviceArray<uint16_t>& w, int64_t rows, int64_t cols, const void* x,
          fn::DType x_dtype, void* y, cudaStream_t s) {
  fn::launch_gemv_bf16(w.ptr, rows, cols, x, x_dtype, y, fn::DType::F32, s);
}

// The weights and the carried state of the chain.
struct Chain {
  DeviceArray<uint16_t> norm_w{kW}, w_hc_dn{kHcRows * kW}, w_hc_up{kW * kR};
  DeviceArray<uint16_t> w_proj{kProjRows * kD}, w_o{kD * kHv * kDv}, w_r{(kE + 1) * kD};
  DeviceArray<uint16_t> w_sgu{2 * kIs * kD}, w_sd{kD * kIs};
  DeviceArray<float> conv_w{kConvDim * kConvK}, a_log{kHv}, dt_bias{kHv}, gdn_norm{kDv};
  DeviceArray<uint8_t> gu_packed{kE * 2 * kI * kD / 2}, gu_scales{kE * 2 * kI * kD / 16};
  DeviceArray<uint8_t> dn_packed{kE * kD * kI / 2}, dn_scales{kE * kD * kI / 16};
  DeviceArray<float> gu_gs{2 * kE}, dn_gs{kE};
  // State carried over the steps, and its initial values.
  DeviceArray<float> H{kW}, H0{kW}, state{kHv * kDk * kDv}, conv_state{kConvDim * (kConvK - 1)};
  DeviceArray<unsigned int> counters{kHv + kHk};
  // Per-step scratch.
  DeviceArray<float> sumsq{static_cast<size_t>(fn::hc_down_splits(kS, kD))},
      t{static_cast<size_t>(fn::hc_down_splits(kS, kD) * kHcRows)}, m{kD}, iota{kS};
  DeviceArray<uint16_t> m_bf16{kD}, gout{kHv * kDv}, h{kK * kI};
  DeviceArray<float> proj{kProjRows}, o_scratch{kHv * kDv}, ya{kD}, rl{kE + 1}, rw{kK}, y{kD};
  DeviceArray<float> sgu{2 * kIs};
  DeviceArray<float> mailbox{kE};
  DeviceArray<int32_t> ids{kK}, flag{1};

  Chain() {
    using fn::DType;
    using fn::RandomFill;
    uint64_t id = 1;
    fill(norm_w, RandomFill::Uniform, DType::BF16, -0.1f, 0.1f, id++);
    fill(w_hc_dn, RandomFill::Uniform, DType::BF16, -0.03f, 0.03f, id++);
    fill(w_hc_up, RandomFill::Uniform, DType::BF16, -0.05f, 0.05f, id++);
    fill(w_proj, RandomFill::Uniform, DType::BF16, -0.03f, 0.03f, id++);
    fill(w_o, RandomFill::Uniform, DType::BF16, -0.03f, 0.03f, id++);
    fill(w_r, RandomFill::Uniform, DType::BF16, -0.03f, 0.03f, id++);
    fill(w_sgu, RandomFill::Uniform, DType::BF16, -0.03f, 0.03f, id++);
    fill(w_sd, RandomFill::Uniform, DType::BF16, -0.05f, 0.05f, id++);
    fill(conv_w, RandomFill::Uniform, DType::F32, -0.5f, 0.5f, id++);
    fill(a_log, RandomFill::Uniform, DType::F32, -1.0f, 0.5f, id++);
    fill(dt_bias, RandomFill::Uniform, DType::F32, -0.5f, 0.5f, id++);
    fill(gdn_norm, RandomFill::Uniform, DType::F32, 0.5f, 1.5f, id++);
    fill(gu_packed, RandomFill::E2M1Codes, DType::U8, 0, 0, id++);
    fill(gu_scales, RandomFill::E4M3NearOne, DType::F8_E4M3, 0, 0, id++);
    fill(dn_packed, RandomFill::E2M1Codes, DType::U8, 0, 0, id++);
    fill(dn_scales, RandomFill::E4M3NearOne, DType::F8_E4M3, 0, 0, id++);
    fill(gu_gs, RandomFill::Uniform, DType::F32, 0.005f, 0.01f, id++);
    fill(dn_gs, RandomFill::Uniform, DType::F32, 0.01f, 0.02f, id++);
    fill(H0, RandomFill::Uniform, DType::F32, -2.0f, 2.0f, id++);
    FN_CUDA_CHECK(cudaMemset(counters.ptr, 0, counters.n * sizeof(unsigned int)));
    FN_CUDA_CHECK(cudaDeviceSynchronize());
  }

  void reset() {
    FN_CUDA_CHECK(cudaMemcpy(H.ptr, H0.ptr, kW * sizeof(float), cudaMemcpyDeviceToDevice));
    FN_CUDA_CHECK(cudaMemset(state.ptr, 0, state.n * sizeof(float)));
    FN_CUDA_CHECK(cudaMemset(conv_state.ptr, 0, conv_state.n * sizeof(float)));
    FN_CUDA_CHECK(cudaMemset(flag.ptr, 0, sizeof(int32_t)));
    fn::router_mailbox_init(mailbox.ptr, static_cast<int>(kE), nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // The HC read (2 kernels): t's partials and the partial squares, then m (FP32; the BF16 copy when
  // `bf16`), iota.
  void hc_read(bool bf16, cudaStream_t s) {
    fn::HcDownParams d;
    d.H = H.ptr;
    d.norm = norm_w.ptr;
    d.weight = w_hc_dn.ptr;
    d.rows = kHcRows;
    d.hc_count = kS;
    d.hidden = kD;
    d.t_partial = t.ptr;
    d.sumsq = sumsq.ptr;
    fn::launch_hc_down(d, s);
    fn::HcMixParams x;
    x.w_up = w_hc_up.ptr;
    x.t = t.ptr;
    x.sumsq = sumsq.ptr;
    x.t_splits = fn::hc_down_splits(kS, kD);
    x.t_stride = kHcRows;
    x.H = H.ptr;
    x.norm = norm_w.ptr;
    x.m = m.ptr;
    x.m_bf16 = bf16 ? m_bf16.ptr : nullptr;
    x.iota = iota.ptr;
    x.hidden = kD;
    x.rank = kR;
    fn::launch_hc_mix(x, s);
  }

  void inject(const DeviceArray<float>& from, cudaStream_t s) {
    const fn::HcInjectParams hi{H.ptr, iota.ptr, from.ptr, static_cast<int>(kS), kD};
    fn::launch_hc_inject(hi, s);
  }

  // One decode-like step: 18 kernels, each reading the output of an earlier one.
  void step(cudaStream_t s) {
    using fn::DType;
    hc_read(false, s);
    gemv(w_proj, kProjRows, kD, m.ptr, DType::F32, proj.ptr, s);
    fn::GdnDecodeParams gp;
    gp.proj = proj.ptr;
    gp.conv_weight = conv_w.ptr;
    gp.A_log = a_log.ptr;
    gp.dt_bias = dt_bias.ptr;
    gp.norm_weight = gdn_norm.ptr;
    gp.conv_state = conv_state.ptr;
    gp.state = state.ptr;
    gp.out = gout.ptr;
    gp.num_k_heads = kHk;
    gp.num_v_heads = kHv;
    gp.k_head_dim = kDk;
    gp.v_head_dim = kDv;
    gp.conv_kernel = kConvK;
    gp.o_scratch = o_scratch.ptr;
    gp.head_counters = counters.ptr;
    fn::launch_gdn_decode(gp, s);
    gemv(w_o, kD, kHv * kDv, gout.ptr, DType::BF16, ya.ptr, s);
    inject(ya, s);
    hc_read(true, s);
    fn::RouterSharedGateUpParams rs;
    rs.x = m.ptr;
    rs.hidden = kD;
    rs.router_weight = w_r.ptr;
    rs.gate_up_weight = w_sgu.ptr;
    rs.inter = kIs;
    rs.num_experts = static_cast<int>(kE);
    rs.top_k = kK;
    rs.logits = rl.ptr;
    rs.gate_up = sgu.ptr;
    rs.ids = ids.ptr;
    rs.weights = rw.ptr;
    rs.error_flag = flag.ptr;
    rs.mailbox = mailbox.ptr;
    fn::launch_router_shared_gate_up(rs, s);
    fn::MoeGateUpParams gu;
    gu.experts = {gu_packed.ptr, gu_scales.ptr, gu_gs.ptr, static_cast<int>(kE), 2 * kI, kD};
    gu.expert_ids = ids.ptr;
    gu.top_k = kK;
    gu.x = m_bf16.ptr;
    gu.h = h.ptr;
    fn::launch_moe_gate_up_nvfp4(gu, s);
    fn::MoeDownParams dn;
    dn.experts = {dn_packed.ptr, dn_scales.ptr, dn_gs.ptr, static_cast<int>(kE), kD, kI};
    dn.expert_ids = ids.ptr;
    dn.routing_weights = rw.ptr;
    dn.top_k = kK;
    dn.h = h.ptr;
    dn.y = y.ptr;
    fn::launch_moe_down_nvfp4(dn, s);
    fn::SharedDownCombineParams sd;
    sd.weight = w_sd.ptr;
    sd.hidden = kD;
    sd.inter = kIs;
    sd.gate_up = sgu.ptr;
    sd.gate_logit = rl.ptr + kE;
    sd.y = y.ptr;
    fn::launch_shared_down_combine(sd, s);
    inject(y, s);
  }

  struct Result {
    std::vector<float> H, state, conv_state;
    std::vector<int32_t> ids;
    int32_t flag;
    bool operator==(const Result& o) const {
      auto same = [](const auto& a, const auto& b) {
        return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
      };
      return same(H, o.H) && same(state, o.state) && same(conv_state, o.conv_state) &&
             ids == o.ids && flag == o.flag;
    }
  };
  Result result() const {
    return {H.download(), state.download(), conv_state.download(), ids.download(),
            flag.download()[0]};
  }
};

constexpr int kSteps = 8;

// kSteps steps enqueued back to back on a fresh stream (no host sync in between).
Chain::Result run_eager(Chain& c, bool pdl) {
  fn::set_pdl_enabled(pdl);
  c.reset();
  cudaStream_t s;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int i = 0; i < kSteps; ++i) c.step(s);
  FN_CUDA_CHECK(cudaStreamSynchronize(s));
  FN_CUDA_CHECK(cudaStreamDestroy(s));
  return c.result();
}

// The kSteps steps captured into one graph (with PDL as given at capture), replayed `replays`
// times from the initial state; returns the last replay's result and the mean µs per step.
Chain::Result run_graph(Chain& c, bool pdl, int replays, double* us_per_step) {
  fn::set_pdl_enabled(pdl);
  cudaStream_t s;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  FN_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < kSteps; ++i) c.step(s);
  FN_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  FN_CUDA_CHECK(cudaEventCreate(&a));
  FN_CUDA_CHECK(cudaEventCreate(&b));
  double ms_total = 0;
  for (int r = 0; r < replays; ++r) {
    c.reset();
    FN_CUDA_CHECK(cudaEventRecord(a, s));
    FN_CUDA_CHECK(cudaGraphLaunch(exec, s));
    FN_CUDA_CHECK(cudaEventRecord(b, s));
    FN_CUDA_CHECK(cudaStreamSynchronize(s));
    float ms = 0;
    FN_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (r > 0) ms_total += ms;  // the first replay warms up
  }
  if (us_per_step != nullptr) *us_per_step = 1000.0 * ms_total / ((replays - 1) * kSteps);
  Chain::Result out = c.result();
  FN_CUDA_CHECK(cudaEventDestroy(a));
  FN_CUDA_CHECK(cudaEventDestroy(b));
  FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
  FN_CUDA_CHECK(cudaGraphDestroy(graph));
  FN_CUDA_CHECK(cudaStreamDestroy(s));
  return out;
}

}  // namespace

TEST_CASE("cuda pdl: the switch follows set_pdl_enabled") {
  const bool before = fn::pdl_enabled();
  const char* env = std::getenv("FN_PDL");
  // Default on unless the environment turned it off before the first use.
  CHECK(before == !(env != nullptr && std::string(env) == "0"));
  fn::set_pdl_enabled(false);
  CHECK_FALSE(fn::pdl_enabled());
  fn::set_pdl_enabled(true);
  CHECK(fn::pdl_enabled());
  fn::set_pdl_enabled(before);
}

TEST_CASE(
    "cuda pdl: a chain of decode kernels gives the same bits with PDL on and off, eager and in "
    "a graph") {
  const bool before = fn::pdl_enabled();
  Chain c;
  const Chain::Result ref = run_eager(c, false);
  // Not a trivial chain: H moved away from its start, the state filled, ids in range, no flag.
  const std::vector<float> h0 = c.H0.download();
  CHECK(std::memcmp(ref.H.data(), h0.data(), h0.size() * 4) != 0);
  int64_t finite = 0, nonzero = 0;
  for (float v : ref.H) finite += std::isfinite(v) ? 1 : 0;
  for (float v : ref.state) nonzero += v != 0.0f ? 1 : 0;
  CHECK(finite == kW);
  CHECK(nonzero > static_cast<int64_t>(ref.state.size()) / 2);
  for (int32_t e : ref.ids) CHECK((e >= 0 && e < kE));
  CHECK(ref.flag == 0);

  for (int rep = 0; rep < 3; ++rep) CHECK_MESSAGE(run_eager(c, true) == ref, "eager, PDL on");
  double us_off = 0, us_on = 0;
  CHECK_MESSAGE(run_graph(c, false, 6, &us_off) == ref, "graph, PDL off");
  CHECK_MESSAGE(run_graph(c, true, 6, &us_on) == ref, "graph, PDL on");
  MESSAGE("chain step (18 kernels) in a graph: PDL off ", us_off, " us, PDL on ", us_on, " us");
  fn::set_pdl_enabled(before);
}
