#include "server/kserve_codec.h"

#include <cstring>

#include "gtest/gtest.h"

namespace kiln {
namespace {

inference::ModelInferRequest TypedInt32Request() {
  inference::ModelInferRequest w;
  w.set_model_name("simple");
  w.set_id("req-1");
  for (const char* name : {"INPUT0", "INPUT1"}) {
    auto* in = w.add_inputs();
    in->set_name(name);
    in->set_datatype("INT32");
    in->add_shape(1);
    in->add_shape(16);
    for (int i = 0; i < 16; ++i) in->mutable_contents()->add_int_contents(i);
  }
  return w;
}

std::string Message(const StatusOr<std::unique_ptr<InferenceRequest>>& r) {
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  return std::string(StatusMessage(r.status()));
}

TEST(KServeCodecTest, TypedContentsBecomeRawLittleEndian) {
  auto w = TypedInt32Request();
  auto r = DecodeInferRequest(w);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ((*r)->inputs.size(), 2u);
  const HostTensor& t = (*r)->inputs[0];
  EXPECT_EQ(t.datatype, DataType::kInt32);
  EXPECT_EQ(t.shape, (std::vector<int64_t>{1, 16}));
  ASSERT_EQ(t.data.size(), 64u);
  int32_t v;
  std::memcpy(&v, t.data.data() + 4 * 7, 4);
  EXPECT_EQ(v, 7);
  EXPECT_EQ((*r)->id, "req-1");
}

TEST(KServeCodecTest, RawContentsAreTakenWithoutTypedOnes) {
  inference::ModelInferRequest w;
  auto* in = w.add_inputs();
  in->set_name("X");
  in->set_datatype("FP16");
  in->add_shape(3);
  w.add_raw_input_contents(std::string(6, '\x01'));
  auto r = DecodeInferRequest(w);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->inputs[0].data, std::string(6, '\x01'));
}

TEST(KServeCodecTest, RawAndTypedTogetherIsAnError) {
  auto w = TypedInt32Request();
  w.add_raw_input_contents(std::string(64, '\0'));
  w.add_raw_input_contents(std::string(64, '\0'));
  EXPECT_NE(Message(DecodeInferRequest(w)).find("also uses raw_input_contents"), std::string::npos);
}

TEST(KServeCodecTest, RawEntryCountMustMatchInputs) {
  auto w = TypedInt32Request();
  for (auto& in : *w.mutable_inputs()) in.clear_contents();
  w.add_raw_input_contents(std::string(64, '\0'));
  EXPECT_EQ(Message(DecodeInferRequest(w)),
            "the request has 2 inputs but 1 raw_input_contents entries; there must be one per "
            "input");
}

TEST(KServeCodecTest, UnknownDatatype) {
  auto w = TypedInt32Request();
  w.mutable_inputs(0)->set_datatype("FLOAT32");
  EXPECT_NE(Message(DecodeInferRequest(w)).find("unknown datatype 'FLOAT32'"), std::string::npos);
}

TEST(KServeCodecTest, TypedElementCountMustMatchShape) {
  auto w = TypedInt32Request();
  w.mutable_inputs(1)->mutable_contents()->add_int_contents(99);
  EXPECT_NE(Message(DecodeInferRequest(w)).find("has 17 elements in contents.int_contents"),
            std::string::npos);
}

TEST(KServeCodecTest, WrongTypedFieldForDatatype) {
  auto w = TypedInt32Request();
  w.mutable_inputs(0)->mutable_contents()->clear_int_contents();
  for (int i = 0; i < 16; ++i) w.mutable_inputs(0)->mutable_contents()->add_fp32_contents(1.0f);
  EXPECT_NE(Message(DecodeInferRequest(w)).find("must carry its values in contents.int_contents"),
            std::string::npos);
}

TEST(KServeCodecTest, Fp16CannotBeTyped) {
  inference::ModelInferRequest w;
  auto* in = w.add_inputs();
  in->set_name("H");
  in->set_datatype("FP16");
  in->add_shape(1);
  in->mutable_contents()->add_fp32_contents(1.0f);
  EXPECT_NE(Message(DecodeInferRequest(w)).find("send it in raw_input_contents"),
            std::string::npos);
}

TEST(KServeCodecTest, Int8OutOfRange) {
  inference::ModelInferRequest w;
  auto* in = w.add_inputs();
  in->set_name("B");
  in->set_datatype("INT8");
  in->add_shape(2);
  in->mutable_contents()->add_int_contents(1);
  in->mutable_contents()->add_int_contents(300);
  EXPECT_NE(Message(DecodeInferRequest(w)).find("element 1 is 300, out of range for INT8"),
            std::string::npos);
}

TEST(KServeCodecTest, NegativeDimension) {
  auto w = TypedInt32Request();
  w.mutable_inputs(0)->set_shape(0, -1);
  EXPECT_NE(Message(DecodeInferRequest(w)).find("dimensions must be non-negative"),
            std::string::npos);
}

TEST(KServeCodecTest, BytesBecomeLengthPrefixed) {
  inference::ModelInferRequest w;
  auto* in = w.add_inputs();
  in->set_name("S");
  in->set_datatype("BYTES");
  in->add_shape(2);
  in->mutable_contents()->add_bytes_contents("ab");
  in->mutable_contents()->add_bytes_contents("");
  auto r = DecodeInferRequest(w);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)->inputs[0].data, std::string("\x02\x00\x00\x00"
                                              "ab"
                                              "\x00\x00\x00\x00",
                                              10));
}

TEST(KServeCodecTest, PriorityAndTimeoutParameters) {
  auto w = TypedInt32Request();
  (*w.mutable_parameters())["priority"].set_int64_param(2);
  (*w.mutable_parameters())["timeout"].set_uint64_param(5000);
  auto r = DecodeInferRequest(w);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)->priority, 2u);
  EXPECT_EQ((*r)->timeout_us, 5000u);
}

