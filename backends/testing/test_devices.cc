// The built-in devices for the engine's tests (engine/testing/devices.h).
#include <cstdio>
#include <cstdlib>

#include "backends/builtin.h"
#include "engine/testing/devices.h"

namespace kiln {

std::unique_ptr<backend::Backend> MakeTestBackend(std::string_view name, int threads) {
  if (name == "ref") return backend::MakeRefBackend();
  if (name == "cpu") return backend::MakeCpuBackend(threads);
  if (name == "xpu") return backend::MakeXpuBackend();
  if (name == "cuda") return backend::MakeCudaBackend();
  std::fprintf(stderr, "MakeTestBackend: unknown backend '%.*s' (ref, cpu, xpu or cuda)\n",
               static_cast<int>(name.size()), name.data());
  std::abort();
}

}  // namespace kiln
