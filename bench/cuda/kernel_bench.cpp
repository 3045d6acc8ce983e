// cuda_kernel_bench: microbenchmark of the decode kernels in cuda/kernels on the real shapes.
// For each kernel and shape: µs per call (CUDA graph of back-to-back calls, weights rotated over
// enough copies that L2 never serves a repeat), bytes per call, achieved GB/s, and the floor
// bytes / copy bandwidth, with the device-to-device copy bandwidth measured in the same run.
// The HC read rows time the kernels with PDL on and off. The MoE shared-expert rows time the fused
// launches of cuda/kernels/moe_shared.h. Usage: cuda_kernel_bench
// [--json FILE] [--sweep] [--reps N] [--hc-only] [--moe-shared-only] [--nvfp4-only]
// [--rows-only]. The batched step's rows (--rows-only alone) time its dense GEMMs (gemm_rows in
// the stacked hi + lo form, as cuda/model/cuda_prefill.cpp calls them) on the real shapes at 1 to
// 64 rows, and the row kernels of its HC read and router. The NVFP4
// routed-expert rows time the FP32 kernels (planned team; every team width with --sweep) and, on
// sm_90+, the bulk-copy gate+up at the TP=1/2/4 shapes. Table on stdout; not a test.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cuda/common/cuda_check.h"
#include "cuda/common/pdl.h"
#include "cuda/kernels/decode_ops.h"
#include "cuda/kernels/gemm.h"
#include "cuda/kernels/gemv_bf16.h"
#include "cuda/kernels/hc.h"
#include "cuda/kernels/moe_nvfp4.h"
#include "cuda/kernels/moe_nvfp4_bulk.h"
#include "cuda/kernels/moe_shared.h"
#include "cuda/kernels/prefill_ops.h"

namespace {

constexpr double kAnchorBandwidth = 4.3e12;       // measured D2D copy, docs/performance.md
constexpr size_t kRotateBytes = size_t(1) << 30;  // >= 20x the 50 MB L2

struct Timer {
  cudaStream_t stream;
  int reps;
  // Captures `calls` invocations of launch(i) into one graph; returns the median µs per call.
  template <typename F>
  double time_per_call(int calls, F&& launch) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < calls; ++i) launch(i);
    FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t a, b;
    FN_CUDA_CHECK(cudaEventCreate(&a));
    FN_CUDA_CHECK(cudaEventCreate(&b));
    FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));  // warm-up
    std::vector<double> us;
    for (int r = 0; r < reps; ++r) {
      FN_CUDA_CHECK(cudaEventRecord(a, stream));
      FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      FN_CUDA_CHECK(cudaEventRecord(b, stream));
      FN_CUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      FN_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      us.push_back(1000.0 * ms / calls);
    }
    FN_CUDA_CHECK(cudaEventDestroy(a));
    FN_CUDA_CHECK(cudaEventDestroy(b));
    FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
    FN_CUDA_CHECK(cudaGraphDestroy(graph));
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  }
};

void fill_random(void* dev, size_t bytes, uint64_t seed) {
  // BF16 values in a harmless range (exponent bits limited) for any bytes: random mantissas,
  // sign and a small exponent so no NaN/Inf appears whatever the element type.
  std::vector<uint16_t> host(std::min<size_t>(bytes, size_t(64) << 20) / 2);
  std::mt19937_64 rng(seed);
  for (auto& v : host) v = uint16_t((rng() & 0x807f) | 0x3c00);
  for (size_t off = 0; off < bytes; off += host.size() * 2) {
    const size_t n = std::min(bytes - off, host.size() * 2);
    FN_CUDA_CHECK(
        cudaMemcpy(static_cast<char*>(dev) + off, host.data(), n, cudaMemcpyHostToDevice));
  }
}

struct Row {
  std::string kernel, shape, plan;
  double bytes, us, copy_bw;
};

nlohmann::json report(const Row& r) {
  const double gbs = r.bytes / (r.us * 1e-6) / 1e9;
  const double floor_copy = r.bytes / r.copy_bw * 1e6,
               floor_anchor = r.bytes / kAnchorBandwidth * 1e6;
  std::printf(
      "%-22s %-18s %-10s %10.3f MB %9.2f us %8.1f GB/s %6.1f%% | floor %7.2f us (copy), %7.2f us "
      "(4.3 TB/s)\n",
      r.kernel.c_str(), r.shape.c_str(), r.plan.c_str(), r.bytes / 1e6, r.us, gbs,
      100.0 * gbs * 1e9 / r.copy_bw, floor_copy, floor_anchor);
  std::fflush(stdout);
  return {{"kernel", r.kernel},
          {"shape", r.shape},
          {"plan", r.plan},
          {"bytes_per_call", r.bytes},
          {"us", r.us},
          {"GBps", gbs},
          {"fraction_of_copy_bw", gbs * 1e9 / r.copy_bw},
          {"floor_us_copy_bw", floor_copy},
          {"floor_us_4p3TBps", floor_anchor}};
}

