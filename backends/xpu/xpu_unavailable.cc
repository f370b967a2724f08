// MakeXpuBackend for builds without OpenCL or CLBlast: there is no xpu backend.
#include "backends/builtin.h"

namespace kiln::backend {

std::unique_ptr<Backend> MakeXpuBackend() { return nullptr; }

}  // namespace kiln::backend
