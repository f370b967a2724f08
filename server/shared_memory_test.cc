// The system shared memory registry (server/shared_memory.h) against real POSIX shared memory,
// and the codec's use of it (server/kserve_codec.h): bounds, overlaps, every error naming the
// region.
#include "server/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "gtest/gtest.h"
#include "server/kserve_codec.h"
#include "server/kserve_json.h"

namespace kiln {
namespace {

// A shared-memory object of `size` bytes that the test owns and unlinks.
class ShmObject {
 public:
  explicit ShmObject(size_t size)
      : key_("/kiln_shm_test_" + std::to_string(getpid()) + "_" + std::to_string(next_++)) {
    const int fd = shm_open(key_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd, 0) << key_;
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    base_ = static_cast<char*>(mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    EXPECT_NE(base_, MAP_FAILED);
    close(fd);
    size_ = size;
  }
  ~ShmObject() {
    munmap(base_, size_);
    shm_unlink(key_.c_str());
  }
  const std::string& key() const { return key_; }
  char* data() { return base_; }

 private:
  static inline int next_ = 0;
  std::string key_;
  char* base_ = nullptr;
  size_t size_ = 0;
};

std::string Message(const Status& s) { return std::string(StatusMessage(s)); }

TEST(SharedMemoryManagerTest, RegisterStatusUnregister) {
  ShmObject obj(8192);
  SharedMemoryManager m;
  ASSERT_TRUE(m.Register("in", obj.key(), 0, 64).ok());
  ASSERT_TRUE(m.Register("out", obj.key(), 4096 + 10, 100).ok());  // unaligned offset
  auto all = m.GetStatus("");
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].name, "in");
  EXPECT_EQ((*all)[1].key, obj.key());
  EXPECT_EQ((*all)[1].offset, 4106u);
  EXPECT_EQ((*all)[1].byte_size, 100u);
  auto one = m.GetStatus("out");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->size(), 1u);
  EXPECT_EQ(m.GetStatus("nope").status().code(), StatusCode::kNotFound);
  EXPECT_NE(Message(m.GetStatus("nope").status()).find("'nope'"), std::string::npos);
  m.Unregister("in");
  m.Unregister("never-registered");  // not an error, as in Triton
  EXPECT_EQ(m.size(), 1u);
  m.UnregisterAll();
  EXPECT_EQ(m.size(), 0u);
}

TEST(SharedMemoryManagerTest, BlocksSeeTheClientsBytesBothWays) {
  ShmObject obj(8192);
  SharedMemoryManager m;
  ASSERT_TRUE(m.Register("r", obj.key(), 4096 + 8, 64).ok());
  std::memcpy(obj.data() + 4096 + 8 + 4, "abcd", 4);
  auto b = m.Block("r", 4, 4, "input 'X'");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b->Read(), "abcd");
  ASSERT_TRUE(b->Write("wxyz").ok());
  EXPECT_EQ(std::string(obj.data() + 4096 + 12, 4), "wxyz");
  EXPECT_EQ(b->key_offset, 4096u + 12);
  EXPECT_FALSE(b->Write("too long").ok());
}

// A client that shrinks its object after registering gets an error on its next request; the
// server is not killed by SIGBUS (it reads with pread, not through a mapping).
TEST(SharedMemoryManagerTest, AnObjectShrunkAfterRegisteringIsAnErrorNotACrash) {
  ShmObject obj(8192);
  SharedMemoryManager m;
  ASSERT_TRUE(m.Register("r", obj.key(), 4096, 4096).ok());
  const int fd = shm_open(obj.key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 100), 0);
  close(fd);
  auto b = m.Block("r", 0, 64, "input 'X'");
  ASSERT_TRUE(b.ok());
  auto r = b->Read();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(Message(r.status()).find("smaller than when it was registered"), std::string::npos)
      << r.status();
}

// Inputs read from shared memory count against the request's budget.
TEST(SharedMemoryManagerTest, InputsAreBoundedByTheRequestBudget) {
  ShmObject obj(4096);
  SharedMemoryManager m(/*max_input_bytes=*/1000);
  EXPECT_EQ(m.max_input_bytes(), 1000u);
  ASSERT_TRUE(m.Register("r", obj.key(), 0, 4096).ok());
  uint64_t budget = m.max_input_bytes();
  HostTensor t{"X", DataType::kUint8, {600}, {}};
  ASSERT_TRUE(ReadShmInput(*m.Block("r", 0, 600, "input 'X'"), t, &budget).ok());
  EXPECT_EQ(budget, 400u);
  Status s = ReadShmInput(*m.Block("r", 600, 600, "input 'Y'"), t, &budget);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(Message(s).find("more than the request may read"), std::string::npos) << s;
}

