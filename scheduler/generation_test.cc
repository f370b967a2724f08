// The request path every LLM front end shares, driven directly (the front ends' own tests in
// server/llm/frontends_test.cc drive it through each wire): model lookup, prompt building,
// the checks made once at submission, the admission ticket, cancellation and collection.
#include "scheduler/generation.h"

#include <future>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "scheduler/llm/testing/fake_llm.h"
#include "scheduler/model_repository.h"

namespace kiln {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

class GenerationTest : public ::testing::Test {
 protected:
  GenerationTest() {
    config::ModelConfig llm;
    llm.name = "fake";
    llm.kind = "llm";
    llm.path = "fake";
    llm.scheduler.kv_cache_bytes = 8 * 16 * 256;
    config::ModelConfig simple;
    simple.name = "simple";
    simple.kind = "builtin";
    simple.builtin = "simple";
    ModelDeps deps;
    deps.llm_loader =
        [opts = fake_](const config::ModelConfig&) -> StatusOr<std::unique_ptr<models::LlmModel>> {
      return std::make_unique<llm_testing::FakeLlm>(opts);
    };
    repository_ = std::make_unique<ModelRepository>(std::vector<config::ModelConfig>{llm, simple},
                                                    std::move(deps));
    KILN_CHECK(repository_->LoadStartupModels().ok(), "test models failed to load");
  }
  ~GenerationTest() override { fake_.gate->Open(); }

  LlmEndpoint Llm() { return *LlmEndpoint::Find(*repository_, "fake"); }
  static GenerationInput Text(std::string text, std::optional<int64_t> max_tokens = 4) {
    GenerationInput in;
    in.prompt.text = std::move(text);
    in.request.max_tokens = max_tokens;
    in.request.sampling.temperature = 0;
    return in;
  }
  // Prepares and submits `in`; the result arrives on the future.
  Status Run(GenerationInput in, std::future<GenerationResult>* result) {
    auto prepared = Llm().Prepare(std::move(in));
    if (!prepared.ok()) return prepared.status();
    auto ticket = limiter_.Acquire();
    KILN_CHECK(ticket.ok(), "no ticket");
    auto promise = std::make_shared<std::promise<GenerationResult>>();
    *result = promise->get_future();
    auto acc = std::make_shared<GenerationResult>();
    return Llm().Submit(std::move(*prepared), std::move(*ticket),
                        [promise, acc](GenerateEvent&& ev) {
                          acc->Add(std::move(ev));
                          if (acc->done()) promise->set_value(std::move(*acc));
                        });
  }

