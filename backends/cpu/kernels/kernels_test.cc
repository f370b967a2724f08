// The per-ISA kernels against plain double-precision loops over the engine's dequantizer:
// every weight type, shapes with tails (N not a multiple of the strip, K not a multiple of
// 256 or of 32 for float weights, M = 1..20), strided MatMul operands, and paged attention
// with GQA, block tables with holes, masks and split partials. Each variant this CPU can
// run is tested; the others are skipped with a message.
#include "backends/cpu/kernels/kernels.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace kiln::cpu {
namespace {}  // namespace
void PrintTo(Isa isa, std::ostream* os) { *os << IsaName(isa); }
namespace {

std::vector<Isa> AllIsas() { return {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}; }

class IsaTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    k_ = KernelsFor(GetParam());
    if (k_ == nullptr) GTEST_SKIP() << IsaName(GetParam()) << " is not supported by this CPU";
  }
  const IsaKernels* k_ = nullptr;
};

struct Weights {
  DType t;
  int64_t n, k, row_bytes;
  std::vector<uint8_t> bytes;
  std::vector<float> f32;  // dequantized
};

Weights MakeWeights(DType t, int64_t n, int64_t k, std::mt19937& rng) {
  Weights w{t, n, k, DTypeBytes(t, k), {}, {}};
  std::normal_distribution<float> nd(0, 1);
  std::vector<float> src(n * k);
  for (float& v : src) v = nd(rng);
  w.bytes.resize(n * w.row_bytes);
  w.f32.resize(n * k);
  for (int64_t r = 0; r < n; ++r) {
    if (IsQuantized(t)) {
      EXPECT_TRUE(QuantizeRow(t, src.data() + r * k, w.bytes.data() + r * w.row_bytes, k).ok());
    } else {
      EXPECT_TRUE(
          ConvertElements(DType::kF32, src.data() + r * k, t, w.bytes.data() + r * w.row_bytes, k)
              .ok());
    }
    EXPECT_TRUE(
        ConvertElements(t, w.bytes.data() + r * w.row_bytes, DType::kF32, w.f32.data() + r * k, k)
            .ok());
  }
  return w;
}

// y[M, w.n] = x[M, w.k] . W^T over `w`'s stored bytes; the caller sets y.
GemmArgs ArgsFor(const Weights& w, const float* x, int64_t ldx, int64_t M, int64_t ldy) {
  GemmArgs a;
  a.x = x;
  a.ldx = ldx;
  a.w = w.bytes.data();
  a.wtype = w.t;
  a.w_row_bytes = w.row_bytes;
  a.ldy = ldy;
  a.M = M;
  a.N = w.n;
  a.K = w.k;
  return a;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

double Nmse(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den > 0 ? num / den : num;
}

TEST_P(IsaTest, GemvAndGemmMatchReferenceForEveryWeightType) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0, 1);
  const DType types[] = {DType::kF32,  DType::kF16,  DType::kBF16, DType::kQ4_0,
                         DType::kQ4_1, DType::kQ8_0, DType::kMXFP4};
  struct Shape {
    int64_t m, n, k;
  };
  for (DType t : types) {
    const bool fl = !IsQuantized(t);
    for (const Shape s : {Shape{1, 7, 64}, Shape{3, 9, 96}, Shape{5, 37, 288}, Shape{20, 70, 544},
                          Shape{1, 5, fl ? 45 : 32}, Shape{7, 33, fl ? 300 : 320}}) {
      const Weights w = MakeWeights(t, s.n, s.k, rng);
      const int64_t ldx = s.k + 3, ldy = s.n + 5;
      std::vector<float> x(s.m * ldx);
      for (float& v : x) v = nd(rng);
      std::vector<double> want(s.m * s.n);
      for (int64_t m = 0; m < s.m; ++m) {
        for (int64_t n = 0; n < s.n; ++n) {
          double acc = 0;
          for (int64_t k = 0; k < s.k; ++k) acc += double(x[m * ldx + k]) * w.f32[n * s.k + k];
          want[m * s.n + n] = acc;
        }
      }
      GemmArgs a = ArgsFor(w, x.data(), ldx, s.m, ldy);
      const std::string what = absl::StrCat(DTypeName(t), " M=", s.m, " N=", s.n, " K=", s.k);
      for (int variant = 0; variant < 3; ++variant) {
        std::vector<float> y(s.m * ldy, NAN);
        a.y = y.data();
        if (variant == 0) {  // gemv in two row ranges
          k_->gemv(a, 0, s.n / 3);
          k_->gemv(a, s.n / 3, s.n);
        } else if (variant == 1) {  // gemm in four tiles
          k_->gemm(a, 0, s.m / 2, 0, s.n / 2);
          k_->gemm(a, 0, s.m / 2, s.n / 2, s.n);
          k_->gemm(a, s.m / 2, s.m, 0, s.n / 2);
          k_->gemm(a, s.m / 2, s.m, s.n / 2, s.n);
        } else {  // dequant
          std::vector<float> d(s.n * s.k);
          k_->dequant(a, 0, s.n, d.data());
          for (int64_t i = 0; i < s.n * s.k; ++i) ASSERT_EQ(d[i], w.f32[i]) << what << " at " << i;
          continue;
        }
        std::vector<float> got(s.m * s.n);
        for (int64_t m = 0; m < s.m; ++m) {
          for (int64_t n = 0; n < s.n; ++n) got[m * s.n + n] = y[m * ldy + n];
        }
        EXPECT_LT(Nmse(got, want), 1e-12) << what << (variant == 0 ? " gemv" : " gemm");
        // Padding columns between rows are untouched.
        for (int64_t m = 0; m < s.m; ++m) {
          for (int64_t n = s.n; n < ldy; ++n) EXPECT_TRUE(std::isnan(y[m * ldy + n])) << what;
        }
      }
    }
  }
}

