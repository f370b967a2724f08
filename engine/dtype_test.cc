#include "engine/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace kiln {
namespace internal {
uint32_t EncodeF16Generic(double x);
uint32_t EncodeBF16Generic(double x);
double DecodeF16Generic(uint32_t v);
}  // namespace internal

namespace {

float Bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(DTypeTest, NamesRoundTripAndAliases) {
  for (int i = 1; i < kNumDTypes; ++i) {
    const DType t = static_cast<DType>(i);
    auto parsed = ParseDType(DTypeName(t));
    ASSERT_TRUE(parsed.ok()) << DTypeName(t);
    EXPECT_EQ(*parsed, t);
  }
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("FLOAT32"), DType::kF32);
  auto bad = ParseDType("f33");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(StatusMessage(bad.status()).find("allowed"), std::string_view::npos);
}

TEST(DTypeTest, SizesAndClasses) {
  EXPECT_EQ(DTypeBytes(DType::kF32, 3), 12);
  EXPECT_EQ(DTypeBytes(DType::kQ4_0, 64), 36);
  EXPECT_EQ(DTypeBytes(DType::kQ4_1, 32), 20);
  EXPECT_EQ(DTypeBytes(DType::kQ8_0, 32), 34);
  EXPECT_EQ(DTypeBytes(DType::kMXFP4, 32), 17);
  EXPECT_EQ(DTypeBytes(DType::kQ4_K, 256), 144);
  EXPECT_EQ(DTypeBytes(DType::kQ5_K, 256), 176);
  EXPECT_EQ(DTypeBytes(DType::kQ6_K, 512), 420);
  EXPECT_TRUE(IsFloat(DType::kF8E5M2));
  EXPECT_FALSE(IsFloat(DType::kQ8_0));
  EXPECT_TRUE(IsQuantized(DType::kMXFP4));
  EXPECT_TRUE(IsInteger(DType::kU8));
  EXPECT_FALSE(IsInteger(DType::kBool));
  EXPECT_FALSE(IsSigned(DType::kU8));
  EXPECT_EQ(ComputeDType(DType::kBF16), DType::kF32);
  EXPECT_EQ(ComputeDType(DType::kF64), DType::kF64);
  EXPECT_EQ(ComputeDType(DType::kI32), DType::kI64);
}

TEST(DTypeTest, F16KnownValues) {
  EXPECT_EQ(FloatToF16(1.0f), 0x3C00);
  EXPECT_EQ(FloatToF16(-2.0f), 0xC000);
  EXPECT_EQ(FloatToF16(0.1f), 0x2E66);
  EXPECT_EQ(FloatToF16(1.0f / 3), 0x3555);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7BFF);                  // max finite
  EXPECT_EQ(FloatToF16(65519.99f), 0x7BFF);                 // just below the rounding boundary
  EXPECT_EQ(FloatToF16(65520.0f), 0x7C00);                  // tie rounds to even = infinity
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -14)), 0x0400);     // min normal
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -24)), 0x0001);     // min subnormal
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -25)), 0x0000);     // tie to even -> 0
  EXPECT_EQ(FloatToF16(std::ldexp(3.0f, -26)), 0x0001);     // 0.75 ulp rounds up
  EXPECT_EQ(FloatToF16(std::ldexp(1023.0f, -24)), 0x03FF);  // max subnormal
  EXPECT_EQ(FloatToF16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToF16(kInf), 0x7C00);
  EXPECT_EQ(FloatToF16(-kInf), 0xFC00);
  EXPECT_EQ(FloatToF16(kNaN), 0x7E00);
  EXPECT_EQ(F16ToFloat(0x3C00), 1.0f);
  EXPECT_EQ(F16ToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(F16ToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(F16ToFloat(0xFC00), -kInf);
  EXPECT_TRUE(std::isnan(F16ToFloat(0x7E01)));
  EXPECT_TRUE(std::signbit(F16ToFloat(0x8000)));
}

TEST(DTypeTest, F16ExhaustiveRoundTripAndFastPathMatchesGeneric) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const float f = F16ToFloat(static_cast<uint16_t>(c));
    const double g = internal::DecodeF16Generic(c);
    if (!std::isnan(g)) {
      ASSERT_EQ(static_cast<double>(f), g) << "code " << c;
    }
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(f))));
    } else {
      ASSERT_EQ(FloatToF16(f), c) << "code " << c;
    }
  }
  // Sweep float bit patterns (all exponents, many mantissas) against the generic codec.
  for (uint64_t b = 0; b <= 0xFFFFFFFFull; b += 65521) {
    const float f = Bits(static_cast<uint32_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToF16(f), internal::EncodeF16Generic(f)) << std::hex << b;
    ASSERT_EQ(FloatToBF16(f), internal::EncodeBF16Generic(f)) << std::hex << b;
  }
}