  llm_testing::FakeLlmOptions fake_;
  std::unique_ptr<ModelRepository> repository_;
  InflightLimiter limiter_{16};
};

TEST_F(GenerationTest, FindNamesTheModelField) {
  auto unknown = LlmEndpoint::Find(*repository_, "nope");
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(ParamOf(unknown.status()), "model");
  auto tensor = LlmEndpoint::Find(*repository_, "simple", "model_name");
  EXPECT_EQ(tensor.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(StatusMessage(tensor.status()), HasSubstr("does not generate text"));
  EXPECT_EQ(ParamOf(tensor.status()), "model_name");
  EXPECT_THAT(StatusMessage(LlmEndpoint::Find(*repository_, "").status()),
              HasSubstr("`model` is missing"));
  const LlmInfo info = Llm().info();
  EXPECT_EQ(info.architecture, "fake");
  EXPECT_EQ(info.context_length, 256);
  EXPECT_TRUE(info.has_chat_template);
}

TEST_F(GenerationTest, GeneratesWhatTheModelPredictsAndReleasesTheTicket) {
  GenerationInput in = Text("Hello world");
  in.id_prefix = "cmpl-";
  auto prepared = Llm().Prepare(std::move(in));
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  EXPECT_THAT(prepared->id(), StartsWith("cmpl-"));
  EXPECT_EQ(prepared->prompt_text(), "Hello world");
  const std::vector<int32_t> prompt = prepared->request().prompt;

  std::future<GenerationResult> f;
  ASSERT_TRUE(Run(Text("Hello world"), &f).ok());
  GenerationResult r = f.get();
  EXPECT_EQ(r.finish, FinishReason::kLength);
  EXPECT_EQ(r.token_ids, llm_testing::FakeLlm::Continue(prompt, 4));
  EXPECT_TRUE(FinalStatus(r.finish, r.status).ok());
  EXPECT_TRUE(limiter_.WaitIdle(absl::Now() + absl::Seconds(10)))
      << "the ticket is released after the final event";
}

TEST_F(GenerationTest, CheckErrorsNameTheClientsFieldsAndQueueNothing) {
  std::future<GenerationResult> f;
  GenerationInput zero = Text("hi", 0);
  zero.request.fields.max_tokens = "sampling.max_tokens";
  Status s = Run(std::move(zero), &f);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(StatusMessage(s), HasSubstr("`sampling.max_tokens` is 0"));
  EXPECT_EQ(ParamOf(s), "sampling.max_tokens");
  EXPECT_EQ(limiter_.inflight(), 0) << "a refused request gives its ticket back";

  GenerationInput chat;
  chat.prompt.kind = PromptInput::Kind::kChat;
  chat.prompt.field = "chat.messages";
  chat.prompt.messages = nlohmann::ordered_json::parse(R"([{"role": "ghost", "content": "boo"}])");
  s = Run(std::move(chat), &f);
  EXPECT_THAT(StatusMessage(s), HasSubstr("`chat.messages[0].role` is `ghost`"));

  std::string long_text;
  for (int i = 0; i < 300; ++i) long_text += " word";
  s = Run(Text(long_text, std::nullopt), &f);
  EXPECT_THAT(StatusMessage(s), HasSubstr("has a context of 256 tokens"));
  EXPECT_EQ(ParamOf(s), "prompt") << "the prompt's field, as Prepare recorded it";

  GenerationInput adapter = Text("hi");
  adapter.request.adapter = "sql-lora";
  s = Run(std::move(adapter), &f);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_THAT(StatusMessage(s), HasSubstr("no adapter 'sql-lora'"));
  EXPECT_EQ(limiter_.inflight(), 0);
}

TEST_F(GenerationTest, CancellingMidStepEndsTheRequestAfterThatStep) {
  fake_.gate->Close();
  auto prepared = Llm().Prepare(Text("Hello", 100));
  ASSERT_TRUE(prepared.ok());
  auto cancel = prepared->Canceller();
  auto promise = std::make_shared<std::promise<GenerationResult>>();
  auto result = promise->get_future();
  auto acc = std::make_shared<GenerationResult>();
  ASSERT_TRUE(Llm()
                  .Submit(std::move(*prepared), {},
                          [promise, acc](GenerateEvent&& ev) {
                            acc->Add(std::move(ev));
                            if (acc->done()) promise->set_value(std::move(*acc));
                          })
                  .ok());
  fake_.gate->AwaitArrivals(1);  // its first step waits at the gate
  cancel();
  cancel();  // idempotent
  fake_.gate->Open();
  GenerationResult r = result.get();
  EXPECT_EQ(r.finish, FinishReason::kCancelled);
  EXPECT_EQ(r.token_ids.size(), 1u) << "the step in flight finishes; no other runs";
  EXPECT_EQ(FinalStatus(r.finish, r.status).code(), StatusCode::kCancelled);
}

TEST_F(GenerationTest, TokenTextsAndDetokenize) {
  LlmEndpoint llm = Llm();
  PromptInput in;
  in.text = "Hello <|im_end|>";
  auto prompt = llm.BuildPrompt(in);
  ASSERT_TRUE(prompt.ok());
  const TokenTexts tokens = llm.tokens();
  EXPECT_TRUE(tokens.IsControl(prompt->ids.front())) << "BOS";
  EXPECT_EQ(tokens.Piece(prompt->ids.front()), "<|begin_of_text|>");
  auto text = llm.Detokenize(prompt->ids, /*skip_special_tokens=*/true, "token_ids");
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "Hello <|im_end|>") << "typed control-token text stayed text";
  std::vector<int32_t> bad = {5, -4};
  auto refused = llm.Detokenize(bad, true, "token_ids");
  EXPECT_THAT(StatusMessage(refused.status()),
              HasSubstr("`token_ids[1]` is -4, which is not a token of model 'fake'"));
}

}  // namespace
}  // namespace kiln
