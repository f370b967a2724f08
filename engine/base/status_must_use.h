// Makes a dropped absl::Status (kiln::Status) a compile error.
//
// Abseil marks Status as must-use only under Clang; Debian's build under GCC leaves the class
// unannotated, so `DoSomething();` silently discards an error. This header re-declares the
// class [[nodiscard]] *before* Abseil defines it — the attribute of a first declaration holds
// for the class — and CMakeLists.txt forces it into every translation unit (-include) and
// turns -Werror=unused-result on. StatusOr is already [[nodiscard]] in Abseil.
//
// To drop a status on purpose, say why and cast: `(void)stream->Synchronize();  // best effort`.
// engine/base/status_must_use_test.sh checks that a dropped Status does not compile.
#pragma once

#ifdef __cplusplus
#include "absl/base/config.h"

namespace absl {
ABSL_NAMESPACE_BEGIN
class [[nodiscard]] Status;
ABSL_NAMESPACE_END
}  // namespace absl
#endif
