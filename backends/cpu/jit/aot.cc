#include "backends/cpu/jit/aot.h"

#include <algorithm>
#include <cstring>

namespace kiln::cpu::jit {

const AotKernel* FindAotKernel(std::string_view key) {
  const std::span<const AotKernel> t = AotKernels();
  auto it = std::lower_bound(t.begin(), t.end(), key, [](const AotKernel& k, std::string_view v) {
    return std::string_view(k.key) < v;
  });
  return it != t.end() && std::string_view(it->key) == key ? &*it : nullptr;
}

}  // namespace kiln::cpu::jit
