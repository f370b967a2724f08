#include "models/train/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "absl/strings/str_join.h"
#include "models/io/durable_file.h"

namespace kiln::models {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using json = nlohmann::json;
namespace fs = std::filesystem;

PeftBaseModel TinyBase() {
  LlmHParams hp;
  hp.architecture = "llama";
  hp.hidden_size = 16;
  hp.num_layers = 2;
  hp.num_heads = 2;
  hp.num_kv_heads = 1;
  hp.head_dim = 8;
  hp.ffn_size = 24;
  hp.rope.layout = RopeParams::Layout::kInterleaved;
  return PeftBaseModel::FromHParams(hp, "tiny");
}

std::vector<float> Values(size_t n, float seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::sin(seed + 0.7f * i);
  return v;
}

Checkpoint LoraCheckpoint(int64_t step, float seed = 1) {
  Checkpoint c;
  c.state.step = step;
  c.state.epoch = step / 10.0;
  c.state.data_position = {{"file", "train.jsonl"}, {"offset", 1234 * step}};
  c.state.rng_state = "5489 1 2 3";
  c.state.losses = {{1, 2.5}, {2, 2.25}, {3, NAN}};
  c.state.options = {{"lr", 1e-4}, {"r", 2}};
  LoraAdapter ad;
  ad.config.r = 2;
  ad.config.alpha = 4;
  ad.config.target_modules = {"q_proj", "k_proj"};
  ad.layers["blk.0.attn_q.weight"] = {16, 16, Values(32, seed), Values(32, seed + 1)};
  ad.layers["blk.1.attn_k.weight"] = {16, 8, Values(32, seed + 2), Values(16, seed + 3)};
  c.adapter = ad;
  for (const auto& [name, l] : ad.layers) {
    c.optimizer[name + ".lora_A.m"] = {{2, 16}, Values(32, seed + 4)};
    c.optimizer[name + ".lora_A.v"] = {{2, 16}, Values(32, seed + 5)};
  }
  c.optimizer["step"] = {{}, {float(step)}};
  return c;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    out_ = (fs::temp_directory_path() /
            StrCat("kiln_ckpt_", ::getpid(), "_",
                   ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    fs::remove_all(out_);
  }
  void TearDown() override { fs::remove_all(out_); }
  std::string Write(const Checkpoint& c, CheckpointOptions o = {}) {
    auto dir = WriteCheckpoint(out_, c, TinyBase(), o);
    EXPECT_TRUE(dir.ok()) << dir.status();
    return dir.ok() ? *dir : "";
  }
  std::vector<std::string> Entries() {
    std::vector<std::string> v;
    for (const auto& e : fs::directory_iterator(out_)) v.push_back(e.path().filename().string());
    std::sort(v.begin(), v.end());
    return v;
  }
  std::string out_;
};

TEST_F(CheckpointTest, LoraRoundTrip) {
  const Checkpoint c = LoraCheckpoint(120);
  const std::string dir = Write(c);
  EXPECT_EQ(dir, out_ + "/checkpoint-000120");
  EXPECT_THAT(Entries(), ElementsAre("checkpoint-000120"));
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  EXPECT_THAT(files, ElementsAre("adapter_config.json", "adapter_model.safetensors",
                                 "optimizer.safetensors", "trainer_state.json"));

  auto back = LoadCheckpoint(dir, TinyBase());
  ASSERT_TRUE(back.ok()) << back.status();
  const TrainerState& s = back->state;
  EXPECT_EQ(s.step, 120);
  EXPECT_EQ(s.epoch, 12.0);
  EXPECT_EQ(s.data_position, c.state.data_position);
  EXPECT_EQ(s.rng_state, "5489 1 2 3");
  EXPECT_EQ(s.options, c.state.options);
  EXPECT_EQ(s.kiln_version, KILN_VERSION_FOR_TEST);
  ASSERT_EQ(s.losses.size(), 3u);
  EXPECT_EQ(s.losses[1].step, 2);
  EXPECT_EQ(s.losses[1].loss, 2.25);
  EXPECT_TRUE(std::isnan(s.losses[2].loss));
  ASSERT_TRUE(back->adapter.has_value());
  EXPECT_FALSE(back->model.has_value());
  EXPECT_EQ(back->adapter->config.r, 2);
  EXPECT_EQ(back->adapter->config.target_modules, c.adapter->config.target_modules);
  for (const auto& [name, l] : c.adapter->layers) {
    EXPECT_EQ(back->adapter->layers.at(name).a, l.a) << name;
    EXPECT_EQ(back->adapter->layers.at(name).b, l.b) << name;  // un-permuted and back
  }
  ASSERT_EQ(back->optimizer.size(), c.optimizer.size());
  for (const auto& [name, t] : c.optimizer) {
    EXPECT_EQ(back->optimizer.at(name).shape, t.shape) << name;
    EXPECT_EQ(back->optimizer.at(name).data, t.data) << name;
  }
  const json state = json::parse(*ReadWholeFile(dir + "/trainer_state.json"));
  EXPECT_EQ(state["kind"], "lora");
  EXPECT_TRUE(state["losses"][2]["loss"].is_null());

  auto found = FindLatestCheckpoint(out_);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->dir, dir);
  EXPECT_EQ(found->step, 120);
  EXPECT_TRUE(found->skipped.empty());
}

TEST_F(CheckpointTest, FullFineTuningRoundTripInBf16) {
  Checkpoint c;
  c.state.step = 7;
  FullModelWeights m;
  m.tensors["model.embed_tokens.weight"] = {{4, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1.0f / 3}};
  m.tensors["model.norm.weight"] = {{3}, {1, 1, 1}};
  m.config = {{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 3}};
  m.dtype = SafetensorsDtype::kBF16;
  c.model = m;
  c.optimizer["model.norm.weight.m"] = {{3}, {0.5f, 0.25f, 0}};
  const std::string dir = Write(c);
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/config.json"));
  EXPECT_FALSE(fs::exists(dir + "/adapter_config.json"));
  auto back = LoadCheckpoint(dir, TinyBase());
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_TRUE(back->model.has_value());
  EXPECT_FALSE(back->adapter.has_value());
  EXPECT_EQ(back->model->dtype, SafetensorsDtype::kBF16);
  EXPECT_EQ(back->model->config, m.config);
  const CheckpointTensor& e = back->model->tensors.at("model.embed_tokens.weight");
  EXPECT_EQ(e.shape, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(e.data[10], 11);
  EXPECT_NEAR(e.data[11], 1.0f / 3, 1e-3);  // bf16-rounded
  EXPECT_NE(e.data[11], 1.0f / 3);
  EXPECT_EQ(back->optimizer.at("model.norm.weight.m").data, (std::vector<float>{0.5f, 0.25f, 0}));
}

TEST_F(CheckpointTest, HalfWrittenCheckpointsAreSkippedForThePreviousCompleteOne) {
  Write(LoraCheckpoint(1));
  const std::string good = Write(LoraCheckpoint(2));
  // 3: trainer_state.json never written (a copy by a tool that is not atomic).
  const std::string three = Write(LoraCheckpoint(3));
  fs::remove(three + "/trainer_state.json");
  // 4: a crash before the rename.
  fs::copy(good, out_ + "/.checkpoint-000004.tmp");
  // 5: trainer_state.json cut short.
  const std::string five = Write(LoraCheckpoint(5));
  ASSERT_TRUE(WriteFileDurably(five + "/trainer_state.json", "{\"format\": \"kiln-che").ok());
  // 6: optimizer.safetensors truncated.
  const std::string six = Write(LoraCheckpoint(6));
  std::string bytes = *ReadWholeFile(six + "/optimizer.safetensors");
  ASSERT_TRUE(WriteFileDurably(six + "/optimizer.safetensors", bytes.substr(0, 40)).ok());
  // 7: the adapter's weights missing.
  const std::string seven = Write(LoraCheckpoint(7));
  fs::remove(seven + "/adapter_model.safetensors");
  // Not checkpoints at all.
  fs::create_directories(out_ + "/checkpoint-latest");
  ASSERT_TRUE(WriteFileDurably(out_ + "/checkpoint-000099", "a file").ok());

  auto found = FindLatestCheckpoint(out_);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->dir, good);
  EXPECT_EQ(found->step, 2);
  ASSERT_EQ(found->skipped.size(), 5u);
  const std::string all = absl::StrJoin(found->skipped, "\n");
  EXPECT_THAT(all, HasSubstr(".checkpoint-000004.tmp: left over from an interrupted write"));
  EXPECT_THAT(all, HasSubstr("checkpoint-000003: incomplete, skipped: " + three +
                             "/trainer_state.json: cannot open"));
  EXPECT_THAT(all, HasSubstr("checkpoint-000005/trainer_state.json: not valid JSON"));
  EXPECT_THAT(all, HasSubstr("checkpoint-000006/optimizer.safetensors"));
  EXPECT_THAT(all, HasSubstr("checkpoint-000007/adapter_model.safetensors"));

  // The next write of step 4 clears the leftover.
  Write(LoraCheckpoint(4));
  EXPECT_FALSE(fs::exists(out_ + "/.checkpoint-000004.tmp"));
}

TEST_F(CheckpointTest, TruncatedSafetensorsGivesAClearError) {
  const std::string dir = Write(LoraCheckpoint(3));
  std::string bytes = *ReadWholeFile(dir + "/optimizer.safetensors");
  ASSERT_TRUE(
      WriteFileDurably(dir + "/optimizer.safetensors", bytes.substr(0, bytes.size() - 8)).ok());
  auto c = LoadCheckpoint(dir, TinyBase());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(StatusMessage(c.status())),
              HasSubstr(dir + "/optimizer.safetensors: tensor \""));
  EXPECT_THAT(std::string(StatusMessage(c.status())), HasSubstr("truncated"));

