#include "cuda/common/cuda_check.h"

namespace fn::detail {

void throw_cuda_error(cudaError_t code, const char* expr, const char* file, int line) {
  throw_error(ErrorKind::Cuda, file, line,
              fmt::format("CUDA call {} failed at {}:{}: {} ({})", expr, file, line,
                          cudaGetErrorString(code), cudaGetErrorName(code)));
}

}  // namespace fn::detail
