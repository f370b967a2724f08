#include "models/tokenizer/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "models/gguf/gguf.h"
#include "models/gguf/gguf_test_util.h"
#include "models/tokenizer/unicode.h"
#include "models/tokenizer/wordpiece.h"

namespace kiln::models {
namespace {

using json = nlohmann::ordered_json;
using ::kiln::models::testing::GgufBuilder;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// GPT-2's byte -> character map, for building vocabularies by hand.
std::string B(const std::string& raw) {
  std::string out;
  for (unsigned char b : raw) {
    bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    uint32_t cp = b;
    if (!printable) {
      int n = 0;
      for (int x = 0; x < b; ++x) {
        if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174))) ++n;
      }
      cp = 256 + n;
    }
    utf8::AppendCodepoint(cp, &out);
  }
  return out;
}

// Byte-level vocabulary: ids 0..255 are the bytes; merges build "hello", " hello", "ll".
std::string ByteLevelJson(const std::string& extra_added = "") {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[B(std::string(1, static_cast<char>(b)))] = b;
  std::vector<std::pair<std::string, std::string>> merges = {
      {"l", "l"}, {"h", "e"}, {"he", "ll"}, {"hell", "o"}, {B(" "), "hello"}, {"w", "o"}};
  int id = 256;
  json jm = json::array();
  for (auto& [a, b] : merges) {
    vocab[a + b] = id++;
    jm.push_back(a + " " + b);
  }
  json added = json::array({{{"id", 262},
                             {"content", "<|x|>"},
                             {"special", true},
                             {"lstrip", false},
                             {"rstrip", false},
                             {"normalized", false},
                             {"single_word", false}}});
  if (!extra_added.empty()) added.push_back(json::parse(extra_added));
  json j = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"vocab", vocab},
        {"merges", jm}}}};
  return j.dump();
}

std::unique_ptr<Tokenizer> Make(const std::string& text) {
  auto t = Tokenizer::FromHfJson(text, nullptr, "test.json");
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

TEST(ByteLevelBpeTest, MergesByRank) {
  auto tok = Make(ByteLevelJson());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 263);
  EXPECT_EQ(tok->kind(), TokenizerKind::kByteLevelBpe);
  auto ids = tok->Encode("hello hello wo");
  ASSERT_TRUE(ids.ok());
  EXPECT_THAT(*ids, ElementsAre(259, 260, static_cast<int32_t>(' '), 261));
  EXPECT_EQ(tok->Decode(*ids), "hello hello wo");
  EXPECT_EQ(tok->Piece(260), B(" ") + "hello");
  EXPECT_EQ(tok->TokenBytes(260), " hello");
  EXPECT_EQ(tok->PieceToId("ll"), 256);
  EXPECT_FALSE(tok->PieceToId("zz").has_value());
}

TEST(ByteLevelBpeTest, SpecialTokens) {
  auto tok = Make(ByteLevelJson());
  ASSERT_NE(tok, nullptr);
  auto on = tok->Encode("a<|x|>b");
  ASSERT_TRUE(on.ok());
  EXPECT_THAT(*on, ElementsAre('a', 262, 'b'));
  EXPECT_TRUE(tok->IsSpecial(262));
  auto off = tok->Encode("a<|x|>b", {.parse_special = false});
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->size(), 7u);  // "a", "<|", "x", "|>" ... as plain bytes, no 262
  EXPECT_EQ(std::count(off->begin(), off->end(), 262), 0);
  EXPECT_EQ(tok->Decode(*on), "a<|x|>b");
  EXPECT_EQ(tok->Decode(*on, {.skip_special_tokens = true}), "ab");
}

TEST(ByteLevelBpeTest, AddedTokenStripping) {
  auto tok = Make(ByteLevelJson(
      R"({"id": 263, "content": "<m>", "special": false, "lstrip": true, "rstrip": true,
          "normalized": false, "single_word": false})"));
  ASSERT_NE(tok, nullptr);
  auto ids = tok->Encode("a  <m>  b");
  ASSERT_TRUE(ids.ok());
  EXPECT_THAT(*ids, ElementsAre('a', 263, 'b'));  // the spaces around <m> are absorbed
  EXPECT_EQ(tok->Attr(263), TokenAttr::kUserDefined);
  EXPECT_FALSE(tok->IsSpecial(263));
  // Non-special added tokens are matched even without parse_special.
  EXPECT_THAT(*tok->Encode("a<m>b", {.parse_special = false}), ElementsAre('a', 263, 'b'));
}

