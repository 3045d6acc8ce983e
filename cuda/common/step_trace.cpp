// The registry of cuda/common/step_trace.h: one setter per translation unit compiled with
// FN_STEP_TRACE.
#include "cuda/common/step_trace.h"

#include <mutex>
#include <vector>

namespace fn {
namespace {

struct Registry {
  std::mutex mu;
  std::vector<StepTraceSetter> setters;
};

Registry& registry() {
  static Registry r;  // constructed on first use: safe from other files' static initialisers
  return r;
}

}  // namespace

bool step_trace_register(StepTraceSetter setter) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  r.setters.push_back(setter);
  return true;
}

bool step_trace_compiled() {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  return !r.setters.empty();
}

void step_trace_attach(StepTraceRecord* records, uint32_t* count, uint32_t capacity) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  for (StepTraceSetter set : r.setters) set(records, count, capacity);
}

}  // namespace fn
