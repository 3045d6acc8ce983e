// The defaults of Backend's optional functions (core/backend.h): a caller's bug when reached.
#include "core/backend.h"

#include "core/error.h"

namespace fn {

std::vector<int32_t> Backend::decode(int32_t, int64_t, const SamplingParams&, uint64_t,
                                     const std::function<bool(int32_t)>&) {
  FN_THROW(Internal, "the {} backend does not sample on the device (decode)", info_.name);
}

double Backend::device_used_mib() const {
  FN_THROW(Internal, "the {} backend has no device memory figure", info_.name);
}

int64_t Backend::graph_captures() const {
  FN_THROW(Internal, "the {} backend captures no graphs", info_.name);
}

void Backend::set_position_for_benchmark(int64_t) {
  FN_THROW(Internal, "the {} backend cannot set its position for a benchmark", info_.name);
}

StepBreakdown Backend::profile_steps(int32_t, int64_t, bool) {
  FN_THROW(Internal, "the {} backend has no per-family step profile", info_.name);
}

}  // namespace fn
