// A compiled PCRE2 pattern in UTF + UCP mode with JIT, for pre-tokenizer splits.
//
// Thread-safety: Compile once, then FindAll from any number of threads.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/base/status.h"

namespace kiln::models {

class Pcre2Regex {
 public:
  // InvalidArgument with PCRE2's message and the offset in the pattern on a syntax error.
  static StatusOr<std::unique_ptr<Pcre2Regex>> Compile(std::string_view pattern);
  ~Pcre2Regex();

  // Appends [begin, end) byte ranges of every non-overlapping match in `text` (REQUIRES: valid
  // UTF-8). An empty match advances by one character.
  void FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const;
  const std::string& pattern() const { return pattern_; }

 private:
  Pcre2Regex() = default;
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

}  // namespace kiln::models
