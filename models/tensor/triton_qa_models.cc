#include "models/tensor/triton_qa_models.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kiln {
namespace {

constexpr std::string_view kPlatform = "kiln_builtin";

// Quotes a client's string for an error message, cut short and with non-printable bytes
// escaped, so that a message stays one readable line.
std::string Quote(std::string_view s) {
  std::string out = "`";
  for (size_t i = 0; i < s.size() && i < 32; ++i) {
    const unsigned char c = s[i];
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += absl::StrCat("\\x", absl::Hex(c, absl::kZeroPad2));
    }
  }
  if (s.size() > 32) out += "...";
  return out + "`";
}

// A decimal 32-bit integer with an optional sign, nothing else (TF's string_to_number refuses
// what this refuses, and a silently partial parse would hide a client's bug).
StatusOr<int32_t> ParseInt32(std::string_view input, size_t index, std::string_view s) {
  std::string_view body = s;
  if (!body.empty() && body.front() == '+') body.remove_prefix(1);
  int32_t v = 0;
  std::errc ec = std::errc::invalid_argument;
  if (!body.empty() && !(body.front() == '-' && s.front() == '+')) {
    auto [p, e] = std::from_chars(body.data(), body.data() + body.size(), v);
    ec = e == std::errc() && p != body.data() + body.size() ? std::errc::invalid_argument : e;
  }
  if (ec == std::errc::result_out_of_range) {
    return InvalidArgument("input '", input, "' element ", index, " is ", Quote(s),
                           ", outside the 32-bit integer range [-2147483648, 2147483647]");
  }
  if (ec != std::errc()) {
    return InvalidArgument("input '", input, "' element ", index, " is ", Quote(s),
                           "; simple_string takes decimal integers written as strings, e.g. `42`");
  }
  return v;
}

template <typename T>
T Wrap(int64_t v) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(static_cast<uint64_t>(v)));
}

// simple_int8: INPUT0 + INPUT1 and INPUT0 - INPUT1, element-wise, wrapping.
class AddSubInt8Model final : public TensorModel {
 public:
  AddSubInt8Model()
      : inputs_{{"INPUT0", DataType::kInt8, {16}}, {"INPUT1", DataType::kInt8, {16}}},
        outputs_{{"OUTPUT0", DataType::kInt8, {16}}, {"OUTPUT1", DataType::kInt8, {16}}} {}

  std::string_view platform() const override { return kPlatform; }
  const std::vector<TensorSpec>& inputs() const override { return inputs_; }
  const std::vector<TensorSpec>& outputs() const override { return outputs_; }

  Status Execute(std::span<const HostTensor> in, std::vector<HostTensor>* out) override {
    const std::string& a = in[0].data;
    const std::string& b = in[1].data;
    HostTensor sum{"OUTPUT0", DataType::kInt8, in[0].shape, std::string(a.size(), '\0')};
    HostTensor diff{"OUTPUT1", DataType::kInt8, in[0].shape, std::string(a.size(), '\0')};
    for (size_t i = 0; i < a.size(); ++i) {
      const int64_t x = static_cast<int8_t>(a[i]), y = static_cast<int8_t>(b[i]);
      sum.data[i] = static_cast<char>(Wrap<int8_t>(x + y));
      diff.data[i] = static_cast<char>(Wrap<int8_t>(x - y));
    }
    out->push_back(std::move(sum));
    out->push_back(std::move(diff));
    return OkStatus();
  }

 private:
  std::vector<TensorSpec> inputs_, outputs_;
};

// simple_string: the sum and difference of decimal strings, as decimal strings.
class SimpleStringModel final : public TensorModel {
 public:
  SimpleStringModel()
      : inputs_{{"INPUT0", DataType::kBytes, {16}}, {"INPUT1", DataType::kBytes, {16}}},
        outputs_{{"OUTPUT0", DataType::kBytes, {16}}, {"OUTPUT1", DataType::kBytes, {16}}} {}

  std::string_view platform() const override { return kPlatform; }
  const std::vector<TensorSpec>& inputs() const override { return inputs_; }
  const std::vector<TensorSpec>& outputs() const override { return outputs_; }

  Status CheckRequest(std::span<const HostTensor> in) const override {
    for (const HostTensor& t : in) {
      const std::vector<std::string_view> elements = BytesElements(t.data);
      for (size_t i = 0; i < elements.size(); ++i) {
        KILN_RETURN_IF_ERROR(ParseInt32(t.name, i, elements[i]).status());
      }
    }
    return OkStatus();
  }

  Status Execute(std::span<const HostTensor> in, std::vector<HostTensor>* out) override {
    const std::vector<std::string_view> a = BytesElements(in[0].data);
    const std::vector<std::string_view> b = BytesElements(in[1].data);
    if (a.size() != b.size()) {
      return Internal("simple_string: INPUT0 holds ", a.size(), " elements, INPUT1 ", b.size());
    }
    HostTensor sum{"OUTPUT0", DataType::kBytes, in[0].shape, {}};
    HostTensor diff{"OUTPUT1", DataType::kBytes, in[0].shape, {}};
    for (size_t i = 0; i < a.size(); ++i) {
      // CheckRequest saw every element already; parse again rather than keep state.
      KILN_ASSIGN_OR_RETURN(const int32_t x, ParseInt32(in[0].name, i, a[i]));
      KILN_ASSIGN_OR_RETURN(const int32_t y, ParseInt32(in[1].name, i, b[i]));
      AppendBytesElement(sum.data, std::to_string(Wrap<int32_t>(int64_t{x} + y)));
      AppendBytesElement(diff.data, std::to_string(Wrap<int32_t>(int64_t{x} - y)));
    }
    out->push_back(std::move(sum));
    out->push_back(std::move(diff));
    return OkStatus();
  }

