// CPU tests of comm/'s GPU-path helpers that need no GPU or driver: the CUDA and NCCL error
// macros, the --allreduce parser, and the abort hooks.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "comm/abort_hooks.h"
#include "comm/device_all_reduce.h"
#include "comm/nccl_check.h"
#include "cuda/common/cuda_check.h"

TEST_CASE("cuda check: a failing CUDA call throws a Cuda error naming the call and the reason") {
  std::string what;
  fn::ErrorKind kind = fn::ErrorKind::Internal;
  try {
    FN_CUDA_CHECK(cudaErrorInvalidValue);
  } catch (const fn::Error& e) {
    what = e.what();
    kind = e.kind();
  }
  CHECK(kind == fn::ErrorKind::Cuda);
  CHECK(what.find("cudaErrorInvalidValue") != std::string::npos);  // the call text and the name
  CHECK(what.find(cudaGetErrorString(cudaErrorInvalidValue)) != std::string::npos);
  CHECK(what.find("test_comm_cuda_check.cpp") != std::string::npos);
  CHECK(exit_code(kind) == 4);
}

TEST_CASE("cuda check: a failing NCCL call throws an Nccl error with NCCL's message") {
  std::string what;
  fn::ErrorKind kind = fn::ErrorKind::Internal;
  try {
    FN_NCCL_CHECK(ncclInvalidArgument);
  } catch (const fn::Error& e) {
    what = e.what();
    kind = e.kind();
  }
  CHECK(kind == fn::ErrorKind::Nccl);
  CHECK(what.find("ncclInvalidArgument") != std::string::npos);
  CHECK(what.find(ncclGetErrorString(ncclInvalidArgument)) != std::string::npos);
  CHECK_NOTHROW(FN_NCCL_CHECK(ncclSuccess));
  CHECK_NOTHROW(FN_CUDA_CHECK(cudaSuccess));
}

TEST_CASE(
    "allreduce flag: auto, custom and nccl parse; anything else is a usage error naming "
    "--allreduce") {
  CHECK(fn::parse_all_reduce_strategy("auto") == fn::AllReduceStrategy::Auto);
  CHECK(fn::parse_all_reduce_strategy("custom") == fn::AllReduceStrategy::Custom);
  CHECK(fn::parse_all_reduce_strategy("nccl") == fn::AllReduceStrategy::Nccl);
  CHECK(std::string(fn::all_reduce_strategy_name(fn::AllReduceStrategy::Custom)) == "custom");
  std::string what;
  try {
    fn::parse_all_reduce_strategy("NCCL");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Usage);
    what = e.what();
  }
  CHECK(what.find("--allreduce NCCL") != std::string::npos);
}

TEST_CASE("abort hooks: registered hooks run once, newest first; unregistered ones never") {
  std::vector<int> order;
  const int a = fn::register_abort_hook([&] { order.push_back(1); });
  const int b = fn::register_abort_hook([&] { order.push_back(2); });
  const int c = fn::register_abort_hook([&] { throw std::runtime_error("hook failure"); });
  const int d = fn::register_abort_hook([&] { order.push_back(4); });
  fn::unregister_abort_hook(b);
  fn::run_abort_hooks();
  CHECK(order == std::vector<int>{4, 1});
  fn::run_abort_hooks();  // already run: nothing twice
  CHECK(order == std::vector<int>{4, 1});
  (void)a, (void)c, (void)d;
}
