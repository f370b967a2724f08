#include "models/tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "models/io/errors.h"
#include "models/tokenizer/unicode.h"

namespace kiln::models {

StatusOr<std::unique_ptr<Pcre2Regex>> Pcre2Regex::Compile(std::string_view pattern) {
  int err = 0;
  PCRE2_SIZE err_off = 0;
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &err_off, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    return InvalidArgument("pre-tokenizer regex /", pattern, "/ does not compile at offset ",
                           err_off, ": ", reinterpret_cast<const char*>(msg));
  }
  std::unique_ptr<Pcre2Regex> re(new Pcre2Regex());
  re->pattern_ = std::string(pattern);
  re->code_ = code;
  re->jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return re;
}

Pcre2Regex::~Pcre2Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void Pcre2Regex::FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const {
  auto* code = static_cast<pcre2_code*>(code_);
  // Match data is per call: the compiled code is shared between threads, this is not.
  thread_local std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
      pcre2_match_data_create(4, nullptr), &pcre2_match_data_free);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  while (pos <= text.size()) {
    int rc =
        jit_ ? pcre2_jit_match(code, subject, text.size(), pos, 0, md.get(), nullptr)
             : pcre2_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, md.get(), nullptr);
    if (rc < 0) break;  // no match (errors cannot happen on valid UTF-8)
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
    size_t b = ov[0], e = ov[1];
    if (e == b) {
      if (b >= text.size()) break;
      pos = b + utf8::SeqLen(static_cast<uint8_t>(text[b]));
      continue;
    }
    out->emplace_back(b, e);
    pos = e;
  }
}

}  // namespace kiln::models
