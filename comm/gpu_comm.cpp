#include "comm/gpu_comm.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <exception>

#include "comm/abort_hooks.h"
#include "comm/mpi_check.h"
#include "comm/mpi_context.h"
#include "comm/nccl_check.h"
#include "core/log.h"
#include "cuda/common/cuda_check.h"

namespace fn {

namespace {

constexpr int kBusIdLen = 32;  // cudaDeviceGetPCIBusId writes at most 13 chars + NUL

std::string uuid_string(const cudaUUID_t& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  return fmt::format(
      "GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-"
      "{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
      b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
      b[15]);
}

const char* visible_devices() {
  const char* v = std::getenv("CUDA_VISIBLE_DEVICES");
  return v != nullptr ? v : "(unset)";
}

// Gathers one fixed-size string per rank.
std::vector<std::string> allgather_strings(const std::string& mine, MPI_Comm comm, int size) {
  char buf[64] = {0};
  std::strncpy(buf, mine.c_str(), sizeof(buf) - 1);
  std::vector<char> all(sizeof(buf) * static_cast<std::size_t>(size));
  FN_MPI_CHECK(MPI_Allgather(buf, sizeof(buf), MPI_CHAR, all.data(), sizeof(buf), MPI_CHAR, comm));
  std::vector<std::string> out;
  for (int r = 0; r < size; ++r) out.emplace_back(all.data() + sizeof(buf) * r);
  return out;
}

}  // namespace

GpuGroup gpu_group(const MpiContext& mpi) {
  return GpuGroup{mpi.world(), mpi.world_rank(), mpi.world_size(), mpi.local_rank(),
                  mpi.local_size()};
}

GpuGroup gpu_group_of_world() {
  GpuGroup g;
  g.comm = MPI_COMM_WORLD;
  FN_MPI_CHECK(MPI_Comm_rank(g.comm, &g.rank));
  FN_MPI_CHECK(MPI_Comm_size(g.comm, &g.size));
  MPI_Comm node = MPI_COMM_NULL;
  FN_MPI_CHECK(MPI_Comm_split_type(g.comm, MPI_COMM_TYPE_SHARED, g.rank, MPI_INFO_NULL, &node));
  MPI_Comm_rank(node, &g.local_rank);
  MPI_Comm_size(node, &g.local_size);
  MPI_Comm_free(&node);
  return g;
}

GpuSelection select_gpu(const GpuGroup& mpi, int device_override) {
  const int rank = mpi.rank;
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  // Every rank must learn whether any rank failed, so that no rank waits in the Allgather.
  std::string problem;
  if (rc != cudaSuccess) {
    problem = fmt::format("rank {} sees no usable GPU: cudaGetDeviceCount: {} ({})", rank,
                          cudaGetErrorString(rc), cudaGetErrorName(rc));
    cudaGetLastError();
  } else {
    const int want = device_override >= 0 ? device_override : mpi.local_rank;
    if (want >= count) {
      problem = fmt::format(
          "rank {} (node-local rank {} of {}) needs GPU {} but only {} GPU(s) are visible "
          "(CUDA_VISIBLE_DEVICES={}): run at most one rank per GPU",
          rank, mpi.local_rank, mpi.local_size, want, count, visible_devices());
    }
  }
  int bad = problem.empty() ? 0 : 1;
  int any_bad = 0;
  FN_MPI_CHECK(MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, mpi.comm));
  if (bad) FN_THROW(Cuda, "{}", problem);
  if (any_bad) FN_THROW(Cuda, "another rank found no usable GPU (see its message)");

