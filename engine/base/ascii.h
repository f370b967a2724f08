// Small ASCII string helpers shared by the front ends (HTTP header names, auth schemes).
#pragma once

#include <cstddef>
#include <string_view>

namespace kiln {

constexpr char AsciiLower(char c) {
  return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c;
}

// Whether `a` and `b` are equal ignoring ASCII case (header names, "Bearer", "100-continue").
constexpr bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (AsciiLower(a[i]) != AsciiLower(b[i])) return false;
  }
  return true;
}

}  // namespace kiln