// From five rows of x the GEMV decodes each strip of four weight rows once and runs every
// group of rows against the f32 copy. Its tiles do the arithmetic of the tiles that decode
// in registers, so each row's result is the one it gets in a batch of two (no single-row
// tiles here: M = 6 and 14 split into groups of 2-6 on every variant).
TEST_P(IsaTest, GemvDecodingStripsOnceMatchesDecodingPerRowGroupBitForBit) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0, 1);
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ4_0, DType::kQ4_1, DType::kQ8_0,
                  DType::kMXFP4}) {
    const int64_t K = IsQuantized(t) ? 320 : 300, N = 11;  // a float K tail; a 3-row strip
    const Weights w = MakeWeights(t, N, K, rng);
    for (int64_t M : {6, 14}) {
      std::vector<float> x(M * K);
      for (float& v : x) v = nd(rng);
      GemmArgs a = ArgsFor(w, x.data(), K, M, N);
      std::vector<float> batch(M * N), pairs(M * N);
      a.y = batch.data();
      k_->gemv(a, 0, N);
      for (int64_t m = 0; m < M; m += 2) {
        GemmArgs two = a;
        two.x = x.data() + m * K;
        two.y = pairs.data() + m * N;
        two.M = std::min<int64_t>(2, M - m);
        ASSERT_EQ(two.M, 2);  // no single-row tile (it sums blocks another way)
        k_->gemv(two, 0, N);
      }
      for (int64_t i = 0; i < M * N; ++i) {
        ASSERT_EQ(Bits(batch[i]), Bits(pairs[i]))
            << DTypeName(t) << " M=" << M << " row " << i / N << " col " << i % N;
      }
    }
  }
}

TEST_P(IsaTest, GemmTakesStridedF32Operands) {
  // MatMul's right operand b [K, N] (N contiguous), seen as W = b^T with k stride N.
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0, 1);
  const int64_t M = 9, N = 40, K = 300;
  std::vector<float> x(M * K), b(K * N);
  for (float& v : x) v = nd(rng);
  for (float& v : b) v = nd(rng);
  std::vector<double> want(M * N);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += double(x[m * K + k]) * b[k * N + n];
      want[m * N + n] = acc;
    }
  }
  GemmArgs a;
  a.x = x.data();
  a.ldx = K;
  a.w = b.data();
  a.w_row_bytes = 4;
  a.w_k_stride = N;
  std::vector<float> y(M * N);
  a.y = y.data();
  a.ldy = N;
  a.M = M;
  a.N = N;
  a.K = K;
  k_->gemm(a, 0, M, 0, N);
  EXPECT_LT(Nmse(y, want), 1e-12);
}

TEST_P(IsaTest, GemvRunsKQuantsThroughTheDequantizer) {
  // Random q4_k super-blocks with sane f16 scales.
  std::mt19937 rng(11);
  const int64_t N = 5, K = 512, M = 2;
  const int64_t rb = DTypeBytes(DType::kQ4_K, K);
  std::vector<uint8_t> w(N * rb);
  for (auto& v : w) v = static_cast<uint8_t>(rng());
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t b = 0; b < K / 256; ++b) {
      uint8_t* blk = w.data() + r * rb + b * DTypeBlockBytes(DType::kQ4_K);
      const uint16_t d = FloatToF16(0.01f), dmin = FloatToF16(0.002f);
      std::memcpy(blk, &d, 2);
      std::memcpy(blk + 2, &dmin, 2);
    }
  }
  std::vector<float> wf(N * K), x(M * K, 0.5f), y(M * N);
  for (int64_t r = 0; r < N; ++r)
    ASSERT_TRUE(DequantizeRow(DType::kQ4_K, w.data() + r * rb, wf.data() + r * K, K).ok());
  GemmArgs a;
  a.x = x.data();
  a.ldx = K;
  a.w = w.data();
  a.wtype = DType::kQ4_K;
  a.w_row_bytes = rb;
  a.y = y.data();
  a.ldy = N;
  a.M = M;
  a.N = N;
  a.K = K;
  k_->gemv(a, 0, N);
  std::vector<double> want(M * N);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t k = 0; k < K; ++k) want[m * N + n] += 0.5 * wf[n * K + k];
    }
  }
  EXPECT_LT(Nmse(y, want), 1e-12);
  std::fill(y.begin(), y.end(), 0.0f);
  k_->gemm(a, 0, M, 0, N);
  EXPECT_LT(Nmse(y, want), 1e-12);
}