// Device-to-device copy bandwidth (read + write bytes / time) of cudaMemcpyAsync on the stream,
// timed with events outside any graph: the first run captured the copies as graph memcpy nodes and
// got 2.72 TB/s, below the 4.6 TB/s the lm_head GEMV reads, so the graph path is not the ceiling.
// Both are reported; docs/performance.md's 4.3 TB/s stays the reference in the table.
double copy_bandwidth(Timer& t, double* graph_bw) {
  const size_t bytes = size_t(1) << 30;
  void *a, *b;
  FN_CUDA_CHECK(cudaMalloc(&a, bytes));
  FN_CUDA_CHECK(cudaMalloc(&b, bytes));
  FN_CUDA_CHECK(cudaMemset(a, 1, bytes));
  auto copy = [&](int i) {
    FN_CUDA_CHECK(
        cudaMemcpyAsync(i % 2 ? a : b, i % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice, t.stream));
  };
  *graph_bw = 2.0 * bytes / (t.time_per_call(10, copy) * 1e-6);
  cudaEvent_t e0, e1;
  FN_CUDA_CHECK(cudaEventCreate(&e0));
  FN_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> us;
  for (int r = 0; r < t.reps; ++r) {
    FN_CUDA_CHECK(cudaEventRecord(e0, t.stream));
    for (int i = 0; i < 10; ++i) copy(i);
    FN_CUDA_CHECK(cudaEventRecord(e1, t.stream));
    FN_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    FN_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(100.0 * ms);  // 1000 * ms / 10 copies
  }
  std::sort(us.begin(), us.end());
  FN_CUDA_CHECK(cudaEventDestroy(e0));
  FN_CUDA_CHECK(cudaEventDestroy(e1));
  FN_CUDA_CHECK(cudaFree(a));
  FN_CUDA_CHECK(cudaFree(b));
  return 2.0 * bytes / (us[us.size() / 2] * 1e-6);
}

struct GemvShape {
  const char* name;
  int64_t rows, cols;
};

// The plan column of a row count: "m8".
std::string rows_label(int64_t m) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "m%lld", static_cast<long long>(m));
  return buf;
}

// gemm_rows' stacked form over m rows of x (hi rows, then lo rows right below) into y [m, n].
fn::GemmRowsParams stacked_gemm(const uint16_t* w, int64_t n, int64_t k, const uint16_t* x,
                                int64_t m, float* y, float* stack, int64_t stack_floats) {
  fn::GemmRowsParams g;
  g.w = w;
  g.n = n;
  g.k = k;
  g.x_hi = x;
  g.x_lo = x + m * k;
  g.ldx = k;
  g.m = m;
  g.y = y;
  g.ldy = n;
  g.stack = stack;
  g.stack_floats = stack_floats;
  return g;
}