TEST(KServeCodecTest, NegativeOrAbsurdParametersAreRejected) {
  auto w = TypedInt32Request();
  (*w.mutable_parameters())["priority"].set_int64_param(-1);
  EXPECT_NE(Message(DecodeInferRequest(w)).find("'priority' is -1"), std::string::npos);
  w = TypedInt32Request();
  (*w.mutable_parameters())["timeout"].set_int64_param(-5);
  EXPECT_NE(Message(DecodeInferRequest(w)).find("'timeout' is -5"), std::string::npos);
  w = TypedInt32Request();
  (*w.mutable_parameters())["timeout"].set_uint64_param(1ull << 60);
  EXPECT_NE(Message(DecodeInferRequest(w)).find("the maximum is 3600000000"), std::string::npos);
  w = TypedInt32Request();
  (*w.mutable_parameters())["priority"].set_string_param("high");
  EXPECT_NE(Message(DecodeInferRequest(w)).find("must be an integer"), std::string::npos);
  w = TypedInt32Request();
  (*w.mutable_parameters())["sequence_id"].set_int64_param(-3);
  EXPECT_NE(Message(DecodeInferRequest(w)).find("'sequence_id' is -3"), std::string::npos);
  w = TypedInt32Request();
  (*w.mutable_parameters())["sequence_start"].set_int64_param(1);
  EXPECT_NE(Message(DecodeInferRequest(w)).find("'sequence_start' must be a boolean"),
            std::string::npos);
}

TEST(KServeCodecTest, SequenceParametersAsTritonclientSendsThem) {
  auto w = TypedInt32Request();
  (*w.mutable_parameters())["sequence_id"].set_int64_param(1001);
  (*w.mutable_parameters())["sequence_start"].set_bool_param(true);
  (*w.mutable_parameters())["sequence_end"].set_bool_param(false);
  auto r = DecodeInferRequest(w);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->sequence.id, 1001u);
  EXPECT_TRUE((*r)->sequence.string_id.empty());
  EXPECT_TRUE((*r)->sequence.start);
  EXPECT_FALSE((*r)->sequence.end);

  w = TypedInt32Request();
  (*w.mutable_parameters())["sequence_id"].set_string_param("6f1c-uuid");
  (*w.mutable_parameters())["sequence_end"].set_bool_param(true);
  r = DecodeInferRequest(w);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->sequence.string_id, "6f1c-uuid");
  EXPECT_TRUE((*r)->sequence.has_id());
  EXPECT_FALSE((*r)->sequence.start);
  EXPECT_TRUE((*r)->sequence.end);
}

TEST(KServeCodecTest, EncodeResponseUsesRawOutputs) {
  InferenceResponse resp;
  resp.outputs.push_back({"OUT", DataType::kFp32, {1, 2}, std::string(8, '\x07')});
  inference::ModelInferResponse w;
  EncodeInferResponse("m", "id-9", std::move(resp), &w);
  EXPECT_EQ(w.model_name(), "m");
  EXPECT_EQ(w.model_version(), "1");
  EXPECT_EQ(w.id(), "id-9");
  ASSERT_EQ(w.outputs_size(), 1);
  EXPECT_EQ(w.outputs(0).datatype(), "FP32");
  EXPECT_EQ(w.raw_output_contents(0), std::string(8, '\x07'));
}

config::ModelConfig SimpleEntry() {
  config::ModelConfig c;
  c.name = "simple";
  c.kind = "builtin";
  c.builtin = "simple";
  c.max_batch_size = 8;
  c.dynamic_batching.emplace().max_queue_delay_microseconds = 100;
  return c;
}

TEST(ParseLoadConfigTest, APartialConfigChangesTheModelsEntry) {
  // tritonclient's load_model("simple", config='{"max_batch_size": 16}'); regression: it was
  // refused with "`kind`: missing".
  const config::ModelConfig current = SimpleEntry();
  auto c = ParseLoadConfig("simple", R"({"max_batch_size": 16})", &current);
  ASSERT_TRUE(c.ok()) << c.status();
  config::ModelConfig want = SimpleEntry();
  want.max_batch_size = 16;
  EXPECT_EQ(*c, want);
  // Its errors point into what was sent.
  c = ParseLoadConfig("simple", R"({"max_batch_size": -1})", &current);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(StatusMessage(c.status()),
            "<load simple>:1:20: `max_batch_size`: expected an integer in [0, 1048576], got `-1`");
}

TEST(ParseLoadConfigTest, ANewModelNeedsAWholeEntry) {
  auto c = ParseLoadConfig("b4", R"({"kind": "builtin", "builtin": "simple"})", nullptr);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "b4");
  c = ParseLoadConfig("b4", R"({"max_batch_size": 16})", nullptr);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(StatusMessage(c.status()).find("`kind`: missing"), std::string::npos) << c.status();
}

TEST(ParseLoadConfigTest, TheNameMustBeTheLoadedModels) {
  const config::ModelConfig current = SimpleEntry();
  for (const config::ModelConfig* cur :
       {&current, static_cast<const config::ModelConfig*>(nullptr)}) {
    auto c = ParseLoadConfig("simple", R"({"name": "other", "max_batch_size": 4})", cur);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(StatusMessage(c.status()),
              "parameter 'config' names model \"other\" but the request loads 'simple'");
  }
  auto c = ParseLoadConfig("simple", "[1]", &current);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(StatusMessage(c.status()),
            "parameter 'config' of the load request for 'simple' (the keys of its `models:` "
            "entry to change) must be a JSON object, got a list");
}

}  // namespace
}  // namespace kiln
