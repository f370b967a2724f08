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
#include <string>
#include <string_view>
#include <type_traits>
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

namespace internal {
// Debian's Abseil has its own string_view: pass std::string_view arguments to absl::StrCat
// as absl::string_view; everything else unchanged.
template <typename T>
decltype(auto) StrArg(const T& v) {
  if constexpr (std::is_convertible_v<const T&, std::string_view> &&
                !std::is_convertible_v<const T&, absl::string_view>) {
    const std::string_view sv(v);
    return absl::string_view(sv.data(), sv.size());
  } else {
    return v;
  }
}
}  // namespace internal

// absl::StrCat that also takes std::string_view.
template <typename... A>
std::string StrCat(const A&... a) {
  return absl::StrCat(internal::StrArg(a)...);
}

// Named factories, so call sites read `kiln::InvalidArgument("...", x, "...")`. Arguments are
// concatenated with StrCat above.
#define KILN_STATUS_FACTORY_(Name, absl_fn)                     \
  template <typename... A>                                      \
  Status Name(const A&... a) {                                  \
    return absl::absl_fn(absl::StrCat(internal::StrArg(a)...)); \
  }
KILN_STATUS_FACTORY_(InvalidArgument, InvalidArgumentError)
KILN_STATUS_FACTORY_(NotFound, NotFoundError)
KILN_STATUS_FACTORY_(AlreadyExists, AlreadyExistsError)
KILN_STATUS_FACTORY_(FailedPrecondition, FailedPreconditionError)
KILN_STATUS_FACTORY_(OutOfRange, OutOfRangeError)
KILN_STATUS_FACTORY_(ResourceExhausted, ResourceExhaustedError)
KILN_STATUS_FACTORY_(Unavailable, UnavailableError)
KILN_STATUS_FACTORY_(Unimplemented, UnimplementedError)
KILN_STATUS_FACTORY_(Internal, InternalError)
KILN_STATUS_FACTORY_(Cancelled, CancelledError)
KILN_STATUS_FACTORY_(DeadlineExceeded, DeadlineExceededError)
KILN_STATUS_FACTORY_(DataLoss, DataLossError)
KILN_STATUS_FACTORY_(PermissionDenied, PermissionDeniedError)
KILN_STATUS_FACTORY_(Unauthenticated, UnauthenticatedError)
#undef KILN_STATUS_FACTORY_

// Returns `status` with `prefix: ` in front of its message (same code).
Status Annotate(const Status& status, std::string_view prefix);

// Attaches the request field a bad-input error is about ("max_tokens", "messages[2].role"),
// which the OpenAI front end reports as the error's `param`. Kept in the status's payload, so
// it survives being returned through any number of layers (but not Annotate).
Status WithParam(Status status, std::string_view param);
// The field attached by WithParam; else the leading backquoted name of the message
// ("`top_p` is 1.5; ..." -> "top_p"), as sampling validation writes them; else "".
std::string ParamOf(const Status& status);

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
#define KILN_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::kiln::Status kiln_status_ = (expr);        \
    if (!kiln_status_.ok()) return kiln_status_; \
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
#define KILN_CHECK(cond, msg)                                                   \
  do {                                                                          \
    if (!(cond)) ::kiln::internal::CheckFailed(__FILE__, __LINE__, #cond, msg); \
  } while (0)
