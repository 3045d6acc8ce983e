#include "comm/mpi_context.h"

#include <cstdlib>

#include "comm/abort_hooks.h"
#include "comm/mpi_check.h"
#include "core/log.h"

namespace fn {

namespace detail {
void throw_mpi_error(int code, const char* expr, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  MPI_Error_string(code, text, &len);
  throw_error(ErrorKind::Mpi, file, line, fmt::format("MPI call {} failed: {}", expr, text));
}
}  // namespace detail

MpiContext::MpiContext(int* argc, char*** argv) {
  int provided = 0;
  FN_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
  FN_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  FN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_));
  FN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size_));
  FN_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank_, MPI_INFO_NULL,
                                   &node_comm_));
  FN_MPI_CHECK(MPI_Comm_rank(node_comm_, &local_rank_));
  FN_MPI_CHECK(MPI_Comm_size(node_comm_, &local_size_));
  set_log_rank(world_rank_, world_size_);
}

MpiContext::~MpiContext() {
  if (node_comm_ != MPI_COMM_NULL) MPI_Comm_free(&node_comm_);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void MpiContext::abort_all(int code) noexcept {
  run_abort_hooks();  // e.g. ncclCommAbort, before the peers are killed
  int initialized = 0;
  MPI_Initialized(&initialized);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (initialized && !finalized) {
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size > 1) MPI_Abort(MPI_COMM_WORLD, code);
    MPI_Finalize();
  }
  std::exit(code);
}

}  // namespace fn