TEST_P(IsaTest, NonFiniteWeightsPropagate) {
  // A NaN mxfp4 scale (e8m0 0xff) and an Inf f16 weight reach the output as NaN / Inf.
  const int64_t K = 64;
  std::vector<uint8_t> w(2 * 34);
  std::vector<uint8_t> mx(2 * 17, 0x11);
  mx[0] = 0xff;  // block 0 of row 0: NaN scale
  mx[17] = 127;  // row 0, block 1: scale 1
  std::vector<float> x(K, 1.0f), y(1);
  GemmArgs a;
  a.x = x.data();
  a.ldx = K;
  a.w = mx.data();
  a.wtype = DType::kMXFP4;
  a.w_row_bytes = 34;
  a.y = y.data();
  a.ldy = 1;
  a.M = 1;
  a.N = 1;
  a.K = K;
  k_->gemv(a, 0, 1);
  EXPECT_TRUE(std::isnan(y[0]));
  std::vector<uint16_t> h(K, FloatToF16(1.0f));
  h[5] = 0x7c00;  // +Inf
  a.w = h.data();
  a.wtype = DType::kF16;
  a.w_row_bytes = 2 * K;
  k_->gemv(a, 0, 1);
  EXPECT_TRUE(std::isinf(y[0]) && y[0] > 0);
}

// Arguments of y[M, N] = x[M, K] w^T over row-major x and y and the weights `w`.
GemmArgs RowMajorArgs(const Weights& w, const float* x, float* y, int64_t M) {
  GemmArgs a;
  a.x = x;
  a.ldx = w.k;
  a.w = w.bytes.data();
  a.wtype = w.t;
  a.w_row_bytes = w.row_bytes;
  a.y = y;
  a.ldy = w.n;
  a.M = M;
  a.N = w.n;
  a.K = w.k;
  return a;
}

TEST_P(IsaTest, Q8ActivationsMatchTheirDequantizedValues) {
  const Q8Kernels* q8 = Q8KernelsFor(GetParam());
  ASSERT_NE(q8, nullptr);
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0, 1);
  for (DType t : {DType::kQ4_0, DType::kQ4_1, DType::kQ8_0, DType::kMXFP4}) {
    for (auto [M, N, K] :
         {std::tuple<int64_t, int64_t, int64_t>{1, 7, 64}, {2, 13, 288}, {3, 4, 544}, {5, 9, 96}}) {
      const Weights w = MakeWeights(t, N, K, rng);
      std::vector<float> x(M * K);
      for (float& v : x) v = nd(rng);
      x[0] = 0;
      std::vector<Q8Block> xq(M * K / 32);
      for (int64_t m = 0; m < M; ++m) q8->quantize(x.data() + m * K, K, xq.data() + m * K / 32);
      // The blocks: d = max|x| / 127 rounded to f16, q = round(x * 127 / max|x|), s = d * sum(q).
      for (int64_t b = 0; b < M * K / 32; ++b) {
        float amax = 0;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[b * 32 + j]));
        const float d = amax / 127.0f;
        int sum = 0;
        for (int j = 0; j < 32; ++j) {
          sum += xq[b].qs[j];
          EXPECT_LE(std::fabs(xq[b].qs[j] * d - x[b * 32 + j]), 0.5001f * d);
        }
        EXPECT_EQ(xq[b].d, RoundToF16(d));
        EXPECT_EQ(xq[b].s, xq[b].d * sum);
      }
      // y equals the exact product with the dequantized activations.
      std::vector<double> want(M * N);
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = 0; n < N; ++n) {
          double acc = 0;
          for (int64_t k = 0; k < K; ++k) {
            const Q8Block& xb = xq[(m * K + k) / 32];
            acc += double(xb.qs[k % 32]) * xb.d * w.f32[n * K + k];
          }
          want[m * N + n] = acc;
        }
      }
      std::vector<float> y(M * N);
      const GemmArgs a = RowMajorArgs(w, x.data(), y.data(), M);
      q8->gemv(a, xq.data(), 0, N / 2);
      q8->gemv(a, xq.data(), N / 2, N);
      EXPECT_LT(Nmse(y, want), 1e-12) << DTypeName(t) << " M=" << M << " N=" << N << " K=" << K;
    }
  }
}

// The q8 products of every set for one row: y[m, n] for all n, the rows computed together.
std::vector<float> Q8Product(const Q8Kernels& q8, const Weights& w, const std::vector<float>& x,
                             int64_t M, int64_t n0, int64_t n1) {
  const int64_t N = w.n, K = w.k;
  std::vector<Q8Block> xq(M * K / 32);
  for (int64_t m = 0; m < M; ++m) q8.quantize(x.data() + m * K, K, xq.data() + m * K / 32);
  std::vector<float> y(M * N, -1.0f);
  q8.gemv(RowMajorArgs(w, x.data(), y.data(), M), xq.data(), n0, n1);
  return y;
}

