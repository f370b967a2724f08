#include "models/safetensors/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace kiln::models {
namespace {

using ::testing::HasSubstr;

// Builds a safetensors file from a header JSON and a data section.
std::string Make(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

// Element i of F32 tensor data. The format does not align tensor data (only writers that pad
// the header do), so the tests read it as the loaders do, without a misaligned float*.
float FloatAt(const void* data, size_t i) {
  float f;
  std::memcpy(&f, static_cast<const char*>(data) + i * sizeof(float), sizeof(float));
  return f;
}

std::string Floats(std::vector<float> v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

StatusOr<std::unique_ptr<SafetensorsFile>> ParseBytes(std::string bytes) {
  return SafetensorsFile::Parse(MappedFile::FromBytes(std::move(bytes), "w.safetensors"));
}

std::string ErrorOf(const std::string& header, const std::string& data) {
  auto f = ParseBytes(Make(header, data));
  EXPECT_FALSE(f.ok()) << header;
  if (f.ok()) return "";
  EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
  return std::string(StatusMessage(f.status()));
}

TEST(SafetensorsTest, ParsesTensorsAndMetadata) {
  // Padded header (the reference writer pads with spaces so the data starts 8-byte aligned:
  // 8 + 152 bytes here).
  std::string header =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2],"data_offsets":[24,28]},)"
      R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}        )";
  std::string data = Floats({1, 2, 3, 4, 5, 6}) + std::string("\x80\x3f\x00\x40", 4);
  auto f = ParseBytes(Make(header, data));
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ((*f)->tensors().size(), 2u);
  EXPECT_EQ((*f)->tensors()[0].name, "a");  // file order
  const SafetensorsTensor* a = (*f)->Find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, SafetensorsDtype::kF32);
  EXPECT_THAT(a->shape, ::testing::ElementsAre(2, 3));
  EXPECT_EQ(a->n_elements, 6u);
  EXPECT_EQ(FloatAt(a->data, 5), 6.0f);
  const SafetensorsTensor* b = (*f)->Find("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->n_bytes, 4u);
  EXPECT_EQ(static_cast<const uint8_t*>(b->data)[1], 0x3f);
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  EXPECT_EQ((*f)->Find("c"), nullptr);
}

TEST(SafetensorsTest, AllDtypesAndScalars) {
  std::string header = "{";
  std::string data;
  const char* names[] = {"F64", "F32", "F16", "BF16", "I64",     "I32",
                         "I16", "I8",  "U8",  "BOOL", "F8_E4M3", "F8_E5M2"};
  for (const char* n : names) {
    auto d = ParseSafetensorsDtype(n);
    ASSERT_TRUE(d.has_value()) << n;
    EXPECT_EQ(SafetensorsDtypeName(*d), n);
    size_t sz = SafetensorsDtypeSize(*d);
    if (header.size() > 1) header += ",";
    header += std::string("\"") + n + "\":{\"dtype\":\"" + n +
              "\",\"shape\":[],\"data_offsets\":[" + std::to_string(data.size()) + "," +
              std::to_string(data.size() + sz) + "]}";
    data += std::string(sz, '\1');
  }
  header += ",\"empty\":{\"dtype\":\"F32\",\"shape\":[0,4],\"data_offsets\":[" +
            std::to_string(data.size()) + "," + std::to_string(data.size()) + "]}}";
  auto f = ParseBytes(Make(header, data));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->tensors().size(), 13u);
  EXPECT_EQ((*f)->Find("empty")->n_bytes, 0u);
  EXPECT_FALSE(ParseSafetensorsDtype("F4").has_value());
}