TEST(DTypeTest, BF16KnownValues) {
  EXPECT_EQ(FloatToBF16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBF16(3.14159274f), 0x4049);
  EXPECT_EQ(FloatToBF16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);      // tie -> even
  EXPECT_EQ(FloatToBF16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);  // tie -> even (up)
  EXPECT_EQ(FloatToBF16(Bits(0x7F7FFFFF)), 0x7F80);                 // FLT_MAX rounds to inf
  EXPECT_EQ(FloatToBF16(Bits(0x00010000)), 0x0001);                 // subnormal kept
  EXPECT_EQ(FloatToBF16(kNaN), 0x7FC0);
  EXPECT_EQ(FloatToBF16(-kInf), 0xFF80);
  EXPECT_EQ(BF16ToFloat(0x4049), 3.140625f);
  EXPECT_TRUE(std::isnan(BF16ToFloat(0x7FC0)));
}

TEST(DTypeTest, F8E4M3KnownValues) {
  EXPECT_EQ(FloatToF8E4M3(1.0f), 0x38);
  EXPECT_EQ(FloatToF8E4M3(-1.0f), 0xB8);
  EXPECT_EQ(FloatToF8E4M3(448.0f), 0x7E);
  EXPECT_EQ(FloatToF8E4M3(464.0f), 0x7E);  // tie between 448 and (NaN slot) -> even
  EXPECT_EQ(FloatToF8E4M3(470.0f), 0x7F);  // rounds past 448: NaN (PyTorch semantics)
  EXPECT_EQ(FloatToF8E4M3(kInf), 0x7F);
  EXPECT_EQ(FloatToF8E4M3(-kNaN), 0xFF);
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(1.0f, -9)), 0x01);   // min subnormal
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(1.0f, -10)), 0x00);  // tie -> 0
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(1.0f, -6)), 0x08);   // min normal
  EXPECT_EQ(FloatToF8E4M3(0.3f), 0x2A);                   // 0.3 -> 0.3125 (1.010 * 2^-2)
  EXPECT_EQ(F8E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(F8E4M3ToFloat(0x2A), 0.3125f);
  EXPECT_TRUE(std::isnan(F8E4M3ToFloat(0x7F)));
  EXPECT_TRUE(std::isnan(F8E4M3ToFloat(0xFF)));
  EXPECT_EQ(F8E4M3ToFloat(0x78), 256.0f);  // exponent 15 is a normal exponent in "fn"
  for (uint32_t c = 0; c < 256; ++c) {
    const float f = F8E4M3ToFloat(static_cast<uint8_t>(c));
    if (!std::isnan(f)) {
      EXPECT_EQ(FloatToF8E4M3(f), c);
    }
  }
}

