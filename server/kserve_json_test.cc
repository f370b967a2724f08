#include "server/kserve_json.h"

#include <cstring>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace kiln {
namespace {

using nlohmann::json;

std::string Error(StatusOr<JsonInferRequest> r) {
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  return std::string(StatusMessage(r.status()));
}

TEST(KServeJsonTest, NestedDataIsFlattenedRowMajor) {
  json body = {
      {"id", "x"},
      {"inputs",
       {{{"name", "IN"}, {"datatype", "INT32"}, {"shape", {2, 2}}, {"data", {{1, 2}, {3, 4}}}}}}};
  auto r = DecodeJsonInferRequest(body.dump(), std::nullopt, "m", "");
  ASSERT_TRUE(r.ok()) << r.status();
  const HostTensor& t = r->request->inputs[0];
  int32_t v[4];
  ASSERT_EQ(t.data.size(), 16u);
  std::memcpy(v, t.data.data(), 16);
  EXPECT_EQ(v[0], 1);
  EXPECT_EQ(v[3], 4);
  EXPECT_EQ(r->request->id, "x");
  EXPECT_EQ(r->request->model_name, "m");
}

TEST(KServeJsonTest, BinaryTensorDataExtension) {
  json header = {{"inputs",
                  {{{"name", "IN"},
                    {"datatype", "FP32"},
                    {"shape", {2}},
                    {"parameters", {{"binary_data_size", 8}}}}}},
                 {"outputs", {{{"name", "OUT"}, {"parameters", {{"binary_data", true}}}}}}};
  std::string h = header.dump();
  float f[2] = {1.5f, -2.0f};
  std::string body = h + std::string(reinterpret_cast<const char*>(f), 8);
  auto r = DecodeJsonInferRequest(body, h.size(), "m", "1");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->request->inputs[0].data, std::string(reinterpret_cast<const char*>(f), 8));
  EXPECT_EQ(r->binary_outputs, (std::vector<std::string>{"OUT"}));
}

TEST(KServeJsonTest, BinarySizeOverrunsBody) {
  json header = {{"inputs",
                  {{{"name", "IN"},
                    {"datatype", "FP32"},
                    {"shape", {2}},
                    {"parameters", {{"binary_data_size", 80}}}}}}};
  std::string h = header.dump();
  EXPECT_NE(Error(DecodeJsonInferRequest(h + "12345678", h.size(), "m", ""))
                .find("declares 80 bytes of binary data but only 8 remain"),
            std::string::npos);
}

TEST(KServeJsonTest, UnclaimedBinaryBytes) {
  json header = {
      {"inputs", {{{"name", "IN"}, {"datatype", "INT32"}, {"shape", {1}}, {"data", {1}}}}}};
  std::string h = header.dump();
  EXPECT_NE(Error(DecodeJsonInferRequest(h + "xx", h.size(), "m", "")).find("no input claims"),
            std::string::npos);
}

TEST(KServeJsonTest, MalformedJsonSaysWhere) {
  EXPECT_NE(
      Error(DecodeJsonInferRequest("{\"inputs\": [", std::nullopt, "m", "")).find("not valid JSON"),
      std::string::npos);
}

TEST(KServeJsonTest, ElementCountAndTypesAreChecked) {
  json body = {
      {"inputs", {{{"name", "IN"}, {"datatype", "INT32"}, {"shape", {3}}, {"data", {1, 2}}}}}};
  EXPECT_NE(Error(DecodeJsonInferRequest(body.dump(), std::nullopt, "m", ""))
                .find("has 2 elements in `data` but its shape [3] has 3"),
            std::string::npos);
  body["inputs"][0]["shape"] = {2};
  body["inputs"][0]["data"] = {1, "two"};
  EXPECT_NE(Error(DecodeJsonInferRequest(body.dump(), std::nullopt, "m", "")).find("element 1"),
            std::string::npos);
  body["inputs"][0]["datatype"] = "UINT8";
  body["inputs"][0]["data"] = {1, 256};
  EXPECT_NE(Error(DecodeJsonInferRequest(body.dump(), std::nullopt, "m", "")).find("256"),
            std::string::npos);
  body["inputs"][0]["datatype"] = "FP16";
  body["inputs"][0]["data"] = {1.0, 2.0};
  EXPECT_NE(Error(DecodeJsonInferRequest(body.dump(), std::nullopt, "m", ""))
                .find("which JSON cannot carry"),
            std::string::npos);
}

TEST(KServeJsonTest, EncodeJsonAndBinaryOutputs) {
  InferenceResponse resp;
  int32_t v[2] = {7, -3};
  resp.outputs.push_back({"A", DataType::kInt32, {2}, std::string(reinterpret_cast<char*>(v), 8)});
  resp.outputs.push_back({"B", DataType::kInt32, {2}, std::string(reinterpret_cast<char*>(v), 8)});
  auto out = EncodeJsonInferResponse("m", "id", std::move(resp), {"B"}, false);
  ASSERT_TRUE(out.header_length.has_value());
  json doc = json::parse(out.body.substr(0, *out.header_length));
  EXPECT_EQ(doc["outputs"][0]["data"], json({7, -3}));
  EXPECT_EQ(doc["outputs"][1]["parameters"]["binary_data_size"], 8);
  EXPECT_EQ(out.body.substr(*out.header_length), std::string(reinterpret_cast<char*>(v), 8));
}

}  // namespace
}  // namespace kiln
