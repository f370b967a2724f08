// GGUF files written by other implementations: the gguf Python package's writer (with its
// reference dequantization as expected values) and the default SmolLM2 model.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "models/gguf/dequant.h"
#include "models/gguf/gguf.h"
#include "models/io/test_paths.h"

namespace kiln::models {
namespace {

TEST(GgufFixtureTest, DequantizeIsBitExactWithGgufPython) {
  auto f = GgufFile::Open(testing::FixturePath("gguf/dequant.gguf"));
  ASSERT_TRUE(f.ok()) << f.status();
  int checked = 0;
  for (const char* name :
       {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "Q5_0", "Q5_1", "F16", "BF16"}) {
    SCOPED_TRACE(name);
    const GgufTensor* q = (*f)->FindTensor(name);
    const GgufTensor* want = (*f)->FindTensor(std::string(name) + ".expected");
    ASSERT_NE(q, nullptr);
    ASSERT_NE(want, nullptr);
    EXPECT_EQ(GgmlTypeName(q->type), name);
    ASSERT_EQ(q->n_elements, want->n_elements);
    auto got = Dequantize(q->type, q->data, q->n_elements);
    ASSERT_TRUE(got.ok()) << got.status();
    const float* expected = static_cast<const float*>(want->data);
    size_t mismatches = 0;
    for (size_t i = 0; i < q->n_elements; ++i) {
      uint32_t a, b;
      std::memcpy(&a, &(*got)[i], 4);
      std::memcpy(&b, &expected[i], 4);
      if (a != b && ++mismatches <= 3) {
        ADD_FAILURE() << "element " << i << ": kiln " << (*got)[i] << " gguf " << expected[i];
      }
    }
    EXPECT_EQ(mismatches, 0u);
    ++checked;
  }
  EXPECT_EQ(checked, 11);
}

TEST(GgufFixtureTest, OpensSmolLM2) {
  auto f = GgufFile::Open(testing::DefaultModelPath());
  ASSERT_TRUE(f.ok()) << f.status() << " (run scripts/fetch-default-model.sh)";
  const GgufFile& g = **f;
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(*g.GetString("general.architecture"), "llama");
  EXPECT_EQ(*g.GetU32("llama.block_count"), 30u);
  EXPECT_EQ(*g.GetU32("llama.attention.head_count_kv"), 3u);
  EXPECT_FLOAT_EQ(*g.GetF32("llama.rope.freq_base"), 100000.0f);
  EXPECT_EQ(g.GetStringArray("tokenizer.ggml.tokens")->size(), 49152u);
  EXPECT_EQ(g.tensors().size(), 272u);
  const GgufTensor* emb = g.FindTensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->dims, (std::vector<int64_t>{576, 49152}));
  // Every tensor dequantizes to finite values of a plausible magnitude.
  for (const GgufTensor& t : g.tensors()) {
    size_t n = std::min<uint64_t>(t.n_elements, 4096);
    auto v = Dequantize(t.type, t.data, n);
    ASSERT_TRUE(v.ok()) << t.name << ": " << v.status();
    for (float x : *v) ASSERT_TRUE(std::isfinite(x) && std::fabs(x) < 1e4) << t.name;
  }
}

}  // namespace
}  // namespace kiln::models