TEST(ByteLevelBpeTest, RejectsInvalidUtf8) {
  auto tok = Make(ByteLevelJson());
  ASSERT_NE(tok, nullptr);
  auto ids = tok->Encode(std::string("ok\xC3(", 4));
  EXPECT_EQ(ids.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(StatusMessage(ids.status())), HasSubstr("invalid byte 0xc3 at offset 2"));
  EXPECT_TRUE(tok->Encode("").ok());
}

TEST(ByteLevelBpeTest, DecodeReplacesInvalidUtf8) {
  auto tok = Make(ByteLevelJson());
  ASSERT_NE(tok, nullptr);
  // 0xE2 0x82 alone is a truncated euro sign; 0xFF is never valid.
  std::vector<int32_t> ids = {'a', 0xE2, 0x82, 'b', 0xFF};
  EXPECT_EQ(tok->Decode(ids),
            "a\xEF\xBF\xBD"
            "b\xEF\xBF\xBD");
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{0xE2, 0x82, 0xAC}), "\xE2\x82\xAC");
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{-1, 9999, 'x'}), "x");
}

TEST(ByteLevelBpeTest, NfcNormalizer) {
  json j = json::parse(ByteLevelJson());
  j["normalizer"] = {{"type", "NFC"}};
  auto tok = Make(j.dump());
  ASSERT_NE(tok, nullptr);
  // "e" + combining acute composes to U+00E9 before byte-level BPE.
  EXPECT_EQ(*tok->Encode("caf"
                         "e\xCC\x81"),
            *tok->Encode("caf\xC3\xA9"));
  EXPECT_EQ(tok->Encode("caf\xC3\xA9")->size(), 5u);
}

TEST(TokenizerJsonTest, ClearErrors) {
  auto err = [](const std::string& text) {
    auto t = Tokenizer::FromHfJson(text, nullptr, "tok.json");
    EXPECT_FALSE(t.ok());
    return t.ok() ? std::string() : std::string(StatusMessage(t.status()));
  };
  EXPECT_THAT(err("{"), HasSubstr("tok.json: not valid JSON"));
  EXPECT_THAT(err(R"({"model": 5})"), HasSubstr("unexpected tokenizer.json structure"));
  EXPECT_THAT(err(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [],
                      "byte_fallback": "yes"}})"),
              HasSubstr("unexpected tokenizer.json structure"));
  EXPECT_THAT(err(R"({"model": {"type": "Unigram", "vocab": []}})"),
              HasSubstr("tokenizer model \"Unigram\" is not supported"));
  EXPECT_THAT(err(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}})"),
              HasSubstr("merge 0 (\"a\" + \"b\") uses a token that is not in the vocabulary"));
  EXPECT_THAT(err(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                      "pre_tokenizer": {"type": "UnicodeScripts"}})"),
              HasSubstr("pre-tokenizer \"UnicodeScripts\" is not supported"));
  EXPECT_THAT(err(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                      "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(("}, "behavior": "Isolated"}})"),
              HasSubstr("does not compile"));
  EXPECT_THAT(err(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                      "normalizer": {"type": "NFKC"}})"),
              HasSubstr("normalizer \"NFKC\" is not supported"));
}

