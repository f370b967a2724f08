// RunFinetune end to end on a tiny random Llama (tests/fixtures/models/llama_gqa_f32): the
// files it writes, resuming from its own checkpoint files with the losses of an uninterrupted
// run, and bad input refused before anything is written.
#include "models/train/finetune.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "models/io/errors.h"
#include "models/io/test_paths.h"
#include "models/llm/loader.h"
#include "models/llm/paged_llm.h"
#include "models/lora/peft_io.h"
#include "models/safetensors/safetensors.h"
#include "models/train/export.h"
#include "models/train/trainer.h"

namespace kiln::models {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class FinetuneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           Cat("kiln_finetune_test_",
               ::testing::UnitTest::GetInstance()->current_test_info()->name(), "_", getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream f(dir_ / "train.jsonl");
    for (int i = 0; i < 24; ++i) {
      f << "{\"prompt\": \"Question " << i << ": what comes next?\", \"completion\": \" The answer "
        << i << " is " << (i * 7) % 13 << ".\"}\n";
    }
  }
  void TearDown() override { fs::remove_all(dir_); }

  FinetuneOptions Options() const {
    FinetuneOptions o;
    o.model = testing::SourceDir() + "/tests/fixtures/models/llama_gqa_f32";
    o.train = (dir_ / "train.jsonl").string();
    o.out = (dir_ / "out").string();
    o.lora.r = 4;
    o.lora.alpha = 8;
    o.lr = 1e-3;
    o.steps = 6;
    o.batch_size = 2;
    o.seq_len = 32;
    o.threads = 2;
    return o;
  }

  fs::path dir_;
};

// Collects the loss of every step; stops after `stop_after` steps when > 0.
struct Recorder {
  std::map<int64_t, double> losses;
  int64_t stop_after = 0;
  std::function<bool(const FinetuneProgress&)> fn() {
    return [this](const FinetuneProgress& p) {
      if (p.step > 0) losses[p.step] = p.loss;
      return stop_after == 0 || p.step < stop_after;
    };
  }
};

TEST_F(FinetuneTest, WritesAPeftAdapterAndCheckpointsAndTheLossFalls) {
  FinetuneOptions o = Options();
  o.save_steps = 3;
  Recorder rec;
  auto s = RunFinetune(o, rec.fn());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->steps, 6);
  EXPECT_FALSE(s->stopped);
  EXPECT_GT(s->tokens, 0);
  ASSERT_EQ(rec.losses.size(), 6u);
  EXPECT_LT(rec.losses[6], rec.losses[1]);  // lr 1e-3 on a repetitive task
  EXPECT_TRUE(fs::exists(dir_ / "out" / "adapter_config.json"));
  EXPECT_TRUE(fs::exists(dir_ / "out" / "adapter_model.safetensors"));
  EXPECT_TRUE(fs::exists(dir_ / "out" / "checkpoint-000003"));
  EXPECT_TRUE(fs::exists(dir_ / "out" / "checkpoint-000006"));
  // The adapter reads back for this model, and serves.
  config::ModelConfig mc;
  mc.path = o.model;
  mc.threads = 2;
  LlmLoadOptions lo;
  lo.adapter = o.out;
  auto model = LoadPagedLlm(mc, lo);
  ASSERT_TRUE(model.ok()) << model.status();
}

