// GPU tests of the fused MoE shared-expert launches (cuda/kernels/moe_shared.h) against the
// separate launches of the same device code (launch_gemv_bf16 x 2 + launch_router_topk;
// launch_swiglu_rows + launch_gemv_bf16 + launch_moe_combine_rows for one row): bitwise equal
// (memcmp), eager and
// replayed in a CUDA graph (every launch leaves the router mailbox empty), on the real shapes
// (D 2560, E 512, k 10, shared I 640 and 320 at TP=2) and the tiny fixture's (D 64, E 8, k 3,
// I 32); plus the GEMV rows against an FP64 evaluation of docs/model.md §C.7 with Higham's bound.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/codecs.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda/kernels/decode_ops.h"
#include "cuda/kernels/gemv_bf16.h"
#include "cuda/kernels/moe_shared.h"
#include "cuda/kernels/prefill_ops.h"
#include "tests/cuda_test_util.h"

namespace {

using fn::test::DeviceArray;
using fn::test::normal_floats;
using fn::test::random_bf16_bits;

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Index of the first element whose bits differ (-1: none), for the failure message.
template <typename T>
int64_t first_diff(const std::vector<T>& a, const std::vector<T>& b) {
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<int64_t>(i);
  return a.size() == b.size() ? -1 : static_cast<int64_t>(std::min(a.size(), b.size()));
}

// rows x cols BF16 W times FP32 x in FP64 (docs/model.md §C.7 linears), and Higham's bound for an
// FP32 dot of cols terms in any order: gamma_cols * sum |w x|.
void fp64_gemv(const std::vector<uint16_t>& w, const std::vector<float>& x, int64_t rows,
               int64_t cols, std::vector<double>& want, std::vector<double>& bound) {
  want.assign(rows, 0.0);
  bound.assign(rows, 0.0);
  const double g = fn::test::gamma_fp32(static_cast<int>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0, a = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const double t = static_cast<double>(fn::bf16_to_float(w[r * cols + c])) * x[c];
      s += t;
      a += std::fabs(t);
    }
    want[r] = s;
    bound[r] = g * a;
  }
}

struct RouterShape {
  int E, k;
  int64_t D, I;
  bool norm;
};

std::string describe(const RouterShape& s) {
  return "E " + std::to_string(s.E) + ", k " + std::to_string(s.k) + ", D " + std::to_string(s.D) +
         ", I " + std::to_string(s.I) + (s.norm ? ", norm" : ", no norm");
}

// Outputs of one router + shared gate/up evaluation.
struct RouterOut {
  std::vector<float> logits, gate_up, weights;
  std::vector<int32_t> ids;
  int32_t flag = 0;
};

void check_router_equal(const RouterOut& got, const RouterOut& want) {
  CHECK_MESSAGE(same_bits(got.logits, want.logits),
                "logits differ first at " << first_diff(got.logits, want.logits));
  CHECK_MESSAGE(same_bits(got.gate_up, want.gate_up),
                "gate_up differs first at " << first_diff(got.gate_up, want.gate_up));
  CHECK_MESSAGE(same_bits(got.ids, want.ids),
                "ids differ first at " << first_diff(got.ids, want.ids));
  CHECK_MESSAGE(same_bits(got.weights, want.weights),
                "weights differ first at " << first_diff(got.weights, want.weights));
  CHECK(got.flag == want.flag);
}

// Device buffers of one router shape; `fused` and `ref` outputs are separate.
struct RouterRig {
  RouterShape s;
  DeviceArray<uint16_t> w_router, w_gate_up;
  DeviceArray<float> x;
  DeviceArray<float> logits, gate_up, weights, ref_logits, ref_gate_up, ref_weights;
  DeviceArray<int32_t> ids, ref_ids, flag, ref_flag;
  DeviceArray<float> mailbox;
  std::vector<uint16_t> h_router, h_gate_up;