// The VNNI set (vpdpbusd, wider tiles) gives the AVX2 set's results bit for bit, and in
// both a row's result is the same whether it is computed alone or with up to 39 others (a
// sequence's numerics must not depend on its batch): every weight type, ragged strips. The
// batches of 1-8 rows take the unpacked tiles (for q4 under VNNI, Q8Tile4Nibbles: four rows
// per register), 40 rows the strips with weight rows in the lanes.
// The bf16 kernels: x rounded as FloatToBF16 does (to nearest even), zero-padded to whole
// chunks; y within f32 accumulation error of the exact products of the rounded x and the
// weights (shapes with partial chunks, odd K, edge tiles), and a row's bits the same in any
// range of rows or weight rows.
TEST(Bf16KernelsTest, MatchTheRoundedProductsAndRowsDoNotDependOnTheirRange) {
  // Where the CPU has the instruction, whether or not Bf16KernelsFor() would choose it.
  if (!IsaSupported(Isa::kAvx512) || !CpuHasAvx512Bf16()) {
    GTEST_SKIP() << "this CPU has no AVX-512 BF16 (vdpbf16ps)";
  }
  const Bf16Kernels* bf = &Avx512Bf16Kernels();
  std::mt19937 rng(31);
  std::normal_distribution<float> nd(0, 1);
  for (auto [N, K] : {std::pair<int64_t, int64_t>{13, 96}, {16, 576}, {7, 33}, {6, 1}, {9, 75}}) {
    const Weights w = MakeWeights(DType::kBF16, N, K, rng);
    const int64_t M = 11, ld = Bf16RowElems(K);
    std::vector<float> x(M * K), xr(M * K);
    for (float& v : x) v = nd(rng);
    std::vector<uint16_t> xb(M * ld, 0xFFFF);
    for (int64_t m = 0; m < M; ++m) bf->round(x.data() + m * K, K, xb.data() + m * ld);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < ld; ++k) {
        const uint16_t want = k < K ? FloatToBF16(x[m * K + k]) : 0;
        ASSERT_EQ(xb[m * ld + k], want) << "K=" << K << " row " << m << " element " << k;
        if (k < K) xr[m * K + k] = BF16ToFloat(want);
      }
    }
    std::vector<float> y(M * N);
    GemmArgs a = ArgsFor(w, x.data(), K, M, N);
    a.y = y.data();
    bf->gemm(a, xb.data(), ld, 0, M, 0, N);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        double want = 0, mag = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double p = double{xr[m * K + k]} * w.f32[n * K + k];
          want += p;
          mag += std::abs(p);
        }
        EXPECT_NEAR(y[m * N + n], want, 1e-6 * mag + 1e-30)
            << "N=" << N << " K=" << K << " row " << m << " column " << n;
      }
    }
    // Rows [m0, m1) by weight rows [n0, n1), for ranges that cut tiles anywhere.
    for (auto [m0, m1, n0, n1] : {std::array<int64_t, 4>{0, 1, 0, N},
                                  {3, 8, 1, N},
                                  {5, 11, 0, N / 2 + 1},
                                  {10, 11, N - 1, N}}) {
      std::vector<float> part(M * N, -1);
      a.y = part.data();
      bf->gemm(a, xb.data() + m0 * ld, ld, m0, m1, n0, n1);
      for (int64_t m = m0; m < m1; ++m) {
        for (int64_t n = n0; n < n1; ++n) {
          ASSERT_EQ(Bits(part[m * N + n]), Bits(y[m * N + n]))
              << "N=" << N << " K=" << K << " rows [" << m0 << ", " << m1 << ") row " << m
              << " column " << n;
        }
      }
    }
  }
}

// The measured speedup chooses the kernels: null below kMinBf16DotSpeedup, and 0 without the
// instruction.
TEST(Bf16KernelsTest, ChosenOnlyWhereTheDotsBeatTheFmas) {
  const double s = Bf16DotSpeedup();
  EXPECT_EQ(s, Bf16DotSpeedup());  // measured once
  if (!IsaSupported(Isa::kAvx512) || !CpuHasAvx512Bf16()) {
    EXPECT_EQ(s, 0);
    EXPECT_EQ(Bf16KernelsFor(Isa::kAvx512), nullptr);
    GTEST_SKIP() << "this CPU has no AVX-512 BF16 (vdpbf16ps)";
  }
  EXPECT_GT(s, 0.1);
  EXPECT_LT(s, 10);
  EXPECT_EQ(Bf16KernelsFor(Isa::kAvx512) != nullptr, s >= kMinBf16DotSpeedup) << s;
  EXPECT_EQ(Bf16KernelsFor(Isa::kAvx2), nullptr);
}