TEST(DTypeTest, F8E5M2KnownValues) {
  EXPECT_EQ(FloatToF8E5M2(1.0f), 0x3C);
  EXPECT_EQ(FloatToF8E5M2(57344.0f), 0x7B);  // max finite
  EXPECT_EQ(FloatToF8E5M2(61440.0f), 0x7C);  // tie -> even = inf
  EXPECT_EQ(FloatToF8E5M2(kInf), 0x7C);
  EXPECT_EQ(FloatToF8E5M2(-kInf), 0xFC);
  EXPECT_EQ(FloatToF8E5M2(kNaN), 0x7E);
  EXPECT_EQ(FloatToF8E5M2(std::ldexp(1.0f, -16)), 0x01);  // min subnormal
  EXPECT_EQ(F8E5M2ToFloat(0x7B), 57344.0f);
  EXPECT_EQ(F8E5M2ToFloat(0x7C), kInf);
  EXPECT_TRUE(std::isnan(F8E5M2ToFloat(0x7D)));
  for (uint32_t c = 0; c < 256; ++c) {
    const float f = F8E5M2ToFloat(static_cast<uint8_t>(c));
    if (!std::isnan(f)) {
      EXPECT_EQ(FloatToF8E5M2(f), c);
    }
  }
}

TEST(DTypeTest, E2M1AndE8M0KnownValues) {
  const float values[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (uint8_t c = 0; c < 8; ++c) {
    EXPECT_EQ(E2M1ToFloat(c), values[c]);
    EXPECT_EQ(E2M1ToFloat(c | 8), -values[c]);
    EXPECT_EQ(FloatToE2M1(values[c]), c);
  }
  EXPECT_EQ(FloatToE2M1(0.25f), 0x0);   // tie between 0 and 0.5 -> even (0)
  EXPECT_EQ(FloatToE2M1(0.75f), 0x2);   // tie between 0.5 and 1 -> even (1.0)
  EXPECT_EQ(FloatToE2M1(5.0f), 0x6);    // tie between 4 and 6 -> even (4)
  EXPECT_EQ(FloatToE2M1(100.0f), 0x7);  // saturates
  EXPECT_EQ(FloatToE2M1(-kInf), 0xF);
  EXPECT_EQ(FloatToE2M1(-0.0f), 0x8);
  EXPECT_EQ(FloatToE2M1(kNaN), 0x0);
  EXPECT_EQ(E8M0ToFloat(127), 1.0f);
  EXPECT_EQ(E8M0ToFloat(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(E8M0ToFloat(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(E8M0ToFloat(255)));
}

TEST(DTypeTest, Q4_0MatchesGgmlLayout) {
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j - 16);
  uint8_t block[18];
  ASSERT_TRUE(QuantizeRow(DType::kQ4_0, x, block, 32).ok());
  const uint8_t want[18] = {0x00, 0x40,  // d = max / -8 = 2.0
                            0x80, 0x91, 0x91, 0xA2, 0xA2, 0xB3, 0xB3, 0xC4,
                            0xC4, 0xD5, 0xD5, 0xE6, 0xE6, 0xF7, 0xF7, 0xF8};
  EXPECT_EQ(std::vector<uint8_t>(block, block + 18), std::vector<uint8_t>(want, want + 18));
  float y[32];
  ASSERT_TRUE(DequantizeRow(DType::kQ4_0, block, y, 32).ok());
  EXPECT_EQ(y[0], -16.0f);  // (0 - 8) * 2
  EXPECT_EQ(y[1], -14.0f);  // (1 - 8) * 2
  EXPECT_EQ(y[16], 0.0f);   // (8 - 8) * 2
  EXPECT_EQ(y[31], 14.0f);  // (15 - 8) * 2 (clamped)
}

TEST(DTypeTest, Q4_1MatchesGgmlLayout) {
  float x[32];
  for (int j = 0; j < 31; ++j) x[j] = 1.0f + 0.5f * j;  // min 1, max 16 -> d = 1, m = 1
  x[31] = 1.0f;
  uint8_t block[20];
  ASSERT_TRUE(QuantizeRow(DType::kQ4_1, x, block, 32).ok());
  EXPECT_EQ(block[0], 0x00);
  EXPECT_EQ(block[1], 0x3C);  // d = 1.0
  EXPECT_EQ(block[2], 0x00);
  EXPECT_EQ(block[3], 0x3C);  // m = 1.0
  const uint8_t qs[16] = {0x80, 0x91, 0x91, 0xA2, 0xA2, 0xB3, 0xB3, 0xC4,
                          0xC4, 0xD5, 0xD5, 0xE6, 0xE6, 0xF7, 0xF7, 0x08};
  EXPECT_EQ(std::vector<uint8_t>(block + 4, block + 20), std::vector<uint8_t>(qs, qs + 16));
  float y[32];
  ASSERT_TRUE(DequantizeRow(DType::kQ4_1, block, y, 32).ok());
  EXPECT_EQ(y[3], 3.0f);   // q = 2 -> 2 * 1 + 1
  EXPECT_EQ(y[31], 1.0f);  // q = 0
}

TEST(DTypeTest, Q8_0MatchesGgmlLayout) {
  float x[32] = {127, -127, 0.5f, 1.5f, -0.5f, 2.5f, -2.5f, 0.49f};
  uint8_t block[34];
  ASSERT_TRUE(QuantizeRow(DType::kQ8_0, x, block, 32).ok());
  EXPECT_EQ(block[0], 0x00);
  EXPECT_EQ(block[1], 0x3C);  // d = 127 / 127
  // roundf: halves away from zero.
  const int8_t want[8] = {127, -127, 1, 2, -1, 3, -3, 0};
  for (int j = 0; j < 8; ++j) EXPECT_EQ(static_cast<int8_t>(block[2 + j]), want[j]) << j;
  float y[32];
  ASSERT_TRUE(DequantizeRow(DType::kQ8_0, block, y, 32).ok());
  EXPECT_EQ(y[5], 3.0f);
  EXPECT_EQ(y[1], -127.0f);
}

TEST(DTypeTest, Mxfp4MatchesGgmlLayout) {
  float x[32] = {};
  x[0] = 6;
  x[1] = 1;
  x[2] = 0.75f;  // tie between 0.5 and 1.0: ggml keeps the lower index (0.5)
  x[3] = 3;
  x[16] = -6;
  x[17] = 0.5f;
  x[18] = -0.25f;  // ties with 0 -> index 0
  uint8_t block[17];
  ASSERT_TRUE(QuantizeRow(DType::kMXFP4, x, block, 32).ok());
  EXPECT_EQ(block[0], 127);             // floor(log2 6) - 2 + 127; element scale 2^0, table halves
  EXPECT_EQ(block[1], 0x7 | 0xF << 4);  // 6 | -6 << 4
  EXPECT_EQ(block[2], 0x2 | 0x1 << 4);  // 1 | 0.5 << 4
  EXPECT_EQ(block[3], 0x1 | 0x0 << 4);  // 0.5 | 0
  EXPECT_EQ(block[4], 0x5);             // 3
  float y[32];
  ASSERT_TRUE(DequantizeRow(DType::kMXFP4, block, y, 32).ok());
  EXPECT_EQ(y[0], 6.0f);
  EXPECT_EQ(y[16], -6.0f);
  EXPECT_EQ(y[2], 0.5f);
  // Dequantization agrees with the OCP definition e2m1 * 2^(e - 127).
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], E2M1ToFloat(block[1 + j] & 0xF) * E8M0ToFloat(block[0]));
    EXPECT_EQ(y[j + 16], E2M1ToFloat(block[1 + j] >> 4) * E8M0ToFloat(block[0]));
  }
}

