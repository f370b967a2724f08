// The encoder against sentence-transformers: all-MiniLM-L6-v2 on the 200 fixture sentences
// (scripts/fixtures/make_embedding_fixtures.py) — the same tokens, and embeddings with cosine
// >= 0.9999 to the reference's; plus batching, truncation and bad input.
#include "models/encoder/encoder_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/io/test_paths.h"
#include "models/safetensors/safetensors.h"

namespace kiln::models {
namespace {

namespace fs = std::filesystem;
using ::kiln::models::testing::DefaultEmbeddingModelPath;
using ::kiln::models::testing::FixturePath;

struct Sentence {
  std::string text;
  std::vector<int32_t> tokens;
};

std::vector<Sentence> LoadSentences() {
  std::ifstream in(FixturePath("embeddings/sentences.jsonl"));
  std::vector<Sentence> out;
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    out.push_back({j["text"].get<std::string>(), j["tokens"].get<std::vector<int32_t>>()});
  }
  return out;
}

config::ModelConfig EmbeddingConfig(const std::string& path = DefaultEmbeddingModelPath()) {
  config::ModelConfig c;
  c.name = "minilm";
  c.kind = "embedding";
  c.path = path;
  c.threads = 2;
  return c;
}

double Cosine(const float* a, const float* b, size_t n) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < n; ++i) {
    ab += static_cast<double>(a[i]) * b[i];
    aa += static_cast<double>(a[i]) * a[i];
    bb += static_cast<double>(b[i]) * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

class EncoderModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto m = EncoderModel::Load(EmbeddingConfig());
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = m->release();
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  static EncoderModel* model_;
};
EncoderModel* EncoderModelTest::model_ = nullptr;

TEST_F(EncoderModelTest, ReadsTheSentenceTransformersConfiguration) {
  const EncoderInfo& info = model_->info();
  EXPECT_EQ(info.architecture, "bert");
  EXPECT_EQ(info.dimensions, 384);
  EXPECT_EQ(info.num_layers, 6);
  EXPECT_EQ(info.max_tokens, 256);  // sentence_bert_config.json, not the 512 positions
  EXPECT_EQ(info.pooling, EmbeddingPooling::kMean);
  EXPECT_TRUE(info.normalize);
}

TEST_F(EncoderModelTest, TokensAndEmbeddingsMatchSentenceTransformers) {
  const std::vector<Sentence> sentences = LoadSentences();
  ASSERT_EQ(sentences.size(), 200u);
  auto ref_file = SafetensorsFile::Open(FixturePath("embeddings/minilm_embeddings.safetensors"));
  ASSERT_TRUE(ref_file.ok()) << ref_file.status();
  const SafetensorsTensor* ref = (*ref_file)->Find("embeddings");
  ASSERT_NE(ref, nullptr);
  ASSERT_EQ(ref->shape, (std::vector<int64_t>{200, 384}));
  const float* want = static_cast<const float*>(ref->data);

  std::vector<std::vector<int32_t>> ids;
  int mismatched = 0, truncated = 0;
  for (const Sentence& s : sentences) {
    auto t = model_->Tokenize(s.text);
    ASSERT_TRUE(t.ok()) << s.text << ": " << t.status();
    if (t->ids != s.tokens && ++mismatched <= 3) ADD_FAILURE() << "tokens differ for: " << s.text;
    truncated += t->truncated;
    ids.push_back(t->ids);
  }
  EXPECT_EQ(mismatched, 0);
  EXPECT_EQ(truncated, 1);  // the 300-word sentence, cut at 256 tokens as sentence-transformers

  auto got = model_->Embed(ids);  // several steps of up to 32 texts
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 200u * 384u);
  double worst = 1;
  for (size_t i = 0; i < 200; ++i) {
    const double c = Cosine(got->data() + i * 384, want + i * 384, 384);
    worst = std::min(worst, c);
    EXPECT_GE(c, 0.9999) << sentences[i].text;
    double norm = 0;
    for (size_t k = 0; k < 384; ++k) norm += double{(*got)[i * 384 + k]} * (*got)[i * 384 + k];
    EXPECT_NEAR(norm, 1.0, 1e-5) << "normalised";
  }
  RecordProperty("worst_cosine", std::to_string(worst));
  std::cout << "worst cosine to sentence-transformers over 200 sentences: " << std::setprecision(9)
            << worst << "\n";
}