// shm_open ignores leading slashes: "/k" and "k" are one object, and overlap checks see that.
TEST(SharedMemoryManagerTest, OverlapSeesOneObjectUnderTwoSpellings) {
  ShmObject obj(256);
  SharedMemoryManager m;
  ASSERT_TRUE(m.Register("a", obj.key(), 0, 128).ok());
  ASSERT_TRUE(m.Register("b", obj.key().substr(1), 0, 128).ok());
  const std::string what[] = {"output 'O0'", "output 'O1'"};
  SharedMemoryBlock both[] = {*m.Block("a", 0, 16, "x"), *m.Block("b", 8, 16, "x")};
  EXPECT_EQ(CheckDisjoint(both, what).code(), StatusCode::kInvalidArgument);
}

TEST(SharedMemoryManagerTest, RegisterErrorsNameTheRegion) {
  ShmObject obj(100);
  SharedMemoryManager m;
  Status s = m.Register("big", obj.key(), 0, 101);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(Message(s).find("'big'"), std::string::npos) << s;
  EXPECT_NE(Message(s).find("100 bytes"), std::string::npos) << s;
  s = m.Register("past", obj.key(), 90, 11);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  s = m.Register("wrap", obj.key(), ~uint64_t{0}, 2);  // offset + byte_size overflows
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  s = m.Register("missing", "/kiln_shm_test_no_such_key", 0, 8);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(Message(s).find("'/kiln_shm_test_no_such_key'"), std::string::npos) << s;
  EXPECT_NE(Message(s).find("No such file"), std::string::npos) << s;
  EXPECT_EQ(m.Register("zero", obj.key(), 0, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.Register("", obj.key(), 0, 8).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.Register("nokey", "", 0, 8).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(m.Register("r", obj.key(), 0, 8).ok());
  s = m.Register("r", obj.key(), 0, 8);
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists);
  EXPECT_NE(Message(s).find("'r' is already registered"), std::string::npos) << s;
  EXPECT_EQ(m.size(), 1u);
}

TEST(SharedMemoryManagerTest, BlockBoundsAreChecked) {
  ShmObject obj(128);
  SharedMemoryManager m;
  ASSERT_TRUE(m.Register("r", obj.key(), 0, 64).ok());
  EXPECT_TRUE(m.Block("r", 0, 64, "x").ok());
  EXPECT_TRUE(m.Block("r", 64, 0, "x").ok());
  Status s = m.Block("r", 60, 8, "input 'INPUT0'").status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(Message(s).find("input 'INPUT0'"), std::string::npos) << s;
  EXPECT_NE(Message(s).find("region 'r', which has 64 bytes"), std::string::npos) << s;
  EXPECT_FALSE(m.Block("r", ~uint64_t{0}, 2, "x").ok());
  s = m.Block("nope", 0, 1, "output 'OUTPUT0'").status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(Message(s).find("'nope' is not registered"), std::string::npos) << s;
}

TEST(SharedMemoryManagerTest, AnUnregisteredRegionStaysOpenWhileABlockHoldsIt) {
  ShmObject obj(64);
  SharedMemoryManager m;
  ASSERT_TRUE(m.Register("r", obj.key(), 0, 64).ok());
  auto b = m.Block("r", 0, 64, "x");
  ASSERT_TRUE(b.ok());
  m.UnregisterAll();
  ASSERT_TRUE(b->Write("still open").ok());  // a closed descriptor would fail here
  EXPECT_EQ(std::string(obj.data(), 10), "still open");
  ASSERT_TRUE(m.Register("r", obj.key(), 0, 64).ok());  // the name is free again
}

TEST(SharedMemoryManagerTest, OverlapIsFoundAcrossRegionsOfOneKey) {
  ShmObject obj(256), other(256);
  SharedMemoryManager m;
  ASSERT_TRUE(m.Register("a", obj.key(), 0, 128).ok());
  ASSERT_TRUE(m.Register("b", obj.key(), 64, 128).ok());
  ASSERT_TRUE(m.Register("c", other.key(), 0, 128).ok());
  auto block = [&](const char* r, uint64_t off, uint64_t n) { return *m.Block(r, off, n, "x"); };
  const std::string what[] = {"output 'O0'", "output 'O1'"};
  // a[64..80) is b[0..16): the same bytes of the object.
  SharedMemoryBlock both[] = {block("a", 64, 16), block("b", 8, 16)};
  Status s = CheckDisjoint(both, what);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(Message(s).find("output 'O0' (shared memory region 'a'"), std::string::npos) << s;
  EXPECT_NE(Message(s).find("overlap"), std::string::npos) << s;
  SharedMemoryBlock adjacent[] = {block("a", 0, 64), block("b", 0, 16)};
  EXPECT_TRUE(CheckDisjoint(adjacent, what).ok());
  SharedMemoryBlock other_key[] = {block("a", 0, 64), block("c", 0, 64)};
  EXPECT_TRUE(CheckDisjoint(other_key, what).ok());
}

TEST(SharedMemoryCodecTest, GrpcInputsAndOutputsInSharedMemory) {
  ShmObject obj(1024);
  SharedMemoryManager m;
  ASSERT_TRUE(m.Register("in", obj.key(), 0, 128).ok());
  ASSERT_TRUE(m.Register("out", obj.key(), 512, 512).ok());
  for (int i = 0; i < 16; ++i) std::memcpy(obj.data() + 4 * i, &i, 4);
  inference::ModelInferRequest w;
  auto* a = w.add_inputs();
  a->set_name("INPUT0");
  a->set_datatype("INT32");
  a->add_shape(1);
  a->add_shape(16);
  (*a->mutable_parameters())["shared_memory_region"].set_string_param("in");
  (*a->mutable_parameters())["shared_memory_byte_size"].set_int64_param(64);
  auto* b = w.add_inputs();  // inline, the only raw_input_contents entry
  b->set_name("INPUT1");
  b->set_datatype("INT32");
  b->add_shape(1);
  b->add_shape(16);
  w.add_raw_input_contents(std::string(64, '\0'));
  auto* o = w.add_outputs();
  o->set_name("OUTPUT0");
  (*o->mutable_parameters())["shared_memory_region"].set_string_param("out");
  (*o->mutable_parameters())["shared_memory_byte_size"].set_int64_param(64);
  (*o->mutable_parameters())["shared_memory_offset"].set_int64_param(8);
  ShmOutputs outs;
  auto r = DecodeInferRequest(w, &m, &outs);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->inputs[0].data, std::string(obj.data(), 64));
  ASSERT_EQ(outs.size(), 1u);
  EXPECT_EQ(outs[0].block.offset, 8u);

  InferenceResponse resp;
  resp.outputs.push_back({"OUTPUT0", DataType::kInt32, {1, 16}, std::string(64, '\x07')});
  ASSERT_TRUE(WriteShmOutputs(outs, resp.outputs).ok());
  EXPECT_EQ(std::string(obj.data() + 520, 64), std::string(64, '\x07'));
  inference::ModelInferResponse wire;
  EncodeInferResponse("simple", "", std::move(resp), &wire, &outs);
  ASSERT_EQ(wire.raw_output_contents_size(), 1);
  EXPECT_TRUE(wire.raw_output_contents(0).empty());
  const auto& params = wire.outputs(0).parameters();
  EXPECT_EQ(params.at("shared_memory_region").string_param(), "out");
  EXPECT_EQ(params.at("shared_memory_byte_size").int64_param(), 64);
  EXPECT_EQ(params.at("shared_memory_offset").int64_param(), 8);

  // An output that does not fit its block.
  InferenceResponse big;
  big.outputs.push_back({"OUTPUT0", DataType::kInt32, {1, 32}, std::string(128, '\x01')});
  Status s = WriteShmOutputs(outs, big.outputs);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(Message(s).find("output 'OUTPUT0' has 128 bytes"), std::string::npos) << s;
  EXPECT_NE(Message(s).find("region 'out'"), std::string::npos) << s;
}