TEST(SafetensorsCorruptTest, BadHeaders) {
  const std::string d8 = Floats({1, 2});
  EXPECT_THAT(ErrorOf("not json", d8), HasSubstr("header at offset 8 is not a JSON object"));
  EXPECT_THAT(ErrorOf("{\"a\": ", d8), HasSubstr("header is not valid JSON"));
  EXPECT_THAT(ErrorOf(R"({"a":{"dtype":"F99","shape":[2],"data_offsets":[0,8]}})", d8),
              HasSubstr("tensor \"a\": unknown dtype \"F99\" (supported: F64, F32"));
  EXPECT_THAT(ErrorOf(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", d8),
              HasSubstr("shape [3] of F32 needs 12 bytes but data_offsets [0, 8] hold 8"));
  EXPECT_THAT(ErrorOf(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", d8),
              HasSubstr("non-negative integers"));
  EXPECT_THAT(ErrorOf(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", d8),
              HasSubstr("run past the data section of 8 bytes"));
  EXPECT_THAT(ErrorOf(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", d8),
              HasSubstr("begin > end"));
  EXPECT_THAT(ErrorOf(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                      d8),
              HasSubstr("overlap the previous tensor"));
  EXPECT_THAT(ErrorOf(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", d8),
              HasSubstr("leaving a hole after offset 0"));
  EXPECT_THAT(ErrorOf(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", d8),
              HasSubstr("tensors cover 4 bytes but the data section has 8"));
  EXPECT_THAT(ErrorOf(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", d8),
              HasSubstr("must be [begin, end]"));
  EXPECT_THAT(ErrorOf(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", d8),
              HasSubstr("unknown field \"x\""));
  EXPECT_THAT(
      ErrorOf(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", d8),
      HasSubstr("overflows"));
  EXPECT_THAT(ErrorOf(R"({"__metadata__":{"k":1}})", ""), HasSubstr("must be a string"));
  EXPECT_THAT(ErrorOf(R"([1,2])", ""), HasSubstr("not a JSON object"));
}

// Found by safetensors_fuzz: a number too large for a double made the JSON parser throw
// out_of_range (not parse_error), which escaped as an uncaught exception.
TEST(SafetensorsCorruptTest, RegressionHugeNumberInHeader) {
  EXPECT_THAT(ErrorOf(R"({"__metadata__": {"f": 4795715e479571568}})", ""),
              HasSubstr("not valid JSON"));
}

TEST(SafetensorsCorruptTest, BadSizes) {
  auto tiny = ParseBytes("abc");
  EXPECT_THAT(std::string(StatusMessage(tiny.status())), HasSubstr("truncated: 3 bytes"));
  std::string huge(8, '\xff');
  EXPECT_THAT(std::string(StatusMessage(ParseBytes(huge + "{}").status())),
              HasSubstr("exceeds the limit"));
  std::string past(8, '\0');
  past[0] = 100;
  EXPECT_THAT(std::string(StatusMessage(ParseBytes(past + "{}").status())),
              HasSubstr("runs past the end"));
  // Every truncation of a valid file fails cleanly.
  std::string ok =
      Make(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", Floats({1, 2}));
  ASSERT_TRUE(ParseBytes(ok).ok());
  for (size_t n = 0; n < ok.size(); ++n) EXPECT_FALSE(ParseBytes(ok.substr(0, n)).ok()) << n;
}

class SafetensorsModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        std::filesystem::path(::testing::TempDir()) / ("kiln_st_model_" + std::to_string(getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void Write(const std::string& name, const std::string& bytes) {
    std::ofstream out(dir_ / name, std::ios::binary);
    out.write(bytes.data(), bytes.size());
  }
  std::filesystem::path dir_;
};

TEST_F(SafetensorsModelTest, SingleFileFolder) {
  Write("model.safetensors",
        Make(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", Floats({1, 2})));
  auto m = SafetensorsModel::Open(dir_.string());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->size(), 1u);
  EXPECT_EQ(FloatAt((*(*m)->Get("w"))->data, 1), 2.0f);
  EXPECT_EQ((*m)->Get("nope").status().code(), StatusCode::kNotFound);
}

TEST_F(SafetensorsModelTest, ShardedIndex) {
  Write("model-00001-of-00002.safetensors",
        Make(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", Floats({1})));
  Write("model-00002-of-00002.safetensors",
        Make(R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", Floats({2})));
  Write("model.safetensors.index.json",
        R"({"metadata":{"total_size":8},"weight_map":{"a":"model-00001-of-00002.safetensors",)"
        R"("b":"model-00002-of-00002.safetensors"}})");
  auto m = SafetensorsModel::Open(dir_.string());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->shards().size(), 2u);
  EXPECT_EQ((*m)->tensors().size(), 2u);
  EXPECT_EQ(FloatAt((*m)->Find("b")->data, 0), 2.0f);

  // A tensor mapped to the wrong shard.
  Write("model.safetensors.index.json",
        R"({"weight_map":{"a":"model-00002-of-00002.safetensors"}})");
  auto bad = SafetensorsModel::Open(dir_.string());
  EXPECT_THAT(std::string(StatusMessage(bad.status())), HasSubstr("does not contain it"));
  // Path escapes are refused.
  Write("model.safetensors.index.json", R"({"weight_map":{"a":"../x.safetensors"}})");
  EXPECT_THAT(std::string(StatusMessage(SafetensorsModel::Open(dir_.string()).status())),
              HasSubstr("must be a plain file name"));
  // A missing shard.
  Write("model.safetensors.index.json", R"({"weight_map":{"a":"gone.safetensors"}})");
  EXPECT_EQ(SafetensorsModel::Open(dir_.string()).status().code(), StatusCode::kNotFound);
  // Same tensor in two shards.
  Write("model-00002-of-00002.safetensors",
        Make(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", Floats({2})));
  Write("model.safetensors.index.json", R"({"weight_map":{"a":"model-00001-of-00002.safetensors",)"
                                        R"("b":"model-00002-of-00002.safetensors"}})");
  EXPECT_FALSE(SafetensorsModel::Open(dir_.string()).ok());
}

TEST_F(SafetensorsModelTest, EmptyFolder) {
  EXPECT_EQ(SafetensorsModel::Open(dir_.string()).status().code(), StatusCode::kNotFound);
}

// ---- Writer ----------------------------------------------------------------------------------

TEST(SafetensorsWriterTest, RoundTripsThroughTheReader) {
  SafetensorsWriter w;
  const std::vector<float> a = {1.5f, -2, 3, 4, 5, 6};
  const std::vector<float> h = {1, -0.5f, 65504};
  const int8_t bytes[3] = {1, -2, 3};
  ASSERT_TRUE(w.Add("z.i8", SafetensorsDtype::kI8, {3}, bytes, 3).ok());
  ASSERT_TRUE(w.AddFloats("b.f16", {3}, h.data(), h.size(), SafetensorsDtype::kF16).ok());
  ASSERT_TRUE(w.AddFloats("a.f32", {2, 3}, a.data(), a.size()).ok());
  ASSERT_TRUE(w.AddFloats("c.bf16", {1, 3}, h.data(), 3, SafetensorsDtype::kBF16).ok());
  ASSERT_TRUE(w.AddFloats("empty", {0, 4}, nullptr, 0).ok());
  w.SetMetadata("format", "pt");
  const std::string file = w.Serialize();
  uint64_t header_size;
  std::memcpy(&header_size, file.data(), 8);
  EXPECT_EQ((8 + header_size) % 8, 0u) << "data section starts 8-byte aligned";

  auto f = ParseBytes(file);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  ASSERT_EQ((*f)->tensors().size(), 5u);
  // Largest element size first, then by name: each tensor is aligned to its element size.
  EXPECT_EQ((*f)->tensors()[0].name, "a.f32");
  EXPECT_EQ((*f)->tensors()[1].name, "empty");
  EXPECT_EQ((*f)->tensors()[2].name, "b.f16");
  EXPECT_EQ((*f)->tensors()[3].name, "c.bf16");
  EXPECT_EQ((*f)->tensors()[4].name, "z.i8");
  for (const SafetensorsTensor& t : (*f)->tensors()) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data) % SafetensorsDtypeSize(t.dtype), 0u) << t.name;
  }
  const SafetensorsTensor* ta = (*f)->Find("a.f32");
  EXPECT_EQ(ta->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(*SafetensorsToFloats(*ta), a);
  EXPECT_EQ(*SafetensorsToFloats(*(*f)->Find("b.f16")), h);  // exact in f16
  const std::vector<float> bf = *SafetensorsToFloats(*(*f)->Find("c.bf16"));
  EXPECT_EQ(bf[0], 1);
  EXPECT_EQ(bf[1], -0.5f);
  EXPECT_EQ(bf[2], 65536);  // 65504 rounds to 2^16 in bf16
  EXPECT_EQ(std::memcmp((*f)->Find("z.i8")->data, bytes, 3), 0);
  EXPECT_THAT(std::string(StatusMessage(SafetensorsToFloats(*(*f)->Find("z.i8")).status())),
              HasSubstr("\"z.i8\" is I8; expected a float tensor"));
}

TEST(SafetensorsWriterTest, NoTensorsNoMetadata) {
  SafetensorsWriter w;
  const std::string file = w.Serialize();
  EXPECT_EQ(file.size() % 8, 0u);
  auto f = ParseBytes(file);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE((*f)->tensors().empty());
  EXPECT_TRUE((*f)->metadata().empty());
}

TEST(SafetensorsWriterTest, RejectsBadTensors) {
  SafetensorsWriter w;
  const float x[4] = {};
  ASSERT_TRUE(w.AddFloats("x", {4}, x, 4).ok());
  EXPECT_THAT(std::string(StatusMessage(w.AddFloats("x", {4}, x, 4))), HasSubstr("added twice"));
  EXPECT_THAT(std::string(StatusMessage(w.AddFloats("y", {2, 3}, x, 4))),
              HasSubstr("6 elements of F32 need 24 bytes, got 16"));
  EXPECT_FALSE(w.AddFloats("__metadata__", {4}, x, 4).ok());
  EXPECT_FALSE(w.AddFloats("", {4}, x, 4).ok());
  EXPECT_THAT(std::string(StatusMessage(w.AddFloats("z", {4}, x, 4, SafetensorsDtype::kI32))),
              HasSubstr("allowed: F32, F16, BF16"));
  EXPECT_EQ(w.size(), 1u);
}

TEST(SafetensorsWriterTest, WritesAFile) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("kiln_st_writer_" + std::to_string(::getpid()) + ".safetensors"))
                               .string();
  SafetensorsWriter w;
  const float x[2] = {7, 8};
  ASSERT_TRUE(w.AddFloats("x", {2}, x, 2).ok());
  ASSERT_TRUE(w.WriteFile(path).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(*SafetensorsToFloats(*(*f)->Find("x")), (std::vector<float>{7, 8}));
  std::filesystem::remove(path);
  EXPECT_EQ(w.WriteFile("/nonexistent-dir/x.safetensors").code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kiln::models
