#include "engine/profile.h"

#include <gtest/gtest.h>

namespace kiln {
namespace {

TEST(LaunchProfileTest, FoldsBlockIndicesSoOneRowCoversEveryLayer) {
  EXPECT_EQ(FoldBlockIndex("blk.12.attn_q"), "blk.*.attn_q");
  EXPECT_EQ(FoldBlockIndex("blk.3.blk.3.ffn_up.lora_b"), "blk.*.blk.*.ffn_up.lora_b");
  EXPECT_EQ(FoldBlockIndex("logits"), "logits");
  EXPECT_EQ(FoldBlockIndex("blk.x"), "blk.x");
  EXPECT_EQ(FoldBlockIndex(""), "");
}

TEST(LaunchProfileTest, ReportSortsByTotalTimeWithSharesAndRates) {
  LaunchProfile p;
  p.Add("small", 0.001, 0);
  p.Add("big", 0.002, 4e6);
  p.Add("big", 0.002, 4e6);
  p.AddRun(3, 0.006);
  const std::string r = p.Report();
  EXPECT_NE(r.find("1 runs, 3 launches (3.0 per run)"), std::string::npos) << r;
  const size_t big = r.find("big"), small = r.find("small");
  ASSERT_NE(big, std::string::npos);
  ASSERT_NE(small, std::string::npos);
  EXPECT_LT(big, small) << r;
  // big: 80% of the launch time, 2 calls, 2,000 us each, 8e6 FLOP in 4 ms = 2 GFLOP/s.
  const std::string big_line = r.substr(r.rfind('\n', big) + 1, big - r.rfind('\n', big) - 1);
  EXPECT_NE(big_line.find("80.0%"), std::string::npos) << big_line;
  EXPECT_NE(big_line.find(" 2 "), std::string::npos) << big_line;
  EXPECT_NE(big_line.find("2000.0"), std::string::npos) << big_line;
  EXPECT_NE(big_line.find("2.0"), std::string::npos) << big_line;
}

}  // namespace
}  // namespace kiln
