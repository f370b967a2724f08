// Kiln's tokenizers against ids produced by independent implementations (Hugging Face
// `tokenizers`, llama.cpp) on the fixture strings. Regenerate the fixtures with
// scripts/fixtures/make_tokenizer_fixtures.py and (WordPiece: minilm*.jsonl, bert_chars.json)
// scripts/fixtures/make_wordpiece_fixtures.py.
#include <gtest/gtest.h>
#include <unicode/uchar.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "models/gguf/gguf.h"
#include "models/hf/hf_folder.h"
#include "models/io/mapped_file.h"
#include "models/io/test_paths.h"
#include "models/tokenizer/tokenizer.h"
#include "models/tokenizer/unicode.h"
#include "models/tokenizer/wordpiece.h"

namespace kiln::models {
namespace {

using json = nlohmann::json;

using ::kiln::models::testing::DefaultEmbeddingModelPath;
using ::kiln::models::testing::DefaultModelPath;

std::string FixtureDir() { return testing::FixturePath("tokenizer/"); }

std::vector<json> ReadJsonl(const std::string& path) {
  std::ifstream in(path);
  std::vector<json> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(json::parse(line));
  return out;
}

struct Case {
  std::string text;
  std::vector<int32_t> ids;
  std::string decoded;
};

std::vector<Case> LoadCases(const std::string& ids_file) {
  std::vector<json> strings = ReadJsonl(FixtureDir() + "strings.jsonl");
  std::vector<json> rows = ReadJsonl(FixtureDir() + ids_file);
  EXPECT_EQ(strings.size(), rows.size()) << ids_file;
  std::vector<Case> cases;
  for (size_t i = 0; i < std::min(strings.size(), rows.size()); ++i) {
    Case c;
    c.text = strings[i].get<std::string>();
    c.ids = rows[i]["ids"].get<std::vector<int32_t>>();
    c.decoded = rows[i].contains("decoded") ? rows[i]["decoded"].get<std::string>() : c.text;
    cases.push_back(std::move(c));
  }
  return cases;
}

std::string Show(const std::vector<int32_t>& v) {
  std::string s;
  for (int32_t x : v) s += std::to_string(x) + " ";
  return s;
}

// Compares every string; reports the first few mismatches in full.
void ExpectEncodes(const Tokenizer& tok, const std::vector<Case>& cases, bool add_special,
                   bool check_decode, const DecodeOptions& dopts) {
  ASSERT_GE(cases.size(), 1000u);
  int failures = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    auto ids = tok.Encode(c.text, {.add_special_tokens = add_special, .parse_special = true});
    ASSERT_TRUE(ids.ok()) << ids.status();
    if (*ids != c.ids && ++failures <= 5) {
      ADD_FAILURE() << "line " << i << " text " << json(c.text).dump() << "\n  kiln: " << Show(*ids)
                    << "\n  want: " << Show(c.ids);
    }
    if (check_decode) {
      std::string text = tok.Decode(c.ids, dopts);
      if (text != c.decoded && ++failures <= 5) {
        ADD_FAILURE() << "decode line " << i << ": got " << json(text).dump() << " want "
                      << json(c.decoded).dump();
      }
    }
  }
  EXPECT_EQ(failures, 0) << "of " << cases.size() << " strings";
}

std::unique_ptr<Tokenizer> FromJsonFile(const std::string& name) {
  auto file = MappedFile::Open(FixtureDir() + name);
  EXPECT_TRUE(file.ok()) << file.status();
  auto tok = Tokenizer::FromHfJson((*file)->bytes(), nullptr, name);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? std::move(*tok) : nullptr;
}

TEST(TokenizerFixtureTest, SmolLM2GgufMatchesHuggingFace) {
  auto gguf = GgufFile::Open(DefaultModelPath());
  ASSERT_TRUE(gguf.ok()) << gguf.status() << " (run scripts/fetch-default-model.sh)";
  auto tok = Tokenizer::FromGguf(**gguf);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 49152);
  EXPECT_EQ((*tok)->kind(), TokenizerKind::kByteLevelBpe);
  EXPECT_EQ((*tok)->eos_id(), 2);
  EXPECT_FALSE((*tok)->add_bos());
  ExpectEncodes(**tok, LoadCases("smollm2.jsonl"), /*add_special=*/true, /*check_decode=*/true,
                {.skip_special_tokens = false});
}