// The batched decode step's pieces at M = 1 .. 64 rows on the real shapes (TP=1): each dense GEMM
// as gemm_rows' stacked form (one GEMM of 2M rows, then the halves' sum), the HC read's three row
// kernels, and the router's top-k rows. Bytes: the weights once plus the activations.
void rows_section(Timer& t, double bw, nlohmann::json& rows) {
  const std::vector<GemvShape> shapes = {
      {"gdn_in", 16480, 2560},        {"gdn_out", 2560, 6144},    {"qsa_in", 13952, 2560},
      {"hc_down_inj", 324, 10240},    {"hc_up", 10240, 320},      {"router", 513, 2560},
      {"shared_gate_up", 1280, 2560}, {"shared_down", 2560, 640}, {"lm_head", 248320, 2560}};
  const int64_t max_m = 64;
  fn::CublasHandle blas(t.stream);
  void *xb, *yb, *st;
  FN_CUDA_CHECK(cudaMalloc(&xb, size_t(2 * max_m) * 10240 * 2));
  FN_CUDA_CHECK(cudaMalloc(&yb, size_t(max_m) * 248320 * 4));
  const int64_t stack_floats = 2 * max_m * 248320;
  FN_CUDA_CHECK(cudaMalloc(&st, size_t(stack_floats) * 4));
  fill_random(xb, size_t(2 * max_m) * 10240 * 2, 41);
  for (const GemvShape& s : shapes) {
    const size_t wbytes = size_t(s.rows) * s.cols * 2;
    const int copies = int(std::max<size_t>(1, (kRotateBytes + wbytes - 1) / wbytes));
    uint16_t* w;
    FN_CUDA_CHECK(cudaMalloc(&w, wbytes * copies));
    fill_random(w, wbytes * copies, 43);
    const int calls = std::max(copies, 20);
    for (int64_t m : {1, 2, 4, 8, 16, 32, 64}) {
      fn::GemmRowsParams g =
          stacked_gemm(nullptr, s.rows, s.cols, static_cast<const uint16_t*>(xb), m,
                       static_cast<float*>(yb), static_cast<float*>(st), stack_floats);
      const double us = t.time_per_call(calls, [&](int i) {
        g.w = w + size_t(i % copies) * s.rows * s.cols;
        fn::gemm_rows(blas.get(), g);
      });
      const double bytes = double(wbytes) + double(m) * s.cols * 4 + double(m) * s.rows * 4;
      char shape[64];
      std::snprintf(shape, sizeof shape, "%s %lldx%lld", s.name, static_cast<long long>(s.rows),
                    static_cast<long long>(s.cols));
      rows.push_back(report({"gemm_rows stacked", shape, rows_label(m), bytes, us, bw}));
    }
    FN_CUDA_CHECK(cudaFree(w));
  }
  // The HC read at T rows both ways: the GEMM path (norm rows, down/inject GEMM, act rows, up
  // GEMM, mix rows) and the decode step's two kernels with the rows as tokens, for several
  // tokens per block (0: all in one block, the z copies of the grid otherwise).
  {
    const int64_t D = 2560, W = 4 * D, R = 320, NR = R + 4;
    const int64_t splits = fn::hc_down_splits(4, D);
    const size_t set = size_t(NR * W + W * R) * 2;
    const int copies = int((kRotateBytes + set - 1) / set);
    uint16_t *w, *nw, *nh, *uh, *mh;
    float *H, *scale, *tv, *g, *iota, *tp, *ss;
    FN_CUDA_CHECK(cudaMalloc(&w, set * copies));
    FN_CUDA_CHECK(cudaMalloc(&nw, W * 2));
    FN_CUDA_CHECK(cudaMalloc(&nh, 2 * max_m * W * 2));
    FN_CUDA_CHECK(cudaMalloc(&uh, 2 * max_m * R * 2));
    FN_CUDA_CHECK(cudaMalloc(&mh, 2 * max_m * D * 2));
    FN_CUDA_CHECK(cudaMalloc(&H, max_m * W * 4));
    FN_CUDA_CHECK(cudaMalloc(&scale, max_m * 16));
    FN_CUDA_CHECK(cudaMalloc(&tv, max_m * NR * 4));
    FN_CUDA_CHECK(cudaMalloc(&g, max_m * W * 4));
    FN_CUDA_CHECK(cudaMalloc(&iota, max_m * 16));
    FN_CUDA_CHECK(cudaMalloc(&tp, max_m * splits * NR * 4));
    FN_CUDA_CHECK(cudaMalloc(&ss, max_m * splits * 4));
    fill_random(w, set * copies, 61);
    fill_random(nw, W * 2, 62);
    fill_random(H, max_m * W * 4, 63);
    const int calls = std::max(copies, 20);
    auto dn_w = [&](int i) { return w + size_t(i % copies) * (set / 2); };
    auto up_w = [&](int i) { return dn_w(i) + NR * W; };
    for (int64_t m : {1, 2, 4, 8, 16, 32, 64}) {
      const std::string pm = rows_label(m);
      const double bytes = double(set) + double(m) * W * 4 * 2;
      const double gemm_us = t.time_per_call(calls, [&](int i) {
        fn::launch_hc_norm_rows(H, nw, 4, D, 1e-6f, m, scale, nh, nh + m * W, t.stream);
        float* stack = static_cast<float*>(st);
        fn::gemm_rows(blas.get(), stacked_gemm(dn_w(i), NR, W, nh, m, tv, stack, stack_floats));
        fn::launch_hc_act_rows(tv, NR, R, 4, m, uh, uh + m * R, iota, t.stream);
        fn::gemm_rows(blas.get(), stacked_gemm(up_w(i), W, R, uh, m, g, stack, stack_floats));
        fn::launch_hc_mix_rows(g, H, scale, nw, 4, D, m, mh, mh + m * D, t.stream);
      });
      rows.push_back(report({"hc_read gemm path", "5 launches + 2 sums", pm, bytes, gemm_us, bw}));
      for (int tpb : {0, 1, 2, 4, 8}) {
        if (tpb > 0 && tpb >= m) continue;
        fn::HcDownParams dp;
        dp.H = H;
        dp.norm = nw;
        dp.rows = NR;
        dp.hc_count = 4;
        dp.hidden = D;
        dp.t_partial = tp;
        dp.sumsq = ss;
        dp.tokens = static_cast<int>(m);
        dp.tokens_per_block = tpb;
        fn::HcMixParams mp;
        mp.t = tp;
        mp.t_splits = splits;
        mp.t_stride = NR;
        mp.sumsq = ss;
        mp.H = H;
        mp.norm = nw;
        mp.m = g;
        mp.m_bf16 = mh;
        mp.m_lo = mh + m * D;
        mp.iota = iota;
        mp.hidden = D;
        mp.rank = R;
        mp.tokens = static_cast<int>(m);
        mp.tokens_per_block = tpb;
        const double us = t.time_per_call(calls, [&](int i) {
          dp.weight = dn_w(i);
          mp.w_up = up_w(i);
          fn::launch_hc_down(dp, t.stream);
          fn::launch_hc_mix(mp, t.stream);
        });
        char plan[32];
        std::snprintf(plan, sizeof plan, "%s tpb%d", pm.c_str(), tpb);
        rows.push_back(report({"hc_read kernels", "down + mix", plan, bytes, us, bw}));
      }
    }
    // The HC read's row kernels alone (no weights: activations only), on the same buffers.
    fill_random(tv, max_m * NR * 4, 53);
    fill_random(g, max_m * W * 4, 54);
    for (int64_t m : {1, 8, 16, 64}) {
      const std::string pm = rows_label(m);
      const double norm_us = t.time_per_call(50, [&](int) {
        fn::launch_hc_norm_rows(H, nw, 4, D, 1e-6f, m, scale, nh, nh + m * W, t.stream);
      });
      rows.push_back(report({"hc_norm_rows", "4x2560", pm, double(m) * W * 8, norm_us, bw}));
      const double act_us = t.time_per_call(50, [&](int) {
        fn::launch_hc_act_rows(tv, R + 4, R, 4, m, uh, uh + m * R, iota, t.stream);
      });
      rows.push_back(report({"hc_act_rows", "324", pm, double(m) * (R + 4) * 8, act_us, bw}));
      const double mix_us = t.time_per_call(50, [&](int) {
        fn::launch_hc_mix_rows(g, H, scale, nw, 4, D, m, mh, mh + m * D, t.stream);
      });
      rows.push_back(report({"hc_mix_rows", "4x2560", pm, double(m) * W * 8, mix_us, bw}));
      const double inj_us = t.time_per_call(
          50, [&](int) { fn::launch_hc_inject_rows(H, iota, g, 4, D, m, t.stream); });
      rows.push_back(report({"hc_inject_rows", "4x2560", pm, double(m) * W * 8, inj_us, bw}));
    }
    for (void* p : {(void*)w, (void*)nw, (void*)nh, (void*)uh, (void*)mh, (void*)H, (void*)scale,
                    (void*)tv, (void*)g, (void*)iota, (void*)tp, (void*)ss})
      FN_CUDA_CHECK(cudaFree(p));
  }
  // The router's top-k rows.
  float *rl, *rw;
  int32_t *ids, *flag;
  FN_CUDA_CHECK(cudaMalloc(&rl, max_m * 513 * 4));
  FN_CUDA_CHECK(cudaMalloc(&rw, max_m * 10 * 4));
  FN_CUDA_CHECK(cudaMalloc(&ids, max_m * 10 * 4));
  FN_CUDA_CHECK(cudaMalloc(&flag, 4));
  FN_CUDA_CHECK(cudaMemset(flag, 0, 4));
  fill_random(rl, max_m * 513 * 4, 55);
  for (int64_t m : {1, 8, 16, 64}) {
    fn::RouterRowsParams rr;
    rr.logits = rl;
    rr.logits_stride = 513;
    rr.rows = m;
    rr.num_experts = 512;
    rr.top_k = 10;
    rr.norm_topk_prob = true;
    rr.ids = ids;
    rr.weights = rw;
    rr.error_flag = flag;
    const double topk_us =
        t.time_per_call(50, [&](int) { fn::launch_router_topk_rows(rr, t.stream); });
    rows.push_back(report(
        {"router_topk_rows", "512 top 10", rows_label(m), double(m) * 513 * 4, topk_us, bw}));
  }
  for (void* p : {(void*)rl, (void*)rw, (void*)ids, (void*)flag, xb, yb, st})
    FN_CUDA_CHECK(cudaFree(p));
}

}  // namespace

