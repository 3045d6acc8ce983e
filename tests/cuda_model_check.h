// Shared checks of the CUDA model tests (test_cuda_model.cpp against the transformers fixtures,
// test_cuda_model_realwidth.cpp against the CPU model): the CUDA tolerance, per-row comparison
// with near-tie and ill-conditioned rows reported instead of failed, and teacher-forced runs with
// the CPU model's router/indexer choices replayed. Host code; needs a GPU to run.
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "comm/mpi_check.h"
#include "core/collectives.h"
#include "core/cpu_model.h"
#include "cuda/common/cuda_check.h"
#include "cuda/model/cuda_model.h"
#include "cuda/model/cuda_model_testing.h"
#include "test_cpu_fixture.h"

namespace fn::test {

// The MPI world size; *rank = this rank (the GPU model tests run under mpirun).
inline int mpi_world(int* rank) {
  int n = 0;
  FN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &n));
  FN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, rank));
  return n;
}

// Selects this rank's GPU (rank modulo the device count); returns the rank.
inline int use_gpu_of_rank() {
  int rank = 0;
  mpi_world(&rank);
  int devices = 0;
  FN_CUDA_CHECK(cudaGetDeviceCount(&devices));
  FN_CUDA_CHECK(cudaSetDevice(rank % devices));
  return rank;
}

constexpr double kRelTol = 2e-2;  // 2e-2 * max |ref logit| (BF16 activations)
// Ill-conditioned rows (CpuModel::DecisionMargins): a PLE |gamma| or a GDN head's relative output
// RMS below this. BF16 inputs carry ~2^-8 relative noise; the signed-sqrt gate amplifies an
// absolute error d in gamma to d / (2 sqrt|gamma|) and the gated RMSNorm amplifies a head's noise
// by 1 / (its relative RMS), so below 0.05 the amplification reaches 10-20x and a few-1e-3 BF16
// noise becomes a several-% change of that head or gate. On the fixtures every row above the
// tolerance with replayed choices sits below this (reported per row, with the margins).
constexpr double kIllConditioned = 0.05;

// Top-1 minus top-2 of a row.
inline double margin(const float* row, int64_t n) {
  float a = -INFINITY, b = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    if (row[i] > a) {
      b = a;
      a = row[i];
    } else if (row[i] > b) {
      b = row[i];
    }
  }
  return static_cast<double>(a) - b;
}

struct RowCheck {
  double worst_ratio = 0;      // max over checked rows of max|diff| / (kRelTol * max|ref|)
  int argmax_mismatch = 0;     // checked rows with margin > tol and a different argmax
  int near_ties = 0;           // rows with margin <= tol and a different argmax (reported)
  int tie_rows = 0;            // rows with a router/indexer choice within kRelTol of a tie
  double worst_tie_ratio = 0;  // the largest ratio among those rows (reported)
  std::string per_row;         // ratio of every row, '*' marking the tie rows
};

// The FP32 CPU model (the reference's twin, within 4e-6) on the fixture's tokens: per row, its
// router / indexer choices and whether one of them was within kRelTol (relative) of a tie.
struct CpuRun {
  std::vector<float> logits;  // [tokens, vocab] the CPU model's own logits
  std::vector<fn::CpuModel::Choices> choices;
  std::vector<bool> tie;         // a router/indexer choice within kRelTol of a tie
  std::vector<bool> ill;         // an ill-conditioned PLE gate or GDN head (kIllConditioned)
  std::vector<bool> tie_or_ill;  // either
};
inline CpuRun cpu_run(const RefFixture& f) {
  fn::LocalCollectives coll;
  auto cpu = fn::CpuModel::load(f.dir, coll);
  CpuRun r;
  for (int32_t t : f.tokens) {
    const auto l = cpu->forward(t);
    r.logits.insert(r.logits.end(), l.begin(), l.end());
    const auto& m = cpu->last_margins();
    r.tie.push_back(m.router <= kRelTol || m.indexer <= kRelTol);
    r.ill.push_back(m.ple_gamma <= kIllConditioned || m.gdn_head_rms <= kIllConditioned);
    r.tie_or_ill.push_back(r.tie.back() || r.ill.back());
    r.choices.push_back(cpu->last_choices());
  }
  return r;
}

// The logits of every fixture token, teacher-forced, with the CPU model's router and indexer
// choices replayed (a model built with CudaModelTestOptions::replay_choices).
inline std::vector<float> run_rows_replayed(fn::CudaModel& m, const RefFixture& f,
                                            const CpuRun& cpu) {
  std::vector<float> all;
  for (std::size_t p = 0; p < f.tokens.size(); ++p) {
    fn::CudaModelTesting::set_forced_choices(m, cpu.choices[p].router, cpu.choices[p].indexer);
    const auto l = m.forward(f.tokens[p]);
    all.insert(all.end(), l.begin(), l.end());
  }
  return all;
}

// Compares all teacher-forced rows of `got` ([rows, vocab]) with the fixture; rows where `tie`
// is set are reported, not checked.
inline RowCheck check_rows(const RefFixture& f, const std::vector<float>& got,
                           const std::vector<bool>& tie = {}) {
  RowCheck rc;
  for (std::size_t p = 0; p < f.tokens.size(); ++p) {
    const float* ref = f.row(p);
    const float* g = got.data() + p * static_cast<std::size_t>(f.vocab);
    const double tol = kRelTol * max_abs(ref, f.vocab);
    const double ratio = max_abs_diff(g, ref, f.vocab) / tol;
    const bool near_tie = !tie.empty() && tie[p];
    rc.per_row += fmt::format(" {:.2f}{}", ratio, near_tie ? "*" : "");
    if (near_tie) {
      ++rc.tie_rows;
      rc.worst_tie_ratio = std::max(rc.worst_tie_ratio, ratio);
      continue;
    }
    rc.worst_ratio = std::max(rc.worst_ratio, ratio);
    if (argmax(g, f.vocab) != argmax(ref, f.vocab)) {
      if (margin(ref, f.vocab) > tol) {
        ++rc.argmax_mismatch;
      } else {
        ++rc.near_ties;
      }
    }
  }
  return rc;
}

// The logits of every fixture token, teacher-forced.
inline std::vector<float> run_rows(fn::CudaModel& m, const RefFixture& f) {
  std::vector<float> all;
  for (int32_t t : f.tokens) {
    const auto l = m.forward(t);
    all.insert(all.end(), l.begin(), l.end());
  }
  return all;
}

}  // namespace fn::test