TEST(TokenizerFixtureTest, TrainedByteLevelTokenizerJson) {
  auto tok = FromJsonFile("bpe_bytelevel.tokenizer.json");
  ASSERT_NE(tok, nullptr);
  EXPECT_TRUE(tok->add_bos());
  ExpectEncodes(*tok, LoadCases("bpe_bytelevel.jsonl"), true, true, {.skip_special_tokens = true});
}

TEST(TokenizerFixtureTest, TrainedSentencePieceTokenizerJson) {
  auto tok = FromJsonFile("sp_bpe.tokenizer.json");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->kind(), TokenizerKind::kSentencePieceBpe);
  EXPECT_TRUE(tok->add_bos());
  ExpectEncodes(*tok, LoadCases("sp_bpe.jsonl"), true, true, {.skip_special_tokens = true});
}

std::unique_ptr<Tokenizer> MiniLm() {
  auto folder = HfFolder::Open(DefaultEmbeddingModelPath());
  EXPECT_TRUE(folder.ok()) << folder.status() << " (run scripts/fetch-default-model.sh)";
  if (!folder.ok()) return nullptr;
  auto tok = Tokenizer::FromHfFolder(*folder);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? std::move(*tok) : nullptr;
}

TEST(TokenizerFixtureTest, MiniLmWordPieceMatchesHuggingFace) {
  auto tok = MiniLm();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->kind(), TokenizerKind::kWordPiece);
  EXPECT_EQ(tok->vocab_size(), 30522);
  EXPECT_EQ(tok->bos_id(), 101);  // [CLS]
  EXPECT_EQ(tok->eos_id(), 102);  // [SEP]
  EXPECT_EQ(tok->unk_id(), 100);
  EXPECT_EQ(tok->pad_id(), 0);
  EXPECT_TRUE(tok->add_bos());
  EXPECT_TRUE(tok->add_eos());
  ExpectEncodes(*tok, LoadCases("minilm.jsonl"), /*add_special=*/true, /*check_decode=*/true,
                {.skip_special_tokens = false});
}

// Special-token text with parse_special on and off, over-long words, control characters, the
// characters whose category changed since Unicode 8.0, decoding with and without specials.
TEST(TokenizerFixtureTest, MiniLmWordPieceEdgeCases) {
  auto tok = MiniLm();
  ASSERT_NE(tok, nullptr);
  std::vector<json> rows = ReadJsonl(FixtureDir() + "minilm_extra.jsonl");
  ASSERT_GE(rows.size(), 20u);
  for (const json& r : rows) {
    std::string text = r["text"].get<std::string>();
    SCOPED_TRACE(json(text).dump());
    auto ids = tok->Encode(text, {.add_special_tokens = true, .parse_special = true});
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(Show(*ids), Show(r["ids"].get<std::vector<int32_t>>()));
    auto plain = tok->Encode(text, {.add_special_tokens = true, .parse_special = false});
    ASSERT_TRUE(plain.ok()) << plain.status();
    EXPECT_EQ(Show(*plain), Show(r["ids_no_special"].get<std::vector<int32_t>>()));
    EXPECT_EQ(tok->Decode(*ids), r["decoded"].get<std::string>());
    EXPECT_EQ(tok->Decode(*ids, {.skip_special_tokens = true}),
              r["decoded_skip"].get<std::string>());
  }
}

// Inclusive code point ranges, read once from the fixture's [[first, last], ...].
using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

Ranges ReadRanges(const json& ranges) {
  Ranges out;
  for (const json& r : ranges) out.emplace_back(r[0].get<uint32_t>(), r[1].get<uint32_t>());
  return out;
}

bool InRanges(const Ranges& ranges, uint32_t cp) {
  for (const auto& [first, last] : ranges) {
    if (cp >= first && cp <= last) return true;
  }
  return false;
}