 private:
  std::vector<TensorSpec> inputs_, outputs_;
};

// simple_identity (BYTES) and custom_identity_int32 (INT32): OUTPUT0 = INPUT0, shape [-1].
class IdentityModel final : public TensorModel {
 public:
  explicit IdentityModel(DataType type)
      : inputs_{{"INPUT0", type, {-1}}}, outputs_{{"OUTPUT0", type, {-1}}} {}

  std::string_view platform() const override { return kPlatform; }
  const std::vector<TensorSpec>& inputs() const override { return inputs_; }
  const std::vector<TensorSpec>& outputs() const override { return outputs_; }

  Status Execute(std::span<const HostTensor> in, std::vector<HostTensor>* out) override {
    out->push_back(HostTensor{"OUTPUT0", in[0].datatype, in[0].shape, in[0].data});
    return OkStatus();
  }

 private:
  std::vector<TensorSpec> inputs_, outputs_;
};

// repeat_int32: Triton's repeat backend (one response per element of IN).
class RepeatInt32Model final : public TensorModel {
 public:
  RepeatInt32Model()
      : inputs_{{"IN", DataType::kInt32, {-1}},
                {"DELAY", DataType::kUint32, {-1}},
                {"WAIT", DataType::kUint32, {1}}},
        outputs_{{"OUT", DataType::kInt32, {1}}, {"IDX", DataType::kUint32, {1}}} {}

  std::string_view platform() const override { return kPlatform; }
  const std::vector<TensorSpec>& inputs() const override { return inputs_; }
  const std::vector<TensorSpec>& outputs() const override { return outputs_; }
  bool decoupled() const override { return true; }

  Status CheckRequest(std::span<const HostTensor> in) const override {
    const size_t count = in[0].data.size() / 4;
    if (in[1].data.size() / 4 != count) {
      return InvalidArgument("input 'DELAY' has ", in[1].data.size() / 4,
                             " elements but input 'IN' has ", count,
                             "; repeat_int32 needs one delay per value of IN");
    }
    for (const HostTensor* t : {&in[1], &in[2]}) {
      for (size_t i = 0; i < t->data.size() / 4; ++i) {
        const uint32_t ms = U32(*t, i);
        if (ms > kMaxRepeatDelayMs) {
          return InvalidArgument("input '", t->name, "' element ", i, " is ", ms,
                                 " ms; repeat_int32 waits at most ", kMaxRepeatDelayMs,
                                 " ms at a time");
        }
      }
    }
    return OkStatus();
  }

  Status Execute(std::span<const HostTensor>, std::vector<HostTensor>*) override {
    return FailedPrecondition("repeat_int32 is decoupled; run it through ExecuteDecoupled");
  }

  Status ExecuteDecoupled(std::span<const HostTensor> in, ResponseSender& sender) override {
    KILN_RETURN_IF_ERROR(CheckRequest(in));
    const size_t count = in[0].data.size() / 4;
    for (size_t i = 0; i < count; ++i) {
      KILN_RETURN_IF_ERROR(Wait(U32(in[1], i), sender));
      std::vector<HostTensor> outputs;
      outputs.push_back({"OUT", DataType::kInt32, {1}, in[0].data.substr(4 * i, 4)});
      const uint32_t idx = static_cast<uint32_t>(i);
      outputs.push_back({"IDX", DataType::kUint32, {1}, std::string(4, '\0')});
      std::memcpy(outputs.back().data.data(), &idx, 4);
      KILN_RETURN_IF_ERROR(sender.Send(std::move(outputs), /*final=*/false));
    }
    return Wait(U32(in[2], 0), sender);
  }

 private:
  static uint32_t U32(const HostTensor& t, size_t i) {
    uint32_t v;
    std::memcpy(&v, t.data.data() + 4 * i, 4);
    return v;
  }

  // Sleeps `ms` in short slices so that a closed stream stops the model within ~10 ms.
  static Status Wait(uint32_t ms, const ResponseSender& sender) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (true) {
      if (sender.cancelled()) return Cancelled("request cancelled");
      const auto now = std::chrono::steady_clock::now();
      if (now >= until) return OkStatus();
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
          until - now, std::chrono::milliseconds(10)));
    }
  }

  std::vector<TensorSpec> inputs_, outputs_;
};

constexpr std::array<std::string_view, 5> kNames = {
    "simple_string", "simple_int8", "simple_identity", "custom_identity_int32", "repeat_int32"};

}  // namespace

std::span<const std::string_view> TritonQaModelNames() { return kNames; }

StatusOr<std::unique_ptr<TensorModel>> CreateTritonQaModel(std::string_view name) {
  if (name == "simple_string") return std::unique_ptr<TensorModel>(new SimpleStringModel());
  if (name == "simple_int8") return std::unique_ptr<TensorModel>(new AddSubInt8Model());
  if (name == "simple_identity") {
    return std::unique_ptr<TensorModel>(new IdentityModel(DataType::kBytes));
  }
  if (name == "custom_identity_int32") {
    return std::unique_ptr<TensorModel>(new IdentityModel(DataType::kInt32));
  }
  if (name == "repeat_int32") return std::unique_ptr<TensorModel>(new RepeatInt32Model());
  std::vector<std::string> names(kNames.begin(), kNames.end());
  return NotFound("unknown Triton QA model `", ToAbsl(name),
                  "`; they are: ", absl::StrJoin(names, ", "));
}

}  // namespace kiln
