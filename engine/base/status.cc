#include "engine/base/status.h"

#include "absl/strings/cord.h"

namespace kiln {
namespace {

constexpr std::string_view kParamPayload = "type.kiln.dev/llm.param";

}  // namespace

Status Annotate(const Status& status, std::string_view prefix) {
  if (status.ok()) return status;
  return Status(status.code(), absl::StrCat(ToAbsl(prefix), ": ", status.message()));
}

Status WithParam(Status status, std::string_view param) {
  if (!status.ok()) status.SetPayload(ToAbsl(kParamPayload), absl::Cord(ToAbsl(param)));
  return status;
}

std::string ParamOf(const Status& status) {
  if (auto p = status.GetPayload(ToAbsl(kParamPayload))) return std::string(*p);
  std::string_view m = StatusMessage(status);
  if (m.size() > 2 && m[0] == '`') {
    const size_t end = m.find('`', 1);
    if (end != std::string_view::npos) return std::string(m.substr(1, end - 1));
  }
  return "";
}

namespace internal {
void CheckFailed(const char* file, int line, const char* cond, const char* msg) {
  std::fprintf(stderr, "%s:%d: KILN_CHECK(%s) failed: %s\n", file, line, cond, msg);
  std::fflush(stderr);
  std::abort();
}
}  // namespace internal

}  // namespace kiln