// A BERT-style tokenizer.json: BertNormalizer, BertPreTokenizer, WordPiece (words of at most
// 9 characters), [CLS] $A [SEP], WordPiece decoder.
json WordPieceJson() {
  const std::vector<std::string> pieces = {
      "[PAD]",     "[UNK]", "[CLS]",  "[SEP]", "[MASK]",
      "un",        "##aff", "##able", "##a",   "a",
      "hello",     "world", "cafe",   "!",     ".",
      ",",         "中",    "文",     "##ll",  "he",
      "x",         "##x",   "[",      "]",     "\xC3\x9F" /* ß */,
      "##\xC3\x9F"};
  json vocab = json::object();
  for (size_t i = 0; i < pieces.size(); ++i) vocab[pieces[i]] = i;
  json added = json::array();
  for (int id = 0; id < 5; ++id) {
    added.push_back({{"id", id},
                     {"content", pieces[id]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  auto special = [](const char* name) {
    return json{{"SpecialToken", {{"id", name}, {"type_id", 0}}}};
  };
  return {{"version", "1.0"},
          {"truncation", {{"max_length", 4}}},  // ignored by Encode
          {"padding", {{"pad_id", 0}, {"pad_token", "[PAD]"}}},
          {"added_tokens", added},
          {"normalizer",
           {{"type", "BertNormalizer"},
            {"clean_text", true},
            {"handle_chinese_chars", true},
            {"strip_accents", nullptr},
            {"lowercase", true}}},
          {"pre_tokenizer", {{"type", "BertPreTokenizer"}}},
          {"post_processor",
           {{"type", "TemplateProcessing"},
            {"single",
             {special("[CLS]"), {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}, special("[SEP]")}},
            {"special_tokens",
             {{"[CLS]", {{"id", "[CLS]"}, {"ids", {2}}, {"tokens", {"[CLS]"}}}},
              {"[SEP]", {{"id", "[SEP]"}, {"ids", {3}}, {"tokens", {"[SEP]"}}}}}}}},
          {"decoder", {{"type", "WordPiece"}, {"prefix", "##"}, {"cleanup", true}}},
          {"model",
           {{"type", "WordPiece"},
            {"unk_token", "[UNK]"},
            {"continuing_subword_prefix", "##"},
            {"max_input_chars_per_word", 9},
            {"vocab", vocab}}}};
}

std::vector<int32_t> Ids(const Tokenizer& tok, std::string_view text, bool parse_special = true) {
  auto ids = tok.Encode(text, {.add_special_tokens = false, .parse_special = parse_special});
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *ids : std::vector<int32_t>{};
}

enum : int32_t {
  kPad,
  kUnk,
  kCls,
  kSep,
  kMask,
  kUn,
  kAff,
  kAble,
  kA,
  kAWord,
  kHello,
  kWorld,
  kCafe,
  kBang,
  kDot,
  kComma,
  kZhong,
  kWen,
  kLl,
  kHe,
  kX,
  kXCont,
  kLBracket,
  kRBracket,
  kEszett,
  kEszettCont
};

TEST(WordPieceTest, GreedyLongestMatchWithContinuations) {
  auto tok = Make(WordPieceJson().dump());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->kind(), TokenizerKind::kWordPiece);
  // "##aff" wins over the shorter "##a"; a whole-word entry wins over "he" + "##ll" ...
  EXPECT_THAT(Ids(*tok, "unaffable"), ElementsAre(kUn, kAff, kAble));
  EXPECT_THAT(Ids(*tok, "hello hell"), ElementsAre(kHello, kHe, kLl));
  EXPECT_THAT(Ids(*tok, "a unaa"), ElementsAre(kAWord, kUn, kA, kA));
  // ... and a word with a position nothing matches is one [UNK], not a partial match.
  EXPECT_THAT(Ids(*tok, "unaffz world"), ElementsAre(kUnk, kWorld));
  EXPECT_THAT(Ids(*tok, "zzz"), ElementsAre(kUnk));
}

TEST(WordPieceTest, OverLongWordIsUnknownCountingCharacters) {
  auto tok = Make(WordPieceJson().dump());
  ASSERT_NE(tok, nullptr);
  std::vector<int32_t> nine = {kX, kXCont, kXCont, kXCont, kXCont, kXCont, kXCont, kXCont, kXCont};
  EXPECT_EQ(Ids(*tok, std::string(9, 'x')), nine);
  EXPECT_THAT(Ids(*tok, std::string(10, 'x') + " x"), ElementsAre(kUnk, kX));
  EXPECT_THAT(Ids(*tok, "unaffablez"), ElementsAre(kUnk));
  // Nine characters, 18 bytes: still within max_input_chars_per_word.
  std::string eszetts;
  for (int i = 0; i < 9; ++i) eszetts += "\xC3\x9F";
  std::vector<int32_t> want(9, kEszettCont);
  want[0] = kEszett;
  EXPECT_EQ(Ids(*tok, eszetts), want);
}

TEST(WordPieceTest, NormalizesAndSplits) {
  auto tok = Make(WordPieceJson().dump());
  ASSERT_NE(tok, nullptr);
  // Punctuation is its own word; whitespace of every kind splits.
  EXPECT_THAT(Ids(*tok, "hello,world!."), ElementsAre(kHello, kComma, kWorld, kBang, kDot));
  EXPECT_THAT(Ids(*tok, "hello\tworld\n\xE3\x80\x80hello"), ElementsAre(kHello, kWorld, kHello));
  // Lowercased, accents stripped (precomposed and combining).
  EXPECT_THAT(Ids(*tok, "HeLLo Caf\xC3\xA9 CAFE\xCC\x81"), ElementsAre(kHello, kCafe, kCafe));
  // CJK ideographs become words of their own even without spaces.
  EXPECT_THAT(Ids(*tok, "hello\xE4\xB8\xAD\xE6\x96\x87world"),
              ElementsAre(kHello, kZhong, kWen, kWorld));
  // Control and format characters, NUL and U+FFFD are dropped (joining the word).
  EXPECT_THAT(Ids(*tok, std::string("hel\x01l\0o wor\xE2\x80\x8Bld caf\xEF\xBF\xBD"
                                    "e",
                                    25)),
              ElementsAre(kHello, kWorld, kCafe));
  EXPECT_THAT(Ids(*tok, ""), ElementsAre());
  EXPECT_THAT(Ids(*tok, " \t\x01 "), ElementsAre());
  EXPECT_FALSE(tok->Encode("caf\xC3").ok());  // invalid UTF-8
}

TEST(WordPieceTest, SpecialTokensAndTemplate) {
  auto tok = Make(WordPieceJson().dump());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->bos_id(), kCls);
  EXPECT_EQ(tok->eos_id(), kSep);
  EXPECT_EQ(tok->unk_id(), kUnk);
  EXPECT_EQ(tok->pad_id(), kPad);
  EXPECT_TRUE(tok->add_bos());
  EXPECT_TRUE(tok->add_eos());
  // The truncation section (max_length 4) is not applied.
  EXPECT_THAT(*tok->Encode("hello world hello"), ElementsAre(kCls, kHello, kWorld, kHello, kSep));
  EXPECT_THAT(*tok->Encode(""), ElementsAre(kCls, kSep));
  // Special-token text is matched in the raw text (before lowercasing) only with parse_special.
  EXPECT_THAT(Ids(*tok, "[CLS]hello [MASK]."), ElementsAre(kCls, kHello, kMask, kDot));
  EXPECT_THAT(Ids(*tok, "[CLS]hello [MASK].", /*parse_special=*/false),
              ElementsAre(kLBracket, kUnk, kRBracket, kHello, kLBracket, kUnk, kRBracket, kDot));
  EXPECT_THAT(Ids(*tok, "[cls]"), ElementsAre(kLBracket, kUnk, kRBracket));
  EXPECT_EQ(tok->Piece(kAff), "##aff");
  EXPECT_EQ(tok->TokenBytes(kAff), "aff");
  EXPECT_EQ(tok->TokenBytes(kCls), "[CLS]");
  EXPECT_TRUE(tok->IsSpecial(kSep));
  EXPECT_FALSE(tok->IsSpecial(kHello));
}

TEST(WordPieceTest, WithoutPostProcessorUsesClsAndSep) {
  json j = WordPieceJson();
  j["post_processor"] = nullptr;
  j.erase("padding");
  auto tok = Make(j.dump());
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(*tok->Encode("hello"), ElementsAre(kCls, kHello, kSep));
  EXPECT_EQ(tok->pad_id(), kPad);  // the [PAD] token
  // Older BERT files use BertProcessing.
  j["post_processor"] = {{"type", "BertProcessing"}, {"sep", {"[SEP]", 3}}, {"cls", {"[CLS]", 2}}};
  j["normalizer"] = nullptr;  // also: no normalizer, so no lowercasing
  auto bert = Make(j.dump());
  ASSERT_NE(bert, nullptr);
  EXPECT_THAT(*bert->Encode("Hello hello"), ElementsAre(kCls, kUnk, kHello, kSep));
  EXPECT_EQ(bert->bos_id(), kCls);
  EXPECT_EQ(bert->eos_id(), kSep);
}

TEST(WordPieceTest, DecodeGluesPiecesAndCleansUp) {
  auto tok = Make(WordPieceJson().dump());
  ASSERT_NE(tok, nullptr);
  auto ids = tok->Encode("Unaffable, hello world! Hell.");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(tok->Decode(*ids), "[CLS] unaffable, hello world! hell. [SEP]");
  EXPECT_EQ(tok->Decode(*ids, {.skip_special_tokens = true}), "unaffable, hello world! hell.");
  // A leading continuation keeps its "##" (HF only glues pieces after the first).
  std::vector<int32_t> cont = {kAff, kAble};
  EXPECT_EQ(tok->Decode(cont), "##affable");
  // Without a decoder HF joins the tokens with spaces.
  json j = WordPieceJson();
  j["decoder"] = nullptr;
  auto plain = Make(j.dump());
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->Decode(*ids, {.skip_special_tokens = true}),
            "un ##aff ##able , hello world ! he ##ll .");
  std::vector<std::string_view> tokens = {"it", "'", "s", "do", "not", "?", "##x"};
  EXPECT_EQ(WordPieceDecode(tokens, "##", /*cleanup=*/true), "it ' s do not?x");
  EXPECT_EQ(WordPieceDecode(tokens, "##", /*cleanup=*/false), "it ' s do not ?x");
}

TEST(WordPieceTest, BertNormalizerOptions) {
  BertNormalizerOptions keep{
      .clean_text = true, .handle_chinese_chars = false, .strip_accents = false, .lowercase = true};
  // Lowercased without stripping; per-character (no final sigma); U+0130 -> "i" U+0307.
  EXPECT_EQ(BertNormalize("Caf\xC3\x89 \xCE\xA3\xCE\xA3 \xC4\xB0", keep),
            "caf\xC3\xA9 \xCF\x83\xCF\x83 i\xCC\x87");
  EXPECT_EQ(BertNormalize("a\xE4\xB8\xAD"
                          "b",
                          keep),
            "a\xE4\xB8\xAD"
            "b");
  BertNormalizerOptions raw{
      .clean_text = false, .handle_chinese_chars = true, .strip_accents = true, .lowercase = false};
  EXPECT_EQ(BertNormalize("A\x01\xC3\x89\xE4\xB8\xAD", raw),
            "A\x01"
            "E \xE4\xB8\xAD ");
}

TEST(WordPieceTest, ClearErrors) {
  auto err = [](const json& j) {
    auto t = Tokenizer::FromHfJson(j.dump(), nullptr, "bert.json");
    EXPECT_FALSE(t.ok());
    return t.ok() ? std::string() : std::string(StatusMessage(t.status()));
  };
  json j = WordPieceJson();
  j["model"].erase("vocab");
  EXPECT_THAT(err(j), HasSubstr("bert.json: model.vocab is missing or empty"));
  j = WordPieceJson();
  j["model"]["unk_token"] = "<unk>";
  EXPECT_THAT(err(j), HasSubstr("model.unk_token \"<unk>\" is not in model.vocab"));
  j = WordPieceJson();
  j["normalizer"]["type"] = "BertNormaliser";
  EXPECT_THAT(err(j), HasSubstr("unknown normalizer.type \"BertNormaliser\""));
  j = WordPieceJson();
  j["normalizer"]["strip_accents"] = "yes";
  EXPECT_THAT(err(j), HasSubstr("normalizer.strip_accents is \"yes\""));
  j = WordPieceJson();
  j["pre_tokenizer"]["type"] = "BertPretokenizer";
  EXPECT_THAT(err(j), HasSubstr("unknown pre_tokenizer.type \"BertPretokenizer\""));
  j = WordPieceJson();
  j["model"]["max_input_chars_per_word"] = -1;
  EXPECT_THAT(err(j), HasSubstr("model.max_input_chars_per_word is -1"));
  j = WordPieceJson();
  j["decoder"] = {{"type", "ByteLevel"}};
  EXPECT_THAT(err(j), HasSubstr("decoder \"ByteLevel\" is not supported with a WordPiece model"));
}

// A SentencePiece-style GGUF vocabulary: <unk> <s> </s>, 256 byte tokens, then pieces.
std::string SpmGguf(const std::string& model = "llama") {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};
  std::vector<float> scores = {0, 0, 0};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
    tokens.push_back(buf);
    types.push_back(6);
    scores.push_back(0);
  }
  const std::vector<std::pair<std::string, float>> pieces = {{"\xE2\x96\x81", -1},
                                                             {"h", -2},
                                                             {"i", -3},
                                                             {"\xE2\x96\x81h", -4},
                                                             {"\xE2\x96\x81hi", -5},
                                                             {"t", -6},
                                                             {"\xE2\x96\x81t", -7}};
  for (auto& [p, s] : pieces) {
    tokens.push_back(p);
    types.push_back(1);
    scores.push_back(s);
  }
  GgufBuilder g;
  g.Str("tokenizer.ggml.model", model)
      .StrArray("tokenizer.ggml.tokens", tokens)
      .F32Array("tokenizer.ggml.scores", scores)
      .I32Array("tokenizer.ggml.token_type", types)
      .U32("tokenizer.ggml.bos_token_id", 1)
      .U32("tokenizer.ggml.eos_token_id", 2)
      .U32("tokenizer.ggml.unknown_token_id", 0);
  return g.Build();
}

