// Status-based errors for every module boundary in Kiln.
//
// Kiln uses absl::Status / absl::StatusOr (gRPC already depends on Abseil), under short
// aliases. Errors cross module boundaries as values, never as exceptions. The mapping from a
// Status to a gRPC code or an HTTP status lives in one place: server/status_mapping.h.
//
// Messages are written for the person who sent the bad input: say what was wrong, where,
// and what is allowed ("`max_tokens` is 100000 but this model's context is 8192").
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace kiln {

using Status = absl::Status;
template <typename T>
using StatusOr = absl::StatusOr<T>;
using StatusCode = absl::StatusCode;

inline Status OkStatus() { return absl::OkStatus(); }

// Named factories, re-exported so call sites read `kiln::InvalidArgument(...)`.
template <typename... A>
Status InvalidArgument(const A&... a) { return absl::InvalidArgumentError(absl::StrCat(a...)); }
template <typename... A>
Status NotFound(const A&... a) { return absl::NotFoundError(absl::StrCat(a...)); }
template <typename... A>
Status AlreadyExists(const A&... a) { return absl::AlreadyExistsError(absl::StrCat(a...)); }
template <typename... A>
Status FailedPrecondition(const A&... a) {
  return absl::FailedPreconditionError(absl::StrCat(a...));
}
template <typename... A>
Status OutOfRange(const A&... a) { return absl::OutOfRangeError(absl::StrCat(a...)); }
template <typename... A>
Status ResourceExhausted(const A&... a) {
  return absl::ResourceExhaustedError(absl::StrCat(a...));
}
template <typename... A>
Status Unavailable(const A&... a) { return absl::UnavailableError(absl::StrCat(a...)); }
template <typename... A>
Status Unimplemented(const A&... a) { return absl::UnimplementedError(absl::StrCat(a...)); }
template <typename... A>
Status Internal(const A&... a) { return absl::InternalError(absl::StrCat(a...)); }
template <typename... A>
Status Cancelled(const A&... a) { return absl::CancelledError(absl::StrCat(a...)); }
template <typename... A>
Status DeadlineExceeded(const A&... a) {
  return absl::DeadlineExceededError(absl::StrCat(a...));
}
template <typename... A>
Status DataLoss(const A&... a) { return absl::DataLossError(absl::StrCat(a...)); }

// Returns `status` with `prefix: ` in front of its message (same code).
Status Annotate(const Status& status, std::string_view prefix);

// Debian's Abseil is built with its own string_view type, not std::string_view: convert at
// the boundary with these rather than relying on implicit conversions.
inline std::string_view ToStd(absl::string_view s) { return {s.data(), s.size()}; }
inline absl::string_view ToAbsl(std::string_view s) { return {s.data(), s.size()}; }
inline std::string_view StatusMessage(const Status& s) { return ToStd(s.message()); }

namespace internal {
[[noreturn]] void CheckFailed(const char* file, int line, const char* cond, const char* msg);
}  // namespace internal

}  // namespace kiln

#define KILN_STATUS_CONCAT_INNER_(a, b) a##b
#define KILN_STATUS_CONCAT_(a, b) KILN_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (a Status) is not OK.
#define KILN_RETURN_IF_ERROR(expr)                      \
  do {                                                  \
    ::kiln::Status kiln_status_ = (expr);               \
    if (!kiln_status_.ok()) return kiln_status_;        \
  } while (0)

// `KILN_ASSIGN_OR_RETURN(auto x, F());` — unwraps a StatusOr or returns its error.
#define KILN_ASSIGN_OR_RETURN(lhs, expr) \
  KILN_ASSIGN_OR_RETURN_IMPL_(KILN_STATUS_CONCAT_(kiln_statusor_, __LINE__), lhs, expr)
#define KILN_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return std::move(tmp).status();    \
  lhs = std::move(tmp).value()

// Programmer errors only (broken invariants), never bad input: aborts with file, line and a
// message. Always on, in every build type.
#define KILN_CHECK(cond, msg)                                               \
  do {                                                                      \
    if (!(cond)) ::kiln::internal::CheckFailed(__FILE__, __LINE__, #cond, msg); \
  } while (0)
