#include "models/tensor/triton_qa_models.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>

#include "gtest/gtest.h"

namespace kiln {
namespace {

std::string BytesRaw(const std::vector<std::string>& v) {
  std::string raw;
  for (const auto& s : v) {
    const uint32_t n = static_cast<uint32_t>(s.size());
    raw.append(reinterpret_cast<const char*>(&n), 4);
    raw += s;
  }
  return raw;
}

std::vector<std::string> BytesOf(const std::string& raw) {
  std::vector<std::string> out;
  for (size_t at = 0; at + 4 <= raw.size();) {
    uint32_t n;
    std::memcpy(&n, raw.data() + at, 4);
    out.push_back(raw.substr(at + 4, n));
    at += 4 + n;
  }
  return out;
}

template <typename T>
std::string Raw(const std::vector<T>& v) {
  std::string s(v.size() * sizeof(T), '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}

template <typename T>
std::vector<T> Values(const std::string& s) {
  std::vector<T> v(s.size() / sizeof(T));
  std::memcpy(v.data(), s.data(), s.size());
  return v;
}

std::unique_ptr<TensorModel> Create(std::string_view name) {
  auto m = CreateBuiltinModel(name);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

TEST(TritonQaModelsTest, EveryNameIsABuiltinAndDeclaresTritonsSignature) {
  auto builtins = BuiltinModelNames();
  for (std::string_view name : TritonQaModelNames()) {
    EXPECT_NE(std::find(builtins.begin(), builtins.end(), name), builtins.end()) << name;
    EXPECT_NE(Create(name), nullptr) << name;
  }
  EXPECT_EQ(CreateTritonQaModel("simple").status().code(), StatusCode::kNotFound);

  auto repeat = Create("repeat_int32");
  EXPECT_TRUE(repeat->decoupled());
  ASSERT_EQ(repeat->inputs().size(), 3u);
  EXPECT_EQ(repeat->inputs()[1].name, "DELAY");
  EXPECT_EQ(repeat->inputs()[1].datatype, DataType::kUint32);
  EXPECT_EQ(repeat->inputs()[2].dims, (std::vector<int64_t>{1}));
  EXPECT_EQ(repeat->outputs()[1].name, "IDX");
  EXPECT_FALSE(Create("simple_string")->decoupled());
  EXPECT_EQ(Create("simple_identity")->inputs()[0].dims, (std::vector<int64_t>{-1}));
  EXPECT_EQ(Create("custom_identity_int32")->inputs()[0].datatype, DataType::kInt32);
}

TEST(TritonQaModelsTest, SimpleStringAddsAndSubtractsDecimalStrings) {
  auto model = Create("simple_string");
  std::vector<std::string> a, b;
  for (int i = 0; i < 16; ++i) {
    a.push_back(std::to_string(i));
    b.push_back("1");
  }
  a[14] = "-7";
  b[14] = "+3";
  a[15] = "2147483647";  // wraps, as TF's int32 add does
  std::vector<HostTensor> in = {{"INPUT0", DataType::kBytes, {1, 16}, BytesRaw(a)},
                                {"INPUT1", DataType::kBytes, {1, 16}, BytesRaw(b)}};
  ASSERT_TRUE(model->CheckRequest(in).ok());
  std::vector<HostTensor> out;
  ASSERT_TRUE(model->Execute(in, &out).ok());
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].name, "OUTPUT0");
  EXPECT_EQ(out[0].datatype, DataType::kBytes);
  EXPECT_EQ(out[0].shape, (std::vector<int64_t>{1, 16}));
  auto sum = BytesOf(out[0].data), diff = BytesOf(out[1].data);
  ASSERT_EQ(sum.size(), 16u);
  for (int i = 0; i < 14; ++i) {
    EXPECT_EQ(sum[i], std::to_string(i + 1));
    EXPECT_EQ(diff[i], std::to_string(i - 1));
  }
  EXPECT_EQ(sum[14], "-4");
  EXPECT_EQ(diff[14], "-10");
  EXPECT_EQ(sum[15], "-2147483648");
  EXPECT_EQ(diff[15], "2147483646");
}

TEST(TritonQaModelsTest, SimpleStringRefusesWhatIsNotADecimalInt32NamingTheInput) {
  auto model = Create("simple_string");
  std::vector<std::string> ok(16, "1");
  for (const char* bad : {"abc", "", "1.5", " 1", "1x", "+-1", "--1", "+", "-"}) {
    std::vector<std::string> b = ok;
    b[3] = bad;
    std::vector<HostTensor> in = {{"INPUT0", DataType::kBytes, {1, 16}, BytesRaw(ok)},
                                  {"INPUT1", DataType::kBytes, {1, 16}, BytesRaw(b)}};
    Status s = model->CheckRequest(in);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(StatusMessage(s).find("input 'INPUT1' element 3"), std::string_view::npos) << s;
    EXPECT_NE(StatusMessage(s).find("decimal integers"), std::string_view::npos) << s;
  }
  std::vector<std::string> big = ok;
  big[0] = "2147483648";
  std::vector<HostTensor> in = {{"INPUT0", DataType::kBytes, {1, 16}, BytesRaw(big)},
                                {"INPUT1", DataType::kBytes, {1, 16}, BytesRaw(ok)}};
  Status s = model->CheckRequest(in);
  EXPECT_NE(StatusMessage(s).find("input 'INPUT0' element 0 is `2147483648`, outside"),
            std::string_view::npos)
      << s;
  big[0] = std::string("\x01\xff", 2);  // escaped in the message
  in[0].data = BytesRaw(big);
  EXPECT_NE(StatusMessage(model->CheckRequest(in)).find("`\\x01\\xff`"), std::string_view::npos);
}

TEST(TritonQaModelsTest, SimpleInt8WrapsLikeInt8Arithmetic) {
  auto model = Create("simple_int8");
  std::vector<int8_t> a(32), b(32, 1);
  for (int i = 0; i < 32; ++i) a[i] = static_cast<int8_t>(i);
  a[30] = 127;
  a[31] = -128;
  std::vector<HostTensor> in = {{"INPUT0", DataType::kInt8, {2, 16}, Raw(a)},
                                {"INPUT1", DataType::kInt8, {2, 16}, Raw(b)}};
  std::vector<HostTensor> out;
  ASSERT_TRUE(model->Execute(in, &out).ok());
  auto sum = Values<int8_t>(out[0].data), diff = Values<int8_t>(out[1].data);
  EXPECT_EQ(out[1].shape, (std::vector<int64_t>{2, 16}));
  for (int i = 0; i < 30; ++i) {
    EXPECT_EQ(sum[i], i + 1);
    EXPECT_EQ(diff[i], i - 1);
  }
  EXPECT_EQ(sum[30], -128);
  EXPECT_EQ(diff[31], 127);
}

TEST(TritonQaModelsTest, IdentitiesReturnTheirInput) {
  std::string bytes = BytesRaw({std::string("he\0llo", 6), "\x00\x01\x02\x03"});
  std::vector<HostTensor> in = {{"INPUT0", DataType::kBytes, {1, 2}, bytes}};
  std::vector<HostTensor> out;
  ASSERT_TRUE(Create("simple_identity")->Execute(in, &out).ok());
  EXPECT_EQ(out[0].name, "OUTPUT0");
  EXPECT_EQ(out[0].data, bytes);
  EXPECT_EQ(out[0].shape, (std::vector<int64_t>{1, 2}));

  in = {{"INPUT0", DataType::kInt32, {3, 1}, Raw<int32_t>({10, -1, 7})}};
  out.clear();
  ASSERT_TRUE(Create("custom_identity_int32")->Execute(in, &out).ok());
  EXPECT_EQ(Values<int32_t>(out[0].data), (std::vector<int32_t>{10, -1, 7}));
  EXPECT_EQ(out[0].datatype, DataType::kInt32);
}

// Collects what a decoupled model sends; cancels itself after `cancel_after` responses.
class FakeSender final : public ResponseSender {
 public:
  explicit FakeSender(size_t cancel_after = SIZE_MAX) : cancel_after_(cancel_after) {}
  Status Send(std::vector<HostTensor> outputs, bool final) override {
    if (cancelled_) return Cancelled("gone");
    responses.push_back(std::move(outputs));
    finals.push_back(final);
    if (responses.size() >= cancel_after_) cancelled_ = true;
    return OkStatus();
  }
  bool cancelled() const override { return cancelled_; }

  std::vector<std::vector<HostTensor>> responses;
  std::vector<bool> finals;

 private:
  size_t cancel_after_;
  std::atomic<bool> cancelled_{false};
};

std::vector<HostTensor> RepeatInputs(const std::vector<int32_t>& values,
                                     const std::vector<uint32_t>& delays, uint32_t wait) {
  const int64_t n = static_cast<int64_t>(values.size());
  return {{"IN", DataType::kInt32, {n}, Raw(values)},
          {"DELAY", DataType::kUint32, {static_cast<int64_t>(delays.size())}, Raw(delays)},
          {"WAIT", DataType::kUint32, {1}, Raw<uint32_t>({wait})}};
}

TEST(TritonQaModelsTest, RepeatSendsOneResponsePerValueAfterItsDelay) {
  auto model = Create("repeat_int32");
  FakeSender sender;
  auto in = RepeatInputs({100, 101, 102}, {0, 30, 0}, 20);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(model->ExecuteDecoupled(in, sender).ok());
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(50));
  ASSERT_EQ(sender.responses.size(), 3u);
  for (uint32_t i = 0; i < 3; ++i) {
    const auto& r = sender.responses[i];
    ASSERT_EQ(r.size(), 2u);
    EXPECT_EQ(r[0].name, "OUT");
    EXPECT_EQ(r[0].shape, (std::vector<int64_t>{1}));
    EXPECT_EQ(Values<int32_t>(r[0].data), (std::vector<int32_t>{100 + static_cast<int32_t>(i)}));
    EXPECT_EQ(r[1].name, "IDX");
    EXPECT_EQ(r[1].datatype, DataType::kUint32);
    EXPECT_EQ(Values<uint32_t>(r[1].data), (std::vector<uint32_t>{i}));
    EXPECT_FALSE(sender.finals[i]);
  }
  // Nothing to repeat: no response at all (the request still ends).
  FakeSender none;
  ASSERT_TRUE(model->ExecuteDecoupled(RepeatInputs({}, {}, 0), none).ok());
  EXPECT_TRUE(none.responses.empty());
}

TEST(TritonQaModelsTest, RepeatStopsWhenCancelled) {
  auto model = Create("repeat_int32");
  FakeSender sender(/*cancel_after=*/2);
  auto in = RepeatInputs({1, 2, 3, 4}, {0, 0, 5000, 5000}, 0);
  const auto start = std::chrono::steady_clock::now();
  Status s = model->ExecuteDecoupled(in, sender);
  EXPECT_EQ(s.code(), StatusCode::kCancelled) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  EXPECT_EQ(sender.responses.size(), 2u);
}

TEST(TritonQaModelsTest, RepeatRefusesMismatchedAndTooLongDelays) {
  auto model = Create("repeat_int32");
  Status s = model->CheckRequest(RepeatInputs({1, 2}, {0}, 0));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(StatusMessage(s).find("input 'DELAY' has 1 elements but input 'IN' has 2"),
            std::string_view::npos)
      << s;
  s = model->CheckRequest(RepeatInputs({1}, {kMaxRepeatDelayMs + 1}, 0));
  EXPECT_NE(StatusMessage(s).find("input 'DELAY' element 0 is 10001 ms"), std::string_view::npos)
      << s;
  s = model->CheckRequest(RepeatInputs({1}, {0}, 4000000000u));
  EXPECT_NE(StatusMessage(s).find("input 'WAIT' element 0"), std::string_view::npos) << s;
  EXPECT_TRUE(model->CheckRequest(RepeatInputs({1}, {kMaxRepeatDelayMs}, 0)).ok());
  // The plain Execute is no way around the decoupled policy.
  std::vector<HostTensor> out;
  EXPECT_EQ(model->Execute(RepeatInputs({1}, {0}, 0), &out).code(),
            StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kiln
