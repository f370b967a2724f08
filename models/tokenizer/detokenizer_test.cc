#include "models/tokenizer/detokenizer.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "models/gguf/gguf.h"
#include "models/gguf/gguf_test_util.h"
#include "models/io/mapped_file.h"
#include "models/io/test_paths.h"
#include "models/tokenizer/unicode.h"

namespace kiln::models {
namespace {

std::unique_ptr<Tokenizer> FixtureTokenizer(const std::string& name) {
  auto file = MappedFile::Open(testing::FixturePath("tokenizer/" + name));
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return nullptr;
  auto tok = Tokenizer::FromHfJson((*file)->bytes(), nullptr, name);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? std::move(*tok) : nullptr;
}

TEST(DetokenizerTest, HoldsBackIncompleteCharacters) {
  auto tok = FixtureTokenizer("sp_bpe.tokenizer.json");
  ASSERT_NE(tok, nullptr);
  auto byte = [&](int b) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
    return *tok->PieceToId(buf);
  };
  Detokenizer d(*tok);
  EXPECT_EQ(d.Add(byte(0xE2)), "");
  EXPECT_EQ(d.pending_bytes(), 1u);
  EXPECT_EQ(d.Add(byte(0x82)), "");
  EXPECT_EQ(d.Add(byte(0xAC)), "\xE2\x82\xAC");  // €
  EXPECT_EQ(d.pending_bytes(), 0u);
  // Never valid: replaced at once.
  EXPECT_EQ(d.Add(byte(0xFF)), "\xEF\xBF\xBD");
  // Broken sequence: lead followed by ASCII.
  EXPECT_EQ(d.Add(byte(0xF0)), "");
  EXPECT_EQ(d.Add(byte('A')),
            "\xEF\xBF\xBD"
            "A");
  // Incomplete at the end of generation.
  EXPECT_EQ(d.Add(byte(0xE2)), "");
  EXPECT_EQ(d.Finish(), "\xEF\xBF\xBD");
  EXPECT_EQ(d.emitted_bytes(), 3u + 3 + 3 + 1 + 3);
}

TEST(DetokenizerTest, SentencePieceLeadingSpace) {
  auto tok = FixtureTokenizer("sp_bpe.tokenizer.json");
  ASSERT_NE(tok, nullptr);
  auto ids = tok->Encode("Hello world", {.add_special_tokens = false});
  ASSERT_TRUE(ids.ok());
  std::string cont, start;
  Detokenizer a(*tok);  // continuation: keep the space
  Detokenizer b(*tok, {.strip_leading_space = true});
  for (int32_t id : *ids) {
    cont += a.Add(id);
    start += b.Add(id);
  }
  cont += a.Finish();
  start += b.Finish();
  EXPECT_EQ(cont, " Hello world");
  EXPECT_EQ(start, "Hello world");
}

// Streaming output must equal a one-shot decode, for real text and for random ids (which
// cut characters anywhere).
void ExpectStreamEqualsDecode(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  for (bool skip : {false, true}) {
    Detokenizer d(tok, {.skip_special_tokens = skip});
    std::string streamed;
    for (int32_t id : ids) {
      std::string chunk = d.Add(id);
      // Every chunk is valid UTF-8 on its own.
      ASSERT_EQ(utf8::FindInvalid(chunk), std::string_view::npos);
      streamed += chunk;
    }
    streamed += d.Finish();
    EXPECT_EQ(streamed,
              tok.Decode(ids, {.skip_special_tokens = skip, .strip_leading_space = false}));
  }
}

TEST(DetokenizerTest, StreamEqualsDecode) {
  for (const char* name : {"bpe_bytelevel.tokenizer.json", "sp_bpe.tokenizer.json"}) {
    auto tok = FixtureTokenizer(name);
    ASSERT_NE(tok, nullptr);
    std::ifstream in(testing::FixturePath("tokenizer/strings.jsonl"));
    std::string line;
    int n = 0;
    while (std::getline(in, line) && n++ < 300) {
      auto ids = tok->Encode(nlohmann::json::parse(line).get<std::string>());
      ASSERT_TRUE(ids.ok());
      ExpectStreamEqualsDecode(*tok, *ids);
    }
    std::mt19937 rng(7);
    std::uniform_int_distribution<int32_t> any(0, tok->vocab_size() - 1);
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<int32_t> ids(1 + trial % 17);
      for (int32_t& id : ids) id = any(rng);
      ExpectStreamEqualsDecode(*tok, ids);
    }
  }
}

// Encode is const and shares a word cache between threads: results must not depend on
// interleaving.
TEST(TokenizerConcurrencyTest, ParallelEncodeMatchesSerial) {
  auto tok = FixtureTokenizer("bpe_bytelevel.tokenizer.json");
  ASSERT_NE(tok, nullptr);
  std::vector<std::string> texts;
  std::ifstream in(testing::FixturePath("tokenizer/strings.jsonl"));
  std::string line;
  while (std::getline(in, line)) texts.push_back(nlohmann::json::parse(line).get<std::string>());
  std::vector<std::vector<int32_t>> serial;
  for (const auto& t : texts) serial.push_back(*tok->Encode(t));
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (size_t i = 0; i < texts.size(); ++i) {
        size_t j = (i * 7 + k * 131) % texts.size();
        if (*tok->Encode(texts[j]) != serial[j]) ++mismatches[k];
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

}  // namespace
}  // namespace kiln::models