TEST_F(FinetuneTest, FullFineTuningWritesAModelFolderThatLoads) {
  FinetuneOptions o = Options();
  o.method = "full";
  o.steps = 3;
  o.lr = 1e-4;
  Recorder rec;
  auto s = RunFinetune(o, rec.fn());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_GT(s->trainable_parameters, 400000);  // every weight of the tiny model
  EXPECT_EQ(rec.losses.size(), 3u);
  // Every weight is written under its Hugging Face name, trained (changed) but close.
  auto before = SafetensorsModel::Open(o.model);
  auto after = SafetensorsModel::Open(o.out);
  ASSERT_TRUE(before.ok() && after.ok());
  EXPECT_EQ((*after)->size(), (*before)->size());
  for (const char* name : {"model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight",
                           "model.norm.weight", "lm_head.weight"}) {
    const SafetensorsTensor* a = (*before)->Find(name);
    const SafetensorsTensor* b = (*after)->Find(name);
    ASSERT_TRUE(a != nullptr && b != nullptr) << name;
    ASSERT_EQ(a->shape, b->shape) << name;
    auto va = SafetensorsToFloats(*a);
    auto vb = SafetensorsToFloats(*b);
    ASSERT_TRUE(va.ok() && vb.ok());
    double diff = 0;
    for (size_t i = 0; i < va->size(); ++i)
      diff = std::max<double>(diff, std::fabs((*va)[i] - (*vb)[i]));
    EXPECT_GT(diff, 0) << name;
    EXPECT_LT(diff, 1e-2) << name;  // three steps of lr 1e-4
  }
  EXPECT_TRUE(fs::exists(dir_ / "out" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(dir_ / "out" / "config.json"));
  EXPECT_TRUE(fs::exists(dir_ / "out" / "tokenizer.json"));
  config::ModelConfig mc;
  mc.path = o.out;
  mc.threads = 2;
  auto model = LoadPagedLlm(mc);
  ASSERT_TRUE(model.ok()) << model.status();
  // Resuming a full run continues from its checkpoint's weights.
  o.steps = 4;
  o.resume = o.out;
  Recorder more;
  auto s2 = RunFinetune(o, more.fn());
  ASSERT_TRUE(s2.ok()) << s2.status();
  EXPECT_EQ(s2->steps, 1);
}

// `kiln export --merge`: the merged folder computes what the base with the adapter computes.
TEST_F(FinetuneTest, AMergedExportComputesWhatTheAdapterComputes) {
  FinetuneOptions o = Options();
  o.steps = 3;
  o.lr = 1e-2;  // a clearly non-zero adapter
  ASSERT_TRUE(RunFinetune(o, nullptr).ok());
  const std::string merged = (dir_ / "merged").string();
  ASSERT_TRUE(ExportMerged(o.model, o.out, merged).ok());
  // Loss of one batch: base + adapter, and the merged model with a fresh (B = 0) adapter.
  auto loss_of = [&](const std::string& model, const std::string& adapter) -> double {
    config::ModelConfig mc;
    mc.path = model;
    mc.threads = 2;
    auto parts = OpenLlmParts(mc);
    EXPECT_TRUE(parts.ok()) << parts.status();
    TrainerOptions to;
    to.lora.r = 4;
    to.lora.alpha = 8;
    to.batch_size = 1;
    to.seq_len = 16;
    auto t = Trainer::Create(*std::move(parts), to);
    EXPECT_TRUE(t.ok()) << t.status();
    if (!adapter.empty()) {
      auto a = ReadPeftAdapter(adapter, PeftBaseModel::FromHParams((*t)->parts().hparams, model));
      EXPECT_TRUE(a.ok()) << a.status();
      EXPECT_TRUE((*t)->ImportAdapter(*a).ok());
    }
    train::TrainBatch b;
    b.rows = 1;
    b.seq_len = 16;
    for (int i = 0; i < 16; ++i) {
      b.tokens.push_back(40 + 13 * i);
      b.targets.push_back(i + 1 < 16 ? 40 + 13 * (i + 1) : train::kIgnoreIndex);
      b.positions.push_back(i);
      b.doc_ids.push_back(0);
    }
    b.target_count = 15;
    auto r = (*t)->Evaluate(b);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->loss : 0;
  };
  const double base = loss_of(o.model, "");
  const double with_adapter = loss_of(o.model, o.out);
  const double merged_loss = loss_of(merged, "");
  EXPECT_GT(std::fabs(with_adapter - base), 1e-3);  // the adapter matters
  EXPECT_NEAR(merged_loss, with_adapter, 1e-5 * std::fabs(with_adapter));
}

TEST_F(FinetuneTest, ResumingFromACheckpointGivesTheUninterruptedLosses) {
  Recorder whole;
  ASSERT_TRUE(RunFinetune(Options(), whole.fn()).ok());
  ASSERT_EQ(whole.losses.size(), 6u);

  FinetuneOptions o = Options();
  o.out = (dir_ / "split").string();
  Recorder first;
  first.stop_after = 3;
  auto s1 = RunFinetune(o, first.fn());
  ASSERT_TRUE(s1.ok()) << s1.status();
  EXPECT_TRUE(s1->stopped);
  EXPECT_EQ(s1->steps, 3);
  // A leftover of an interrupted write and a newer, incomplete checkpoint are passed over.
  fs::create_directories(fs::path(o.out) / ".checkpoint-000004.tmp");
  fs::create_directories(fs::path(o.out) / "checkpoint-000005");
  o.resume = o.out;
  Recorder second;
  std::vector<std::string> messages;
  auto s2 = RunFinetune(o, [&](const FinetuneProgress& p) {
    if (!p.message.empty()) messages.push_back(p.message);
    return second.fn()(p);
  });
  ASSERT_TRUE(s2.ok()) << s2.status();
  EXPECT_EQ(s2->steps, 3);
  ASSERT_EQ(second.losses.size(), 3u);
  for (int64_t step = 4; step <= 6; ++step) {
    EXPECT_EQ(second.losses[step], whole.losses[step]) << "step " << step;
  }
  std::string all;
  for (const std::string& m : messages) all += m + "\n";
  EXPECT_THAT(all, HasSubstr("resumed from"));
  EXPECT_THAT(all, HasSubstr("checkpoint-000005"));
}

// --grad-accum 2 --batch-size 1 trains on the same rows as --batch-size 2, step for step:
// the same losses (normalised by the step's tokens) and the same adapter, up to rounding.
TEST_F(FinetuneTest, GradientAccumulationTrainsLikeTheLargerBatch) {
  Recorder whole;
  ASSERT_TRUE(RunFinetune(Options(), whole.fn()).ok());
  FinetuneOptions o = Options();
  o.out = (dir_ / "accum").string();
  o.batch_size = 1;
  o.grad_accum = 2;
  Recorder accum;
  std::vector<std::string> messages;
  auto s = RunFinetune(o, [&](const FinetuneProgress& p) {
    if (!p.message.empty()) messages.push_back(p.message);
    return accum.fn()(p);
  });
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->steps, 6);
  ASSERT_EQ(accum.losses.size(), whole.losses.size());
  for (const auto& [step, loss] : whole.losses) {
    EXPECT_NEAR(accum.losses[step], loss, 1e-5 * loss) << "step " << step;
  }
  ASSERT_FALSE(messages.empty());
  EXPECT_THAT(messages[0], HasSubstr("x 2 micro-batches"));
  auto a = SafetensorsFile::Open(Options().out + "/adapter_model.safetensors");
  auto b = SafetensorsFile::Open(o.out + "/adapter_model.safetensors");
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ((*a)->tensors().size(), (*b)->tensors().size());
  double worst = 0;
  for (const SafetensorsTensor& t : (*a)->tensors()) {
    const SafetensorsTensor* u = (*b)->Find(t.name);
    ASSERT_NE(u, nullptr) << t.name;
    ASSERT_EQ(u->n_elements, t.n_elements) << t.name;
    const auto* x = static_cast<const float*>(t.data);
    const auto* y = static_cast<const float*>(u->data);
    double diff = 0, norm = 0;
    for (uint64_t i = 0; i < t.n_elements; ++i) {
      diff += (x[i] - y[i]) * static_cast<double>(x[i] - y[i]);
      norm += x[i] * static_cast<double>(x[i]);
    }
    worst = std::max(worst, std::sqrt(diff / std::max(norm, 1e-30)));
  }
  // The two runs multiply batches of different sizes, which the autotuner may give different
  // GEMM implementations (GEMV, packed GEMM, oneDNN: each sums in its own order), and six AdamW
  // steps carry those roundings into the adapter. Measured: 7.1e-6 to 1.04e-5 with fresh tuning
  // caches, 1.9e-5 with KILN_CPU_AUTOTUNE=0 (GEMV for one size, the packed GEMM for the other).
  // Accumulating the wrong rows moves lora_B, which starts at zero, by O(1) of itself.
  EXPECT_LE(worst, 1e-4);
}

