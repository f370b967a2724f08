#include "models/tokenizer/detokenizer.h"

#include "models/tokenizer/unicode.h"

namespace kiln::models {

std::string Detokenizer::Add(int32_t id) {
  if (id < 0 || id >= tokenizer_.vocab_size()) return "";
  if (options_.skip_special_tokens && tokenizer_.IsSpecial(id)) return "";
  std::string_view bytes = tokenizer_.TokenBytes(id);
  if (!started_) {
    started_ = true;
    if (options_.strip_leading_space && tokenizer_.strips_leading_space() && !bytes.empty() &&
        bytes[0] == ' ') {
      bytes.remove_prefix(1);
    }
  }
  pending_.append(bytes);
  // Hold back a trailing sequence that is valid so far but incomplete (at most 3 bytes).
  size_t hold = pending_.size();
  for (size_t back = 1; back <= 3 && back <= pending_.size(); ++back) {
    size_t p = pending_.size() - back;
    auto c = static_cast<uint8_t>(pending_[p]);
    if (c < 0x80) break;
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for its lead
    bool incomplete = false;
    utf8::ValidSeqLen(pending_, p, &incomplete);
    if (incomplete) hold = p;
    break;
  }
  std::string out;
  utf8::AppendLossy(std::string_view(pending_).substr(0, hold), &out);
  pending_.erase(0, hold);
  emitted_ += out.size();
  return out;
}

std::string Detokenizer::Finish() {
  std::string out;
  utf8::AppendLossy(pending_, &out);
  pending_.clear();
  started_ = false;
  emitted_ += out.size();
  return out;
}

}  // namespace kiln::models
