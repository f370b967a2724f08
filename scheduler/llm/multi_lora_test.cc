// Multi-LoRA serving end to end with a real model: the tiny Llama of
// tests/fixtures/models/llama_gqa_f32 and two adapters made by Python PEFT for it
// (tests/fixtures/peft/llama_gqa_f32_{a,b}, scripts/fixtures/make_multi_lora_fixtures.py), whose
// kiln_reference.json holds PyTorch + PEFT's greedy tokens. Requests of the base model and of
// both adapters share the continuous batcher's steps (and its captured decode steps); each
// must give the tokens it gives alone, which are PyTorch's.
#include <filesystem>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>

#include "engine/testing/source_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/llm/loader.h"
#include "scheduler/generation.h"
#include "scheduler/llm/continuous_batcher.h"
#include "scheduler/model.h"
#include "scheduler/model_repository.h"

namespace kiln {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

const std::string kBase = std::string(TestSourceDir()) + "/tests/fixtures/models/llama_gqa_f32";
const std::string kPeft = std::string(TestSourceDir()) + "/tests/fixtures/peft/";

struct Reference {
  std::vector<std::vector<int32_t>> prompts, greedy;
};

Reference ReadReference(const std::string& folder) {
  std::ifstream in(folder + "/kiln_reference.json");
  EXPECT_TRUE(in.good()) << folder;
  const json ref = json::parse(in);
  Reference r;
  for (const json& p : ref["prompts"]) {
    r.prompts.push_back(p["ids"].get<std::vector<int32_t>>());
    r.greedy.push_back(p["greedy"].get<std::vector<int32_t>>());
  }
  return r;
}

config::ModelConfig Config(int slots, int rank) {
  config::ModelConfig c;
  c.name = "tiny";
  c.kind = "llm";
  c.path = kBase;
  c.threads = 2;
  c.max_loaded_adapters = slots;
  c.max_lora_rank = rank;
  c.scheduler.max_num_seqs = 16;
  c.scheduler.max_num_batched_tokens = 64;
  c.scheduler.capture_batch_sizes = {1, 2, 4, 8, 16};
  c.scheduler.kv_cache_bytes = 16 << 20;
  return c;
}

std::unique_ptr<ContinuousBatcher> Serve(const config::ModelConfig& c,
                                         const models::LlmLoadOptions& options = {}) {
  auto model = models::LoadLlm(c, options);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return nullptr;
  auto b = std::make_unique<ContinuousBatcher>(c.name, std::move(*model), c.scheduler, 1, nullptr);
  const Status s = b->Start();
  EXPECT_TRUE(s.ok()) << s;
  return s.ok() ? std::move(b) : nullptr;
}

std::future<GenerationResult> Submit(ContinuousBatcher& b, const std::vector<int32_t>& prompt,
                                     const std::string& adapter, int n) {
  auto req = std::make_unique<GenerateRequest>();
  req->prompt = prompt;
  req->adapter = adapter;
  req->sampling.temperature = 0;
  req->sampling.ignore_eos = true;  // the reference never stops
  req->max_tokens = n;
  auto promise = std::make_shared<std::promise<GenerationResult>>();
  auto acc = std::make_shared<GenerationResult>();
  req->on_event = [promise, acc](GenerateEvent&& ev) {
    acc->Add(std::move(ev));
    if (acc->done()) promise->set_value(std::move(*acc));
  };
  auto result = promise->get_future();
  const Status s = b.Enqueue(req);
  EXPECT_TRUE(s.ok()) << s;
  return result;
}

Status AddFromFolder(ContinuousBatcher& b, const std::string& name, const std::string& dir) {
  KILN_ASSIGN_OR_RETURN(auto adapter, b.model().ReadAdapter(dir));
  return b.AddAdapter(name, std::move(adapter));
}

// The base model and both adapters, three prompts each, all queued at once.
void ExpectMixedBatchMatchesPyTorch(ContinuousBatcher& b) {
  const std::map<std::string, Reference> refs = {{"", ReadReference(kBase)},
                                                 {"a", ReadReference(kPeft + "llama_gqa_f32_a")},
                                                 {"b", ReadReference(kPeft + "llama_gqa_f32_b")}};
  std::vector<std::tuple<std::string, size_t, std::future<GenerationResult>>> pending;
  for (const auto& [adapter, ref] : refs) {
    for (size_t i = 0; i < ref.prompts.size(); ++i) {
      pending.emplace_back(
          adapter, i, Submit(b, ref.prompts[i], adapter, static_cast<int>(ref.greedy[i].size())));
    }
  }
  for (auto& [adapter, i, f] : pending) {
    GenerationResult r = f.get();
    EXPECT_EQ(r.finish, FinishReason::kLength) << r.status;
    EXPECT_EQ(r.token_ids, refs.at(adapter).greedy[i])
        << "adapter '" << adapter << "' (empty: base), prompt " << i;
  }
}

TEST(MultiLoraTest, MixedStepsGiveEachAdaptersPyTorchTokens) {
  auto b = Serve(Config(/*slots=*/2, /*rank=*/8));
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(AddFromFolder(*b, "a", kPeft + "llama_gqa_f32_a").ok());
  ASSERT_TRUE(AddFromFolder(*b, "b", kPeft + "llama_gqa_f32_b").ok());
  ExpectMixedBatchMatchesPyTorch(*b);
  // Each alone, after the others: the same tokens (a step's other rows never matter).
  const Reference a = ReadReference(kPeft + "llama_gqa_f32_a");
  EXPECT_EQ(Submit(*b, a.prompts[1], "a", 16).get().token_ids, a.greedy[1]);
  const Reference base = ReadReference(kBase);
  EXPECT_EQ(Submit(*b, base.prompts[2], "", 16).get().token_ids, base.greedy[2]);
}

TEST(MultiLoraTest, OneSlotServesTwoAdaptersInTurn) {
  auto b = Serve(Config(/*slots=*/1, /*rank=*/8));
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(AddFromFolder(*b, "a", kPeft + "llama_gqa_f32_a").ok());
  ASSERT_TRUE(AddFromFolder(*b, "b", kPeft + "llama_gqa_f32_b").ok());
  ExpectMixedBatchMatchesPyTorch(*b);
}

// `kiln generate --adapter`: one adapter for every sequence, slot 0 of the same mechanism.
TEST(MultiLoraTest, SingleAdapterOptionAppliesToEverySequence) {
  models::LlmLoadOptions opts;
  opts.adapter = kPeft + "llama_gqa_f32_b";
  auto b = Serve(Config(/*slots=*/4, /*rank=*/4), opts);  // its rank 8 raises the program's
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->model().max_adapters(), 0) << "no slot is left to the batcher";
  const Reference ref = ReadReference(kPeft + "llama_gqa_f32_b");
  std::vector<std::future<GenerationResult>> pending;
  for (const auto& p : ref.prompts) pending.push_back(Submit(*b, p, "", 16));
  for (size_t i = 0; i < pending.size(); ++i) {
    EXPECT_EQ(pending[i].get().token_ids, ref.greedy[i]) << "prompt " << i;
  }
}

