// Shared state of one launch for host kernels whose threads cooperate inside the launch: for
// example, the parts of a split row that the last thread to arrive combines. A kernel's data
// holds one LaunchScratch<T>; each launch gets its own T, keyed by its LaunchArgs, which stay put
// while the program that owns them lives.
//
// Entries are never dropped. A program destroyed while its kernel data lives on leaves one T
// per launch behind; a later launch at the same address reuses it.
//
// Thread-safety: For is thread-safe. The T it returns is shared by the launch's threads.
// Every thread of a launch must ask `fit` for the same size, so that nothing is resized while
// another thread of the launch uses it.
#pragma once

#include <memory>
#include <mutex>
#include <unordered_map>

#include "engine/backend/kernel_abi.h"

namespace kiln::backend {

template <class T>
class LaunchScratch {
 public:
  // Launch `a`'s state, default-constructed on first use; `fit(T&)` runs under the lock (to
  // grow buffers to the launch's sizes).
  template <class Fit>
  T& For(const LaunchArgs* a, Fit&& fit) const {
    std::lock_guard<std::mutex> l(mu_);
    std::unique_ptr<T>& s = map_[a];
    if (s == nullptr) s = std::make_unique<T>();
    fit(*s);
    return *s;
  }

 private:
  mutable std::mutex mu_;
  mutable std::unordered_map<const LaunchArgs*, std::unique_ptr<T>> map_;
};

}  // namespace kiln::backend
