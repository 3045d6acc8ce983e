// GPU tests of launch_gemv_bf16 (cuda/kernels/gemv_bf16.h) against host references: exact integer
// sums on every decode shape, random values within the FP32 summation bound, every variant (rows
// per team x team width x dtypes), the overlapped launch (no programmatic wait) bitwise equal to
// the plain one, and the launcher's precondition checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/codecs.h"
#include "core/error.h"
#include "cuda/kernels/gemv_bf16.h"
#include "tests/cuda_test_util.h"

namespace {

using fn::DType;
using fn::test::DeviceArray;

struct Shape {
  int64_t rows, cols, ld;
};

int sm_count() {
  int dev = 0, sms = 0;
  FN_CUDA_CHECK(cudaGetDevice(&dev));
  FN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

// Deepest chain of FP32 roundings any product passes through in the kernel with this plan: one
// for the product (FP32 x), one per FMA of the lane's chain, the butterfly, the cross-warp sum.
int rounding_depth(const fn::GemvBf16Plan& plan, int64_t cols) {
  const int t = plan.team_threads;
  const int64_t per_lane = (cols / 8 + t - 1) / t * 8;
  int levels = 0;
  for (int w = std::min(t, 32); w > 1; w >>= 1) ++levels;
  return static_cast<int>(per_lane) + levels + (t > 32 ? t / 32 - 1 : 0) + 1;
}

struct Problem {
  Shape s;
  std::vector<uint16_t> w;  // [rows, ld] BF16 bits
  std::vector<float> x;     // [cols], BF16-exact values when x is BF16
};

Problem make_problem(Shape s, bool integers, bool x_bf16, uint64_t seed) {
  Problem p{s, std::vector<uint16_t>(s.rows * s.ld), std::vector<float>(s.cols)};
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> small(-3, 3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t c = 0; c < s.ld; ++c) {
      // Columns past cols (ld padding) hold a poison value the kernel must never read into y.
      const float v = c >= s.cols ? 1e30f : (integers ? float(small(rng)) : 0.05f * normal(rng));
      p.w[r * s.ld + c] = fn::float_to_bf16(v);
    }
  for (auto& v : p.x) {
    v = integers ? float(small(rng)) : normal(rng);
    if (x_bf16) v = fn::bf16_to_float(fn::float_to_bf16(v));
  }
  return p;
}

// Runs the kernel; returns y as floats (BF16 outputs widened exactly).
std::vector<float> run(const Problem& p, DType x_dtype, DType y_dtype, fn::GemvBf16Plan plan = {},
                       bool no_pdl_wait = false) {
  DeviceArray<uint16_t> w(p.w);
  DeviceArray<uint8_t> x(p.s.cols * (x_dtype == DType::F32 ? 4 : 2));
  if (x_dtype == DType::F32) {
    FN_CUDA_CHECK(cudaMemcpy(x.ptr, p.x.data(), p.s.cols * 4, cudaMemcpyHostToDevice));
  } else {
    std::vector<uint16_t> xb(p.s.cols);
    for (int64_t c = 0; c < p.s.cols; ++c) xb[c] = fn::float_to_bf16(p.x[c]);
    FN_CUDA_CHECK(cudaMemcpy(x.ptr, xb.data(), p.s.cols * 2, cudaMemcpyHostToDevice));
  }
  DeviceArray<uint8_t> y(p.s.rows * 4);
  FN_CUDA_CHECK(cudaMemset(y.ptr, 0xff, p.s.rows * 4));  // NaN fill: unwritten rows fail
  fn::GemvBf16Params prm;
  prm.weight = w.ptr;
  prm.rows = p.s.rows;
  prm.cols = p.s.cols;
  prm.ld = p.s.ld;
  prm.x = x.ptr;
  prm.x_dtype = x_dtype;
  prm.y = y.ptr;
  prm.y_dtype = y_dtype;
  prm.plan = plan;
  prm.no_pdl_wait = no_pdl_wait;
  fn::launch_gemv_bf16(prm, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> raw = y.download();
  std::vector<float> out(p.s.rows);
  for (int64_t r = 0; r < p.s.rows; ++r) {
    if (y_dtype == DType::F32) {
      std::memcpy(&out[r], raw.data() + 4 * r, 4);
    } else {
      uint16_t b;
      std::memcpy(&b, raw.data() + 2 * r, 2);
      out[r] = fn::bf16_to_float(b);
    }
  }
  return out;
}

// FP64 reference y and sum |w x| per row.
void reference(const Problem& p, std::vector<double>& y, std::vector<double>& abs_sum) {
  y.assign(p.s.rows, 0.0);
  abs_sum.assign(p.s.rows, 0.0);
  for (int64_t r = 0; r < p.s.rows; ++r) {
    double s = 0, a = 0;
    const uint16_t* row = p.w.data() + r * p.s.ld;
    for (int64_t c = 0; c < p.s.cols; ++c) {
      const double t = double(fn::bf16_to_float(row[c])) * double(p.x[c]);
      s += t;
      a += std::fabs(t);
    }
    y[r] = s;
    abs_sum[r] = a;
  }
}

// Integer inputs: every partial sum is an integer below 2^24, so FP32 is exact in any order.
void check_exact(const Problem& p, DType x_dtype, DType y_dtype, fn::GemvBf16Plan plan = {}) {
  std::vector<double> want, abs_sum;
  reference(p, want, abs_sum);
  if (y_dtype == DType::BF16)
    for (auto& v : want) v = fn::bf16_to_float(fn::float_to_bf16(float(v)));
  const auto got = run(p, x_dtype, y_dtype, plan);
  const auto c = fn::test::compare_bounded(got, want, std::vector<double>(want.size(), 0.0));
  CHECK_MESSAGE(c.wrong == 0, "rows ", p.s.rows, " cols ", p.s.cols, " ld ", p.s.ld, " x ",
                fn::dtype_name(x_dtype), " y ", fn::dtype_name(y_dtype), " plan ",
                plan.rows_per_team, "x", plan.team_threads, ": ", c.describe());
}

const std::vector<Shape> kDecodeShapes = {
    {10240, 2560, 2560},   // GDN in_proj_qkv
    {2560, 6144, 6144},    // GDN out_proj
    {12288, 2560, 2560},   // QSA q_proj (with gate)
    {124160, 2560, 2560},  // lm_head at TP=2 (248320 / 2)
    {320, 10240, 10240},   // HC down
    {10240, 320, 320},     // HC up
    {512, 2560, 2560},     // router
    {1280, 2560, 2560},    // shared expert gate+up
    {2560, 640, 640},      // shared expert down
    {16480, 2560, 2560},   // GDN fused in_proj (qkv + z + b + a)
};

const std::vector<Shape> kEdgeShapes = {
    {1, 8, 8},         {3, 24, 24},      {5, 264, 264},
    {7, 4104, 4104},   {33, 2560, 2624},  // a column slice: ld > cols, padding poisoned
    {1, 10240, 10240}, {129, 8, 16},     {2049, 40, 40},
};

}  // namespace

TEST_CASE("cuda gemv: integer inputs give the exact sums on every decode shape (BF16 x, FP32 y)") {
  for (size_t i = 0; i < kDecodeShapes.size(); ++i)
    check_exact(make_problem(kDecodeShapes[i], true, true, 100 + i), DType::BF16, DType::F32);
}

TEST_CASE("cuda gemv: integer inputs give the exact sums on edge shapes for all dtype pairs") {
  for (size_t i = 0; i < kEdgeShapes.size(); ++i) {
    const Problem p = make_problem(kEdgeShapes[i], true, true, 200 + i);
    for (DType xd : {DType::BF16, DType::F32})
      for (DType yd : {DType::F32, DType::BF16}) check_exact(p, xd, yd);
  }
}

TEST_CASE("cuda gemv: every variant (rows per team, team width, dtypes) sums exactly") {
  const int64_t cols_list[] = {2584, 264};  // 323 and 33 vectors: ragged for every team width
  for (int64_t cols : cols_list) {
    const Problem p = make_problem({37, cols, cols}, true, true, 300 + cols);
    for (int r : {1, 2, 4})
      for (int t = 8; t <= 256; t *= 2) {
        const int64_t rows_per_block = int64_t(r) * (256 / t);
        const fn::GemvBf16Plan plan{r, t, (37 + rows_per_block - 1) / rows_per_block};
        for (DType xd : {DType::BF16, DType::F32})
          for (DType yd : {DType::F32, DType::BF16}) check_exact(p, xd, yd, plan);
      }
  }
}

TEST_CASE("cuda gemv: random values stay within the FP32 summation bound (all dtype pairs)") {
  const std::vector<Shape> shapes = {{10240, 2560, 2560}, {2560, 6144, 6144}, {320, 10240, 10240},
                                     {10240, 320, 320},   {512, 2560, 2560},  {7, 4104, 4104}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    for (DType xd : {DType::BF16, DType::F32}) {
      const Problem p = make_problem(shapes[i], false, xd == DType::BF16, 400 + i);
      std::vector<double> want, abs_sum;
      reference(p, want, abs_sum);
      const fn::GemvBf16Plan plan = fn::plan_gemv_bf16(p.s.rows, p.s.cols, sm_count());
      const double gamma = fn::test::gamma_fp32(rounding_depth(plan, p.s.cols));
      for (DType yd : {DType::F32, DType::BF16}) {
        std::vector<double> bound(want.size());
        for (size_t r = 0; r < want.size(); ++r) {
          bound[r] = gamma * abs_sum[r];
          if (yd == DType::BF16) bound[r] += fn::test::kBf16Unit * (std::fabs(want[r]) + bound[r]);
        }
        const auto got = run(p, xd, yd, plan);
        const auto c = fn::test::compare_bounded(got, want, bound);
        CHECK_MESSAGE(c.wrong == 0, "rows ", p.s.rows, " cols ", p.s.cols, " x ",
                      fn::dtype_name(xd), " y ", fn::dtype_name(yd), ": ", c.describe());
      }
    }
  }
}

TEST_CASE("cuda gemv: the overlapped launch (no programmatic wait) gives the plain launch's bits") {
  // Random values, so the bits depend on the summation order: the x staged in shared memory and
  // the rows per team must not change it (the QSA launcher splits its projection on this).
  const std::vector<Shape> shapes = {
      {13952, 2560, 2560}, {640, 2560, 2560}, {37, 2584, 2584}, {33, 2560, 2624}, {5, 8192, 8192}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Problem p = make_problem(shapes[i], false, false, 500 + i);
    const auto want = run(p, DType::F32, DType::F32);
    const fn::GemvBf16Plan whole = fn::plan_gemv_bf16(p.s.rows, p.s.cols, sm_count());
    for (int r : {1, 2, 4}) {
      const auto got =
          run(p, DType::F32, DType::F32, fn::plan_gemv_bf16_part(whole, p.s.rows, r), true);
      CHECK_MESSAGE(std::memcmp(got.data(), want.data(), want.size() * 4) == 0, "rows ", p.s.rows,
                    " cols ", p.s.cols, " rows per team ", r);
    }
  }
}

TEST_CASE("cuda gemv: rows left out (skip_at, skip) keep the other rows' bits and stay unwritten") {
  // The GDN launcher computes its projection's rows but z this way (cuda/kernels/gdn.h).
  const Problem p = make_problem({1000, 2560, 2560}, false, false, 600);
  const auto want = run(p, DType::F32, DType::F32);
  DeviceArray<uint16_t> w(p.w);
  DeviceArray<float> x(p.x), y(size_t(p.s.rows));
  FN_CUDA_CHECK(cudaMemset(y.ptr, 0xff, y.n * 4));
  fn::GemvBf16Params prm;
  prm.weight = w.ptr;
  prm.rows = 1000 - 300;  // rows [400, 700) left out
  prm.cols = prm.ld = 2560;
  prm.x = x.ptr;
  prm.x_dtype = DType::F32;
  prm.y = y.ptr;
  prm.skip_at = 400;
  prm.skip = 300;
  const auto whole = fn::plan_gemv_bf16(1000, 2560, sm_count());
  prm.plan = fn::plan_gemv_bf16_part(whole, prm.rows, whole.rows_per_team);
  fn::launch_gemv_bf16(prm, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  const auto got = y.download();
  for (int64_t r = 0; r < 1000; ++r) {
    uint32_t bits;
    std::memcpy(&bits, &got[size_t(r)], 4);
    if (r >= 400 && r < 700)
      CHECK_MESSAGE(bits == 0xffffffffu, "row ", r, " was written");
    else
      CHECK_MESSAGE(std::memcmp(&got[size_t(r)], &want[size_t(r)], 4) == 0, "row ", r);
  }
}

TEST_CASE("cuda gemv: the plan fills the GPU on the decode shapes and keeps lanes busy") {
  const int sms = sm_count();
  for (const Shape& s : kDecodeShapes) {
    const auto plan = fn::plan_gemv_bf16(s.rows, s.cols, sms);
    // The grid has 2 blocks per SM unless the plan ran out of ways to widen (one row per team
    // and teams that cannot double without dropping below 2 vectors per lane); no lane has more
    // than 16 vectors.
    if (plan.blocks < 2 * sms)
      CHECK((plan.rows_per_team == 1 &&
             (plan.team_threads == 256 || s.cols / 8 < 4 * plan.team_threads)));
    CHECK((s.cols / 8 + plan.team_threads - 1) / plan.team_threads <= 16);
  }
  // Hand-checked: 10240 x 2560 -> 4 rows per team, 32 lanes (10 vectors each), 320 blocks.
  const auto p = fn::plan_gemv_bf16(10240, 2560, 132);
  CHECK(p.rows_per_team == 4);
  CHECK(p.team_threads == 32);
  CHECK(p.blocks == 320);
  // A part of it keeps the team width: 640 rows at 1 row per team are 640 / 8 = 80 blocks.
  const auto part = fn::plan_gemv_bf16_part(p, 640, 1);
  CHECK(part.rows_per_team == 1);
  CHECK(part.team_threads == 32);
  CHECK(part.blocks == 80);
}

TEST_CASE("cuda gemv: the launcher rejects bad shapes, misalignment, dtypes and plans") {
  DeviceArray<uint16_t> w(64 * 64), x(64);
  DeviceArray<float> y(64);
  fn::GemvBf16Params ok;
  ok.weight = w.ptr;
  ok.rows = 64;
  ok.cols = 64;
  ok.ld = 64;
  ok.x = x.ptr;
  ok.y = y.ptr;
  fn::launch_gemv_bf16(ok, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  auto bad = ok;
  bad.cols = 60;  // not a multiple of 8
  bad.ld = 64;
  CHECK_THROWS_AS(fn::launch_gemv_bf16(bad, nullptr), fn::Error);
  bad = ok;
  bad.ld = 32;  // ld < cols
  CHECK_THROWS_AS(fn::launch_gemv_bf16(bad, nullptr), fn::Error);
  bad = ok;
  bad.weight = w.ptr + 1;  // 2-byte aligned only
  CHECK_THROWS_AS(fn::launch_gemv_bf16(bad, nullptr), fn::Error);
  bad = ok;
  bad.x_dtype = DType::F16;
  CHECK_THROWS_AS(fn::launch_gemv_bf16(bad, nullptr), fn::Error);
  bad = ok;
  bad.y = nullptr;
  CHECK_THROWS_AS(fn::launch_gemv_bf16(bad, nullptr), fn::Error);
  bad = ok;
  bad.plan = {3, 32, 22};  // 3 rows per team is not a variant
  CHECK_THROWS_AS(fn::launch_gemv_bf16(bad, nullptr), fn::Error);
  bad.plan = {4, 32, 1};  // grid too small for the rows
  CHECK_THROWS_AS(fn::launch_gemv_bf16(bad, nullptr), fn::Error);
  bad = ok;
  bad.no_pdl_wait = true;  // the overlapped launch takes FP32 x and y only
  CHECK_THROWS_AS(fn::launch_gemv_bf16(bad, nullptr), fn::Error);
  bad.x_dtype = DType::F32;
  bad.y_dtype = DType::BF16;
  CHECK_THROWS_AS(fn::launch_gemv_bf16(bad, nullptr), fn::Error);
  DeviceArray<uint16_t> wide(8200);
  DeviceArray<float> xw(8200);
  bad = ok;  // more columns than its shared-memory copy of x takes
  bad.weight = wide.ptr;
  bad.rows = 1;
  bad.cols = 8200;
  bad.ld = 8200;
  bad.x = xw.ptr;
  bad.x_dtype = DType::F32;
  bad.no_pdl_wait = true;
  CHECK_THROWS_AS(fn::launch_gemv_bf16(bad, nullptr), fn::Error);
}