TEST(Q8KernelsTest, VnniAndAvx2AgreeBitForBitAndRowsDoNotDependOnTheirBatch) {
  if (!IsaSupported(Isa::kAvx2)) GTEST_SKIP() << "avx2 is not supported by this CPU";
  std::vector<const Q8Kernels*> sets = {&Avx2Q8Kernels()};
  if (VnniQ8Kernels() != nullptr) sets.push_back(VnniQ8Kernels());
  std::mt19937 rng(29);
  std::normal_distribution<float> nd(0, 1);
  for (DType t : {DType::kQ4_0, DType::kQ4_1, DType::kQ8_0, DType::kMXFP4}) {
    for (auto [N, K] : {std::pair<int64_t, int64_t>{13, 96}, {16, 576}, {7, 32}, {41, 160}}) {
      const Weights w = MakeWeights(t, N, K, rng);
      const int64_t M = 40;  // >= 32: the strips with weight rows in the lanes
      std::vector<float> x(M * K);
      for (float& v : x) v = nd(rng);
      const std::vector<float> want = Q8Product(Avx2Q8Kernels(), w, x, M, 0, N);
      for (const Q8Kernels* q8 : sets) {
        for (int64_t rows : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{5}, int64_t{8}, M}) {
          for (int64_t m0 = 0; m0 < M; m0 += rows) {
            const int64_t mr = std::min(rows, M - m0);
            const std::vector<float> xs(x.begin() + m0 * K, x.begin() + (m0 + mr) * K);
            const std::vector<float> y = Q8Product(*q8, w, xs, mr, 4, N);
            for (int64_t i = 0; i < mr * N; ++i) {
              if (i % N < 4) continue;  // outside [4, N)
              ASSERT_EQ(Bits(y[i]), Bits(want[m0 * N + i]))
                  << q8->name << " " << DTypeName(t) << " N=" << N << " K=" << K << " rows=" << rows
                  << " row " << m0 + i / N << " column " << i % N;
            }
          }
        }
      }
    }
  }
  if (sets.size() == 1) {
    GTEST_SKIP() << "compared the avx2 set only: this CPU has no AVX-512 VNNI";
  }
}

// ---- Paged attention ----

struct AttnProblem {
  int64_t T, Hq, Hkv, D, Dv, NB, BS;
  std::vector<float> q, k, v;
};

// Reference: one row and head, in double.
void RefRow(const AttnProblem& p, const std::vector<int64_t>& blocks, int64_t t, int64_t h,
            int64_t pos, int64_t j0, int64_t j1, MaskKind mask, int64_t window, double scale,
            std::vector<double>* out) {
  const int64_t g = h / (p.Hq / p.Hkv);
  std::vector<double> s;
  std::vector<int64_t> js;
  for (int64_t j = j0; j < j1; ++j) {
    if (mask != MaskKind::kNone && j > pos) continue;
    if (mask == MaskKind::kSlidingWindow && pos - j >= window) continue;
    const int64_t blk = blocks[j / p.BS];
    if (blk < 0) continue;
    double d = 0;
    for (int64_t e = 0; e < p.D; ++e) {
      d += double(p.q[(t * p.Hq + h) * p.D + e]) *
           p.k[((blk * p.BS + j % p.BS) * p.Hkv + g) * p.D + e];
    }
    s.push_back(d * scale);
    js.push_back(j);
  }
  out->assign(p.Dv, 0.0);
  if (s.empty()) return;
  const double m = *std::max_element(s.begin(), s.end());
  double l = 0;
  for (double& v : s) l += (v = std::exp(v - m));
  for (size_t i = 0; i < s.size(); ++i) {
    const int64_t j = js[i], blk = blocks[j / p.BS];
    for (int64_t e = 0; e < p.Dv; ++e)
      (*out)[e] += s[i] / l * p.v[((blk * p.BS + j % p.BS) * p.Hkv + g) * p.Dv + e];
  }
}

// Random queries and caches for `p` (sized here); with a 16-bit `kv` the caches are rounded
// to it (p.k, p.v keep the rounded values, kh and vh the cache's bits).
void FillAttnProblem(AttnProblem& p, DType kv, std::mt19937& rng, std::vector<uint16_t>* kh,
                     std::vector<uint16_t>* vh) {
  std::normal_distribution<float> nd(0, 1);
  p.q.resize(p.T * p.Hq * p.D);
  p.k.resize(p.NB * p.BS * p.Hkv * p.D);
  p.v.resize(p.NB * p.BS * p.Hkv * p.Dv);
  for (float& x : p.q) x = nd(rng);
  for (float& x : p.k) x = nd(rng);
  for (float& x : p.v) x = nd(rng);
  kh->assign(p.k.size(), 0);
  vh->assign(p.v.size(), 0);
  if (kv == DType::kF32) return;
  ASSERT_TRUE(ConvertElements(DType::kF32, p.k.data(), kv, kh->data(), p.k.size()).ok());
  ASSERT_TRUE(ConvertElements(DType::kF32, p.v.data(), kv, vh->data(), p.v.size()).ok());
  ASSERT_TRUE(ConvertElements(kv, kh->data(), DType::kF32, p.k.data(), p.k.size()).ok());
  ASSERT_TRUE(ConvertElements(kv, vh->data(), DType::kF32, p.v.data(), p.v.size()).ok());
}