// A text's embedding does not depend on the batch it runs in (padding never leaks into it).
TEST_F(EncoderModelTest, BatchedEqualsOneByOne) {
  const std::vector<Sentence> sentences = LoadSentences();
  std::vector<std::vector<int32_t>> ids;
  for (size_t i = 0; i < 12; ++i) ids.push_back(model_->Tokenize(sentences[i * 7].text)->ids);
  auto batched = model_->Embed(ids);
  ASSERT_TRUE(batched.ok()) << batched.status();
  for (size_t i = 0; i < ids.size(); ++i) {
    auto one = model_->Embed(std::span(&ids[i], 1));
    ASSERT_TRUE(one.ok()) << one.status();
    for (size_t k = 0; k < 384; ++k) {
      ASSERT_NEAR((*one)[k], (*batched)[i * 384 + k], 2e-5) << "text " << i << " dim " << k;
    }
  }
}

TEST_F(EncoderModelTest, BadInputIsRefused) {
  EXPECT_FALSE(model_->Tokenize("").ok());
  EXPECT_FALSE(model_->Tokenize("\xff\xfe bad").ok());
  EXPECT_FALSE(model_->Embed({}).ok());
  const std::vector<std::vector<int32_t>> short_text = {{101}};
  EXPECT_FALSE(model_->Embed(short_text).ok());
  const std::vector<std::vector<int32_t>> out_of_vocab = {{101, 999999, 102}};
  const auto s = model_->Embed(out_of_vocab);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("outside the vocabulary"), std::string::npos);
  // "[SEP]" in the text is text, not the separator token.
  auto t = model_->Tokenize("a [SEP] b");
  ASSERT_TRUE(t.ok());
  EXPECT_GT(t->ids.size(), 5u);
}

// A copy of the model folder with one JSON file replaced (the weights linked, not copied).
fs::path FolderWith(const std::string& file, const std::string& contents) {
  const fs::path src = DefaultEmbeddingModelPath();
  const fs::path dir =
      fs::temp_directory_path() / ("kiln_encoder_" + std::to_string(::getpid()) + "_" +
                                   std::to_string(std::hash<std::string>{}(file + contents)));
  fs::remove_all(dir);
  fs::create_directories(dir / "1_Pooling");
  for (const char* f : {"config.json", "tokenizer.json", "tokenizer_config.json", "modules.json",
                        "sentence_bert_config.json", "1_Pooling/config.json"}) {
    fs::copy_file(src / f, dir / f);
  }
  fs::create_symlink(src / "model.safetensors", dir / "model.safetensors");
  std::ofstream(dir / file, std::ios::trunc) << contents;
  return dir;
}

TEST(EncoderModelLoad, BadFoldersGetClearErrors) {
  struct Case {
    const char* file;
    std::string contents;
    const char* expect;
  };
  const Case cases[] = {
      {"config.json", R"({"model_type": "llama"})", "supported: bert"},
      {"1_Pooling/config.json", R"({"pooling_mode_max_tokens": true})", "pooling mode"},
      {"modules.json", R"([{"type": "sentence_transformers.models.Dense", "path": "2_Dense"}])",
       "Dense"},
      {"modules.json", "[not json", "not valid JSON"},
      {"sentence_bert_config.json", R"({"max_seq_length": 1})", "max_seq_length"},
  };
  for (const Case& c : cases) {
    const fs::path dir = FolderWith(c.file, c.contents);
    auto m = EncoderModel::Load(EmbeddingConfig(dir.string()));
    ASSERT_FALSE(m.ok()) << c.file;
    EXPECT_NE(m.status().message().find(c.expect), std::string::npos)
        << c.file << ": " << m.status();
    fs::remove_all(dir);
  }
  EXPECT_FALSE(EncoderModel::Load(EmbeddingConfig("/nonexistent/folder")).ok());
}

// context_length lowers the tokens per text; a CLS-pooling config is honoured.
TEST(EncoderModelLoad, ContextLengthAndClsPooling) {
  const fs::path dir = FolderWith("1_Pooling/config.json", R"({"pooling_mode": "cls"})");
  config::ModelConfig c = EmbeddingConfig(dir.string());
  c.context_length = 8;
  auto m = EncoderModel::Load(c);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->info().pooling, EmbeddingPooling::kCls);
  EXPECT_EQ((*m)->info().max_tokens, 8);
  auto t = (*m)->Tokenize("one two three four five six seven eight nine");
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(t->truncated);
  EXPECT_EQ(t->ids.size(), 8u);
  EXPECT_EQ(t->ids.back(), 102);  // still ends in [SEP]
  auto e = (*m)->Embed(std::span(&t->ids, 1));
  ASSERT_TRUE(e.ok()) << e.status();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kiln::models
