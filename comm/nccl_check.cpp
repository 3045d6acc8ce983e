#include "comm/nccl_check.h"

#include <string>

namespace fn::detail {

void throw_nccl_error(ncclResult_t code, const char* expr, const char* file, int line) {
  const char* last = ncclGetLastError(nullptr);
  std::string detail = (last != nullptr && last[0] != '\0') ? fmt::format(" [{}]", last) : "";
  throw_error(ErrorKind::Nccl, file, line,
              fmt::format("NCCL call {} failed at {}:{}: {}{}", expr, file, line,
                          ncclGetErrorString(code), detail));
}

}  // namespace fn::detail
