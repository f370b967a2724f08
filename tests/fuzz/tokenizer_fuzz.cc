// libFuzzer target: tokenizer encode/decode and streaming detokenization on arbitrary text,
// with the two vocabularies in tests/fixtures/tokenizer/ (byte-level and SentencePiece-style).
// Properties: Encode never crashes, rejects only invalid UTF-8, returns ids in range; byte-level
// BPE round-trips exactly; streamed detokenization equals Decode.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "models/io/mapped_file.h"
#include "models/tokenizer/detokenizer.h"
#include "models/tokenizer/tokenizer.h"
#include "models/tokenizer/unicode.h"

namespace {

using kiln::models::Tokenizer;

std::unique_ptr<Tokenizer> Load(const char* name) {
  std::string path = std::string(KILN_SOURCE_DIR) + "/tests/fixtures/tokenizer/" + name;
  auto file = kiln::models::MappedFile::Open(path);
  if (!file.ok()) std::abort();
  auto tok = Tokenizer::FromHfJson((*file)->bytes(), nullptr, name);
  if (!tok.ok()) std::abort();
  return std::move(*tok);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Tokenizer* byte_level = Load("bpe_bytelevel.tokenizer.json").release();
  static Tokenizer* spm = Load("sp_bpe.tokenizer.json").release();
  std::string_view text(reinterpret_cast<const char*>(data), size);
  bool valid = kiln::models::utf8::FindInvalid(text) == std::string_view::npos;
  for (Tokenizer* tok : {byte_level, spm}) {
    for (bool special : {true, false}) {
      auto ids = tok->Encode(text, {.add_special_tokens = false, .parse_special = special});
      if (ids.ok() != valid) std::abort();
      if (!ids.ok()) continue;
      for (int32_t id : *ids) {
        if (id < 0 || id >= tok->vocab_size()) std::abort();
      }
      std::string decoded = tok->Decode(*ids, {.strip_leading_space = false});
      if (tok == byte_level && decoded != text) std::abort();  // byte-level BPE is lossless
      kiln::models::Detokenizer d(*tok);
      std::string streamed;
      for (int32_t id : *ids) streamed += d.Add(id);
      streamed += d.Finish();
      if (streamed != decoded) std::abort();
    }
  }
  return 0;
}