  bytes = *ReadWholeFile(dir + "/adapter_model.safetensors");
  ASSERT_TRUE(WriteFileDurably(dir + "/adapter_model.safetensors", bytes.substr(0, 5)).ok());
  c = LoadCheckpoint(dir, TinyBase());
  EXPECT_THAT(std::string(StatusMessage(c.status())),
              HasSubstr(dir + "/adapter_model.safetensors: truncated"));

  json state = json::parse(*ReadWholeFile(dir + "/trainer_state.json"));
  state.erase("rng_state");
  ASSERT_TRUE(WriteFileDurably(dir + "/trainer_state.json", state.dump()).ok());
  c = LoadCheckpoint(dir, TinyBase());
  EXPECT_THAT(std::string(StatusMessage(c.status())), HasSubstr(dir + "/trainer_state.json: "));
  EXPECT_THAT(std::string(StatusMessage(c.status())), HasSubstr("rng_state"));
  EXPECT_EQ(LoadCheckpoint(out_ + "/nope", TinyBase()).status().code(), StatusCode::kNotFound);
}

TEST_F(CheckpointTest, ResumingOnAModelWithOtherQkRowOrderIsRefused) {
  const std::string dir = Write(LoraCheckpoint(3));
  PeftBaseModel hf = TinyBase();
  hf.qk_rows_permuted = false;
  auto c = LoadCheckpoint(dir, hf);
  EXPECT_EQ(c.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(StatusMessage(c.status())),
              HasSubstr("trained on a model with llama.cpp's (GGUF) q/k row order, but the "
                        "model given has Hugging Face's"));
  EXPECT_TRUE(ReadPeftAdapter(dir, hf).ok());  // the adapter itself is portable
}