  RouterRig(const RouterShape& shape, uint64_t seed)
      : s(shape),
        w_router(static_cast<size_t>(shape.E + 1) * shape.D),
        w_gate_up(static_cast<size_t>(2 * shape.I * shape.D)),
        x(static_cast<size_t>(shape.D)),
        logits(shape.E + 1),
        gate_up(static_cast<size_t>(2 * shape.I)),
        weights(shape.k),
        ref_logits(shape.E + 1),
        ref_gate_up(static_cast<size_t>(2 * shape.I)),
        ref_weights(shape.k),
        ids(shape.k),
        ref_ids(shape.k),
        flag(1),
        ref_flag(1),
        mailbox(static_cast<size_t>(shape.E)) {
    // Logits of standard deviation ~1 (0.02 * sqrt(2560)): a spread-out softmax.
    const float sigma = 1.0f / std::sqrt(static_cast<float>(shape.D));
    h_router = random_bf16_bits(w_router.n, sigma, seed);
    h_gate_up = random_bf16_bits(w_gate_up.n, sigma, seed + 1);
    w_router.upload(h_router);
    w_gate_up.upload(h_gate_up);
    fn::router_mailbox_init(mailbox.ptr, shape.E, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // Whether every mailbox slot is empty again (all bits set), as each launch must leave it.
  bool mailbox_empty() {
    for (float v : mailbox.download()) {
      uint32_t b;
      std::memcpy(&b, &v, sizeof b);
      if (b != 0xffffffffu) return false;
    }
    return true;
  }

  fn::RouterSharedGateUpParams params() {
    fn::RouterSharedGateUpParams p;
    p.x = x.ptr;
    p.hidden = s.D;
    p.router_weight = w_router.ptr;
    p.gate_up_weight = w_gate_up.ptr;
    p.inter = s.I;
    p.num_experts = s.E;
    p.top_k = s.k;
    p.norm_topk_prob = s.norm;
    p.logits = logits.ptr;
    p.gate_up = gate_up.ptr;
    p.ids = ids.ptr;
    p.weights = weights.ptr;
    p.error_flag = flag.ptr;
    p.mailbox = mailbox.ptr;
    return p;
  }

  // The unfused sequence of the decode step on the current x.
  RouterOut reference(cudaStream_t st) {
    ref_flag.upload({0});
    fn::launch_gemv_bf16(w_router.ptr, s.E + 1, s.D, x.ptr, fn::DType::F32, ref_logits.ptr,
                         fn::DType::F32, st);
    fn::RouterParams rp;
    rp.logits = ref_logits.ptr;
    rp.num_experts = s.E;
    rp.top_k = s.k;
    rp.norm_topk_prob = s.norm;
    rp.ids = ref_ids.ptr;
    rp.weights = ref_weights.ptr;
    rp.error_flag = ref_flag.ptr;
    fn::launch_router_topk(rp, st);
    fn::launch_gemv_bf16(w_gate_up.ptr, 2 * s.I, s.D, x.ptr, fn::DType::F32, ref_gate_up.ptr,
                         fn::DType::F32, st);
    FN_CUDA_CHECK(cudaStreamSynchronize(st));
    return {ref_logits.download(), ref_gate_up.download(), ref_weights.download(),
            ref_ids.download(), ref_flag.download().at(0)};
  }

  // Sentinels in the fused outputs, so that a launch that skips a part cannot pass.
  void poison() {
    FN_CUDA_CHECK(cudaMemset(logits.ptr, 0xff, logits.n * sizeof(float)));
    FN_CUDA_CHECK(cudaMemset(gate_up.ptr, 0xff, gate_up.n * sizeof(float)));
    FN_CUDA_CHECK(cudaMemset(ids.ptr, 0xff, ids.n * sizeof(int32_t)));
    FN_CUDA_CHECK(cudaMemset(weights.ptr, 0xff, weights.n * sizeof(float)));
    flag.upload({0});
  }

  RouterOut fused_out() {
    return {logits.download(), gate_up.download(), weights.download(), ids.download(),
            flag.download().at(0)};
  }
};

const RouterShape kRouterShapes[] = {{512, 10, 2560, 640, true},
                                     {512, 10, 2560, 320, true},
                                     {8, 3, 64, 32, true},
                                     {8, 3, 64, 32, false}};

}  // namespace

TEST_CASE("cuda moe shared: router + shared gate/up + top-k equal the unfused launches bitwise") {
  cudaStream_t st;
  FN_CUDA_CHECK(cudaStreamCreate(&st));
  uint64_t seed = 100;
  for (const RouterShape& s : kRouterShapes) {
    CAPTURE(describe(s));
    RouterRig rig(s, seed);
    const auto x = normal_floats(static_cast<size_t>(s.D), 1.0f, seed + 2);
    seed += 10;
    rig.x.upload(x);
    const RouterOut want = rig.reference(st);
    rig.poison();
    fn::launch_router_shared_gate_up(rig.params(), st);
    FN_CUDA_CHECK(cudaStreamSynchronize(st));
    const RouterOut got = rig.fused_out();
    check_router_equal(got, want);
    CHECK(want.flag == 0);
    CHECK(rig.mailbox_empty());

    // Independent check of the GEMV rows: FP64 docs/model.md §C.7 and Higham's bound.
    std::vector<double> w64, b64;
    fp64_gemv(rig.h_router, x, s.E + 1, s.D, w64, b64);
    const auto c1 = fn::test::compare_bounded(got.logits, w64, b64);
    CHECK_MESSAGE(c1.wrong == 0, "logits vs FP64: " << c1.describe());
    fp64_gemv(rig.h_gate_up, x, 2 * s.I, s.D, w64, b64);
    const auto c2 = fn::test::compare_bounded(got.gate_up, w64, b64);
    CHECK_MESSAGE(c2.wrong == 0, "gate_up vs FP64: " << c2.describe());
    // The ids are distinct and in range.
    for (int i = 0; i < s.k; ++i) {
      CHECK(got.ids[i] >= 0);
      CHECK(got.ids[i] < s.E);
      for (int j = 0; j < i; ++j) CHECK(got.ids[i] != got.ids[j]);
    }
  }
  FN_CUDA_CHECK(cudaStreamDestroy(st));
}

TEST_CASE("cuda moe shared: the fused router replayed in a CUDA graph recomputes every replay") {
  cudaStream_t st;
  FN_CUDA_CHECK(cudaStreamCreate(&st));
  uint64_t seed = 300;
  for (const RouterShape& s : kRouterShapes) {
    CAPTURE(describe(s));
    RouterRig rig(s, seed);
    // Two launches per graph (two layers sharing one mailbox), then replays on new inputs.
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    FN_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    fn::launch_router_shared_gate_up(rig.params(), st);
    fn::launch_router_shared_gate_up(rig.params(), st);
    FN_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
    FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<std::vector<int32_t>> ids_seen;
    for (int replay = 0; replay < 4; ++replay) {
      CAPTURE(replay);
      const auto x = normal_floats(static_cast<size_t>(s.D), 1.0f, seed + 2 + replay);
      rig.x.upload(x);
      const RouterOut want = rig.reference(st);
      rig.poison();
      FN_CUDA_CHECK(cudaGraphLaunch(exec, st));
      FN_CUDA_CHECK(cudaStreamSynchronize(st));
      check_router_equal(rig.fused_out(), want);
      CHECK(rig.mailbox_empty());
      ids_seen.push_back(want.ids);
    }
    if (s.E == 512) {  // new inputs choose new experts, so a stale top-k could not pass
      bool changed = false;
      for (size_t i = 1; i < ids_seen.size(); ++i) changed = changed || ids_seen[i] != ids_seen[0];
      CHECK(changed);
    }
    FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
    FN_CUDA_CHECK(cudaGraphDestroy(graph));
    seed += 10;
  }
  FN_CUDA_CHECK(cudaStreamDestroy(st));
}

TEST_CASE("cuda moe shared: a NaN router logit sets the flag 4 as the unfused top-k does") {
  cudaStream_t st;
  FN_CUDA_CHECK(cudaStreamCreate(&st));
  for (const RouterShape& s : {kRouterShapes[0], kRouterShapes[2]}) {
    CAPTURE(describe(s));
    RouterRig rig(s, 500);
    // A NaN weight in router row 1 makes logit 1 NaN, hence every probability (the sum is NaN).
    rig.h_router[static_cast<size_t>(1 * s.D + 3)] = 0x7fc0;
    rig.w_router.upload(rig.h_router);
    rig.x.upload(normal_floats(static_cast<size_t>(s.D), 1.0f, 501));
    const RouterOut want = rig.reference(st);
    CHECK(std::isnan(want.logits[1]));
    CHECK(want.flag == 4);
    rig.poison();
    fn::launch_router_shared_gate_up(rig.params(), st);
    FN_CUDA_CHECK(cudaStreamSynchronize(st));
    const RouterOut got = rig.fused_out();
    check_router_equal(got, want);
    CHECK(got.flag == 4);
    for (int i = 0; i < s.k; ++i) {
      CHECK(got.ids[i] >= 0);
      CHECK(got.ids[i] < s.E);
    }
    CHECK(rig.mailbox_empty());
    // A NaN x: every logit and every gate/up row NaN; still the unfused bits.
    auto x = normal_floats(static_cast<size_t>(s.D), 1.0f, 502);
    x[5] = std::numeric_limits<float>::quiet_NaN();
    rig.x.upload(x);
    const RouterOut want2 = rig.reference(st);
    rig.poison();
    fn::launch_router_shared_gate_up(rig.params(), st);
    FN_CUDA_CHECK(cudaStreamSynchronize(st));
    check_router_equal(rig.fused_out(), want2);
    CHECK(want2.flag == 4);
  }
  FN_CUDA_CHECK(cudaStreamDestroy(st));
}

namespace {

struct DownShape {
  int64_t D, I;
};

// y after launch_swiglu_rows + launch_gemv_bf16 + launch_moe_combine_rows (one row), and after the
// fused launch
// (eager, then `replays` replays of a captured graph, y reset to y0 before each).
void check_down_combine(const DownShape& s, float gate, uint64_t seed, cudaStream_t st) {
  const auto w = random_bf16_bits(static_cast<size_t>(s.D * s.I),
                                  1.0f / std::sqrt(static_cast<float>(s.I)), seed);
  const auto sgu = normal_floats(static_cast<size_t>(2 * s.I), 1.5f, seed + 1);
  const auto y0 = normal_floats(static_cast<size_t>(s.D), 1.0f, seed + 2);
  std::vector<float> logit_row(4, 0.0f);
  logit_row[2] = gate;  // the gate logit at an offset, as logits + E
  DeviceArray<uint16_t> d_w(w), d_sh(static_cast<size_t>(s.I));
  DeviceArray<float> d_sgu(sgu), d_y(y0), d_yref(y0), d_ys(static_cast<size_t>(s.D)),
      d_logits(logit_row);

  fn::launch_swiglu_rows(d_sgu.ptr, s.I, 1, d_sh.ptr, st);
  fn::launch_gemv_bf16(d_w.ptr, s.D, s.I, d_sh.ptr, fn::DType::BF16, d_ys.ptr, fn::DType::F32, st);
  fn::launch_moe_combine_rows(d_yref.ptr, d_ys.ptr, d_logits.ptr + 2, 1, s.D, 1, st);

  fn::SharedDownCombineParams p;
  p.weight = d_w.ptr;
  p.hidden = s.D;
  p.inter = s.I;
  p.gate_up = d_sgu.ptr;
  p.gate_logit = d_logits.ptr + 2;
  p.y = d_y.ptr;
  fn::launch_shared_down_combine(p, st);
  FN_CUDA_CHECK(cudaStreamSynchronize(st));
  const auto want = d_yref.download();
  const auto got = d_y.download();
  CHECK_MESSAGE(same_bits(got, want), "y differs first at " << first_diff(got, want));
  CHECK(!same_bits(want, y0));  // the shared expert changed y

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  FN_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  fn::launch_shared_down_combine(p, st);
  FN_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
  FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    d_y.upload(y0);
    FN_CUDA_CHECK(cudaGraphLaunch(exec, st));
    FN_CUDA_CHECK(cudaStreamSynchronize(st));
    const auto again = d_y.download();
    CHECK_MESSAGE(same_bits(again, want),
                  "replay " << replay << " differs first at " << first_diff(again, want));
  }
  FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
  FN_CUDA_CHECK(cudaGraphDestroy(graph));
}

}  // namespace