TEST(DTypeTest, Q4_KDequantizeKnownBlock) {
  uint8_t b[144] = {};
  b[0] = 0x00, b[1] = 0x3C;  // d = 1
  b[2] = 0x00, b[3] = 0x38;  // dmin = 0.5
  const uint8_t scales[12] = {1, 2, 3, 4, 0, 1, 2, 3, 0x15, 0x26, 0x37, 0x48};
  std::memcpy(b + 4, scales, 12);
  for (int l = 0; l < 128; ++l) b[16 + l] = (l & 15) | (15 - (l & 15)) << 4;
  float y[256];
  ASSERT_TRUE(DequantizeRow(DType::kQ4_K, b, y, 256).ok());
  EXPECT_EQ(y[3], 3.0f);                 // sub-block 0: scale 1, min 0
  EXPECT_EQ(y[32 + 3], 2 * 12 - 0.5f);   // sub-block 1: scale 2, min 1 * 0.5
  EXPECT_EQ(y[128 + 5], 5 * 5 - 0.5f);   // sub-block 4: scale 0x15 & 15 = 5, min 1
  EXPECT_EQ(y[224 + 1], 8 * 14 - 2.0f);  // sub-block 7: scale 8, min 4
}

TEST(DTypeTest, Q5_KDequantizeKnownBlock) {
  uint8_t b[176] = {};
  b[1] = 0x3C;       // d = 1
  b[3] = 0x38;       // dmin = 0.5
  b[4] = 2;          // sub-block 0 scale
  b[8] = 1;          // sub-block 0 min
  b[5] = 3;          // sub-block 1 scale
  b[16 + 0] = 0x01;  // qh[0]: bit 0 -> +16 for element 0 (sub-block 0)
  b[16 + 1] = 0x02;  // qh[1]: bit 1 -> +16 for element 33 (sub-block 1)
  b[48 + 0] = 0x07;  // ql[0] low nibble 7
  b[48 + 1] = 0x50;  // ql[1] high nibble 5
  float y[256];
  ASSERT_TRUE(DequantizeRow(DType::kQ5_K, b, y, 256).ok());
  EXPECT_EQ(y[0], 2 * (7 + 16) - 0.5f);
  EXPECT_EQ(y[33], 3 * (5 + 16) - 0.0f);
  EXPECT_EQ(y[2], -0.5f);
}