TEST(SharedMemoryCodecTest, GrpcErrorsNameTheRegionAndTheTensor) {
  ShmObject obj(1024);
  SharedMemoryManager m;
  ASSERT_TRUE(m.Register("r", obj.key(), 0, 1024).ok());
  auto request = [](const std::string& region, int64_t size, int64_t offset = 0) {
    inference::ModelInferRequest w;
    auto* a = w.add_inputs();
    a->set_name("INPUT0");
    a->set_datatype("INT32");
    a->add_shape(16);
    auto& p = *a->mutable_parameters();
    if (!region.empty()) p["shared_memory_region"].set_string_param(region);
    if (size >= 0) p["shared_memory_byte_size"].set_int64_param(size);
    if (offset) p["shared_memory_offset"].set_int64_param(offset);
    return w;
  };
  auto error = [&](inference::ModelInferRequest w) {
    ShmOutputs outs;
    auto r = DecodeInferRequest(w, &m, &outs);
    EXPECT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    return Message(r.status());
  };
  EXPECT_NE(error(request("r", 60)).find("shared_memory_byte_size is 60"), std::string::npos);
  EXPECT_NE(error(request("r", 64, 1000)).find("past the end of shared memory region 'r'"),
            std::string::npos);
  EXPECT_NE(error(request("nope", 64)).find("'nope' is not registered"), std::string::npos);
  EXPECT_NE(error(request("r", -1)).find("needs both"), std::string::npos);
  EXPECT_NE(error(request("", 64)).find("needs both"), std::string::npos);
  EXPECT_NE(error(request("r", 64, -4)).find("'shared_memory_offset' is -4"), std::string::npos);
  auto w = request("r", 64);
  w.mutable_inputs(0)->mutable_contents()->add_int_contents(1);
  EXPECT_NE(error(w).find("also has contents"), std::string::npos);
  // Without a registry (a core built by hand), no region is registered.
  ShmOutputs outs;
  auto none = request("r", 64);
  EXPECT_FALSE(DecodeInferRequest(none, nullptr, &outs).ok());

  // Two outputs into overlapping bytes.
  inference::ModelInferRequest two;
  for (const char* name : {"OUTPUT0", "OUTPUT1"}) {
    auto* o = two.add_outputs();
    o->set_name(name);
    (*o->mutable_parameters())["shared_memory_region"].set_string_param("r");
    (*o->mutable_parameters())["shared_memory_byte_size"].set_int64_param(64);
    (*o->mutable_parameters())["shared_memory_offset"].set_int64_param(name[6] == '0' ? 0 : 32);
  }
  const std::string msg = error(two);
  EXPECT_NE(msg.find("output 'OUTPUT0'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("overlap"), std::string::npos) << msg;
}

TEST(SharedMemoryCodecTest, JsonInputsAndOutputsInSharedMemory) {
  ShmObject obj(256);
  SharedMemoryManager m;
  ASSERT_TRUE(m.Register("in", obj.key(), 0, 128).ok());
  ASSERT_TRUE(m.Register("out", obj.key(), 128, 128).ok());
  std::memcpy(obj.data(), "0123456789abcdef", 16);
  const std::string body = R"({"inputs": [{"name": "X", "datatype": "FP32", "shape": [4],
      "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": 16}}],
      "outputs": [{"name": "Y", "parameters": {"shared_memory_region": "out",
      "shared_memory_byte_size": 16, "shared_memory_offset": 4, "binary_data": true}}]})";
  auto r = DecodeJsonInferRequest(body, std::nullopt, "m", "", &m);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->request->inputs[0].data, "0123456789abcdef");
  ASSERT_EQ(r->shm_outputs.size(), 1u);
  InferenceResponse resp;
  resp.outputs.push_back({"Y", DataType::kFp32, {4}, "ABCDEFGHIJKLMNOP"});
  ASSERT_TRUE(WriteShmOutputs(r->shm_outputs, resp.outputs).ok());
  EXPECT_EQ(std::string(obj.data() + 132, 16), "ABCDEFGHIJKLMNOP");
  auto out =
      EncodeJsonInferResponse("m", "", std::move(resp), r->binary_outputs, false, &r->shm_outputs);
  const std::string json_part = out.body.substr(0, out.header_length.value_or(out.body.size()));
  EXPECT_NE(json_part.find(R"("shared_memory_region":"out")"), std::string::npos) << json_part;
  EXPECT_NE(json_part.find(R"("shared_memory_offset":4)"), std::string::npos) << json_part;
  EXPECT_EQ(json_part.find("binary_data_size"), std::string::npos) << json_part;
  EXPECT_EQ(json_part.find("\"data\""), std::string::npos) << json_part;

  const std::string with_data = R"({"inputs": [{"name": "X", "datatype": "FP32", "shape": [4],
      "data": [1, 2, 3, 4],
      "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": 16}}]})";
  auto bad = DecodeJsonInferRequest(with_data, std::nullopt, "m", "", &m);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(Message(bad.status()).find("also has `data`"), std::string::npos) << bad.status();
  const std::string wrong_type = R"({"inputs": [{"name": "X", "datatype": "FP32", "shape": [4],
      "parameters": {"shared_memory_region": 7, "shared_memory_byte_size": 16}}]})";
  bad = DecodeJsonInferRequest(wrong_type, std::nullopt, "m", "", &m);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(Message(bad.status()).find("must be a string"), std::string::npos) << bad.status();
}

}  // namespace
}  // namespace kiln
