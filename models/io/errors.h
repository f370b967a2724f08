// String and Status helpers for models/: StrCat-style concatenation that also takes
// std::string_view (Debian's Abseil has its own absl::string_view, which std::string_view does
// not convert to), and Status factories in kiln::models that accept the same arguments. Inside
// namespace kiln::models these shadow kiln::InvalidArgument etc.; codes are unchanged.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "engine/base/status.h"

namespace kiln::models {
namespace internal {

template <typename T>
decltype(auto) AlphaArg(const T& v) {
  if constexpr (std::is_same_v<T, std::string_view>) {
    return ToAbsl(v);
  } else {
    return (v);
  }
}

}  // namespace internal

// absl::StrCat that also accepts std::string_view.
template <typename... A>
std::string Cat(const A&... a) {
  return absl::StrCat(internal::AlphaArg(a)...);
}

template <typename... A>
Status InvalidArgument(const A&... a) {
  return absl::InvalidArgumentError(Cat(a...));
}
template <typename... A>
Status NotFound(const A&... a) {
  return absl::NotFoundError(Cat(a...));
}
template <typename... A>
Status Internal(const A&... a) {
  return absl::InternalError(Cat(a...));
}
template <typename... A>
Status Unimplemented(const A&... a) {
  return absl::UnimplementedError(Cat(a...));
}
template <typename... A>
Status FailedPrecondition(const A&... a) {
  return absl::FailedPreconditionError(Cat(a...));
}
template <typename... A>
Status OutOfRange(const A&... a) {
  return absl::OutOfRangeError(Cat(a...));
}

}  // namespace kiln::models