TEST(DTypeTest, Q6_KDequantizeKnownBlock) {
  uint8_t b[210] = {};
  b[0] = 0x21;          // ql[0]: low 1 (element 0), high 2 (element 64)
  b[32] = 0x03;         // ql[32]: low 3 (element 32)
  b[128] = 0b00100001;  // qh[0]: bits 0-1 = 1 (elem 0), 2-3 = 0 (elem 32), 4-5 = 2 (elem 64)
  b[192 + 0] = 2;       // scale of elements 0..15
  b[192 + 2] = static_cast<uint8_t>(-3);  // scale of elements 32..47
  b[192 + 4] = 1;                         // scale of elements 64..79
  b[208] = 0x00, b[209] = 0x34;           // d = 0.25
  float y[256];
  ASSERT_TRUE(DequantizeRow(DType::kQ6_K, b, y, 256).ok());
  EXPECT_EQ(y[0], 0.25f * 2 * ((1 | 1 << 4) - 32));
  EXPECT_EQ(y[32], 0.25f * -3 * (3 - 32));
  EXPECT_EQ(y[64], 0.25f * 1 * ((2 | 2 << 4) - 32));
}

TEST(DTypeTest, Q5_0AndQ5_1DequantizeKnownBlocks) {
  EXPECT_EQ(DTypeBytes(DType::kQ5_0, 64), 44);
  EXPECT_EQ(DTypeBytes(DType::kQ5_1, 64), 48);
  uint8_t b0[22] = {};
  b0[1] = 0x40;  // d = 2
  b0[2] = 0x01;  // qh bit 0: element 0's 5th bit
  b0[4] = 0x02;  // qh bit 17: element 17's 5th bit
  b0[6] = 0x3F;  // qs[0]: element 0 low nibble 15, element 16 high nibble 3
  b0[7] = 0x90;  // qs[1]: element 1 low 0, element 17 high 9
  float y[32];
  ASSERT_TRUE(DequantizeRow(DType::kQ5_0, b0, y, 32).ok());
  EXPECT_EQ(y[0], 2.0f * ((15 | 16) - 16));
  EXPECT_EQ(y[16], 2.0f * (3 - 16));
  EXPECT_EQ(y[1], 2.0f * -16);
  EXPECT_EQ(y[17], 2.0f * ((9 | 16) - 16));
  uint8_t b1[24] = {};
  b1[1] = 0x3C;  // d = 1
  b1[3] = 0xB8;  // m = -0.5
  b1[4] = 0x01;  // qh bit 0
  b1[8] = 0x3F;  // qs[0]
  ASSERT_TRUE(DequantizeRow(DType::kQ5_1, b1, y, 32).ok());
  EXPECT_EQ(y[0], 31 - 0.5f);
  EXPECT_EQ(y[16], 3 - 0.5f);
  EXPECT_EQ(y[5], -0.5f);
}

