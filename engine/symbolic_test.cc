#include "engine/symbolic.h"

#include <gtest/gtest.h>

#include "absl/hash/hash.h"

namespace kiln {
namespace {

const std::vector<std::string> kNames = {"T", "S", "H"};

TEST(DimTest, ConstantsAndSymbols) {
  Dim c = 4096;
  EXPECT_TRUE(c.is_constant());
  EXPECT_EQ(c.constant(), 4096);
  EXPECT_TRUE(Dim(0).is_constant());
  EXPECT_EQ(Dim(0).constant(), 0);
  Dim t = Dim::Symbol(0);
  EXPECT_FALSE(t.is_constant());
  EXPECT_FALSE(t.TryConstant().has_value());
  EXPECT_TRUE(t.DependsOn(0));
  EXPECT_FALSE(t.DependsOn(1));
  EXPECT_EQ(t.ToString(kNames), "T");
}

TEST(DimTest, CanonicalFormMakesEqualExpressionsEqual) {
  Dim t = Dim::Symbol(0), h = Dim::Symbol(2);
  EXPECT_EQ(t * h * 64, h * (t * 64));
  EXPECT_EQ((t + 1) * (t - 1), t * t - 1);
  EXPECT_EQ(t - t, Dim(0));
  EXPECT_TRUE((t - t).is_constant());
  EXPECT_NE(t + 1, t);
  EXPECT_EQ(absl::HashOf(t * h), absl::HashOf(h * t));
}

TEST(DimTest, EvalAndPrint) {
  Dim t = Dim::Symbol(0), s = Dim::Symbol(1);
  Dim d = 2 * t * s + t * t - 3;
  const int64_t vals[] = {5, 7};
  EXPECT_EQ(d.Eval(vals), 2 * 5 * 7 + 25 - 3);
  EXPECT_EQ(d.ToString(kNames), "T^2 + 2*T*S - 3");
  EXPECT_EQ((-t).ToString(kNames), "-T");
  EXPECT_EQ(Dim::Symbol(5).ToString(kNames), "s5");
  EXPECT_EQ(ShapeString({t, 4096}, kNames), "[T,4096]");
}

TEST(DimTest, MonotoneAndSymbolMask) {
  Dim t = Dim::Symbol(0), s = Dim::Symbol(1);
  EXPECT_TRUE((t - 1).IsMonotone());
  EXPECT_TRUE((t * s + 3).IsMonotone());
  EXPECT_FALSE((s - t).IsMonotone());
  EXPECT_EQ((t * s).SymbolMask(), 3u);
  EXPECT_EQ(Dim(3).SymbolMask(), 0u);
}

TEST(DimTest, DivExact) {
  Dim t = Dim::Symbol(0), h = Dim::Symbol(2);
  EXPECT_EQ(*(t * h * 64).DivExact(h * 64), t);
  EXPECT_EQ(*(t * 6 + 12).DivExact(6), t + 2);
  EXPECT_FALSE((t * 6 + 1).DivExact(6).has_value());
  EXPECT_FALSE(t.DivExact(h).has_value());
  EXPECT_FALSE(t.DivExact(t + 1).has_value());
}

TEST(DimTest, NumElementsAndEvalShape) {
  Dim t = Dim::Symbol(0);
  SymShape shape = {t, 4, 8};
  EXPECT_EQ(NumElements(shape), t * 32);
  EXPECT_EQ(NumElements({}), Dim(1));
  const int64_t vals[] = {3};
  EXPECT_EQ(EvalShape(shape, vals), (std::vector<int64_t>{3, 4, 8}));
}

}  // namespace
}  // namespace kiln
