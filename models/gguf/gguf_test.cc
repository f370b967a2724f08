#include "models/gguf/gguf.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "models/gguf/dequant.h"
#include "models/gguf/gguf_test_util.h"

namespace kiln::models {
namespace {

using ::kiln::models::testing::GgufBuilder;
using ::testing::HasSubstr;

StatusOr<std::unique_ptr<GgufFile>> ParseBytes(std::string bytes) {
  return GgufFile::Parse(MappedFile::FromBytes(std::move(bytes), "test.gguf"));
}

std::string Floats(std::vector<float> v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

std::string ValidFile() {
  GgufBuilder b;
  b.Str("general.architecture", "llama")
      .U32("llama.block_count", 2)
      .F32("llama.rope.freq_base", 10000.0f)
      .Bool("tokenizer.ggml.add_bos_token", true)
      .I32("neg", -5)
      .U64("big", 1ull << 40)
      .StrArray("tokenizer.ggml.tokens", {"<s>", "a", "b"})
      .F32Array("tokenizer.ggml.scores", {0.f, -1.f, -2.f})
      .I32Array("tokenizer.ggml.token_type", {3, 1, 1})
      .Tensor("a.weight", 0, {4, 2}, Floats({1, 2, 3, 4, 5, 6, 7, 8}))
      .Tensor("b.weight", 0, {3}, Floats({9, 10, 11}));
  return b.Build();
}

TEST(GgufTest, ParsesMetadataAndTensors) {
  auto f = ParseBytes(ValidFile());
  ASSERT_TRUE(f.ok()) << f.status();
  const GgufFile& g = **f;
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(g.alignment(), 32u);
  EXPECT_EQ(g.keys().size(), 9u);
  EXPECT_EQ(*g.GetString("general.architecture"), "llama");
  EXPECT_EQ(*g.GetU32("llama.block_count"), 2u);
  EXPECT_EQ(*g.GetI64("llama.block_count"), 2);
  EXPECT_FLOAT_EQ(*g.GetF32("llama.rope.freq_base"), 10000.0f);
  EXPECT_TRUE(*g.GetBool("tokenizer.ggml.add_bos_token"));
  EXPECT_EQ(*g.GetI32("neg"), -5);
  EXPECT_EQ(*g.GetU64("big"), 1ull << 40);
  EXPECT_THAT(*g.GetStringArray("tokenizer.ggml.tokens"), ::testing::ElementsAre("<s>", "a", "b"));
  EXPECT_THAT(*g.GetF32Array("tokenizer.ggml.scores"), ::testing::ElementsAre(0.f, -1.f, -2.f));
  EXPECT_THAT(*g.GetI32Array("tokenizer.ggml.token_type"), ::testing::ElementsAre(3, 1, 1));
  EXPECT_EQ(*g.GetU32Or("absent", 7), 7u);
  EXPECT_EQ(*g.GetStringOr("absent", "x"), "x");

  ASSERT_EQ(g.tensors().size(), 2u);
  const GgufTensor* a = g.FindTensor("a.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->type, GgmlType::kF32);
  EXPECT_THAT(a->dims, ::testing::ElementsAre(4, 2));
  EXPECT_EQ(a->n_elements, 8u);
  EXPECT_EQ(a->n_bytes, 32u);
  EXPECT_EQ(a->file_offset % 32, 0u);
  EXPECT_EQ(static_cast<const float*>(a->data)[7], 8.0f);
  // Zero-copy: the pointer is inside the file's bytes.
  EXPECT_EQ(static_cast<const uint8_t*>(a->data), g.file()->data() + a->file_offset);
  const GgufTensor* b = g.FindTensor("b.weight");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(static_cast<const float*>(b->data)[2], 11.0f);
  EXPECT_EQ(g.FindTensor("missing"), nullptr);
  EXPECT_EQ(g.GetTensor("missing").status().code(), StatusCode::kNotFound);
}

TEST(GgufTest, TypedGettersExplainErrors) {
  auto f = ParseBytes(ValidFile());
  ASSERT_TRUE(f.ok());
  const GgufFile& g = **f;
  auto missing = g.GetU32("llama.context_length");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(std::string(StatusMessage(missing.status())),
              HasSubstr("test.gguf: metadata key \"llama.context_length\" is missing"));
  auto wrong = g.GetU32("general.architecture");
  EXPECT_EQ(wrong.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(StatusMessage(wrong.status())), HasSubstr("is STRING \"llama\""));
  EXPECT_FALSE(g.GetU32("neg").ok());  // negative into unsigned
  EXPECT_FALSE(g.GetU32("big").ok());  // 2^40 into 32 bits
  EXPECT_FALSE(g.GetString("llama.block_count").ok());
  EXPECT_FALSE(g.GetStringArray("tokenizer.ggml.scores").ok());
  EXPECT_FALSE(g.GetF32Array("tokenizer.ggml.tokens").ok());
  EXPECT_FALSE(g.GetBoolOr("llama.block_count", false).ok());  // present, wrong type
}

TEST(GgufTest, NestedArraysAndVersion2) {
  std::string payload;
  auto put32 = [&](uint32_t v) { payload.append(reinterpret_cast<char*>(&v), 4); };
  auto put64 = [&](uint64_t v) { payload.append(reinterpret_cast<char*>(&v), 8); };
  put32(9);  // element type ARRAY
  put64(2);
  for (int i = 0; i < 2; ++i) {
    put32(4);  // UINT32
    put64(2);
    put32(10 * i + 1);
    put32(10 * i + 2);
  }
  GgufBuilder b(2);
  b.RawKv("nested", 9, payload);
  auto f = ParseBytes(b.Build());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->version(), 2u);
  const GgufValue* v = (*f)->Find("nested");
  ASSERT_NE(v, nullptr);
  ASSERT_EQ(v->items().size(), 2u);
  EXPECT_EQ(v->items()[1].element(1).as_u64(), 12u);
  EXPECT_EQ(v->DebugString(), "ARRAY[ARRAY; 2]");
}

TEST(GgufTest, CustomAlignment) {
  GgufBuilder b;
  b.Alignment(64).Tensor("t", 0, {2}, Floats({1, 2})).Tensor("u", 0, {2}, Floats({3, 4}));
  auto f = ParseBytes(b.Build());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->alignment(), 64u);
  EXPECT_EQ((*f)->data_offset() % 64, 0u);
  EXPECT_EQ((*f)->FindTensor("u")->offset, 64u);
}

std::string ErrorOf(std::string bytes) {
  auto f = ParseBytes(std::move(bytes));
  EXPECT_FALSE(f.ok());
  if (f.ok()) return "";
  EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
  return std::string(StatusMessage(f.status()));
}

TEST(GgufCorruptTest, WrongMagic) {
  std::string s = ValidFile();
  s[0] = 'X';
  EXPECT_THAT(ErrorOf(s), HasSubstr("test.gguf: not a GGUF file: magic at offset 0 is \"XGUF\""));
  EXPECT_THAT(ErrorOf("GG"), HasSubstr("truncated at offset 2 while reading the header"));
  EXPECT_THAT(ErrorOf(""), HasSubstr("truncated at offset 0"));
}

TEST(GgufCorruptTest, BadVersion) {
  EXPECT_THAT(ErrorOf(GgufBuilder(1).Build()),
              HasSubstr("unsupported GGUF version 1 at offset 4 (supported: 2, 3)"));
  EXPECT_THAT(ErrorOf(GgufBuilder(4).Build()), HasSubstr("unsupported GGUF version 4"));
  EXPECT_THAT(ErrorOf(GgufBuilder(0x03000000).Build()), HasSubstr("big-endian GGUF v3"));
}

TEST(GgufCorruptTest, EveryTruncationFailsCleanly) {
  const std::string s = ValidFile();
  for (size_t n = 0; n < s.size(); ++n) {
    auto f = ParseBytes(s.substr(0, n));
    // Cutting only trailing padding of the last tensor's data is not possible here: the last
    // tensor ends the file, so every strict prefix must fail.
    ASSERT_FALSE(f.ok()) << "prefix of " << n << " bytes parsed";
    EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(GgufCorruptTest, TruncationMessageNamesTensorInfo) {
  GgufBuilder b;
  b.Tensor("blk.0.w", 0, {2}, Floats({1, 2})).Tensor("blk.3.ffn_up.weight", 0, {2}, Floats({1, 2}));
  std::string s = b.Build();
  // Cut in the middle of the second tensor info's dims: header 24 + info0 (8+7+4+8+4+8=39) +
  // name of info1 (8+19) + n_dims (4) + 3 bytes.
  size_t cut = 24 + 39 + 27 + 4 + 3;
  EXPECT_THAT(ErrorOf(s.substr(0, cut)),
              HasSubstr("test.gguf: truncated at offset 94 while reading tensor info 1 of 2 "
                        "(\"blk.3.ffn_up.weight\")"));
}

TEST(GgufCorruptTest, TensorOffsetOutOfRange) {
  GgufBuilder b;
  b.Tensor("t", 0, {4}, Floats({1, 2, 3, 4}), /*offset_override=*/4096);
  EXPECT_THAT(ErrorOf(b.Build()), HasSubstr("tensor \"t\" data [4096, +16) is out of range"));
  // Data cut short: the file ends inside the tensor.
  GgufBuilder c;
  c.Tensor("t", 0, {4}, Floats({1, 2, 3, 4}));
  std::string s = c.Build();
  EXPECT_THAT(ErrorOf(s.substr(0, s.size() - 4)), HasSubstr("out of range"));
}

TEST(GgufCorruptTest, MisalignedOffset) {
  GgufBuilder b;
  b.Tensor("t", 0, {1}, Floats({1}), /*offset_override=*/4);
  EXPECT_THAT(ErrorOf(b.Build()), HasSubstr("is not a multiple of the alignment 32"));
}

TEST(GgufCorruptTest, OverlappingTensors) {
  GgufBuilder b;
  b.Tensor("t", 0, {16}, Floats(std::vector<float>(16, 1.f)))
      .Tensor("u", 0, {8}, Floats(std::vector<float>(8, 1.f)), /*offset_override=*/32);
  EXPECT_THAT(ErrorOf(b.Build()),
              HasSubstr("tensor \"u\" data at offset 32 overlaps tensor \"t\""));
}

TEST(GgufCorruptTest, OverflowingDims) {
  GgufBuilder b;
  b.Tensor("t", 0, {1ull << 32, 1ull << 32}, "");
  EXPECT_THAT(ErrorOf(b.Build()), HasSubstr("element count overflows"));
  GgufBuilder c;
  c.Tensor("t", 0, {~0ull}, "");
  EXPECT_THAT(ErrorOf(c.Build()), HasSubstr("overflows"));
}

TEST(GgufCorruptTest, TensorTypes) {
  GgufBuilder unknown;
  unknown.Tensor("t", 77, {32}, "");
  EXPECT_THAT(ErrorOf(unknown.Build()), HasSubstr("unknown tensor type 77 in tensor \"t\""));
  GgufBuilder unsupported;
  unsupported.Tensor("blk.0.w", 10, {256}, std::string(84, '\0'));
  EXPECT_THAT(ErrorOf(unsupported.Build()),
              HasSubstr("unsupported tensor type Q2_K in tensor \"blk.0.w\""));
  GgufBuilder partial_block;
  partial_block.Tensor("t", 2, {33}, std::string(36, '\0'));
  EXPECT_THAT(ErrorOf(partial_block.Build()), HasSubstr("not a multiple of the block size 32"));
  GgufBuilder dims;
  dims.Tensor("t", 0, {1, 1, 1, 1, 1}, Floats({1}));
  EXPECT_THAT(ErrorOf(dims.Build()), HasSubstr("has 5 dimensions"));
}

TEST(GgufCorruptTest, DuplicateNames) {
  GgufBuilder t;
  t.Tensor("t", 0, {1}, Floats({1})).Tensor("t", 0, {1}, Floats({1}));
  EXPECT_THAT(ErrorOf(t.Build()), HasSubstr("duplicate tensor name \"t\""));
  GgufBuilder k;
  k.U32("a", 1).U32("a", 2);
  EXPECT_THAT(ErrorOf(k.Build()), HasSubstr("duplicate metadata key \"a\""));
}

TEST(GgufCorruptTest, HugeLengthsAndCounts) {
  std::string huge_len(8, '\xff');
  EXPECT_THAT(ErrorOf(GgufBuilder().RawKv("s", 8, huge_len).Build()), HasSubstr("has length"));
  std::string huge_array = std::string("\x04\0\0\0", 4) + std::string(8, '\x7f');
  EXPECT_THAT(ErrorOf(GgufBuilder().RawKv("a", 9, huge_array).Build()),
              HasSubstr("elements of type UINT32 but only"));
  EXPECT_THAT(ErrorOf(GgufBuilder().RawKv("v", 99, "").Build()),
              HasSubstr("unknown value type 99"));
  std::string header = "GGUF";
  uint32_t v = 3;
  uint64_t n = 1ull << 50;
  header.append(reinterpret_cast<char*>(&v), 4);
  header.append(reinterpret_cast<char*>(&n), 8);
  uint64_t zero = 0;
  header.append(reinterpret_cast<char*>(&zero), 8);
  EXPECT_THAT(ErrorOf(header), HasSubstr("tensor count 1125899906842624"));
}

TEST(GgufCorruptTest, DeepNesting) {
  std::string payload;
  for (int i = 0; i < 64; ++i) {
    uint32_t t = 9;
    uint64_t c = 1;
    payload.append(reinterpret_cast<char*>(&t), 4);
    payload.append(reinterpret_cast<char*>(&c), 8);
  }
  payload += std::string(64, '\0');
  EXPECT_THAT(ErrorOf(GgufBuilder().RawKv("deep", 9, payload).Build()), HasSubstr("nested deeper"));
}

TEST(GgufCorruptTest, BadAlignment) {
  EXPECT_THAT(ErrorOf(GgufBuilder().U32("general.alignment", 0).Build()),
              HasSubstr("power of two"));
  EXPECT_THAT(ErrorOf(GgufBuilder().U32("general.alignment", 48).Build()),
              HasSubstr("power of two"));
  EXPECT_THAT(ErrorOf(GgufBuilder().Str("general.alignment", "x").Build()),
              HasSubstr("must be UINT32"));
}

TEST(GgufTest, OpensFromDisk) {
  std::string path = ::testing::TempDir() + "/kiln_gguf_test_" + std::to_string(getpid()) + ".gguf";
  {
    std::ofstream out(path, std::ios::binary);
    std::string s = ValidFile();
    out.write(s.data(), s.size());
  }
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->path(), path);
  EXPECT_EQ(static_cast<const float*>((*f)->FindTensor("a.weight")->data)[0], 1.0f);
  std::remove(path.c_str());
  auto missing = GgufFile::Open(path);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(std::string(StatusMessage(missing.status())), HasSubstr(path));
}

TEST(DequantTest, HalfAndBf16) {
  EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xC000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x0001), 5.9604644775390625e-8f);  // smallest subnormal
  EXPECT_EQ(HalfToFloat(0x03FF), 6.097555160522461e-05f);  // largest subnormal
  EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  EXPECT_TRUE(std::isinf(HalfToFloat(0x7C00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7E00)));
  EXPECT_EQ(Bf16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(0xC0A0), -5.0f);
}

TEST(DequantTest, Q4_0AndQ8_0ByHand) {
  // Q4_0 block: d = 0.5 (0x3800), nibbles: low = j % 16, high = 15 - j % 16.
  std::string q4(18, '\0');
  q4[0] = 0x00;
  q4[1] = 0x38;
  for (int j = 0; j < 16; ++j) q4[2 + j] = static_cast<char>((j & 0xF) | ((15 - j) << 4));
  auto y = Dequantize(GgmlType::kQ4_0, q4.data(), 32);
  ASSERT_TRUE(y.ok());
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ((*y)[j], (j - 8) * 0.5f);
    EXPECT_EQ((*y)[j + 16], (15 - j - 8) * 0.5f);
  }
  std::string q8(34, '\0');
  q8[1] = 0x40;  // d = 2.0
  for (int j = 0; j < 32; ++j) q8[2 + j] = static_cast<char>(j - 16);
  auto z = Dequantize(GgmlType::kQ8_0, q8.data(), 32);
  ASSERT_TRUE(z.ok());
  for (int j = 0; j < 32; ++j) EXPECT_EQ((*z)[j], (j - 16) * 2.0f);
  EXPECT_FALSE(Dequantize(GgmlType::kQ8_0, q8.data(), 31).ok());
  // Found by gguf_fuzz (UBSan): zero elements with null buffers.
  EXPECT_TRUE(Dequantize(GgmlType::kF32, nullptr, 0, nullptr).ok());
  EXPECT_EQ(Dequantize(GgmlType::kQ2_K, q8.data(), 256).status().code(),
            StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace kiln::models