TEST(MultiLoraTest, AdaptersThatDoNotFitAreRefused) {
  auto b = Serve(Config(/*slots=*/2, /*rank=*/4));
  ASSERT_NE(b, nullptr);
  const std::string dir = kPeft + "llama_gqa_f32_b";
  auto big = b->model().ReadAdapter(dir);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(
      StatusMessage(big.status()),
      HasSubstr("rank r is 8 but model 'llama_gqa_f32' takes ranks 1 to 4 (max_lora_rank)"));
  EXPECT_THAT(StatusMessage(big.status()), HasSubstr(dir));

  models::LoraAdapter wrong;
  wrong.config.r = 2;
  wrong.layers["blk.0.attn_q.weight"] = {32, 64, std::vector<float>(64), std::vector<float>(128)};
  Status s = b->AddAdapter("wrong", std::make_shared<const models::LoraAdapter>(wrong));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(StatusMessage(s), HasSubstr("adapter layer blk.0.attn_q.weight maps 32 inputs to "
                                          "64 outputs but that weight of model 'llama_gqa_f32' "
                                          "is ["));
  models::LoraAdapter norm;
  norm.config.r = 2;
  norm.layers["blk.0.attn_norm.weight"] = {64, 64, std::vector<float>(128),
                                           std::vector<float>(128)};
  s = b->AddAdapter("norm", std::make_shared<const models::LoraAdapter>(norm));
  EXPECT_THAT(StatusMessage(s),
              HasSubstr("blk.0.attn_norm.weight is not a layer model 'llama_gqa_f32' "
                        "can adapt"));
  EXPECT_TRUE(b->AdapterNames().empty());

  auto none = Serve(Config(/*slots=*/0, /*rank=*/16));
  ASSERT_NE(none, nullptr);
  s = AddFromFolder(*none, "a", kPeft + "llama_gqa_f32_a");
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(StatusMessage(s), HasSubstr("max_loaded_adapters is 0"));
}

