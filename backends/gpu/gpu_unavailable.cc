// MakeCudaBackend for builds without the CUDA toolkit (KILN_CUDA=OFF, or auto without one).
#include "backends/builtin.h"

namespace kiln::backend {

std::unique_ptr<Backend> MakeCudaBackend() { return nullptr; }

}  // namespace kiln::backend