// Contiguous [T, Hq, D] queries, [NB, BS, Hkv, D] caches of `kv` (p's own or kh/vh), scale
// 1/sqrt(D), no mask.
AttnArgs ArgsFor(const AttnProblem& p, DType kv, const std::vector<uint16_t>& kh,
                 const std::vector<uint16_t>& vh, float* out) {
  AttnArgs a;
  a.q = p.q.data();
  a.q_st = p.Hq * p.D;
  a.q_sh = p.D;
  a.k = kv == DType::kF32 ? static_cast<const void*>(p.k.data()) : kh.data();
  a.v = kv == DType::kF32 ? static_cast<const void*>(p.v.data()) : vh.data();
  a.kv_dtype = kv;
  a.k_sb = p.BS * p.Hkv * p.D;
  a.k_ss = p.Hkv * p.D;
  a.k_sh = p.D;
  a.v_sb = p.BS * p.Hkv * p.Dv;
  a.v_ss = p.Hkv * p.Dv;
  a.v_sh = p.Dv;
  a.block_size = p.BS;
  a.out = out;
  a.o_st = p.Hq * p.Dv;
  a.o_sh = p.Dv;
  a.Hq = p.Hq;
  a.Hkv = p.Hkv;
  a.D = p.D;
  a.Dv = p.Dv;
  a.scale = 1.0f / std::sqrt(float(p.D));
  return a;
}

// Query row T-1, at key position cuts.back() - 1, of kv head g over keys split between
// partial tasks at `cuts` (tile boundaries), combined into out[G * Dv].
void SplitLastRow(const IsaKernels& k, const AttnProblem& p, const AttnArgs& a,
                  const std::vector<int64_t>& blocks, int64_t g, const std::vector<int64_t>& cuts,
                  float* out) {
  const int64_t G = p.Hq / p.Hkv, PF = AttnPartialFloats(p.Dv);
  const int64_t tiles = AttnPartialTiles(0, cuts.back());
  std::vector<float> states(static_cast<size_t>(tiles * G * PF), NAN);
  for (size_t c = 0; c + 1 < cuts.size(); ++c) {
    AttnTask task;
    task.blocks = blocks.data();
    task.t0 = p.T - 1;
    task.t1 = p.T;
    task.pos0 = cuts.back() - 1;
    task.g = g;
    task.j0 = cuts[c];
    task.j1 = cuts[c + 1];
    task.partial = states.data() + (cuts[c] / kAttnKeyTile) * G * PF;
    k.attend(a, task);
  }
  for (int64_t h = 0; h < G; ++h) {
    k.attend_combine(states.data() + h * PF, tiles, G * PF, p.Dv, out + h * p.Dv);
  }
}

TEST_P(IsaTest, AttentionMatchesReference) {
  std::mt19937 rng(5);
  for (DType kv : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (auto [hq, hkv, d] : {std::tuple{6, 2, 64}, std::tuple{4, 4, 12}, std::tuple{8, 1, 40}}) {
      AttnProblem p{5, hq, hkv, d, d, 40, 16, {}, {}, {}};
      // The caches rounded to the cache type (the reference reads the rounded values).
      std::vector<uint16_t> kh, vh;
      FillAttnProblem(p, kv, rng, &kh, &vh);
      // 300 keys over 19 blocks, one hole (block -1): 5 query rows at the end.
      std::vector<int64_t> blocks(19);
      for (int64_t i = 0; i < 19; ++i) blocks[i] = (i * 7) % p.NB;
      blocks[3] = -1;
      const int64_t len = 300;
      std::vector<float> out(p.T * p.Hq * p.Dv, NAN);
      AttnArgs a = ArgsFor(p, kv, kh, vh, out.data());
      for (MaskKind mask : {MaskKind::kNone, MaskKind::kCausal, MaskKind::kSlidingWindow}) {
        a.mask = mask;
        a.window = 70;
        const std::string what = absl::StrCat(DTypeName(kv), " Hq=", hq, " Hkv=", hkv, " D=", d,
                                              " mask=", static_cast<int>(mask));
        // Whole rows.
        for (int64_t g = 0; g < p.Hkv; ++g) {
          AttnTask task;
          task.blocks = blocks.data();
          task.t0 = 0;
          task.t1 = p.T;
          task.pos0 = len - p.T;
          task.g = g;
          task.j0 = 0;
          task.j1 = len;
          k_->attend(a, task);
        }
        // Split: row T-1 over three key ranges (at tile boundaries), combined.
        std::vector<float> split(p.Hq * p.Dv);
        for (int64_t g = 0; g < p.Hkv; ++g) {
          SplitLastRow(*k_, p, a, blocks, g, {0, 64, 192, len},
                       split.data() + g * (p.Hq / p.Hkv) * p.Dv);
        }
        std::vector<float> got;
        std::vector<double> want;
        std::vector<float> got_split;
        std::vector<double> want_split;
        for (int64_t t = 0; t < p.T; ++t) {
          for (int64_t h = 0; h < p.Hq; ++h) {
            std::vector<double> r;
            RefRow(p, blocks, t, h, len - p.T + t, 0, len, mask, a.window, a.scale, &r);
            for (int64_t e = 0; e < p.Dv; ++e) {
              got.push_back(out[(t * p.Hq + h) * p.Dv + e]);
              want.push_back(r[e]);
              if (t == p.T - 1) {
                got_split.push_back(split[h * p.Dv + e]);
                want_split.push_back(r[e]);
              }
            }
          }
        }
        EXPECT_LT(Nmse(got, want), 1e-12) << what;
        EXPECT_LT(Nmse(got_split, want_split), 1e-12) << what << " split";
      }
    }
  }
}