TEST_F(CheckpointTest, RewritingAStepReplacesItAtomically) {
  Write(LoraCheckpoint(5, /*seed=*/1));
  const Checkpoint second = LoraCheckpoint(5, /*seed=*/9);
  const std::string dir = Write(second);
  EXPECT_THAT(Entries(), ElementsAre("checkpoint-000005"));  // no .tmp or .old left behind
  auto back = LoadCheckpoint(dir, TinyBase());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->adapter->layers.at("blk.0.attn_q.weight").a,
            second.adapter->layers.at("blk.0.attn_q.weight").a);
  EXPECT_EQ(back->optimizer.at("blk.0.attn_q.weight.lora_A.m").data,
            second.optimizer.at("blk.0.attn_q.weight.lora_A.m").data);
}

TEST_F(CheckpointTest, KeepLast) {
  for (int64_t step : {10, 20, 30, 40}) Write(LoraCheckpoint(step), {.keep_last = 2});
  EXPECT_THAT(Entries(), ElementsAre("checkpoint-000030", "checkpoint-000040"));
  Write(LoraCheckpoint(1000000), {.keep_last = 1});
  EXPECT_THAT(Entries(), ElementsAre("checkpoint-1000000"));
  EXPECT_EQ(FindLatestCheckpoint(out_)->step, 1000000);
}

TEST_F(CheckpointTest, NothingToResumeFrom) {
  auto found = FindLatestCheckpoint(out_);  // no directory at all
  ASSERT_TRUE(found.ok());
  EXPECT_TRUE(found->dir.empty());
  fs::create_directories(out_);
  found = FindLatestCheckpoint(out_);
  ASSERT_TRUE(found.ok());
  EXPECT_TRUE(found->dir.empty());
  EXPECT_EQ(found->step, -1);
}

TEST_F(CheckpointTest, RejectsBadInputBeforeWriting) {
  Checkpoint c = LoraCheckpoint(1);
  c.model = FullModelWeights{};
  EXPECT_THAT(std::string(StatusMessage(WriteCheckpoint(out_, c, TinyBase()).status())),
              HasSubstr("either a LoRA adapter or full model weights, not both"));
  c = LoraCheckpoint(1);
  c.adapter.reset();
  EXPECT_THAT(std::string(StatusMessage(WriteCheckpoint(out_, c, TinyBase()).status())),
              HasSubstr("got neither"));
  c = LoraCheckpoint(1);
  c.optimizer["x"] = {{2, 3}, {1, 2}};
  EXPECT_THAT(std::string(StatusMessage(WriteCheckpoint(out_, c, TinyBase()).status())),
              HasSubstr("optimizer state tensor \"x\" has 2 values but its shape holds 6"));
  c = LoraCheckpoint(-1);
  EXPECT_FALSE(WriteCheckpoint(out_, c, TinyBase()).ok());
  // An adapter that does not fit the model: nothing is left behind.
  c = LoraCheckpoint(1);
  c.adapter->layers.at("blk.0.attn_q.weight").in = 17;
  EXPECT_THAT(std::string(StatusMessage(WriteCheckpoint(out_, c, TinyBase()).status())),
              HasSubstr("adapter layer blk.0.attn_q: lora_A is (2, 17)"));
  EXPECT_TRUE(!fs::exists(out_) || Entries().empty());
}

}  // namespace
}  // namespace kiln::models