// Every code point through each BertNormalizer step and BertPreTokenizer, against HF. Guards
// the Unicode 8.0 categories (wordpiece.h) whatever ICU version Kiln links.
TEST(TokenizerFixtureTest, BertCharacterClassesMatchHuggingFace) {
  std::ifstream in(FixtureDir() + "bert_chars.json");
  ASSERT_TRUE(in.good());
  json ref = json::parse(in);
  std::unordered_map<uint32_t, std::string> strip, lower;
  for (const json& e : ref["strip_accents"]) strip[e[0].get<uint32_t>()] = e[1].get<std::string>();
  for (const json& e : ref["lowercase"]) lower[e[0].get<uint32_t>()] = e[1].get<std::string>();
  ASSERT_GT(strip.size(), 3000u);
  ASSERT_GT(lower.size(), 1000u);
  const Ranges clean_removed = ReadRanges(ref["clean_removed"]);
  const Ranges clean_space = ReadRanges(ref["clean_space"]);
  const Ranges chinese_chars = ReadRanges(ref["chinese"]);
  const Ranges punctuation = ReadRanges(ref["punctuation"]);
  const Ranges whitespace = ReadRanges(ref["whitespace"]);
  const BertNormalizerOptions none{false, false, false, false};
  BertNormalizerOptions clean = none, chinese = none, accents = none, lowercase = none;
  clean.clean_text = true;
  chinese.handle_chinese_chars = true;
  accents.strip_accents = true;
  lowercase.lowercase = true;
  int failures = 0, unknown_to_icu = 0;
  auto fail = [&](uint32_t cp, std::string_view what, std::string_view got, std::string_view want) {
    if (++failures <= 10) {
      ADD_FAILURE() << "U+" << std::hex << cp << " " << what << ": got " << json(got).dump()
                    << " want " << json(want).dump();
    }
  };
  std::vector<std::pair<size_t, size_t>> words;
  for (uint32_t cp = 0; cp < 0x110000; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    std::string ch;
    utf8::AppendCodepoint(cp, &ch);
    std::string want = InRanges(clean_removed, cp) ? "" : InRanges(clean_space, cp) ? " " : ch;
    if (std::string got = BertNormalize(ch, clean); got != want) fail(cp, "clean_text", got, want);
    want = InRanges(chinese_chars, cp) ? " " + ch + " " : ch;
    if (std::string got = BertNormalize(ch, chinese); got != want) fail(cp, "chinese", got, want);
    if (cp >= 0xAC00 && cp <= 0xD7A3) {  // Hangul syllable: L V (T) jamo
      uint32_t s = cp - 0xAC00;
      want.clear();
      utf8::AppendCodepoint(0x1100 + s / 588, &want);
      utf8::AppendCodepoint(0x1161 + (s % 588) / 28, &want);
      if (s % 28 != 0) utf8::AppendCodepoint(0x11A7 + s % 28, &want);
    } else {
      auto it = strip.find(cp);
      want = it != strip.end() ? it->second : ch;
    }
    if (std::string got = BertNormalize(ch, accents); got != want) fail(cp, "strip", got, want);
    auto it = lower.find(cp);
    want = it != lower.end() ? it->second : ch;
    if (std::string got = BertNormalize(ch, lowercase); got != want) {
      // Rust's std has newer Unicode than the linked ICU (72: 15.0).
      if (u_charType(static_cast<UChar32>(cp)) == U_UNASSIGNED) {
        ++unknown_to_icu;
      } else {
        fail(cp, "lowercase", got, want);
      }
    }
    words.clear();
    BertPreTokenize("a" + ch + "a", 0, &words);
    size_t want_words = InRanges(punctuation, cp) ? 3 : InRanges(whitespace, cp) ? 2 : 1;
    if (words.size() != want_words) {
      fail(cp, "pre-tokenizer words", std::to_string(words.size()), std::to_string(want_words));
    }
  }
  EXPECT_EQ(failures, 0);
  // Characters HF lowercases that this ICU does not know yet (Unicode 16 with ICU 72: 55).
  EXPECT_LE(unknown_to_icu, 100);
}

void ExpectGgufMatchesLlamaCpp(const std::string& name) {
  std::ifstream probe(FixtureDir() + name + ".llama_cpp.jsonl");
  if (!probe.good()) {
    GTEST_SKIP() << "no llama.cpp reference ids for " << name
                 << " (regenerate fixtures with llama-cpp-python installed)";
  }
  auto gguf = GgufFile::Open(FixtureDir() + name + ".gguf");
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  auto tok = Tokenizer::FromGguf(**gguf);
  ASSERT_TRUE(tok.ok()) << tok.status();
  ExpectEncodes(**tok, LoadCases(name + ".llama_cpp.jsonl"), true, false, {});
}

TEST(TokenizerFixtureTest, TrainedByteLevelGgufMatchesLlamaCpp) {
  ExpectGgufMatchesLlamaCpp("bpe_bytelevel");
}

TEST(TokenizerFixtureTest, TrainedSentencePieceGgufMatchesLlamaCpp) {
  ExpectGgufMatchesLlamaCpp("sp_bpe");
}

}  // namespace
}  // namespace kiln::models