TEST(SentencePieceGgufTest, ScoresByteFallbackAndSpacePrefix) {
  auto g = GgufFile::Parse(MappedFile::FromBytes(SpmGguf(), "spm.gguf"));
  ASSERT_TRUE(g.ok()) << g.status();
  auto tok = Tokenizer::FromGguf(**g);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->kind(), TokenizerKind::kSentencePieceBpe);
  EXPECT_TRUE((*tok)->add_bos());
  const int32_t kHi = 259 + 4, kT = 259 + 6, kSpace = 259;
  auto ids = (*tok)->Encode("hi t\xC3\xA9");
  ASSERT_TRUE(ids.ok());
  // <s> ▁hi ▁t <0xC3> <0xA9>
  EXPECT_THAT(*ids, ElementsAre(1, kHi, kT, 3 + 0xC3, 3 + 0xA9));
  EXPECT_EQ((*tok)->Decode(*ids, {.skip_special_tokens = true}), "hi t\xC3\xA9");
  EXPECT_EQ((*tok)->Decode(*ids), "<s> hi t\xC3\xA9");
  EXPECT_EQ((*tok)->Decode(*ids, {.skip_special_tokens = true, .strip_leading_space = false}),
            " hi t\xC3\xA9");
  // A space prefix again after a special token.
  auto after = (*tok)->Encode("</s>hi", {.add_special_tokens = false});
  ASSERT_TRUE(after.ok());
  EXPECT_THAT(*after, ElementsAre(2, kHi));
  auto spaces = (*tok)->Encode("  ", {.add_special_tokens = false});
  EXPECT_THAT(*spaces, ElementsAre(kSpace, kSpace, kSpace));
  EXPECT_THAT((*tok)->eog_ids(), ElementsAre(2));
}

