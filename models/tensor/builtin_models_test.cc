#include <algorithm>
#include <cstring>
#include <limits>

#include "config/config.h"
#include "engine/testing/source_dir.h"
#include "gtest/gtest.h"
#include "models/tensor/tensor_model.h"

namespace kiln {
namespace {

std::string Int32Raw(const std::vector<int32_t>& v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}

std::vector<int32_t> Int32s(const std::string& s) {
  std::vector<int32_t> v(s.size() / 4);
  std::memcpy(v.data(), s.data(), s.size());
  return v;
}

TEST(DataTypeTest, NamesRoundTripAndSizes) {
  for (auto name : {"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                    "INT64", "FP16", "FP32", "FP64", "BYTES", "BF16"}) {
    auto t = ParseDataType(name);
    ASSERT_TRUE(t.has_value()) << name;
    EXPECT_EQ(DataTypeName(*t), name);
  }
  EXPECT_FALSE(ParseDataType("int32").has_value());
  EXPECT_FALSE(ParseDataType("FLOAT").has_value());
  EXPECT_EQ(DataTypeSize(DataType::kBf16), 2);
  EXPECT_EQ(DataTypeSize(DataType::kFp64), 8);
  EXPECT_EQ(DataTypeSize(DataType::kBytes), 0);
}

TEST(DataTypeTest, ElementCountRejectsNegativeAndOverflow) {
  std::vector<int64_t> ok = {2, 3, 4}, neg = {2, -1}, big = {1ll << 40, 1ll << 40}, empty = {};
  EXPECT_EQ(ElementCount(ok), 24);
  EXPECT_EQ(ElementCount(empty), 1);
  EXPECT_FALSE(ElementCount(neg).has_value());
  EXPECT_FALSE(ElementCount(big).has_value());
}

TEST(DataTypeTest, CountBytesElements) {
  std::string raw;
  for (std::string s : {"ab", "", "xyz"}) {
    uint32_t n = s.size();
    raw.append(reinterpret_cast<const char*>(&n), 4);
    raw += s;
  }
  EXPECT_EQ(*CountBytesElements(raw), 3);
  EXPECT_FALSE(CountBytesElements(raw.substr(0, raw.size() - 1)).ok());
  EXPECT_FALSE(CountBytesElements("\x01\x00").ok());
}

TEST(BuiltinModelsTest, SimpleAddsAndSubtractsWithWraparound) {
  auto model = CreateBuiltinModel("simple");
  ASSERT_TRUE(model.ok());
  std::vector<int32_t> a(32), b(32);
  for (int i = 0; i < 32; ++i) {
    a[i] = i;
    b[i] = 100 - i;
  }
  a[5] = std::numeric_limits<int32_t>::max();
  b[5] = 1;
  std::vector<HostTensor> in = {{"INPUT0", DataType::kInt32, {2, 16}, Int32Raw(a)},
                                {"INPUT1", DataType::kInt32, {2, 16}, Int32Raw(b)}};
  std::vector<HostTensor> out;
  ASSERT_TRUE((*model)->Execute(in, &out).ok());
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].name, "OUTPUT0");
  EXPECT_EQ(out[0].shape, (std::vector<int64_t>{2, 16}));
  auto sum = Int32s(out[0].data), diff = Int32s(out[1].data);
  for (int i = 0; i < 32; ++i) {
    if (i == 5) continue;
    EXPECT_EQ(sum[i], 100) << i;
    EXPECT_EQ(diff[i], 2 * i - 100) << i;
  }
  EXPECT_EQ(sum[5], std::numeric_limits<int32_t>::min());
  EXPECT_EQ(diff[5], std::numeric_limits<int32_t>::max() - 1);
}

TEST(BuiltinModelsTest, SleepReturnsInputAndClampsNegative) {
  auto model = CreateBuiltinModel("sleep_us");
  ASSERT_TRUE(model.ok());
  std::vector<HostTensor> in = {{"SLEEP_US", DataType::kInt32, {2, 1}, Int32Raw({-5, 1000})}};
  std::vector<HostTensor> out;
  auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE((*model)->Execute(in, &out).ok());
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::microseconds(1000));
  EXPECT_EQ(Int32s(out[0].data), (std::vector<int32_t>{-5, 1000}));
}

TEST(BuiltinModelsTest, UnknownNameListsTheKnownOnes) {
  auto model = CreateBuiltinModel("resnet");
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), StatusCode::kNotFound);
  EXPECT_NE(StatusMessage(model.status()).find("simple, identity_fp32, sleep_us"),
            std::string_view::npos);
}

// config/ keeps its own copy of the names (it depends on nothing): every built-in must be
// accepted there, and config/examples/triton_qa.yaml must load (it serves Triton's QA models).
TEST(BuiltinModelsTest, TheConfigAcceptsEveryBuiltin) {
  for (std::string_view name : BuiltinModelNames()) {
    const std::string yaml = std::string("models:\n  - name: m\n    kind: builtin\n    builtin: ") +
                             std::string(name) + "\n";
    auto config = config::ParseConfig(yaml, "t.yaml");
    EXPECT_TRUE(config.ok()) << name << ": " << config.status();
  }
  auto qa =
      config::LoadConfigFile(std::string(TestSourceDir()) + "/config/examples/triton_qa.yaml");
  ASSERT_TRUE(qa.ok()) << qa.status();
  std::vector<std::string> served;
  for (const config::ModelConfig& m : qa->models) served.push_back(m.builtin);
  for (std::string_view name : BuiltinModelNames()) {
    if (name == "identity_fp32" || name == "sleep_us") continue;  // Kiln's own test models
    EXPECT_NE(std::find(served.begin(), served.end(), name), served.end()) << name;
  }
}

}  // namespace
}  // namespace kiln