TEST_F(FinetuneTest, BadOptionsAreRefusedBeforeAnythingIsWritten) {
  struct Bad {
    std::function<void(FinetuneOptions&)> set;
    std::string message;
  };
  const std::vector<Bad> cases = {
      {[](FinetuneOptions& o) { o.lora.r = 0; }, "rank r must be positive"},
      {[](FinetuneOptions& o) { o.lora.r = -3; }, "rank r must be positive"},
      {[](FinetuneOptions& o) { o.lr = 0; }, "learning rate must be positive"},
      {[](FinetuneOptions& o) { o.lr = -1e-4; }, "learning rate must be positive"},
      {[](FinetuneOptions& o) { o.lora.target_modules = {"c_attn"}; },
       "unknown LoRA target module 'c_attn'"},
      {[](FinetuneOptions& o) { o.method = "qlora"; }, "--method must be lora or full"},
      {[](FinetuneOptions& o) { o.schedule = "step"; }, "step"},
      {[](FinetuneOptions& o) { o.optimizer = "lion"; }, "lion"},
      {[&](FinetuneOptions& o) { o.train = (dir_ / "missing.jsonl").string(); }, "missing.jsonl"},
      {[&](FinetuneOptions& o) {
         std::ofstream(dir_ / "empty.jsonl");
         o.train = (dir_ / "empty.jsonl").string();
       },
       "empty.jsonl"},
      {[&](FinetuneOptions& o) {
         std::ofstream(dir_ / "bad.jsonl")
             << "{\"prompt\": \"a\", \"completion\": \"b\"}\nnot json\n";
         o.train = (dir_ / "bad.jsonl").string();
       },
       "bad.jsonl:2"},
      {[](FinetuneOptions& o) { o.seq_len = 100000; }, "context"},
      {[](FinetuneOptions& o) { o.grad_accum = 0; }, "--grad-accum must be between 1"},
  };
  for (const Bad& c : cases) {
    FinetuneOptions o = Options();
    c.set(o);
    auto s = RunFinetune(o, nullptr);
    ASSERT_FALSE(s.ok()) << c.message;
    EXPECT_THAT(std::string(StatusMessage(s.status())), HasSubstr(c.message));
    EXPECT_FALSE(fs::exists(o.out)) << c.message;
  }
}