// The repository path every front end takes: an adapter added with AddLoraAdapter (and one
// from the model's configuration) is a model name of its own, resolved by LlmEndpoint::Find.
TEST(MultiLoraTest, RepositoryServesAdaptersByName) {
  config::ModelConfig c = Config(/*slots=*/2, /*rank=*/8);
  config::LoraAdapterConfig configured;
  configured.name = "b";
  configured.path = kPeft + "llama_gqa_f32_b";
  c.adapters.push_back(configured);
  ModelDeps deps;
  deps.llm_loader = [](const config::ModelConfig& m) { return models::LoadLlm(m); };
  ModelRepository repo({c}, deps);
  ASSERT_TRUE(repo.LoadStartupModels().ok());

  Status s = repo.AddLoraAdapter("a", "tiny", kPeft + "llama_gqa_f32_a");
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(repo.AddLoraAdapter("a", "tiny", kPeft + "llama_gqa_f32_a").code(),
            StatusCode::kAlreadyExists);
  EXPECT_EQ(repo.AddLoraAdapter("tiny", "tiny", kPeft + "llama_gqa_f32_a").code(),
            StatusCode::kAlreadyExists)
      << "a model's name";
  s = repo.AddLoraAdapter("c", "tiny", kPeft + "nope");
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
  EXPECT_THAT(StatusMessage(s), HasSubstr("nope"));
  EXPECT_EQ(repo.AddLoraAdapter("c", "ghost", kPeft + "llama_gqa_f32_a").code(),
            StatusCode::kNotFound);
  ASSERT_EQ(repo.LoraAdapters().size(), 2u);
  EXPECT_EQ(repo.LoraAdapters()[0].name, "a");
  EXPECT_EQ(repo.LoraAdapters()[0].base_model, "tiny");
  EXPECT_EQ(repo.LoraAdapters()[1].path, kPeft + "llama_gqa_f32_b");

  for (const std::string name : {"a", "b"}) {
    const Reference ref = ReadReference(kPeft + "llama_gqa_f32_" + name);
    auto llm = LlmEndpoint::Find(repo, name);
    ASSERT_TRUE(llm.ok()) << llm.status();
    EXPECT_EQ(llm->name(), name);
    EXPECT_EQ(llm->adapter(), name);
    GenerationInput in;
    in.prompt.kind = PromptInput::Kind::kTokenIds;
    in.prompt.token_ids.assign(ref.prompts[0].begin(), ref.prompts[0].end());
    in.request.sampling.temperature = 0;
    in.request.sampling.ignore_eos = true;
    in.request.max_tokens = 16;
    auto prepared = llm->Prepare(std::move(in));
    ASSERT_TRUE(prepared.ok()) << prepared.status();
    auto promise = std::make_shared<std::promise<GenerationResult>>();
    auto acc = std::make_shared<GenerationResult>();
    ASSERT_TRUE(llm->Submit(std::move(*prepared), {},
                            [promise, acc](GenerateEvent&& ev) {
                              acc->Add(std::move(ev));
                              if (acc->done()) promise->set_value(std::move(*acc));
                            })
                    .ok());
    EXPECT_EQ(promise->get_future().get().token_ids, ref.greedy[0]) << "adapter " << name;
  }

  // A reload adds the adapters again; a removed one is gone for good.
  ASSERT_TRUE(repo.RemoveLoraAdapter("b").ok());
  EXPECT_EQ(repo.RemoveLoraAdapter("b").code(), StatusCode::kNotFound);
  EXPECT_EQ(LlmEndpoint::Find(repo, "b").status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(repo.Load("tiny").ok());
  auto model = repo.GetReady("tiny");
  ASSERT_TRUE(model.ok());
  EXPECT_THAT((*model)->llm()->AdapterNames(), ::testing::ElementsAre("a"));

  // A runtime adapter whose folder is gone by the next reload is dropped, not fatal.
  const std::filesystem::path copy =
      std::filesystem::temp_directory_path() / ("kiln-lora-" + std::to_string(::getpid()));
  std::filesystem::remove_all(copy);
  std::filesystem::copy(kPeft + "llama_gqa_f32_a", copy);
  ASSERT_TRUE(repo.AddLoraAdapter("gone", "tiny", copy.string()).ok());
  std::filesystem::remove_all(copy);
  ASSERT_TRUE(repo.Load("tiny").ok());
  model = repo.GetReady("tiny");
  ASSERT_TRUE(model.ok());
  EXPECT_THAT((*model)->llm()->AdapterNames(), ::testing::ElementsAre("a"));
}

}  // namespace
}  // namespace kiln
