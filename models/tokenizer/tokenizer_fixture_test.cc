// Kiln's tokenizers against ids produced by independent implementations (Hugging Face
// `tokenizers`, llama.cpp) on the fixture strings. Regenerate the fixtures with
// scripts/fixtures/make_tokenizer_fixtures.py.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/gguf/gguf.h"
#include "models/io/mapped_file.h"
#include "models/io/test_paths.h"
#include "models/tokenizer/tokenizer.h"

namespace kiln::models {
namespace {

using json = nlohmann::json;

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