TEST_CASE("cuda moe shared: SwiGLU + shared down + gated combine equal the separate launches") {
  cudaStream_t st;
  FN_CUDA_CHECK(cudaStreamCreate(&st));
  uint64_t seed = 700;
  for (const DownShape& s : {DownShape{2560, 640}, DownShape{2560, 320}, DownShape{64, 32}}) {
    for (float gate : {0.7f, -1.3f}) {  // both branches of the sigmoid
      CAPTURE(s.D);
      CAPTURE(s.I);
      CAPTURE(gate);
      check_down_combine(s, gate, seed, st);
      seed += 10;
    }
  }
  FN_CUDA_CHECK(cudaStreamDestroy(st));
}

TEST_CASE("cuda moe shared: launchers reject null pointers and sizes out of range") {
  DeviceArray<float> buf(4096);
  DeviceArray<uint16_t> w(4096);
  DeviceArray<int32_t> ids(16);
  DeviceArray<float> mailbox(8);
  fn::RouterSharedGateUpParams p;
  p.x = buf.ptr;
  p.hidden = 64;
  p.router_weight = w.ptr;
  p.gate_up_weight = w.ptr;
  p.inter = 8;
  p.num_experts = 8;
  p.top_k = 3;
  p.logits = buf.ptr + 1024;
  p.gate_up = buf.ptr + 2048;
  p.ids = ids.ptr;
  p.weights = buf.ptr + 3072;
  p.mailbox = mailbox.ptr;
  auto bad = p;
  bad.mailbox = nullptr;
  CHECK_THROWS_AS(fn::launch_router_shared_gate_up(bad, nullptr), fn::Error);
  bad = p;
  bad.num_experts = 1025;
  CHECK_THROWS_AS(fn::launch_router_shared_gate_up(bad, nullptr), fn::Error);
  bad = p;
  bad.top_k = 9;
  CHECK_THROWS_AS(fn::launch_router_shared_gate_up(bad, nullptr), fn::Error);
  bad = p;
  bad.hidden = 60;
  CHECK_THROWS_AS(fn::launch_router_shared_gate_up(bad, nullptr), fn::Error);
  bad = p;
  bad.x = buf.ptr + 1;  // not 16-byte aligned
  CHECK_THROWS_AS(fn::launch_router_shared_gate_up(bad, nullptr), fn::Error);

  fn::SharedDownCombineParams d;
  d.weight = w.ptr;
  d.hidden = 64;
  d.inter = 32;
  d.gate_up = buf.ptr;
  d.gate_logit = buf.ptr + 100;
  d.y = buf.ptr + 200;
  auto badd = d;
  badd.y = nullptr;
  CHECK_THROWS_AS(fn::launch_shared_down_combine(badd, nullptr), fn::Error);
  badd = d;
  badd.inter = 12;
  CHECK_THROWS_AS(fn::launch_shared_down_combine(badd, nullptr), fn::Error);
  badd = d;
  badd.inter = 8200;
  CHECK_THROWS_AS(fn::launch_shared_down_combine(badd, nullptr), fn::Error);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
}