  GpuSelection sel;
  sel.device = device_override >= 0 ? device_override : mpi.local_rank;
  FN_CUDA_CHECK(cudaSetDevice(sel.device));
  char bus[kBusIdLen] = {0};
  FN_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, kBusIdLen, sel.device));
  cudaDeviceProp prop{};
  FN_CUDA_CHECK(cudaGetDeviceProperties(&prop, sel.device));
  sel.bus_ids = allgather_strings(bus, mpi.comm, mpi.size);
  sel.uuids = allgather_strings(uuid_string(prop.uuid), mpi.comm, mpi.size);
  // Ranks on one node share a GPU when their UUIDs agree (bus ids can repeat across nodes).
  for (int a = 0; a < mpi.size; ++a) {
    for (int b = a + 1; b < mpi.size; ++b) {
      FN_REQUIRE(sel.uuids[a] != sel.uuids[b], Usage,
                 "ranks {} and {} both use GPU {} (bus {}): each rank needs its own GPU "
                 "(CUDA_VISIBLE_DEVICES={} on rank {})",
                 a, b, sel.uuids[a], sel.bus_ids[a], visible_devices(), rank);
    }
  }
  FN_LOG_DEBUG("rank {} uses GPU {} ({}, bus {})", rank, sel.device, prop.name, bus);
  return sel;
}

GpuComm::GpuComm(const MpiContext& mpi, int device_override)
    : GpuComm(gpu_group(mpi), device_override) {}

GpuComm::GpuComm(const GpuGroup& mpi, int device_override)
    : rank_(mpi.rank), size_(mpi.size), mpi_comm_(mpi.comm) {
  selection_ = select_gpu(mpi, device_override);

  // Peer access, decided identically everywhere (MPI_MIN over every rank's verdict).
  std::string why;
  int ok = 1;
  const char* disable = std::getenv("FN_DISABLE_P2P");
  if (mpi.local_size != mpi.size) {
    ok = 0;
    why = fmt::format("ranks span several nodes ({} of {} ranks on this node)", mpi.local_size,
                      mpi.size);
  } else if (disable != nullptr && std::strcmp(disable, "1") == 0) {
    ok = 0;
    why = "peer access disabled by FN_DISABLE_P2P=1";
  } else {
    for (int p = 0; p < size_ && ok; ++p) {
      if (p == rank_) continue;
      int peer_dev = -1;
      if (cudaDeviceGetByPCIBusId(&peer_dev, selection_.bus_ids[p].c_str()) != cudaSuccess) {
        cudaGetLastError();
        ok = 0;
        why = fmt::format("rank {} cannot see rank {}'s GPU (bus {})", rank_, p,
                          selection_.bus_ids[p]);
        break;
      }
      int can = 0;
      FN_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, selection_.device, peer_dev));
      if (!can) {
        ok = 0;
        why = fmt::format("no peer access from rank {}'s GPU (bus {}) to rank {}'s (bus {})", rank_,
                          selection_.bus_ids[rank_], p, selection_.bus_ids[p]);
      }
    }
  }
  int all_ok = 0;
  FN_MPI_CHECK(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, mpi_comm_));
  custom_possible_ = all_ok != 0;
  if (!custom_possible_) {
    custom_why_ = ok ? std::string("another rank lacks peer access (see its log)") : why;
    if (!ok) FN_LOG_WARN("custom all-reduce unavailable: {}", why);
  }

  // Never NVLink multicast / NVLS (it can put shared GPUs out of service).
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  ncclUniqueId id{};
  if (rank_ == 0) FN_NCCL_CHECK(ncclGetUniqueId(&id));
  FN_MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, mpi_comm_));
  FN_NCCL_CHECK(ncclCommInitRank(&nccl_, size_, id, rank_));
  abort_hook_ = register_abort_hook([this] { abort(); });
  int version = 0;
  ncclGetVersion(&version);
  FN_LOG_INFO("gpu: {} ranks, NCCL {} communicator ready (NCCL_NVLS_ENABLE=0)", size_, version);
}

GpuComm::~GpuComm() {
  unregister_abort_hook(abort_hook_);
  if (nccl_ == nullptr) return;
  // Unwinding from an error: peers may be gone, so abort rather than destroy.
  if (std::uncaught_exceptions() > 0) {
    ncclCommAbort(nccl_);
  } else {
    ncclCommDestroy(nccl_);
  }
  nccl_ = nullptr;
}

bool GpuComm::custom_all_reduce_possible(std::string* why) const {
  if (why != nullptr) *why = custom_why_;
  return custom_possible_;
}

void GpuComm::abort() noexcept {
  if (nccl_ != nullptr) {
    ncclCommAbort(nccl_);
    nccl_ = nullptr;
  }
}

}  // namespace fn