int main(int argc, char** argv) try {
  std::string json_path;
  bool sweep = false;
  bool hc_only = false;          // --hc-only: the HC read rows only (a short GPU call)
  bool moe_shared_only = false;  // --moe-shared-only: the fused MoE shared-expert rows only
  bool nvfp4_only = false;       // --nvfp4-only: the NVFP4 routed-expert rows only
  bool rows_only = false;        // --rows-only: the batched step's GEMMs and row kernels only
  int reps = 7;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc)
      json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--sweep"))
      sweep = true;
    else if (!std::strcmp(argv[i], "--hc-only"))
      hc_only = true;
    else if (!std::strcmp(argv[i], "--moe-shared-only"))
      moe_shared_only = true;
    else if (!std::strcmp(argv[i], "--nvfp4-only"))
      nvfp4_only = true;
    else if (!std::strcmp(argv[i], "--rows-only"))
      rows_only = true;
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr,
                   "usage: cuda_kernel_bench [--json FILE] [--sweep] [--reps N] [--hc-only] "
                   "[--moe-shared-only] [--nvfp4-only] [--rows-only]\n");
      return 2;
    }
  }
  cudaDeviceProp prop{};
  FN_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  Timer t{nullptr, reps};
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&t.stream, cudaStreamNonBlocking));
  nlohmann::json out;
  out["device"] = prop.name;
  out["sm_count"] = prop.multiProcessorCount;
  double graph_bw = 0;
  const double bw = copy_bandwidth(t, &graph_bw);
  out["copy_bandwidth_Bps"] = bw;
  out["copy_bandwidth_graph_node_Bps"] = graph_bw;
  std::printf(
      "device %s, %d SMs, D2D cudaMemcpyAsync %.0f GB/s on the stream, %.0f GB/s as graph "
      "nodes (read + write)\n",
      prop.name, prop.multiProcessorCount, bw / 1e9, graph_bw / 1e9);
  nlohmann::json rows = nlohmann::json::array();
  // The rows so far as the report's results, into --json FILE when given (every exit path).
  auto write_json = [&] {
    out["results"] = rows;
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  };

  // ---- The batched step at M rows: gemm_rows (stacked hi + lo) and the row kernels -------------
  if (rows_only) {
    rows_section(t, bw, rows);
    write_json();
    return 0;
  }

  // ---- MoE shared expert: the fused launches of the decode step (cuda/kernels/moe_shared.h) ----
  for (int64_t inter :
       hc_only || nvfp4_only ? std::vector<int64_t>{} : std::vector<int64_t>{640, 320}) {
    const int64_t D = 2560;
    const int E = 512, k = 10;
    const std::string tp = "tp" + std::to_string(640 / inter);
    const size_t r_elems = size_t(E + 1) * D, gu_elems = size_t(2 * inter) * D,
                 dn_elems = size_t(D) * inter;
    const size_t set_bytes = 2 * (r_elems + gu_elems + dn_elems);
    const int copies = int((kRotateBytes + set_bytes - 1) / set_bytes);
    uint16_t* w;
    float *xm, *rl, *rw, *sgu, *yv;
    int32_t *d_ids, *flag;
    float* mailbox;
    FN_CUDA_CHECK(cudaMalloc(&w, set_bytes * copies));
    FN_CUDA_CHECK(cudaMalloc(&xm, D * 4));
    FN_CUDA_CHECK(cudaMalloc(&rl, (E + 1) * 4));
    FN_CUDA_CHECK(cudaMalloc(&rw, k * 4));
    FN_CUDA_CHECK(cudaMalloc(&sgu, 2 * inter * 4));
    FN_CUDA_CHECK(cudaMalloc(&yv, D * 4));
    FN_CUDA_CHECK(cudaMalloc(&d_ids, k * 4));
    FN_CUDA_CHECK(cudaMalloc(&flag, 4));
    FN_CUDA_CHECK(cudaMalloc(&mailbox, sizeof(float) * E));
    fn::router_mailbox_init(mailbox, static_cast<int>(E), nullptr);
    FN_CUDA_CHECK(cudaMemset(flag, 0, 4));
    fill_random(w, set_bytes * copies, 31);
    fill_random(xm, D * 4, 32);
    fill_random(yv, D * 4, 33);
    auto set = [&](int i) { return w + size_t(i % copies) * (set_bytes / 2); };
    const int calls = std::max(copies, 20);
    const double r_bytes = double(r_elems) * 2 + D * 4 + (E + 1) * 4;
    const double gu_bytes = double(gu_elems) * 2 + D * 4 + 2 * inter * 4;
    const double topk_bytes = (E + 1) * 4 + k * 8;
    fn::RouterSharedGateUpParams fp;
    fp.x = xm;
    fp.hidden = D;
    fp.inter = inter;
    fp.num_experts = E;
    fp.top_k = k;
    fp.logits = rl;
    fp.gate_up = sgu;
    fp.ids = d_ids;
    fp.weights = rw;
    fp.error_flag = flag;
    fp.mailbox = mailbox;
    const double k1_us = t.time_per_call(calls, [&](int i) {
      fp.router_weight = set(i);
      fp.gate_up_weight = set(i) + r_elems;
      fn::launch_router_shared_gate_up(fp, t.stream);
    });
    rows.push_back(report({"router_shared_gate_up", tp + " 1 launch", "512t",
                           r_bytes + gu_bytes + topk_bytes, k1_us, bw}));
    const double dn_bytes = double(dn_elems) * 2 + 2 * inter * 4 + D * 8;
    fn::SharedDownCombineParams dp;
    dp.hidden = D;
    dp.inter = inter;
    dp.gate_up = sgu;
    dp.gate_logit = rl + E;
    dp.y = yv;
    const double k2_us = t.time_per_call(calls, [&](int i) {
      dp.weight = set(i) + r_elems + gu_elems;
      fn::launch_shared_down_combine(dp, t.stream);
    });
    rows.push_back(report({"shared_down_combine", tp + " 1 launch", "256t", dn_bytes, k2_us, bw}));
    std::printf(
        "moe shared %s: router+gu+topk %.2f us, swiglu+down+combine %.2f us; %.2f us per layer\n",
        tp.c_str(), k1_us, k2_us, k1_us + k2_us);
    for (void* ptr : {(void*)w, (void*)xm, (void*)rl, (void*)rw, (void*)sgu, (void*)yv,
                      (void*)d_ids, (void*)flag, (void*)mailbox})
      FN_CUDA_CHECK(cudaFree(ptr));
  }
  if (moe_shared_only) {
    write_json();
    return 0;
  }

  // ---- BF16 GEMV ------------------------------------------------------------------------------
  const std::vector<GemvShape> shapes = {
      {"gdn_in_qkv", 10240, 2560},   {"gdn_out", 2560, 6144},       {"qsa_q", 12288, 2560},
      {"lm_head_tp2", 124160, 2560}, {"lm_head_tp1", 248320, 2560}, {"hc_down", 320, 10240},
      {"hc_up", 10240, 320},         {"router", 512, 2560},         {"shared_gate_up", 1280, 2560},
      {"shared_down", 2560, 640},    {"gdn_in_fused", 16480, 2560}, {"gdn_in_tp4", 4120, 2560},
      {"gdn_out_tp4", 2560, 1536},   {"hc_down_inj", 324, 10240}};
  void* x;
  void* y;
  FN_CUDA_CHECK(cudaMalloc(&x, 10240 * 4));
  FN_CUDA_CHECK(cudaMalloc(&y, 248320 * 4));
  fill_random(x, 10240 * 4, 7);
  for (const GemvShape& s : hc_only || nvfp4_only ? std::vector<GemvShape>{} : shapes) {
    const size_t wbytes = size_t(s.rows) * s.cols * 2;
    const int copies = int(std::max<size_t>(1, (kRotateBytes + wbytes - 1) / wbytes));
    const size_t total = wbytes * copies;
    uint16_t* w;
    FN_CUDA_CHECK(cudaMalloc(&w, total));
    fill_random(w, total, 11);
    const int calls = std::max(copies, 20);
    auto run_plan = [&](fn::GemvBf16Plan plan, fn::DType xd, fn::DType yd, const char* label) {
      fn::GemvBf16Params p;
      p.rows = s.rows;
      p.cols = s.cols;
      p.ld = s.cols;
      p.x = x;
      p.x_dtype = xd;
      p.y = y;
      p.y_dtype = yd;
      p.plan = plan;
      const double us = t.time_per_call(calls, [&](int i) {
        p.weight = w + size_t(i % copies) * s.rows * s.cols;
        fn::launch_gemv_bf16(p, t.stream);
      });
      const double bytes =
          double(wbytes) + s.cols * fn::dtype_size(xd) + s.rows * fn::dtype_size(yd);
      const fn::GemvBf16Plan used =
          plan.team_threads ? plan : fn::plan_gemv_bf16(s.rows, s.cols, prop.multiProcessorCount);
      auto j = report(
          {std::string("gemv_bf16") + label,
           std::string(s.name) + " " + std::to_string(s.rows) + "x" + std::to_string(s.cols),
           std::to_string(used.rows_per_team) + "r/" + std::to_string(used.team_threads) + "t",
           bytes, us, bw});
      j["x_dtype"] = fn::dtype_name(xd);
      j["y_dtype"] = fn::dtype_name(yd);
      j["planned"] = plan.team_threads == 0;
      rows.push_back(j);
      return us;
    };
    run_plan({}, fn::DType::BF16, fn::DType::F32, "");
    if (std::string(s.name) == "hc_up" || std::string(s.name) == "gdn_in_qkv")
      run_plan({}, fn::DType::F32, fn::DType::BF16, " x32/y16");
    if (sweep) {
      for (int r : {1, 2, 4})
        for (int tt = 8; tt <= 256; tt *= 2) {
          if ((s.cols / 8 + tt - 1) / tt > 64) continue;  // > 64 vectors per lane: pointless
          const int64_t rpb = int64_t(r) * (256 / tt);
          run_plan({r, tt, (s.rows + rpb - 1) / rpb}, fn::DType::BF16, fn::DType::F32, " sweep");
        }
    }
    FN_CUDA_CHECK(cudaFree(w));
  }

  // ---- HC read: split-K down/inject GEMV + partial squares, then the mix (scales, N, m) ------
  if (!nvfp4_only) {
    const int64_t D = 2560, r = 320, W = 4 * D, nrows = r + 4;
    const int64_t splits = fn::hc_down_splits(4, D);
    const size_t up_bytes = size_t(W * r) * 2, dn_bytes = size_t(nrows * W) * 2;
    const int copies = int((kRotateBytes + up_bytes + dn_bytes - 1) / (up_bytes + dn_bytes));
    uint16_t *w_up, *w_dn, *nw, *mb;
    float *h, *ss, *m, *tv, *iota;
    FN_CUDA_CHECK(cudaMalloc(&w_up, up_bytes * copies));
    FN_CUDA_CHECK(cudaMalloc(&w_dn, dn_bytes * copies));
    FN_CUDA_CHECK(cudaMalloc(&nw, W * 2));
    FN_CUDA_CHECK(cudaMalloc(&mb, D * 2));
    FN_CUDA_CHECK(cudaMalloc(&h, W * 4));
    FN_CUDA_CHECK(cudaMalloc(&ss, splits * 4));
    FN_CUDA_CHECK(cudaMalloc(&m, D * 4));
    FN_CUDA_CHECK(cudaMalloc(&tv, splits * nrows * 4));
    FN_CUDA_CHECK(cudaMalloc(&iota, 16));
    fill_random(w_up, up_bytes * copies, 21);
    fill_random(w_dn, dn_bytes * copies, 22);
    fill_random(nw, W * 2, 24);
    fill_random(h, W * 4, 25);
    fill_random(tv, splits * nrows * 4, 26);
    fill_random(ss, splits * 4, 27);
    fn::HcDownParams dp;
    dp.H = h;
    dp.norm = nw;
    dp.rows = nrows;
    dp.hc_count = 4;
    dp.hidden = D;
    dp.t_partial = tv;
    dp.sumsq = ss;
    fn::HcMixParams mp;
    mp.t = tv;
    mp.t_splits = splits;
    mp.t_stride = nrows;
    mp.sumsq = ss;
    mp.H = h;
    mp.norm = nw;
    mp.m = m;
    mp.m_bf16 = mb;
    mp.iota = iota;
    mp.hidden = D;
    mp.rank = r;
    const int calls = std::max(copies, 20);
    const double down_bytes = double(dn_bytes) + W * (4 + 2) + splits * (nrows + 1) * 4;
    const double mix_bytes = double(up_bytes) + splits * (nrows + 1) * 4 + W * (4 + 2) + D * 6 + 16;
    // With PDL on (as the decode step) and off.
    for (bool pdl : {true, false}) {
      fn::set_pdl_enabled(pdl);
      const std::string plan = pdl ? "pdl" : "nopdl";
      const double down_us = t.time_per_call(calls, [&](int i) {
        dp.weight = w_dn + size_t(i % copies) * nrows * W;
        fn::launch_hc_down(dp, t.stream);
      });
      rows.push_back(report({"hc_down", "324x10240 +sumsq", plan, down_bytes, down_us, bw}));
      const double mix_us = t.time_per_call(calls, [&](int i) {
        mp.w_up = w_up + size_t(i % copies) * W * r;
        fn::launch_hc_mix(mp, t.stream);
      });
      rows.push_back(report({"hc_mix", "10240x320 +scale,N,m", plan, mix_bytes, mix_us, bw}));
      const double read_us = t.time_per_call(calls, [&](int i) {
        dp.weight = w_dn + size_t(i % copies) * nrows * W;
        mp.w_up = w_up + size_t(i % copies) * W * r;
        fn::launch_hc_down(dp, t.stream);
        fn::launch_hc_mix(mp, t.stream);
      });
      rows.push_back(report({"hc_read", "down + mix", plan, down_bytes + mix_bytes, read_us, bw}));
    }
    fn::set_pdl_enabled(true);
    std::printf("hc_mix staged kernel used at rank 320: %s\n",
                fn::hc_mix_uses_staging(mp) ? "yes" : "no");
    for (void* p : {(void*)w_up, (void*)w_dn, (void*)nw, (void*)mb, (void*)h, (void*)ss, (void*)m,
                    (void*)tv, (void*)iota})
      FN_CUDA_CHECK(cudaFree(p));
  }
  if (hc_only) {
    write_json();
    return 0;
  }

  // ---- NVFP4 experts --------------------------------------------------------------------------
  const int num_experts = 512, top_k = 10;
  const int64_t hidden = 2560;
  const int calls = 64;
  std::vector<int32_t> ids(size_t(calls) * top_k);
  std::mt19937_64 rng(5);
  for (int c = 0; c < calls; ++c) {
    std::vector<int32_t> all(num_experts);
    for (int e = 0; e < num_experts; ++e) all[e] = e;
    std::shuffle(all.begin(), all.end(), rng);
    std::copy(all.begin(), all.begin() + top_k, ids.begin() + size_t(c) * top_k);
  }
  int32_t* d_ids;
  float* d_rw;
  FN_CUDA_CHECK(cudaMalloc(&d_ids, ids.size() * 4));
  FN_CUDA_CHECK(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  std::vector<float> rw(top_k, 0.1f);
  FN_CUDA_CHECK(cudaMalloc(&d_rw, top_k * 4));
  FN_CUDA_CHECK(cudaMemcpy(d_rw, rw.data(), top_k * 4, cudaMemcpyHostToDevice));
  for (int64_t inter : {640, 320, 160}) {
    const std::string tp = "tp" + std::to_string(640 / inter);
    uint8_t *gu_p, *gu_s, *dn_p, *dn_s, *h;
    float *gu_g, *dn_g;
    const size_t gu_pb = size_t(num_experts) * 2 * inter * hidden / 2;
    const size_t dn_pb = size_t(num_experts) * hidden * inter / 2;
    FN_CUDA_CHECK(cudaMalloc(&gu_p, gu_pb));
    FN_CUDA_CHECK(cudaMalloc(&gu_s, gu_pb / 8));
    FN_CUDA_CHECK(cudaMalloc(&dn_p, dn_pb));
    FN_CUDA_CHECK(cudaMalloc(&dn_s, dn_pb / 8));
    FN_CUDA_CHECK(cudaMalloc(&gu_g, num_experts * 2 * 4));
    FN_CUDA_CHECK(cudaMalloc(&dn_g, num_experts * 4));
    FN_CUDA_CHECK(cudaMalloc(&h, top_k * inter * 2));
    fill_random(gu_p, gu_pb, 1);
    fill_random(gu_s, gu_pb / 8, 2);
    fill_random(dn_p, dn_pb, 3);
    fill_random(dn_s, dn_pb / 8, 4);
    fill_random(gu_g, num_experts * 2 * 4, 5);
    fill_random(dn_g, num_experts * 4, 6);
    fill_random(h, top_k * inter * 2, 8);

    fn::MoeGateUpParams g;
    g.experts = {gu_p, gu_s, gu_g, num_experts, 2 * inter, hidden};
    g.top_k = top_k;
    g.x = static_cast<const uint16_t*>(x);
    g.h = reinterpret_cast<uint16_t*>(h);
    fn::MoeDownParams d;
    d.experts = {dn_p, dn_s, dn_g, num_experts, hidden, inter};
    d.top_k = top_k;
    d.routing_weights = d_rw;
    d.h = reinterpret_cast<const uint16_t*>(h);
    d.y = static_cast<float*>(y);
    const double gu_bytes =
        double(top_k) * 2 * inter * (hidden / 2 + hidden / 16) + hidden * 2 + top_k * inter * 2;
    const double dn_bytes =
        double(top_k) * hidden * (inter / 2 + inter / 16) + top_k * inter * 2 + hidden * 4;
    // The FP32 kernels, planned team, then (with --sweep) every team width.
    auto time_gu = [&](int team) {
      g.team_threads = team;
      return t.time_per_call(calls, [&](int i) {
        g.expert_ids = d_ids + size_t(i) * top_k;
        fn::launch_moe_gate_up_nvfp4(g, t.stream);
      });
    };
    auto time_dn = [&](int team) {
      d.team_threads = team;
      return t.time_per_call(calls, [&](int i) {
        d.expert_ids = d_ids + size_t(i) * top_k;
        fn::launch_moe_down_nvfp4(d, t.stream);
      });
    };
    const int gu_team = fn::plan_moe_gate_up_team(top_k, inter, hidden, prop.multiProcessorCount);
    rows.push_back(
        report({"moe_gate_up_nvfp4 fp32", tp + " 10x" + std::to_string(2 * inter) + "x2560",
                std::to_string(gu_team) + "t", gu_bytes, time_gu(0), bw}));
    const int dn_team = fn::plan_moe_down_team(top_k, inter, hidden, prop.multiProcessorCount);
    rows.push_back(report({"moe_down_nvfp4 fp32", tp + " 10x2560x" + std::to_string(inter),
                           std::to_string(dn_team) + "t", dn_bytes, time_dn(0), bw}));
    if (fn::moe_gate_up_bulk_supported(top_k, inter, hidden)) {  // the bulk-copy kernel (sm_90+)
      g.bulk = true;
      rows.push_back(report(
          {"moe_gate_up_nvfp4 bulk", tp + " 10x" + std::to_string(2 * inter) + "x2560",
           std::to_string(fn::detail::bulk_gate_up_ctas(top_k, inter, prop.multiProcessorCount)) +
               "cta",
           gu_bytes, time_gu(0), bw}));
      g.bulk = false;
    }
    if (sweep) {
      for (int tt = 8; tt <= 256; tt *= 2) {
        rows.push_back(report({"moe_gate_up_nvfp4 fp32 sweep", tp, std::to_string(tt) + "t",
                               gu_bytes, time_gu(tt), bw}));
        rows.push_back(report({"moe_down_nvfp4 fp32 sweep", tp, std::to_string(tt) + "t", dn_bytes,
                               time_dn(tt), bw}));
      }
    }
    for (void* p :
         {(void*)gu_p, (void*)gu_s, (void*)dn_p, (void*)dn_s, (void*)gu_g, (void*)dn_g, (void*)h})
      FN_CUDA_CHECK(cudaFree(p));
  }
  write_json();
  FN_CUDA_CHECK(cudaFree(x));
  FN_CUDA_CHECK(cudaFree(y));
  FN_CUDA_CHECK(cudaFree(d_ids));
  FN_CUDA_CHECK(cudaFree(d_rw));
  FN_CUDA_CHECK(cudaStreamDestroy(t.stream));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "cuda_kernel_bench: %s\n", e.what());
  return 1;
}
