#include "comm/abort_hooks.h"

#include <mutex>
#include <utility>
#include <vector>

namespace fn {

namespace {
std::mutex g_mutex;
int g_next_id = 1;
std::vector<std::pair<int, std::function<void()>>>& hooks() {
  static std::vector<std::pair<int, std::function<void()>>> list;
  return list;
}
}  // namespace

int register_abort_hook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const int id = g_next_id++;
  hooks().emplace_back(id, std::move(hook));
  return id;
}

void unregister_abort_hook(int id) noexcept {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& list = hooks();
  for (auto it = list.begin(); it != list.end(); ++it) {
    if (it->first == id) {
      list.erase(it);
      return;
    }
  }
}

void run_abort_hooks() noexcept {
  std::vector<std::pair<int, std::function<void()>>> list;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    list.swap(hooks());
  }
  for (auto it = list.rbegin(); it != list.rend(); ++it) {
    try {
      it->second();
    } catch (...) {
      // A hook failing must not stop the abort.
    }
  }
}

}  // namespace fn
