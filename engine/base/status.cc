#include "engine/base/status.h"

namespace kiln {

Status Annotate(const Status& status, std::string_view prefix) {
  if (status.ok()) return status;
  return Status(status.code(), absl::StrCat(ToAbsl(prefix), ": ", status.message()));
}

namespace internal {
void CheckFailed(const char* file, int line, const char* cond, const char* msg) {
  std::fprintf(stderr, "%s:%d: KILN_CHECK(%s) failed: %s\n", file, line, cond, msg);
  std::fflush(stderr);
  std::abort();
}
}  // namespace internal

}  // namespace kiln