TEST_F(FinetuneTest, AnAdapterForAnotherBaseModelIsRefusedNamingTheMismatch) {
  FinetuneOptions o = Options();
  o.steps = 1;
  ASSERT_TRUE(RunFinetune(o, nullptr).ok());
  config::ModelConfig mc;
  mc.path = testing::SourceDir() + "/.kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  mc.threads = 2;
  LlmLoadOptions lo;
  lo.adapter = o.out;
  auto model = LoadPagedLlm(mc, lo);
  ASSERT_FALSE(model.ok());
  EXPECT_THAT(std::string(StatusMessage(model.status())), HasSubstr("lora_A is"));
}

// The Hugging Face layout writes a folder's weights back under the names they were read from:
// Phi-3's fused gate_up_proj (GGUF name ffn_up, which Llama's up_proj also maps to) stays
// gate_up_proj. A GGUF of another architecture than llama is refused (its config.json would be
// Llama's).
TEST(HfLayoutTest, KeepsStoredNamesAndRefusesNonLlamaGguf) {
  config::ModelConfig c;
  c.name = "m";
  c.kind = "llm";
  c.path = testing::FixturePath("models/phi3_fused_f32");
  auto phi3 = OpenLlmParts(c);
  ASSERT_TRUE(phi3.ok()) << phi3.status();
  const HfLayout layout = MakeHfLayout(*phi3);
  EXPECT_EQ(layout.hf_of.at("blk.0.ffn_up.weight"), "model.layers.0.mlp.gate_up_proj.weight");
  EXPECT_EQ(layout.hf_of.at("blk.1.attn_qkv.weight"), "model.layers.1.self_attn.qkv_proj.weight");

  c.path = testing::FixturePath("models/gemma3_text_bf16.gguf");
  auto gemma = OpenLlmParts(c);
  ASSERT_TRUE(gemma.ok()) << gemma.status();
  const fs::path out = fs::path(::testing::TempDir()) / "kiln_hf_layout_gemma";
  const Status s = WriteHfModel(out.string(), c.path, *gemma, MakeHfLayout(*gemma), {});
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(StatusMessage(s)), HasSubstr("gemma3 GGUF"));
  EXPECT_FALSE(fs::exists(out / "model.safetensors"));
}

}  // namespace
}  // namespace kiln::models