TEST(SentencePieceGgufTest, ClearErrors) {
  auto g = GgufFile::Parse(MappedFile::FromBytes(SpmGguf("bert"), "spm.gguf"));
  ASSERT_TRUE(g.ok());
  auto tok = Tokenizer::FromGguf(**g);
  EXPECT_THAT(std::string(StatusMessage(tok.status())),
              HasSubstr("unsupported tokenizer.ggml.model \"bert\""));
  GgufBuilder b;
  b.Str("tokenizer.ggml.model", "gpt2")
      .StrArray("tokenizer.ggml.tokens", {"a"})
      .StrArray("tokenizer.ggml.merges", {})
      .Str("tokenizer.ggml.pre", "nonesuch");
  auto g2 = GgufFile::Parse(MappedFile::FromBytes(b.Build(), "x.gguf"));
  ASSERT_TRUE(g2.ok());
  EXPECT_THAT(std::string(StatusMessage(Tokenizer::FromGguf(**g2).status())),
              HasSubstr("unsupported tokenizer.ggml.pre \"nonesuch\""));
  auto g3 = GgufFile::Parse(MappedFile::FromBytes(GgufBuilder().Build(), "empty.gguf"));
  ASSERT_TRUE(g3.ok());
  EXPECT_EQ(Tokenizer::FromGguf(**g3).status().code(), StatusCode::kNotFound);
}

TEST(Utf8Test, LossyReplacement) {
  std::string out;
  utf8::AppendLossy(
      "a\xF0\x9F\x98"
      "b\xED\xA0\x80"
      "c\xC0\xAF",
      &out);
  // Truncated 4-byte seq -> one U+FFFD; surrogate ED A0 80 -> three; overlong C0 AF -> two.
  EXPECT_EQ(out,
            "a\xEF\xBF\xBD"
            "b\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"
            "c\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(utf8::FindInvalid("caf\xC3\xA9"), std::string_view::npos);
  EXPECT_EQ(utf8::FindInvalid("caf\xC3"), 3u);
}

}  // namespace
}  // namespace kiln::models