TEST(DTypeTest, QuantizeRejectsPartialBlocksAndKQuants) {
  float x[48] = {};
  uint8_t out[64];
  EXPECT_EQ(QuantizeRow(DType::kQ4_0, x, out, 48).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeRow(DType::kQ4_K, x, out, 256).code(), StatusCode::kUnimplemented);
  EXPECT_EQ(QuantizeRow(DType::kQ5_0, x, out, 32).code(), StatusCode::kUnimplemented);
  EXPECT_EQ(QuantizeRow(DType::kF32, x, out, 32).code(), StatusCode::kInvalidArgument);
}

TEST(DTypeTest, ElementAccessAndIntegerSemantics) {
  int32_t i32[2];
  StoreElement(i32, DType::kI32, 0, 3.9);
  StoreElement(i32, DType::kI32, 1, -1e20);
  EXPECT_EQ(i32[0], 3);                                    // truncates toward zero
  EXPECT_EQ(i32[1], std::numeric_limits<int32_t>::min());  // saturates
  uint8_t u8;
  StoreElement(&u8, DType::kU8, 0, std::nan(""));
  EXPECT_EQ(u8, 0);
  StoreInt(&u8, DType::kU8, 0, 257);
  EXPECT_EQ(u8, 1);  // integer -> integer wraps
  int64_t i64 = 0;
  StoreInt(&i64, DType::kI64, 0, (int64_t{1} << 62) + 1);
  EXPECT_EQ(LoadInt(&i64, DType::kI64, 0), (int64_t{1} << 62) + 1);  // exact, no double trip
  uint8_t bools[2];
  StoreElement(bools, DType::kBool, 0, -0.5);
  StoreElement(bools, DType::kBool, 1, 0.0);
  EXPECT_EQ(bools[0], 1);
  EXPECT_EQ(bools[1], 0);
  uint16_t h;
  StoreElement(&h, DType::kF16, 0, 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40));
  EXPECT_EQ(h, 0x3C01);  // correctly rounded from the double (no double rounding)
}

TEST(DTypeTest, ConvertElementsThroughQuantized) {
  std::vector<float> x(64);
  for (int i = 0; i < 64; ++i) x[i] = std::sin(0.3f * i);
  std::vector<uint8_t> q(DTypeBytes(DType::kQ8_0, 64));
  ASSERT_TRUE(ConvertElements(DType::kF32, x.data(), DType::kQ8_0, q.data(), 64).ok());
  std::vector<uint16_t> h(64);
  ASSERT_TRUE(ConvertElements(DType::kQ8_0, q.data(), DType::kF16, h.data(), 64).ok());
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(F16ToFloat(h[i]), x[i], 0.01) << i;
  std::vector<int32_t> ints = {1, -2, 300};
  std::vector<int8_t> i8(3);
  ASSERT_TRUE(ConvertElements(DType::kI32, ints.data(), DType::kI8, i8.data(), 3).ok());
  EXPECT_EQ(i8[2], static_cast<int8_t>(300));
}

}  // namespace
}  // namespace kiln