// A row's output must not depend on how the rows and keys are cut into tasks: one task for
// every row (blocks of 32 rows), a row per task (the decode path), tasks of 5 and of 7 rows,
// and the last rows split over the context at tile boundaries — bit for bit. That is what
// keeps a prompt's numerics the same prefilled at once, in chunks or after a prefix-cache hit.
TEST_P(IsaTest, AttentionRowsAreBitIdenticalHoweverTheTaskIsCut) {
  std::mt19937 rng(17);
  for (DType kv : {DType::kF32, DType::kF16}) {
    for (auto [hq, hkv, d] : {std::tuple{6, 2, 64}, std::tuple{8, 1, 40}}) {
      AttnProblem p{40, hq, hkv, d, d, 24, 16, {}, {}, {}};
      std::vector<uint16_t> kh, vh;
      FillAttnProblem(p, kv, rng, &kh, &vh);
      const int64_t len = 330;  // 21 blocks, one a hole; the 40 rows are the last positions
      std::vector<int64_t> blocks(21);
      for (int64_t i = 0; i < 21; ++i) blocks[i] = (i * 5) % p.NB;
      blocks[6] = -1;
      std::vector<float> slopes(p.Hq);
      for (int64_t h = 0; h < p.Hq; ++h) slopes[h] = 0.05f * static_cast<float>(h + 1);
      for (int variant = 0; variant < 5; ++variant) {
        const std::string what =
            absl::StrCat(DTypeName(kv), " Hq=", hq, " D=", d, " variant=", variant);
        // Rows [t0, t1) per task, tasks of `rows` rows; all rows of kv head g.
        auto run = [&](int64_t rows, std::vector<float>* out) {
          out->assign(p.T * p.Hq * p.Dv, NAN);
          AttnArgs a = ArgsFor(p, kv, kh, vh, out->data());
          a.mask = variant == 1   ? MaskKind::kNone
                   : variant == 2 ? MaskKind::kSlidingWindow
                                  : MaskKind::kCausal;
          a.window = 100;
          if (variant == 3) a.alibi_slopes = slopes.data();
          if (variant == 4) a.softcap = 2.5f;
          for (int64_t g = 0; g < p.Hkv; ++g) {
            for (int64_t t0 = 0; t0 < p.T; t0 += rows) {
              AttnTask task;
              task.blocks = blocks.data();
              task.t0 = t0;
              task.t1 = std::min(p.T, t0 + rows);
              task.pos0 = len - p.T + t0;
              task.g = g;
              task.j1 = len;
              k_->attend(a, task);
            }
          }
          return a;
        };
        std::vector<float> whole, one, five, seven;
        const AttnArgs a = run(p.T, &whole);
        run(1, &one);
        run(5, &five);
        run(7, &seven);
        // The last row split over the context, as decode splits it.
        std::vector<float> split_last(p.Hq * p.Dv), split_coarse(p.Hq * p.Dv);
        std::vector<float> scratch(p.T * p.Hq * p.Dv);
        AttnArgs sa = a;
        sa.out = scratch.data();
        const int64_t G = p.Hq / p.Hkv;
        for (int64_t g = 0; g < p.Hkv; ++g) {
          SplitLastRow(*k_, p, sa, blocks, g, {0, 64, 128, 192, 256, len},
                       split_last.data() + g * G * p.Dv);
          SplitLastRow(*k_, p, sa, blocks, g, {0, 192, len}, split_coarse.data() + g * G * p.Dv);
        }
        ASSERT_EQ(std::memcmp(whole.data(), one.data(), whole.size() * 4), 0) << what << " one";
        ASSERT_EQ(std::memcmp(whole.data(), five.data(), whole.size() * 4), 0) << what << " 5";
        ASSERT_EQ(std::memcmp(whole.data(), seven.data(), whole.size() * 4), 0) << what << " 7";
        const float* last = whole.data() + (p.T - 1) * p.Hq * p.Dv;
        ASSERT_EQ(std::memcmp(last, split_last.data(), split_last.size() * 4), 0) << what;
        ASSERT_EQ(std::memcmp(last, split_coarse.data(), split_coarse.size() * 4), 0) << what;
        // And it is attention: finite, not all zeros.
        EXPECT_TRUE(
            std::all_of(whole.begin(), whole.end(), [](float x) { return std::isfinite(x); }));
        EXPECT_TRUE(std::any_of(whole.begin(), whole.end(), [](float x) { return x != 0.0f; }));
      }
    }
  }
}

TEST_P(IsaTest, AttentionRowsWithoutVisibleKeysAreZero) {
  // Every key of the row sits in a hole of the block table.
  std::vector<float> q(8, 1.0f), k(4 * 8, 1.0f), v(4 * 8, 1.0f), out(8, NAN);
  std::vector<int64_t> blocks = {-1};
  AttnArgs a;
  a.q = q.data();
  a.q_st = 8;
  a.q_sh = 8;
  a.k = k.data();
  a.v = v.data();
  a.k_sb = a.v_sb = 32;
  a.k_ss = a.v_ss = 8;
  a.k_sh = a.v_sh = 8;
  a.block_size = 4;
  a.out = out.data();
  a.o_st = a.o_sh = 8;
  a.Hq = a.Hkv = 1;
  a.D = a.Dv = 8;
  AttnTask t;
  t.blocks = blocks.data();
  t.t0 = 0;
  t.t1 = 1;
  t.pos0 = 3;
  t.j1 = 4;
  k_->attend(a, t);
  for (float o : out) EXPECT_EQ(o, 0.0f);
}

TEST_P(IsaTest, SoftmaxInPlaceMatchesStatsThenScaledExpBitForBit) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0, 4);
  const float ninf = -std::numeric_limits<float>::infinity();
  // Lengths around the vector widths and the 1,024-element chunks of the sums; masked (-inf)
  // scores, a fully masked row, a NaN.
  for (const int64_t n : {1, 7, 16, 33, 64, 255, 1024, 1031, 2500}) {
    for (const int variant : {0, 1, 2, 3}) {
      std::vector<float> x(static_cast<size_t>(n));
      for (float& e : x) e = nd(rng);
      if (variant == 1) {
        for (int64_t j = 0; j < n; j += 3) x[j] = ninf;
      }
      if (variant == 2) std::fill(x.begin(), x.end(), ninf);
      if (variant == 3) x[n / 2] = NAN;
      float m0 = 0;
      double s0 = 0;
      k_->softmax_stats(x.data(), n, &m0, &s0);
      std::vector<float> want(x.size(), 0.0f);
      if (m0 != ninf) k_->scaled_exp(x.data(), n, m0, static_cast<float>(1.0 / s0), want.data());
      float m1 = 0;
      double s1 = 0;
      std::vector<float> got = x;
      k_->softmax(got.data(), n, &m1, &s1);
      SCOPED_TRACE(testing::Message() << "n " << n << " variant " << variant);
      if (variant == 3) {  // NaN everywhere (its sign bit may differ)
        EXPECT_TRUE(std::isnan(m1));
        for (float e : got) EXPECT_TRUE(std::isnan(e));
        continue;
      }
      EXPECT_EQ(m1, m0);
      EXPECT_EQ(s1, m0 == ninf ? 0.0 : s0);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
    }
  }
}

// soft_cap is cap * tanh(pre * s / cap) to within a few ulps of cap (Gemma 2's score_mod), over
// the whole range: tiny, ordinary and huge scores of both signs, +-inf to +-cap, NaN stays NaN;
// lengths around the vector width (the tail too).
TEST_P(IsaTest, SoftCapIsCapTimesTanhToAFewUlpsOfTheCap) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0, 30);
  const float inf = std::numeric_limits<float>::infinity();
  for (const float cap : {50.0f, 30.0f, 1.5f}) {
    for (const float pre : {1.0f, 0.125f}) {
      for (const int64_t n : {1, 7, 8, 9, 64, 1000}) {
        std::vector<float> s(static_cast<size_t>(n));
        for (float& e : s) e = nd(rng);
        // Non-finite first, so that the short rows (all tail) get them too; and -inf last in
        // the rows with a tail after whole vectors.
        const float special[] = {inf,     -inf,  NAN,     0.0f,     -0.0f, 1e-30f,
                                 -1e-30f, 1e-3f, 4 * cap, -4 * cap, 1e30f, -1e30f};
        for (size_t i = 0; i < std::size(special) && i < s.size(); ++i) s[i * 5 % n] = special[i];
        if (n % 8 != 0) s[n - 1] = -inf;
        std::vector<float> got = s;
        k_->soft_cap(got.data(), n, pre, cap);
        const double ulp = std::nextafter(cap, inf) - cap;
        for (int64_t j = 0; j < n; ++j) {
          SCOPED_TRACE(testing::Message()
                       << "cap " << cap << " pre " << pre << " n " << n << " s " << s[j]);
          if (std::isnan(s[j])) {
            EXPECT_TRUE(std::isnan(got[j]));
            continue;
          }
          const double want = cap * std::tanh(static_cast<double>(pre) * s[j] / cap);
          EXPECT_LE(std::abs(got[j] - want), 4 * ulp) << got[j] << " against " << want;
          EXPECT_LE(std::abs(got[j]), cap);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, IsaTest, ::testing::ValuesIn(AllIsas()),
                         [](const auto& info) { return std::string(IsaName(info.param)); });

TEST(IsaDetection, ActiveIsaIsSupportedAndNamed) {
  EXPECT_TRUE(IsaSupported(ActiveIsa()));
  EXPECT_TRUE(IsaSupported(Isa::kScalar));
  EXPECT_EQ(ParseIsa(IsaName(DetectedIsa())), DetectedIsa());
  EXPECT_FALSE(ParseIsa("sse9").has_value());
  EXPECT_NE(std::string(CpuDescription()), "");
}

}  // namespace
}  // namespace kiln::cpu
