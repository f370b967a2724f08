// The LLM front ends end to end, in-process: the real gRPC and HTTP servers over a repository
// serving the fake LLM (test_llm.h), driven by real clients (gRPC stubs, an HTTP client).
// Every generation is checked against FakeLlm::Continue, the model's own greedy output.
#include <grpcpp/grpcpp.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <cmath>
#include <cstring>
#include <future>
#include <regex>
#include <set>
#include <thread>

#include "engine/testing/source_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/grammar/grammar.h"
#include "proto/kiln/v1/generation.grpc.pb.h"
#include "proto/kserve/grpc_service.grpc.pb.h"
#include "scheduler/generation.h"
#include "server/llm/test_llm.h"

namespace kiln::llm {
namespace {

using nlohmann::json;
using testing::FakeLlm;
using ::testing::HasSubstr;
using testing::HttpCall;
using testing::SseData;
using ::testing::StartsWith;
using testing::TestServer;
using namespace std::chrono_literals;

config::ModelConfig Simple() {
  config::ModelConfig m;
  m.name = "simple";
  m.kind = "builtin";
  m.builtin = "simple";
  m.max_batch_size = 8;
  m.dynamic_batching.emplace();
  return m;
}

// Waits (without polling) until the batcher's snapshot satisfies `pred`. The gauges are set
// before the snapshot, and a request's admission ticket is released before either.
bool Await(ContinuousBatcher& b,
           const std::function<bool(const ContinuousBatcher::Snapshot&)>& pred) {
  return b.AwaitSnapshot(pred, absl::Seconds(10));
}

bool Idle(const ContinuousBatcher::Snapshot& s) {
  return s.running == 0 && s.waiting == 0 && s.kv_blocks_used == 0;
}

class FrontEndsTest : public ::testing::Test {
 protected:
  explicit FrontEndsTest(testing::FakeLlmOptions fake = {})
      : server_({testing::FakeModelConfig("fake"), Simple()}, std::move(fake)) {
    tok_ = testing::LoadFixtureTokenizer();
  }

  std::vector<int32_t> Encode(const std::string& text) {
    return *tok_->Encode(text, {.add_special_tokens = true, .parse_special = false});
  }
  // What the model generates greedily after `prompt`, as ids and as text.
  std::vector<int32_t> ExpectedIds(const std::vector<int32_t>& prompt, int n) {
    return FakeLlm::Continue(prompt, n, server_.fake().eos_at->load());
  }
  std::string Text(const std::vector<int32_t>& ids) {
    return tok_->Decode(ids, {.skip_special_tokens = true, .strip_leading_space = false});
  }
  std::vector<int32_t> ChatPrompt(const std::string& user) {
    PromptInput r;
    r.kind = PromptInput::Kind::kChat;
    r.messages =
        nlohmann::ordered_json::parse(json::array({{{"role", "user"}, {"content", user}}}).dump());
    return LlmEndpoint::Find(server_.repository(), "fake")->BuildPrompt(r)->ids;
  }

  std::pair<int, json> Post(const std::string& path, const json& body) {
    auto reply = HttpCall(server_.http_port(), "POST", path, body.dump());
    return {reply.status, json::parse(reply.body, nullptr, false)};
  }

  TestServer server_;
  std::unique_ptr<models::Tokenizer> tok_;
};

// ---- OpenAI-compatible HTTP ----------------------------------------------------------------

size_t CodePoints(const std::string& s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

TEST_F(FrontEndsTest, ModelsListsTheLlmsOnly) {
  auto reply = HttpCall(server_.http_port(), "GET", "/v1/models");
  ASSERT_EQ(reply.status, 200) << reply.body;
  json j = json::parse(reply.body);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u) << "tensor models do not generate text";
  EXPECT_EQ(j["data"][0]["id"], "fake");
  EXPECT_EQ(j["data"][0]["object"], "model");
  EXPECT_EQ(j["data"][0]["max_model_len"], 256);
  EXPECT_EQ(HttpCall(server_.http_port(), "GET", "/v1/models/fake").status, 200);
  auto missing = HttpCall(server_.http_port(), "GET", "/v1/models/nope");
  EXPECT_EQ(missing.status, 404);
  EXPECT_EQ(json::parse(missing.body)["error"]["code"], "model_not_found");
  EXPECT_EQ(HttpCall(server_.http_port(), "GET", "/v1/models/simple").status, 404);
}

// A LoRA adapter is a model name of its own in every front end (the fake shifts its tokens by
// the adapter's rank, 4 for this PEFT fixture), listed with its base as `parent`.
TEST_F(FrontEndsTest, LoraAdaptersAreServedAndListedUnderTheirOwnName) {
  const std::string dir = std::string(TestSourceDir()) + "/tests/fixtures/peft/llama_gqa_f32_a";
  Status s = server_.repository().AddLoraAdapter("sql-lora", "fake", dir);
  ASSERT_TRUE(s.ok()) << s;
  s = server_.repository().AddLoraAdapter("other", "fake", "/nonexistent");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_THAT(StatusMessage(s), HasSubstr("/nonexistent/adapter_config.json"));
  EXPECT_EQ(server_.repository().AddLoraAdapter("x", "simple", dir).code(),
            StatusCode::kInvalidArgument)
      << "a tensor model";

  auto reply = HttpCall(server_.http_port(), "GET", "/v1/models");
  ASSERT_EQ(reply.status, 200) << reply.body;
  json j = json::parse(reply.body);
  ASSERT_EQ(j["data"].size(), 2u);
  EXPECT_EQ(j["data"][1]["id"], "sql-lora");
  EXPECT_EQ(j["data"][1]["parent"], "fake");
  EXPECT_EQ(j["data"][1]["root"], dir);
  EXPECT_FALSE(j["data"][0].contains("parent"));
  EXPECT_EQ(HttpCall(server_.http_port(), "GET", "/v1/models/sql-lora").status, 200);

  auto [status, c] = Post(
      "/v1/completions",
      {{"model", "sql-lora"}, {"prompt", "Hello world"}, {"max_tokens", 8}, {"temperature", 0}});
  ASSERT_EQ(status, 200) << c;
  EXPECT_EQ(c["model"], "sql-lora");
  const auto prompt = Encode("Hello world");
  EXPECT_EQ(c["choices"][0]["text"],
            Text(FakeLlm::Continue(prompt, 8, server_.fake().eos_at->load(), 4)));
  EXPECT_NE(c["choices"][0]["text"], Text(ExpectedIds(prompt, 8))) << "not the base model's";

  ASSERT_TRUE(server_.repository().RemoveLoraAdapter("sql-lora").ok());
  EXPECT_EQ(HttpCall(server_.http_port(), "GET", "/v1/models/sql-lora").status, 404);
}

TEST_F(FrontEndsTest, CompletionMatchesTheModel) {
  auto [status, j] =
      Post("/v1/completions",
           {{"model", "fake"}, {"prompt", "Hello world"}, {"max_tokens", 8}, {"temperature", 0}});
  ASSERT_EQ(status, 200) << j;
  const auto prompt = Encode("Hello world");
  EXPECT_THAT(j["id"].get<std::string>(), StartsWith("cmpl-"));
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "fake");
  EXPECT_EQ(j["choices"][0]["text"], Text(ExpectedIds(prompt, 8)));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["choices"][0]["index"], 0);
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt.size());
  EXPECT_EQ(j["usage"]["completion_tokens"], 8);
  EXPECT_EQ(j["usage"]["total_tokens"], prompt.size() + 8);
}

// Kiln's `speculative` field: drafted tokens never change the output (the batcher's tests
// check the acceptance side on a model that repeats itself).
TEST_F(FrontEndsTest, SpeculativeDecodingKeepsTheOutput) {
  const std::string prompt = "one two three one two three one two";
  for (const json& spec :
       {json{{"method", "ngram"}, {"num_tokens", 3}},
        json{{"method", "ngram"}, {"prompt_lookup_max", 2}}, json{{"method", "none"}}}) {
    SCOPED_TRACE(spec.dump());
    auto [status, j] = Post("/v1/completions", {{"model", "fake"},
                                                {"prompt", prompt},
                                                {"max_tokens", 12},
                                                {"temperature", 0},
                                                {"speculative", spec}});
    ASSERT_EQ(status, 200) << j;
    EXPECT_EQ(j["choices"][0]["text"], Text(ExpectedIds(Encode(prompt), 12)));
  }
}

TEST_F(FrontEndsTest, CompletionDefaultsToSixteenTokensAndTakesTokenIds) {
  const std::vector<int32_t> prompt = {5, 400, 401, 402};
  auto [status, j] =
      Post("/v1/completions", {{"model", "fake"}, {"prompt", prompt}, {"temperature", 0}});
  ASSERT_EQ(status, 200) << j;
  EXPECT_EQ(j["usage"]["completion_tokens"], 16) << "OpenAI's default for completions";
  EXPECT_EQ(j["usage"]["prompt_tokens"], 4) << "token ids go in as they are";
  EXPECT_EQ(j["choices"][0]["text"], Text(ExpectedIds(prompt, 16)));
}

TEST_F(FrontEndsTest, ChatCompletionMatchesTheModelAndStopsAtEos) {
  const auto prompt = ChatPrompt("Hi there");
  server_.fake().eos_at->store(static_cast<int>(prompt.size()) + 5);
  auto [status, j] = Post("/v1/chat/completions",
                          {{"model", "fake"},
                           {"messages", json::array({{{"role", "user"}, {"content", "Hi there"}}})},
                           {"temperature", 0}});
  ASSERT_EQ(status, 200) << j;
  EXPECT_THAT(j["id"].get<std::string>(), StartsWith("chatcmpl-"));
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], Text(ExpectedIds(prompt, 100)));
  ASSERT_TRUE(j["choices"][0]["message"].contains("refusal")) << "issue 14: OpenAI's shape";
  EXPECT_TRUE(j["choices"][0]["message"]["refusal"].is_null());
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt.size());
  EXPECT_EQ(j["usage"]["completion_tokens"], 6) << "five tokens and EOS";
}

TEST_F(FrontEndsTest, StreamedChatDeliversTheSameTextAsNonStreamed) {
  json body = {{"model", "fake"},
               {"messages", json::array({{{"role", "user"}, {"content", "Tell me"}}})},
               {"max_tokens", 12},
               {"seed", 7},
               {"temperature", 0.8}};
  auto [status, full] = Post("/v1/chat/completions", body);
  ASSERT_EQ(status, 200) << full;
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  auto reply = HttpCall(server_.http_port(), "POST", "/v1/chat/completions", body.dump());
  ASSERT_EQ(reply.status, 200) << reply.body;
  EXPECT_EQ(reply.content_type, "text/event-stream");
  auto events = SseData(reply.body);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back(), "[DONE]");
  json first = json::parse(events[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(first["choices"][0]["delta"].contains("refusal"));
  std::string text;
  std::string finish;
  for (size_t i = 0; i + 2 < events.size(); ++i) {
    json c = json::parse(events[i]);
    EXPECT_EQ(c["id"], first["id"]) << "one id for the whole stream";
    EXPECT_TRUE(c.contains("usage") && c["usage"].is_null());
    ASSERT_EQ(c["choices"].size(), 1u);
    if (c["choices"][0]["delta"].contains("content")) {
      text += c["choices"][0]["delta"]["content"].get<std::string>();
    }
    if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(text, full["choices"][0]["message"]["content"]) << "same seed, same text";
  EXPECT_EQ(finish, "length");
  json usage = json::parse(events[events.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  for (const char* k : {"prompt_tokens", "completion_tokens", "total_tokens"}) {
    EXPECT_EQ(usage["usage"][k], full["usage"][k]) << k;
  }
  EXPECT_GT(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
      << "the second request reuses the first one's prompt blocks";
}

TEST_F(FrontEndsTest, StreamedCompletionWithLogprobs) {
  auto reply = HttpCall(server_.http_port(), "POST", "/v1/completions",
                        json{{"model", "fake"},
                             {"prompt", "Once upon"},
                             {"max_tokens", 6},
                             {"temperature", 0},
                             {"logprobs", 2},
                             {"stream", true}}
                            .dump());
  ASSERT_EQ(reply.status, 200) << reply.body;
  auto events = SseData(reply.body);
  ASSERT_EQ(events.back(), "[DONE]");
  std::string text, token_text;
  int tokens = 0;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    json c = json::parse(events[i]);
    EXPECT_EQ(c["object"], "text_completion");
    text += c["choices"][0]["text"].get<std::string>();
    const json& lp = c["choices"][0]["logprobs"];
    if (lp.is_null()) continue;
    for (size_t k = 0; k < lp["tokens"].size(); ++k) {
      token_text += lp["tokens"][k].get<std::string>();
      EXPECT_LT(lp["token_logprobs"][k].get<double>(), 0.0);
      EXPECT_EQ(lp["top_logprobs"][k].size(), 2u);
      EXPECT_EQ(lp["text_offset"][k],
                CodePoints(token_text) - CodePoints(lp["tokens"][k].get<std::string>()));
      ++tokens;
    }
  }
  EXPECT_EQ(text, Text(ExpectedIds(Encode("Once upon"), 6)));
  EXPECT_EQ(tokens, 6);
  EXPECT_EQ(token_text, text);
}

TEST_F(FrontEndsTest, ChatLogprobsInOpenAisShape) {
  auto [status, j] = Post("/v1/chat/completions",
                          {{"model", "fake"},
                           {"messages", json::array({{{"role", "user"}, {"content", "x"}}})},
                           {"max_completion_tokens", 4},
                           {"temperature", 0},
                           {"logprobs", true},
                           {"top_logprobs", 3}});
  ASSERT_EQ(status, 200) << j;
  const json& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 4u);
  std::string joined;
  for (const json& t : content) {
    joined += t["token"].get<std::string>();
    EXPECT_EQ(t["top_logprobs"].size(), 3u);
    EXPECT_EQ(t["top_logprobs"][0]["token"], t["token"]) << "greedy: the top token was taken";
    EXPECT_EQ(t["bytes"].size(), t["token"].get<std::string>().size());
  }
  EXPECT_EQ(joined, j["choices"][0]["message"]["content"]);
  EXPECT_EQ(j["usage"]["completion_tokens"], 4) << "max_completion_tokens wins";
}

TEST_F(FrontEndsTest, StopStringEndsTheText) {
  const auto prompt = Encode("Stop here");
  const std::string full = Text(ExpectedIds(prompt, 20));
  ASSERT_GT(full.size(), 20u);
  const std::string stop = full.substr(10, 3);
  const std::string want = full.substr(0, full.find(stop));
  auto [status, j] = Post("/v1/completions", {{"model", "fake"},
                                              {"prompt", "Stop here"},
                                              {"max_tokens", 20},
                                              {"temperature", 0},
                                              {"stop", json::array({stop, "never-there"})}});
  ASSERT_EQ(status, 200) << j;
  EXPECT_EQ(j["choices"][0]["text"], want);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
}

TEST_F(FrontEndsTest, EchoPutsThePromptFirst) {
  auto [status, j] = Post("/v1/completions", {{"model", "fake"},
                                              {"prompt", "Echo me"},
                                              {"max_tokens", 3},
                                              {"temperature", 0},
                                              {"echo", true}});
  ASSERT_EQ(status, 200) << j;
  EXPECT_EQ(j["choices"][0]["text"], "Echo me" + Text(ExpectedIds(Encode("Echo me"), 3)));
}

// logit_bias: +100 on one token makes greedy decoding repeat it; -100 on the token greedy
// decoding would pick first removes it.
TEST_F(FrontEndsTest, LogitBiasSteersTheTokens) {
  const std::vector<int32_t> prompt = Encode("Bias me");
  const std::vector<int32_t> plain = ExpectedIds(prompt, 4);
  const int32_t forced = plain[0] == 321 ? 322 : 321;
  auto [status, j] = Post("/v1/completions", {{"model", "fake"},
                                              {"prompt", "Bias me"},
                                              {"max_tokens", 4},
                                              {"temperature", 0},
                                              {"logit_bias", {{std::to_string(forced), 100}}}});
  ASSERT_EQ(status, 200) << j;
  EXPECT_EQ(j["choices"][0]["text"], Text({forced, forced, forced, forced}));
  json body = {{"model", "fake"},
               {"prompt", "Bias me"},
               {"max_tokens", 1},
               {"temperature", 0},
               {"logprobs", 2}};
  auto [s1, unbiased] = Post("/v1/completions", body);
  ASSERT_EQ(s1, 200) << unbiased;
  body["logit_bias"] = {{std::to_string(plain[0]), -100}};
  auto [s2, j2] = Post("/v1/completions", body);
  ASSERT_EQ(s2, 200) << j2;
  EXPECT_EQ(unbiased["choices"][0]["text"], Text({plain[0]}));
  EXPECT_NE(j2["choices"][0]["text"], unbiased["choices"][0]["text"]);
  // Logprobs stay those of the model's own distribution (taken before the bias).
  EXPECT_EQ(j2["choices"][0]["logprobs"]["top_logprobs"],
            unbiased["choices"][0]["logprobs"]["top_logprobs"]);
}

// Structured output on every front end: the text is in the constraint's language whatever the
// model would have said, streamed or not, and a complete output ends with finish_reason stop.
// (json_object is open-ended: the fake's flat distribution over the allowed tokens would not
// close it; tests/system/test_structured_output.py runs it on SmolLM2.)
TEST_F(FrontEndsTest, StructuredOutputOnEveryFrontEnd) {
  const std::string gbnf =
      R"(root ::= "{\"ok\": " ("true" | "false") ", \"n\": " [1-9] [0-9]{0,2} "}")";
  auto g = grammar::Grammar::ParseGbnf(gbnf);
  ASSERT_TRUE(g.ok()) << g.status();
  const json schema = {{"type", "object"},
                       {"properties",
                        {{"ok", {{"type", "boolean"}}},
                         {"n", {{"type", "integer"}, {"minimum", 1}, {"maximum", 999}}}}},
                       {"required", {"ok", "n"}},
                       {"additionalProperties", false}};
  const json formats[] = {
      {{"grammar", gbnf}},
      {{"response_format",
        {{"type", "json_schema"},
         {"json_schema", {{"name", "r"}, {"schema", schema}, {"strict", true}}}}}},
      {{"regex", "[a-z]{3}-[0-9]{2}"}},
  };
  for (const json& format : formats) {
    SCOPED_TRACE(format.dump());
    for (const char* path : {"/v1/chat/completions", "/v1/completions"}) {
      json body = {{"model", "fake"}, {"max_tokens", 60}, {"temperature", 0.9}, {"seed", 3}};
      if (std::string(path) == "/v1/completions") {
        body["prompt"] = "Answer:";
      } else {
        body["messages"] = json::array({{{"role", "user"}, {"content", "Answer"}}});
      }
      body.update(format);
      auto [status, j] = Post(path, body);
      ASSERT_EQ(status, 200) << j;
      const json& choice = j["choices"][0];
      const std::string text =
          choice.contains("message") ? choice["message"]["content"] : choice["text"];
      EXPECT_EQ(choice["finish_reason"], "stop") << text;
      if (format.contains("grammar")) {
        EXPECT_TRUE(g->Matches(text)) << text;
      }
      if (format.contains("regex")) {
        EXPECT_TRUE(std::regex_match(text, std::regex("[a-z]{3}-[0-9]{2}"))) << text;
      }
      if (format.contains("response_format")) {
        const json out = json::parse(text, nullptr, false);
        ASSERT_TRUE(out.is_object()) << text;
        if (format["response_format"]["type"] == "json_schema") {
          EXPECT_TRUE(out["ok"].is_boolean()) << text;
          ASSERT_TRUE(out["n"].is_number_integer()) << text;
          EXPECT_GE(out["n"].get<int>(), 1);
          EXPECT_LE(out["n"].get<int>(), 999);
          EXPECT_EQ(out.size(), 2u) << text;
        }
      }
      // Streamed: the same text in chunks.
      body["stream"] = true;
      auto reply = HttpCall(server_.http_port(), "POST", path, body.dump());
      ASSERT_EQ(reply.status, 200) << reply.body;
      std::string streamed;
      for (const auto& e : SseData(reply.body)) {
        if (e == "[DONE]") continue;
        const json c = json::parse(e);
        if (c["choices"].empty()) continue;
        const json& ch = c["choices"][0];
        if (ch.contains("delta") && ch["delta"].contains("content")) {
          streamed += ch["delta"]["content"].get<std::string>();
        } else if (ch.contains("text")) {
          streamed += ch["text"].get<std::string>();
        }
      }
      EXPECT_EQ(streamed, text);
    }
  }
  // KServe generate: the same keys among the parameters.
  auto [kstatus, k] =
      Post("/v2/models/fake/generate",
           {{"text_input", "Answer:"}, {"parameters", {{"max_tokens", 60}, {"grammar", gbnf}}}});
  ASSERT_EQ(kstatus, 200) << k;
  const std::string out = k["text_output"];
  EXPECT_TRUE(g->Matches(out.substr(out.find('{')))) << out;
}

// A JSON Schema's properties come out in the order the client wrote them (as OpenAI's do),
// although the request's JSON is read into sorted objects.
TEST_F(FrontEndsTest, JsonSchemaKeepsTheClientsPropertyOrder) {
  const std::string body = R"({"model": "fake", "max_tokens": 40, "temperature": 0,
    "messages": [{"role": "user", "content": "x"}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "o", "strict": true,
      "schema": {"type": "object", "properties": {"zeta": {"type": "boolean"},
                 "alpha": {"type": "boolean"}}, "required": ["zeta", "alpha"]}}}})";
  auto reply = HttpCall(server_.http_port(), "POST", "/v1/chat/completions", body);
  ASSERT_EQ(reply.status, 200) << reply.body;
  const std::string text = json::parse(reply.body)["choices"][0]["message"]["content"];
  ASSERT_NE(text.find("alpha"), std::string::npos) << text;
  EXPECT_LT(text.find("zeta"), text.find("alpha")) << text;
}

// Tool calling on the fake (SmolLM2's template, which knows nothing of tools: Kiln writes them
// into the system prompt and reads Hermes' <tool_call> back), with a context that holds them.
class ToolFrontEndsTest : public FrontEndsTest {
 protected:
  static testing::FakeLlmOptions LongContext() {
    testing::FakeLlmOptions o;
    o.context_length = 2048;
    return o;
  }
  ToolFrontEndsTest() : FrontEndsTest(LongContext()) {}
};

// A named or required tool_choice forces a call whose arguments match the function's schema,
// streamed or not; past calls and tool results in the history are accepted.
TEST_F(ToolFrontEndsTest, ToolCallsAreForcedParsedAndStreamed) {
  const json tools = json::parse(R"([
    {"type": "function", "function": {"name": "add", "description": "Adds two numbers",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
       "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": false}}},
    {"type": "function", "function": {"name": "echo", "parameters": {"type": "object",
     "properties": {"text": {"enum": ["hi", "bye"]}}, "required": ["text"]}}}])");
  const json history = json::parse(R"([
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
      "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    {"role": "user", "content": "And 4 + 4?"}])");
  auto check_call = [](const json& call, const std::string& name) {
    EXPECT_EQ(call["type"], "function");
    EXPECT_EQ(call["id"].get<std::string>().rfind("call_", 0), 0u);
    EXPECT_EQ(call["function"]["name"], name);
    const json args = json::parse(call["function"]["arguments"].get<std::string>());
    if (name == "add") {
      ASSERT_TRUE(args["a"].is_number_integer()) << args;
      EXPECT_LE(args["a"].get<int>(), 99);
      EXPECT_TRUE(args["b"].is_number_integer()) << args;
    } else {
      EXPECT_TRUE(args["text"] == "hi" || args["text"] == "bye") << args;
    }
  };
  for (const json& choice :
       {json{{"type", "function"}, {"function", {{"name", "add"}}}}, json("required")}) {
    SCOPED_TRACE(choice.dump());
    json body = {{"model", "fake"},  {"messages", history},
                 {"tools", tools},   {"tool_choice", choice},
                 {"max_tokens", 80}, {"temperature", 0.8},
                 {"seed", 5},        {"parallel_tool_calls", false}};
    auto [status, j] = Post("/v1/chat/completions", body);
    ASSERT_EQ(status, 200) << j;
    const json& c = j["choices"][0];
    EXPECT_EQ(c["finish_reason"], "tool_calls") << j;
    EXPECT_TRUE(c["message"]["content"].is_null()) << j;
    ASSERT_EQ(c["message"]["tool_calls"].size(), 1u) << j;
    const json& call = c["message"]["tool_calls"][0];
    check_call(call, choice.is_string() ? call["function"]["name"].get<std::string>() : "add");

    // Streamed: one tool_calls delta with index, id, name and the whole arguments.
    body["stream"] = true;
    auto reply = HttpCall(server_.http_port(), "POST", "/v1/chat/completions", body.dump());
    ASSERT_EQ(reply.status, 200) << reply.body;
    json streamed_call;
    std::string finish, content;
    for (const auto& e : SseData(reply.body)) {
      if (e == "[DONE]") continue;
      const json chunk = json::parse(e);
      const json& ch = chunk["choices"][0];
      if (ch["delta"].contains("tool_calls")) streamed_call = ch["delta"]["tool_calls"][0];
      if (ch["delta"].contains("content")) content += ch["delta"]["content"].get<std::string>();
      if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
    }
    EXPECT_EQ(finish, "tool_calls");
    EXPECT_EQ(content, "");
    EXPECT_EQ(streamed_call["index"], 0);
    EXPECT_EQ(streamed_call["function"]["arguments"], call["function"]["arguments"]);
  }
  // auto: the fake never writes a call, so the reply is plain content.
  auto [status, j] = Post("/v1/chat/completions", {{"model", "fake"},
                                                   {"messages", history},
                                                   {"tools", tools},
                                                   {"max_tokens", 8},
                                                   {"temperature", 0}});
  ASSERT_EQ(status, 200) << j;
  EXPECT_FALSE(j["choices"][0]["message"].contains("tool_calls"));
  EXPECT_TRUE(j["choices"][0]["message"]["content"].is_string());
}

TEST_F(FrontEndsTest, ToolErrorsNameTheField) {
  const json user = json::array({{{"role", "user"}, {"content", "hi"}}});
  const json tool = {{"type", "function"},
                     {"function", {{"name", "f"}, {"parameters", {{"type", "object"}}}}}};
  struct Case {
    const char* name;
    json extra;
    const char* param;
    const char* message;
  } cases[] = {
      {"unknown function",
       {{"tools", {tool}}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "g"}}}}}},
       "tool_choice",
       "names the function 'g', which is not in `tools`"},
      {"bad choice", {{"tools", {tool}}, {"tool_choice", "always"}}, "tool_choice", "must be"},
      {"choice without tools", {{"tool_choice", "required"}}, "tool_choice", "needs `tools`"},
      {"malformed schema",
       {{"tools",
         {{{"type", "function"},
           {"function", {{"name", "f"}, {"parameters", {{"type", "objekt"}}}}}}}}},
       "tools",
       "`tools[0].function.parameters`: "},
      {"bad name",
       {{"tools", {{{"type", "function"}, {"function", {{"name", "a b"}}}}}}},
       "tools",
       "`tools[0].function.name` must be"},
      {"forced call and a format",
       {{"tools", {tool}},
        {"tool_choice", "required"},
        {"response_format", {{"type", "json_object"}}}},
       "tool_choice",
       "both constrain"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    json body = {{"model", "fake"}, {"messages", user}, {"max_tokens", 4}};
    body.update(c.extra);
    auto [status, j] = Post("/v1/chat/completions", body);
    EXPECT_EQ(status, 400) << j;
    EXPECT_EQ(j["error"]["param"], c.param) << j;
    EXPECT_THAT(j["error"]["message"].get<std::string>(), HasSubstr(c.message));
  }
  auto [status, j] =
      Post("/v1/completions", {{"model", "fake"}, {"prompt", "a"}, {"tools", {tool}}});
  EXPECT_EQ(status, 400) << j;
  EXPECT_EQ(j["error"]["param"], "tools");
}

// n > 1: each choice is sampled on its own, reproducibly (choice i is what one request with
// seed + i gives), and the choices after the first prefill only what the prefix cache does
// not hold of the prompt.
TEST_F(FrontEndsTest, SeveralChoicesAreReproducibleAndShareThePromptBlocks) {
  std::string words;
  for (int i = 0; i < 40; ++i) words += " word";  // several 16-token blocks
  const json messages = json::array({{{"role", "user"}, {"content", "Several" + words}}});
  json body = {{"model", "fake"},    {"messages", messages}, {"max_tokens", 10},
               {"temperature", 5.0}, {"seed", 11},           {"n", 3}};
  const double hits0 = server_.Metric(R"(kiln_llm_prefix_cache_hit_tokens_total{model="fake"})");
  auto [status, j] = Post("/v1/chat/completions", body);
  ASSERT_EQ(status, 200) << j;
  const double hits = server_.Metric(R"(kiln_llm_prefix_cache_hit_tokens_total{model="fake"})");
  ASSERT_EQ(j["choices"].size(), 3u) << j;
  const int prompt_len = static_cast<int>(ChatPrompt("Several" + words).size());
  EXPECT_EQ(hits - hits0, 2.0 * (prompt_len / 16 * 16))
      << "choices 1 and 2 take every full block of the prompt from the cache";
  std::set<std::string> texts;
  int completion = 0;
  for (int i = 0; i < 3; ++i) {
    const json& c = j["choices"][i];
    EXPECT_EQ(c["index"], i);
    EXPECT_EQ(c["finish_reason"], "length");
    texts.insert(c["message"]["content"].get<std::string>());
    json one = body;
    one["n"] = 1;
    one["seed"] = 11 + i;
    auto [s1, j1] = Post("/v1/chat/completions", one);
    ASSERT_EQ(s1, 200) << j1;
    EXPECT_EQ(c["message"]["content"], j1["choices"][0]["message"]["content"])
        << "choice " << i << " is the request with seed 11 + " << i;
    completion += j1["usage"]["completion_tokens"].get<int>();
  }
  EXPECT_EQ(texts.size(), 3u) << "sampled independently";
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt_len) << "the prompt counts once";
  EXPECT_EQ(j["usage"]["completion_tokens"], completion);
  // Completions' best_of equal to n is the same request.
  json legacy = {{"model", "fake"}, {"prompt", "Several" + words},
                 {"max_tokens", 4}, {"temperature", 5.0},
                 {"seed", 11},      {"n", 2},
                 {"best_of", 2}};
  auto [sb, jb] = Post("/v1/completions", legacy);
  ASSERT_EQ(sb, 200) << jb;
  legacy.erase("best_of");
  auto [sn, jn] = Post("/v1/completions", legacy);
  ASSERT_EQ(sn, 200) << jn;
  EXPECT_EQ(jb["choices"], jn["choices"]);

  // Streamed: each choice's chunks carry its index; one usage chunk and [DONE] at the end.
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  auto reply = HttpCall(server_.http_port(), "POST", "/v1/chat/completions", body.dump());
  ASSERT_EQ(reply.status, 200) << reply.body;
  auto events = SseData(reply.body);
  ASSERT_GE(events.size(), 8u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::vector<std::string> streamed(3);
  std::vector<int> roles(3, 0), finishes(3, 0);
  for (size_t e = 0; e + 2 < events.size(); ++e) {
    const json c = json::parse(events[e]);
    ASSERT_EQ(c["choices"].size(), 1u);
    const json& ch = c["choices"][0];
    const int i = ch["index"].get<int>();
    ASSERT_GE(i, 0);
    ASSERT_LT(i, 3);
    if (ch["delta"].contains("role")) ++roles[i];
    if (ch["delta"].contains("content")) streamed[i] += ch["delta"]["content"].get<std::string>();
    if (!ch["finish_reason"].is_null()) ++finishes[i];
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(roles[i], 1) << i;
    EXPECT_EQ(finishes[i], 1) << i;
    EXPECT_EQ(streamed[i], j["choices"][i]["message"]["content"]) << "choice " << i;
  }
  const json usage = json::parse(events[events.size() - 2]);
  EXPECT_EQ(usage["usage"]["completion_tokens"], completion);
  EXPECT_TRUE(Await(server_.batcher("fake"), Idle));
  EXPECT_EQ(server_.core().limiter->inflight(), 0) << "every choice's ticket was released";
}

struct BadCase {
  std::string name, path;
  json body;
  int status;
  std::string param;    // expected error.param ("" = null)
  std::string message;  // substring of error.message
};

TEST_F(FrontEndsTest, BadInputIsRefusedInOpenAisShapeNamingTheField) {
  const json user = json::array({{{"role", "user"}, {"content", "hi"}}});
  std::string long_prompt;
  for (int i = 0; i < 300; ++i) long_prompt += " word";
  const std::vector<BadCase> cases = {
      {"best_of above n",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"n", 2}, {"best_of", 3}},
       400,
       "best_of",
       "`best_of` is 3 and `n` is 2; Kiln does not rank extra candidates"},
      {"n 0",
       "/v1/chat/completions",
       {{"model", "fake"}, {"messages", user}, {"n", 0}},
       400,
       "n",
       "`n` is 0; it must be in [1, 128]"},
      {"n 129",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"n", 129}},
       400,
       "n",
       "`n` is 129; it must be in [1, 128]"},
      {"n string",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"n", "2"}},
       400,
       "n",
       "`n` must be an integer"},
      {"max_tokens 0",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"max_tokens", 0}},
       400,
       "max_tokens",
       "`max_tokens` is 0; it must be at least 1"},
      {"max_tokens negative",
       "/v1/chat/completions",
       {{"model", "fake"}, {"messages", user}, {"max_tokens", -3}},
       400,
       "max_tokens",
       "`max_tokens` is -3"},
      {"max_tokens huge",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"max_tokens", 1000000000000LL}},
       400,
       "max_tokens",
       "leaves room for at most"},
      {"max_tokens string",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"max_tokens", "10"}},
       400,
       "max_tokens",
       "must be an integer"},
      {"temperature negative",
       "/v1/chat/completions",
       {{"model", "fake"}, {"messages", user}, {"temperature", -0.5}},
       400,
       "temperature",
       "`temperature` is -0.5"},
      {"temperature NaN string",
       "/v1/chat/completions",
       {{"model", "fake"}, {"messages", user}, {"temperature", "NaN"}},
       400,
       "temperature",
       "must be a number"},
      {"top_p zero",
       "/v1/chat/completions",
       {{"model", "fake"}, {"messages", user}, {"top_p", 0}},
       400,
       "top_p",
       "(0, 1]"},
      {"top_p above one",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"top_p", 1.5}},
       400,
       "top_p",
       "`top_p` is 1.5"},
      {"empty messages",
       "/v1/chat/completions",
       {{"model", "fake"}, {"messages", json::array()}},
       400,
       "messages",
       "`messages` is empty"},
      {"unknown role",
       "/v1/chat/completions",
       {{"model", "fake"}, {"messages", json::array({{{"role", "robot"}, {"content", "beep"}}})}},
       400,
       "messages[0].role",
       "allowed roles"},
      {"prompt longer than the context",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", long_prompt}},
       400,
       "prompt",
       "has a context of 256 tokens"},
      {"missing model", "/v1/completions", {{"prompt", "a"}}, 400, "model", "`model` is missing"},
      {"missing prompt",
       "/v1/completions",
       {{"model", "fake"}},
       400,
       "prompt",
       "`prompt` is missing; it must be a string or a list of token ids"},
      {"null prompt (issue 14: reported as missing)",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", nullptr}},
       400,
       "prompt",
       "`prompt` is null; it must be a string or a list of token ids"},
      {"null messages",
       "/v1/chat/completions",
       {{"model", "fake"}, {"messages", nullptr}},
       400,
       "messages",
       "`messages` is null; it must be a list of messages"},
      {"unknown model",
       "/v1/completions",
       {{"model", "nope"}, {"prompt", "a"}},
       404,
       "model",
       "nope"},
      {"tensor model",
       "/v1/completions",
       {{"model", "simple"}, {"prompt", "a"}},
       400,
       "model",
       "does not generate text"},
      {"stream_options without stream",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"stream_options", {{"include_usage", true}}}},
       400,
       "stream_options",
       "only allowed"},
      {"logit_bias unknown token",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"logit_bias", {{"99999999", 10}}}},
       400,
       "logit_bias",
       "names token 99999999, which is not a token of this model"},
      {"logit_bias out of range",
       "/v1/chat/completions",
       {{"model", "fake"}, {"messages", user}, {"logit_bias", {{"50", 100.5}}}},
       400,
       "logit_bias",
       "the bias 100.5; it must be in [-100, 100]"},
      {"logit_bias not an id",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"logit_bias", {{"hello", 1}}}},
       400,
       "logit_bias",
       "keys must be token ids"},
      {"logit_bias list",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"logit_bias", json::array({1, 2})}},
       400,
       "logit_bias",
       "must be an object mapping token ids to biases"},
      {"logit_bias value",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"logit_bias", {{"5", "up"}}}},
       400,
       "logit_bias",
       "must be a number"},
      {"tools without a function",
       "/v1/chat/completions",
       {{"model", "fake"}, {"messages", user}, {"tools", json::array({{{"type", "function"}}})}},
       400,
       "tools",
       "`tools[0].function` must be an object"},
      {"top_logprobs without logprobs",
       "/v1/chat/completions",
       {{"model", "fake"}, {"messages", user}, {"top_logprobs", 2}},
       400,
       "top_logprobs",
       "needs `logprobs`"},
      {"two prompts",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", json::array({"a", "b"})}},
       400,
       "prompt",
       "one prompt per request"},
      {"prompt token out of range",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", json::array({1, 999999})}},
       400,
       "prompt",
       "not a token of model 'fake'"},
      {"response_format of an unknown type",
       "/v1/chat/completions",
       {{"model", "fake"}, {"messages", user}, {"response_format", {{"type", "xml"}}}},
       400,
       "response_format",
       "`response_format.type` is \"xml\"; it must be \"text\", \"json_object\" or"},
      {"response_format json_schema without a schema",
       "/v1/chat/completions",
       {{"model", "fake"},
        {"messages", user},
        {"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "x"}}}}}},
       400,
       "response_format",
       "`response_format.json_schema.schema` must be a JSON Schema"},
      {"invalid JSON Schema",
       "/v1/chat/completions",
       {{"model", "fake"},
        {"messages", user},
        {"response_format",
         {{"type", "json_schema"},
          {"json_schema",
           {{"name", "x"}, {"schema", {{"type", "integer"}, {"minimum", "low"}}}}}}}},
       400,
       "response_format",
       "`response_format.json_schema.schema`: "},
      {"unsupported keyword under strict",
       "/v1/chat/completions",
       {{"model", "fake"},
        {"messages", user},
        {"response_format",
         {{"type", "json_schema"},
          {"json_schema",
           {{"name", "x"},
            {"strict", true},
            {"schema", {{"type", "string"}, {"contentEncoding", "base64"}}}}}}}},
       400,
       "response_format",
       "contentEncoding"},
      {"grammar that does not parse",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"grammar", "root ::= (\"a\""}},
       400,
       "grammar",
       "`grammar`: grammar:1:"},
      {"grammar without root",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"grammar", "value ::= \"a\""}},
       400,
       "grammar",
       "the start rule `root` is not defined"},
      {"regex with a backreference",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"regex", "(a)\\1"}},
       400,
       "regex",
       "`regex`: "},
      {"two constraints",
       "/v1/completions",
       {{"model", "fake"},
        {"prompt", "a"},
        {"response_format", {{"type", "json_object"}}},
        {"regex", "[0-9]+"}},
       400,
       "regex",
       "`regex` and `response_format` both constrain the output"},
      {"speculative with a draft model the model lacks",
       "/v1/chat/completions",
       {{"model", "fake"},
        {"messages", user},
        {"speculative", {{"method", "draft"}, {"model", "tiny"}}}},
       400,
       "speculative.method",
       "model 'fake' has no draft model"},
      {"speculative model without method draft",
       "/v1/completions",
       {{"model", "fake"},
        {"prompt", "a"},
        {"speculative", {{"method", "ngram"}, {"model", "tiny"}}}},
       400,
       "speculative.model",
       "it goes with method \"draft\""},
      {"speculative num_tokens out of range",
       "/v1/completions",
       {{"model", "fake"},
        {"prompt", "a"},
        {"speculative", {{"method", "ngram"}, {"num_tokens", 17}}}},
       400,
       "speculative.num_tokens",
       "`speculative.num_tokens` is 17; it must be in [1, 16]"},
      {"speculative unknown key",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"speculative", {{"method", "ngram"}, {"k", 2}}}},
       400,
       "speculative.k",
       "unknown key \"k\""},
      {"speculative not an object",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"speculative", "ngram"}},
       400,
       "speculative",
       "must be an object"},
      {"min_tokens above max_tokens",
       "/v1/completions",
       {{"model", "fake"}, {"prompt", "a"}, {"max_tokens", 2}, {"min_tokens", 5}},
       400,
       "min_tokens",
       "min_tokens"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto [status, j] = Post(c.path, c.body);
    EXPECT_EQ(status, c.status) << j;
    ASSERT_TRUE(j.contains("error")) << j;
    const json& e = j["error"];
    EXPECT_THAT(e["message"].get<std::string>(), HasSubstr(c.message));
    EXPECT_EQ(e["param"], c.param.empty() ? json(nullptr) : json(c.param));
    EXPECT_EQ(e["type"], "invalid_request_error");
    EXPECT_TRUE(e.contains("code"));
  }
}

TEST_F(FrontEndsTest, MalformedBodiesAreRefused) {
  for (const std::string& body :
       {std::string("{\"model\": \"fake\", \"prompt\": \"\xff\xfe\"}"),
        std::string(R"({"model": "fake", "prompt": "\ud800"})"),
        std::string(R"({"model": "fake", "prompt": "a", "temperature": NaN})"),
        std::string("not json"), std::string("[1]")}) {
    auto reply = HttpCall(server_.http_port(), "POST", "/v1/completions", body);
    EXPECT_EQ(reply.status, 400) << body;
    json j = json::parse(reply.body);
    EXPECT_THAT(j["error"]["message"].get<std::string>(), HasSubstr("the request body"));
  }
  // Invalid UTF-8 reaching the tokenizer through a token-id-free path: a chat message.
  auto reply =
      HttpCall(server_.http_port(), "POST", "/v1/chat/completions",
               "{\"model\":\"fake\",\"messages\":[{\"role\":\"user\",\"content\":\"\xc3\x28\"}]}");
  EXPECT_EQ(reply.status, 400);
}

// Issue 14: a number beyond a double's range made json::out_of_range escape the handlers, and
// every JSON route answered a bare 500. Now: 400 naming the field, in the route's error shape
// (OpenAI's object under /v1, KServe's {"error": "..."} elsewhere), and the server serves on.
TEST_F(FrontEndsTest, NumberBeyondDoubleRangeIsA400NamingTheFieldOnEveryJsonRoute) {
  const int port = server_.http_port();
  for (const std::string path :
       {"/v1/chat/completions", "/v1/completions", "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter", "/v1/fine_tuning/jobs", "/v2/models/fake/generate",
        "/v2/models/fake/generate_stream", "/v2/models/fake/infer", "/v2/models/simple/infer",
        "/v2/repository/index", "/v2/repository/models/simple/load"}) {
    for (const std::string number : {"1e400", "2e308", "-1e400"}) {
      SCOPED_TRACE(path + " " + number);
      auto reply = HttpCall(port, "POST", path,
                            R"({"model": "fake", "prompt": "a", "temperature": )" + number + "}");
      EXPECT_EQ(reply.status, 400) << reply.body;
      const json j = json::parse(reply.body, nullptr, false);
      ASSERT_TRUE(j.is_object() && j.contains("error")) << reply.body;
      const std::string want = "`temperature`: number out of range: " + number;
      if (path.starts_with("/v1/")) {
        const json& e = j["error"];
        ASSERT_TRUE(e.is_object()) << reply.body;
        EXPECT_THAT(e["message"].get<std::string>(), StartsWith(want));
        EXPECT_EQ(e["type"], "invalid_request_error");
        EXPECT_EQ(e["param"], "temperature");
        EXPECT_TRUE(e.contains("code"));
      } else {
        ASSERT_TRUE(j["error"].is_string()) << reply.body;
        EXPECT_THAT(j["error"].get<std::string>(), StartsWith(want));
      }
    }
  }
  // JSON inside JSON: generate's `sampling_parameters` string and a load's inline `config`.
  auto nested = HttpCall(port, "POST", "/v2/models/fake/generate",
                         R"({"text_input": "a", "sampling_parameters": "{\"top_k\": 5e999}"})");
  EXPECT_EQ(nested.status, 400);
  EXPECT_THAT(nested.body, HasSubstr("`sampling_parameters.top_k`: number out of range"));
  auto config = HttpCall(port, "POST", "/v2/repository/models/simple/load",
                         R"({"parameters": {"config": "{\"max_batch_size\": 1e400}"}})");
  EXPECT_EQ(config.status, 400);
  EXPECT_THAT(config.body, HasSubstr("`config.max_batch_size`: number out of range"));

  auto good = Post("/v1/completions", {{"model", "fake"}, {"prompt", "a"}, {"max_tokens", 2}});
  EXPECT_EQ(good.first, 200) << good.second;
}

TEST_F(FrontEndsTest, WrongMethodsAndRoutes) {
  auto get = HttpCall(server_.http_port(), "GET", "/v1/chat/completions");
  EXPECT_EQ(get.status, 405);
  EXPECT_THAT(json::parse(get.body)["error"]["message"].get<std::string>(), HasSubstr("POST"));
  auto unknown = HttpCall(server_.http_port(), "POST", "/v1/audio/speech", "{}");
  EXPECT_EQ(unknown.status, 404);
  EXPECT_EQ(json::parse(unknown.body)["error"]["type"], "invalid_request_error");
  EXPECT_EQ(json::parse(unknown.body)["error"]["code"], "not_found") << "issue 14: was null";
  // /v1/embeddings is routed; the fake LLM is not an embedding model.
  auto not_embedding =
      HttpCall(server_.http_port(), "POST", "/v1/embeddings", R"({"model": "fake", "input": "x"})");
  EXPECT_EQ(not_embedding.status, 400);
  EXPECT_EQ(json::parse(not_embedding.body)["error"]["param"], "model");
  auto unknown_get = HttpCall(server_.http_port(), "GET", "/v1/nope");
  EXPECT_EQ(unknown_get.status, 404);
  EXPECT_EQ(json::parse(unknown_get.body)["error"]["code"], "not_found");
  EXPECT_EQ(HttpCall(server_.http_port(), "GET", "/v2/health/live").status, 200)
      << "KServe routes are untouched";
}

// Reads a streamed response until `enough` of it arrived, calls `before_leaving`, then drops
// the connection.
void StreamThenDisconnect(int port, const json& body, size_t enough,
                          const std::function<void()>& before_leaving) {
  namespace asio = boost::asio;
  namespace bhttp = boost::beast::http;
  asio::io_context ioc;
  asio::ip::tcp::socket sock(ioc);
  sock.connect({asio::ip::address_v4::loopback(), static_cast<uint16_t>(port)});
  bhttp::request<bhttp::string_body> req{bhttp::verb::post, "/v1/chat/completions", 11};
  req.set(bhttp::field::host, "127.0.0.1");
  req.body() = body.dump();
  req.prepare_payload();
  bhttp::write(sock, req);
  // Raw reads: Beast's read_some would block until the whole stream is parsed.
  std::string got;
  char data[4096];
  while (got.size() < enough) {
    got.append(data, sock.read_some(asio::buffer(data)));
  }
  ASSERT_EQ(got.find("[DONE]"), std::string::npos) << "the stream ended before the client left";
  before_leaving();
  sock.close();
}

// With n = 3 the client's leaving cancels every choice, which frees all their KV blocks and
// admission tickets.
TEST_F(FrontEndsTest, ClientDisconnectMidStreamFreesTheKvBlocks) {
  server_.fake().step_delay_us->store(5000);
  ContinuousBatcher& b = server_.batcher("fake");
  double cancelled = 0;
  for (int n : {1, 3}) {
    SCOPED_TRACE(n);
    StreamThenDisconnect(
        server_.http_port(),
        {{"model", "fake"},
         {"messages", json::array({{{"role", "user"}, {"content", "long"}}})},
         {"max_tokens", 200},
         {"n", n},
         {"stream", true}},
        1500, [&] {
          // The request holds KV blocks while it streams.
          EXPECT_TRUE(Await(b, [n](auto& s) { return s.running == n; }));
          EXPECT_GT(b.snapshot().kv_blocks_used, 0);
          EXPECT_GT(server_.Metric(R"(kiln_llm_kv_cache_usage_ratio{model="fake"})"), 0.0);
          EXPECT_EQ(server_.core().limiter->inflight(), n);
        });
    EXPECT_TRUE(Await(b, Idle)) << "running " << b.snapshot().running << ", blocks "
                                << b.snapshot().kv_blocks_used;
    EXPECT_EQ(server_.Metric(R"(kiln_llm_kv_cache_usage_ratio{model="fake"})"), 0.0);
    cancelled += n;
    EXPECT_EQ(server_.Metric(R"(kiln_llm_requests_total{model="fake",finish_reason="cancelled"})"),
              cancelled)
        << server_.registry().Serialize();
    EXPECT_EQ(server_.core().limiter->inflight(), 0) << "the admission tickets were released";
  }
}

TEST(FrontEndsLimitsTest, FullQueueIsRefusedQuicklyWith429) {
  auto cfg = testing::FakeModelConfig("fake");
  cfg.scheduler.max_queue_size = 2;
  cfg.scheduler.max_num_seqs = 2;
  TestServer server({cfg});
  server.fake().step_delay_us->store(10000);
  constexpr int kClients = 24;
  std::vector<std::future<std::pair<int, double>>> calls;
  for (int i = 0; i < kClients; ++i) {
    calls.push_back(std::async(std::launch::async, [&server, i] {
      const auto start = std::chrono::steady_clock::now();
      auto reply = HttpCall(server.http_port(), "POST", "/v1/completions",
                            json{{"model", "fake"},
                                 {"prompt", "client " + std::to_string(i)},
                                 {"max_tokens", 10},
                                 {"stream", true}}
                                .dump());
      if (reply.status == 429) {
        json e = json::parse(reply.body)["error"];
        EXPECT_EQ(e["type"], "rate_limit_error");
        EXPECT_THAT(e["message"].get<std::string>(), HasSubstr("queue"));
      } else {
        EXPECT_EQ(reply.status, 200);
        EXPECT_EQ(SseData(reply.body).back(), "[DONE]") << "an admitted stream completes";
      }
      return std::pair<int, double>(
          reply.status,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }));
  }
  int ok = 0, refused = 0;
  double slowest_refusal = 0;
  for (auto& c : calls) {
    auto [status, seconds] = c.get();
    if (status == 429) {
      ++refused;
      slowest_refusal = std::max(slowest_refusal, seconds);
    } else if (status == 200) {
      ++ok;
    }
  }
  EXPECT_EQ(ok + refused, kClients);
  EXPECT_GE(ok, 2);
  EXPECT_GE(refused, 1);
  EXPECT_LT(slowest_refusal, 1.0) << "refusals do not wait for the queue";
}

TEST(FrontEndsLimitsTest, InflightLimitIsRefusedWith429) {
  TestServer server({testing::FakeModelConfig("fake")}, {}, /*max_inflight=*/1);
  server.fake().gate->Close();
  auto slow = std::async(std::launch::async, [&] {
    return HttpCall(server.http_port(), "POST", "/v1/completions",
                    json{{"model", "fake"}, {"prompt", "a"}, {"max_tokens", 20}}.dump());
  });
  server.fake().gate->AwaitArrivals(1);  // admitted and running, held at its first step
  ASSERT_EQ(server.core().limiter->inflight(), 1);
  auto refused = HttpCall(server.http_port(), "POST", "/v1/completions",
                          json{{"model", "fake"}, {"prompt", "b"}}.dump());
  EXPECT_EQ(refused.status, 429);
  EXPECT_EQ(json::parse(refused.body)["error"]["code"], "rate_limit_exceeded");
  server.fake().gate->Open();
  EXPECT_EQ(slow.get().status, 200);
}

// Each choice takes one admission: n above the free ones is refused whole, holding nothing.
TEST(FrontEndsLimitsTest, ChoicesBeyondTheInflightLimitAreRefusedWith429) {
  TestServer server({testing::FakeModelConfig("fake")}, {}, /*max_inflight=*/2);
  auto refused = HttpCall(server.http_port(), "POST", "/v1/completions",
                          json{{"model", "fake"}, {"prompt", "a"}, {"n", 3}}.dump());
  EXPECT_EQ(refused.status, 429) << refused.body;
  EXPECT_EQ(server.core().limiter->inflight(), 0);
  auto ok = HttpCall(server.http_port(), "POST", "/v1/completions",
                     json{{"model", "fake"}, {"prompt", "a"}, {"n", 2}, {"max_tokens", 3}}.dump());
  ASSERT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(json::parse(ok.body)["choices"].size(), 2u);
  // Tickets are released before the batcher's snapshot shows it idle.
  EXPECT_TRUE(Await(server.batcher("fake"), Idle));
  EXPECT_EQ(server.core().limiter->inflight(), 0);
}

TEST(FrontEndsLimitsTest, ShuttingDownIsRefusedWith503) {
  TestServer server({testing::FakeModelConfig("fake")});
  server.core().shutting_down = true;
  auto reply = HttpCall(server.http_port(), "POST", "/v1/completions",
                        json{{"model", "fake"}, {"prompt", "a"}}.dump());
  EXPECT_EQ(reply.status, 503);
  EXPECT_EQ(json::parse(reply.body)["error"]["type"], "service_unavailable");
}

// ---- kiln.v1.Generation over gRPC ----------------------------------------------------------

class GenerationGrpcTest : public FrontEndsTest {
 protected:
  GenerationGrpcTest()
      : stub_(v1::Generation::NewStub(
            grpc::CreateChannel(server_.grpc_target(), grpc::InsecureChannelCredentials()))) {}

  v1::GenerateRequest TextRequest(const std::string& prompt, int max_tokens) {
    v1::GenerateRequest r;
    r.set_model("fake");
    r.set_prompt(prompt);
    r.mutable_sampling()->set_max_tokens(max_tokens);
    r.mutable_sampling()->set_temperature(0);
    return r;
  }

  std::unique_ptr<v1::Generation::Stub> stub_;
};

TEST_F(GenerationGrpcTest, GenerateAndGenerateStreamMatchTheModel) {
  const auto prompt = Encode("The sky");
  const auto want = ExpectedIds(prompt, 10);
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  auto req = TextRequest("The sky", 10);
  req.set_request_id("req-1");
  ASSERT_TRUE(stub_->Generate(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.request_id(), "req-1");
  EXPECT_EQ(resp.model(), "fake");
  EXPECT_EQ(std::vector<int32_t>(resp.token_ids().begin(), resp.token_ids().end()), want);
  EXPECT_EQ(resp.text(), Text(want));
  EXPECT_EQ(resp.finish_reason(), "length");
  EXPECT_EQ(resp.usage().prompt_tokens(), static_cast<int>(prompt.size()));
  EXPECT_EQ(resp.usage().completion_tokens(), 10);

  grpc::ClientContext sctx;
  auto reader = stub_->GenerateStream(&sctx, req);
  v1::GenerateStreamResponse msg;
  std::string text;
  std::vector<int32_t> ids;
  int messages = 0;
  v1::GenerateStreamResponse last;
  while (reader->Read(&msg)) {
    ++messages;
    text += msg.text();
    ids.insert(ids.end(), msg.token_ids().begin(), msg.token_ids().end());
    if (!msg.finish_reason().empty()) last = msg;
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(text, resp.text());
  EXPECT_EQ(ids, want);
  EXPECT_GE(messages, 2);
  EXPECT_EQ(last.finish_reason(), "length");
  EXPECT_EQ(last.usage().completion_tokens(), 10);
}

TEST_F(GenerationGrpcTest, ChatPromptIdsAndLogprobs) {
  v1::GenerateRequest chat;
  chat.set_model("fake");
  auto* m = chat.mutable_chat()->add_messages();
  m->set_role("user");
  m->set_content("Hi there");
  chat.mutable_chat()->set_add_generation_prompt(true);
  chat.mutable_sampling()->set_max_tokens(5);
  chat.mutable_sampling()->set_temperature(0);
  chat.mutable_sampling()->set_logprobs(2);
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  ASSERT_TRUE(stub_->Generate(&ctx, chat, &resp).ok());
  EXPECT_EQ(resp.text(), Text(ExpectedIds(ChatPrompt("Hi there"), 5)));
  ASSERT_EQ(resp.logprobs_size(), 5);
  EXPECT_EQ(resp.logprobs(0).top_size(), 2);
  EXPECT_EQ(resp.logprobs(0).id(), resp.token_ids(0));

  v1::GenerateRequest ids;
  ids.set_model("fake");
  for (int32_t t : {7, 500, 501}) ids.mutable_prompt_ids()->add_ids(t);
  ids.mutable_sampling()->set_max_tokens(4);
  ids.mutable_sampling()->set_temperature(0);
  grpc::ClientContext ctx2;
  ASSERT_TRUE(stub_->Generate(&ctx2, ids, &resp).ok());
  EXPECT_EQ(resp.text(), Text(ExpectedIds({7, 500, 501}, 4)));

  // logit_bias as in the OpenAI API: +100 makes greedy decoding repeat the token.
  ASSERT_NE(ExpectedIds({7, 500, 501}, 4), std::vector<int32_t>(4, 321));
  (*ids.mutable_sampling()->mutable_logit_bias())[321] = 100;
  grpc::ClientContext ctx3;
  ASSERT_TRUE(stub_->Generate(&ctx3, ids, &resp).ok());
  EXPECT_EQ(resp.text(), Text({321, 321, 321, 321}));
}

TEST_F(GenerationGrpcTest, BadRequestsAreInvalidArgumentNamingTheField) {
  struct Case {
    std::string name;
    std::function<void(v1::GenerateRequest&)> edit;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"top_p 0", [](auto& r) { r.mutable_sampling()->set_top_p(0); },
       grpc::StatusCode::INVALID_ARGUMENT, "`top_p` is 0"},
      {"temperature NaN", [](auto& r) { r.mutable_sampling()->set_temperature(std::nanf("")); },
       grpc::StatusCode::INVALID_ARGUMENT, "`temperature` is nan"},
      {"temperature negative", [](auto& r) { r.mutable_sampling()->set_temperature(-1); },
       grpc::StatusCode::INVALID_ARGUMENT, "`temperature` is -1"},
      {"max_tokens 0", [](auto& r) { r.mutable_sampling()->set_max_tokens(0); },
       grpc::StatusCode::INVALID_ARGUMENT, "`sampling.max_tokens` is 0"},
      {"max_tokens huge", [](auto& r) { r.mutable_sampling()->set_max_tokens(1 << 30); },
       grpc::StatusCode::INVALID_ARGUMENT, "leaves room for at most"},
      {"no input", [](auto& r) { r.clear_prompt(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "has no input"},
      {"unknown role",
       [](auto& r) {
         auto* m = r.mutable_chat()->add_messages();
         m->set_role("ghost");
         m->set_content("boo");
       },
       grpc::StatusCode::INVALID_ARGUMENT, "`chat.messages[0].role` is `ghost`"},
      {"empty chat", [](auto& r) { r.mutable_chat(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "`chat.messages` is empty"},
      {"unknown model", [](auto& r) { r.set_model("nope"); }, grpc::StatusCode::NOT_FOUND, "nope"},
      {"tensor model", [](auto& r) { r.set_model("simple"); }, grpc::StatusCode::INVALID_ARGUMENT,
       "does not generate text"},
      {"priority without levels", [](auto& r) { r.set_priority(3); },
       grpc::StatusCode::INVALID_ARGUMENT, "priority"},
      {"logit_bias unknown token",
       [](auto& r) { (*r.mutable_sampling()->mutable_logit_bias())[99999999] = 1; },
       grpc::StatusCode::INVALID_ARGUMENT, "`logit_bias` names token 99999999"},
      {"logit_bias out of range",
       [](auto& r) { (*r.mutable_sampling()->mutable_logit_bias())[5] = -101; },
       grpc::StatusCode::INVALID_ARGUMENT, "the bias -101; it must be in [-100, 100]"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto req = TextRequest("hello", 4);
    c.edit(req);
    grpc::ClientContext ctx;
    v1::GenerateResponse resp;
    grpc::Status s = stub_->Generate(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.message));
    // The streaming RPC refuses the same way.
    grpc::ClientContext sctx;
    auto reader = stub_->GenerateStream(&sctx, req);
    v1::GenerateStreamResponse msg;
    EXPECT_FALSE(reader->Read(&msg));
    EXPECT_EQ(reader->Finish().error_code(), c.code);
  }
}

TEST_F(GenerationGrpcTest, OutputConstraints) {
  auto req = TextRequest("Answer:", 40);
  req.mutable_sampling()->set_regex("[a-z]{2,4}@[a-z]{3}\\.com");
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  ASSERT_TRUE(stub_->Generate(&ctx, req, &resp).ok());
  EXPECT_TRUE(std::regex_match(resp.text(), std::regex("[a-z]{2,4}@[a-z]{3}\\.com")))
      << resp.text();
  EXPECT_EQ(resp.finish_reason(), "stop");

  req.mutable_sampling()->set_json_schema(
      R"({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2})");
  grpc::ClientContext ctx2;
  ASSERT_TRUE(stub_->Generate(&ctx2, req, &resp).ok());
  const json arr = json::parse(resp.text(), nullptr, false);
  ASSERT_TRUE(arr.is_array()) << resp.text();
  EXPECT_EQ(arr.size(), 2u);

  // Unsupported keywords are errors on kiln.v1 (always strict), naming the field.
  req.mutable_sampling()->set_json_schema(R"({"type": "string", "contentEncoding": "base64"})");
  grpc::ClientContext ctx3;
  grpc::Status s = stub_->Generate(&ctx3, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("`sampling.json_schema`: "));
  EXPECT_THAT(s.error_message(), HasSubstr("contentEncoding"));
  req.mutable_sampling()->set_grammar("root ::= missing");
  grpc::ClientContext ctx4;
  s = stub_->Generate(&ctx4, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("rule `missing` is used but never defined"));
}

TEST_F(GenerationGrpcTest, CancellingTheStreamFreesTheKvBlocks) {
  server_.fake().step_delay_us->store(5000);
  grpc::ClientContext ctx;
  auto reader = stub_->GenerateStream(&ctx, TextRequest("go on and on", 200));
  v1::GenerateStreamResponse msg;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(reader->Read(&msg));
  ctx.TryCancel();
  while (reader->Read(&msg)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(Await(server_.batcher("fake"), Idle));
  EXPECT_EQ(server_.core().limiter->inflight(), 0);
  EXPECT_EQ(server_.Metric(R"(kiln_llm_requests_total{model="fake",finish_reason="cancelled"})"),
            1.0);
}

TEST_F(GenerationGrpcTest, TimeoutIsDeadlineExceeded) {
  server_.fake().step_delay_us->store(5000);
  auto req = TextRequest("slow", 200);
  req.set_timeout_ms(50);
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  grpc::Status s = stub_->Generate(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("deadline"));
}

TEST_F(GenerationGrpcTest, TokenizeDetokenizeAndListModels) {
  v1::TokenizeRequest tr;
  tr.set_model("fake");
  tr.set_text("Hello <|im_end|> world");
  grpc::ClientContext c1;
  v1::TokenizeResponse tokens;
  ASSERT_TRUE(stub_->Tokenize(&c1, tr, &tokens).ok());
  EXPECT_EQ(std::vector<int32_t>(tokens.token_ids().begin(), tokens.token_ids().end()),
            Encode("Hello <|im_end|> world"));
  ASSERT_EQ(tokens.pieces_size(), tokens.token_ids_size());
  EXPECT_EQ(tokens.pieces(0), "<|begin_of_text|>");

  v1::DetokenizeRequest dr;
  dr.set_model("fake");
  dr.mutable_token_ids()->CopyFrom(tokens.token_ids());
  dr.set_skip_special_tokens(true);
  grpc::ClientContext c2;
  v1::DetokenizeResponse text;
  ASSERT_TRUE(stub_->Detokenize(&c2, dr, &text).ok());
  EXPECT_EQ(text.text(), "Hello <|im_end|> world");
  dr.add_token_ids(-4);
  grpc::ClientContext c3;
  EXPECT_EQ(stub_->Detokenize(&c3, dr, &text).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  ASSERT_TRUE(
      server_.repository()
          .AddLoraAdapter("sql-lora", "fake",
                          std::string(TestSourceDir()) + "/tests/fixtures/peft/llama_gqa_f32_a")
          .ok());
  grpc::ClientContext c4;
  v1::ListModelsResponse models;
  ASSERT_TRUE(stub_->ListModels(&c4, v1::ListModelsRequest(), &models).ok());
  ASSERT_EQ(models.models_size(), 3);
  for (const auto& m : models.models()) {
    EXPECT_EQ(m.state(), "READY");
    if (m.name() == "sql-lora") {
      EXPECT_EQ(m.kind(), "lora");
      EXPECT_EQ(m.parent(), "fake");
      EXPECT_EQ(m.context_length(), 256);
    } else if (m.name() == "fake") {
      EXPECT_EQ(m.kind(), "llm");
      EXPECT_EQ(m.architecture(), "fake");
      EXPECT_EQ(m.context_length(), 256);
      EXPECT_TRUE(m.has_chat_template());
    } else {
      EXPECT_EQ(m.kind(), "builtin");
    }
  }
}

// ---- KServe on an LLM ----------------------------------------------------------------------

std::string BytesElement(const std::string& s) {
  std::string out(4, '\0');
  const uint32_t n = static_cast<uint32_t>(s.size());
  std::memcpy(out.data(), &n, 4);
  return out + s;
}

std::string TextOutput(const inference::ModelInferResponse& r) {
  if (r.raw_output_contents_size() == 0) return "<none>";
  const std::string& raw = r.raw_output_contents(0);
  uint32_t n = 0;
  std::memcpy(&n, raw.data(), 4);
  return raw.substr(4, n);
}

class KServeLlmTest : public FrontEndsTest {
 protected:
  KServeLlmTest()
      : stub_(inference::GRPCInferenceService::NewStub(
            grpc::CreateChannel(server_.grpc_target(), grpc::InsecureChannelCredentials()))) {}

  inference::ModelInferRequest Request(const std::string& text, const std::string& sampling,
                                       std::optional<bool> stream = std::nullopt,
                                       std::optional<bool> exclude = std::nullopt) {
    inference::ModelInferRequest r;
    r.set_model_name("fake");
    r.set_id("k1");
    auto add = [&](const std::string& name, const std::string& dtype, std::string raw) {
      auto* in = r.add_inputs();
      in->set_name(name);
      in->set_datatype(dtype);
      in->add_shape(1);
      r.add_raw_input_contents(std::move(raw));
    };
    add("text_input", "BYTES", BytesElement(text));
    if (!sampling.empty()) add("sampling_parameters", "BYTES", BytesElement(sampling));
    if (stream) add("stream", "BOOL", std::string(1, *stream ? 1 : 0));
    if (exclude) add("exclude_input_in_output", "BOOL", std::string(1, *exclude ? 1 : 0));
    return r;
  }

  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
};

TEST_F(KServeLlmTest, ModelInferReturnsPromptAndCompletion) {
  const std::string want = Text(ExpectedIds(Encode("Hello world"), 6));
  grpc::ClientContext ctx;
  inference::ModelInferResponse resp;
  ASSERT_TRUE(stub_
                  ->ModelInfer(&ctx, Request("Hello world", R"({"max_tokens": 6,
      "temperature": 0})"),
                               &resp)
                  .ok());
  EXPECT_EQ(resp.id(), "k1");
  EXPECT_EQ(resp.model_name(), "fake");
  ASSERT_EQ(resp.outputs_size(), 1);
  EXPECT_EQ(resp.outputs(0).name(), "text_output");
  EXPECT_EQ(resp.outputs(0).datatype(), "BYTES");
  EXPECT_EQ(TextOutput(resp), "Hello world" + want) << "Triton's default: the prompt first";

  grpc::ClientContext ctx2;
  ASSERT_TRUE(stub_
                  ->ModelInfer(&ctx2,
                               Request("Hello world", R"({"max_tokens": "6",
      "temperature": "0"})",
                                       false, true),
                               &resp)
                  .ok());
  EXPECT_EQ(TextOutput(resp), want) << "exclude_input_in_output; string values as vLLM takes";
}

TEST_F(KServeLlmTest, RequestParametersCarrySamplingKeys) {
  auto req = Request("Hello world", "", std::nullopt, true);
  (*req.mutable_parameters())["max_tokens"].set_int64_param(3);
  (*req.mutable_parameters())["temperature"].set_double_param(0);
  grpc::ClientContext ctx;
  inference::ModelInferResponse resp;
  ASSERT_TRUE(stub_->ModelInfer(&ctx, req, &resp).ok());
  EXPECT_EQ(TextOutput(resp), Text(ExpectedIds(Encode("Hello world"), 3)));
}

TEST_F(KServeLlmTest, ModelInferRefusesStreamingAndBadSamplingParameters) {
  grpc::ClientContext ctx;
  inference::ModelInferResponse resp;
  grpc::Status s = stub_->ModelInfer(&ctx, Request("a", "", true), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("ModelStreamInfer"));
  grpc::ClientContext ctx2;
  s = stub_->ModelInfer(&ctx2, Request("a", "{not json"), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("sampling_parameters"));
  grpc::ClientContext ctx3;
  s = stub_->ModelInfer(&ctx3, Request("a", R"({"top_p": 2})"), &resp);
  EXPECT_THAT(s.error_message(), HasSubstr("`top_p` is 2"));
  grpc::ClientContext ctx4;
  s = stub_->ModelInfer(&ctx4, Request("bad \xff utf8", ""), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("UTF-8"));
  grpc::ClientContext ctx5;
  s = stub_->ModelInfer(&ctx5, Request("a", R"({"temperature": 1e400})"), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(),
              HasSubstr("`sampling_parameters.temperature`: number out of range: 1e400"));
}

// Runs one request on ModelStreamInfer; returns every response.
std::vector<inference::ModelStreamInferResponse> StreamInfer(
    inference::GRPCInferenceService::Stub& stub, const inference::ModelInferRequest& req) {
  grpc::ClientContext ctx;
  auto stream = stub.ModelStreamInfer(&ctx);
  EXPECT_TRUE(stream->Write(req));
  stream->WritesDone();
  std::vector<inference::ModelStreamInferResponse> out;
  inference::ModelStreamInferResponse r;
  while (stream->Read(&r)) out.push_back(r);
  EXPECT_TRUE(stream->Finish().ok());
  return out;
}

bool IsFinal(const inference::ModelStreamInferResponse& r) {
  auto it = r.infer_response().parameters().find("triton_final_response");
  return it != r.infer_response().parameters().end() && it->second.bool_param();
}

TEST_F(KServeLlmTest, ModelStreamInferStreamsWithTritonsFinalFlag) {
  const std::string want = Text(ExpectedIds(Encode("Stream it"), 8));
  auto responses =
      StreamInfer(*stub_, Request("Stream it", R"({"max_tokens": 8, "temperature": 0})", true));
  ASSERT_GE(responses.size(), 2u);
  std::string text;
  for (size_t i = 0; i < responses.size(); ++i) {
    EXPECT_EQ(responses[i].error_message(), "");
    EXPECT_EQ(IsFinal(responses[i]), i + 1 == responses.size());
    text += TextOutput(responses[i].infer_response());
  }
  EXPECT_EQ(text, want) << "streaming leaves the prompt out by default";

  auto req = Request("Stream it", R"({"max_tokens": 8, "temperature": 0})", true);
  (*req.mutable_parameters())["triton_enable_empty_final_response"].set_bool_param(true);
  responses = StreamInfer(*stub_, req);
  ASSERT_GE(responses.size(), 2u);
  EXPECT_TRUE(IsFinal(responses.back()));
  EXPECT_EQ(responses.back().infer_response().outputs_size(), 0) << "an empty final response";
  text.clear();
  for (size_t i = 0; i + 1 < responses.size(); ++i) {
    EXPECT_FALSE(IsFinal(responses[i]));
    text += TextOutput(responses[i].infer_response());
  }
  EXPECT_EQ(text, want);

  // Not streaming on the stream RPC: one final response with the prompt first.
  responses = StreamInfer(*stub_, Request("Stream it", R"({"max_tokens": 8, "temperature": 0})"));
  ASSERT_EQ(responses.size(), 1u);
  EXPECT_TRUE(IsFinal(responses[0]));
  EXPECT_EQ(TextOutput(responses[0].infer_response()), "Stream it" + want);

  // Errors come back in error_message; the stream stays usable.
  responses = StreamInfer(*stub_, Request("x", R"({"max_tokens": 0})", true));
  ASSERT_EQ(responses.size(), 1u);
  EXPECT_THAT(responses[0].error_message(), HasSubstr("max_tokens"));
}

TEST_F(KServeLlmTest, MetadataAndConfigShowTheLlmSignatureDecoupled) {
  grpc::ClientContext c1;
  inference::ModelMetadataRequest mreq;
  mreq.set_name("fake");
  inference::ModelMetadataResponse md;
  ASSERT_TRUE(stub_->ModelMetadata(&c1, mreq, &md).ok());
  EXPECT_EQ(md.inputs(0).name(), "text_input");
  EXPECT_EQ(md.outputs(0).name(), "text_output");
  grpc::ClientContext c2;
  inference::ModelConfigRequest creq;
  creq.set_name("fake");
  inference::ModelConfigResponse cfg;
  ASSERT_TRUE(stub_->ModelConfig(&c2, creq, &cfg).ok());
  EXPECT_TRUE(cfg.config().model_transaction_policy().decoupled());
  auto rest = HttpCall(server_.http_port(), "GET", "/v2/models/fake/config");
  EXPECT_TRUE(json::parse(rest.body)["model_transaction_policy"]["decoupled"].get<bool>());
  grpc::ClientContext c3;
  creq.set_name("simple");
  ASSERT_TRUE(stub_->ModelConfig(&c3, creq, &cfg).ok());
  EXPECT_FALSE(cfg.config().model_transaction_policy().decoupled());
}

TEST_F(KServeLlmTest, RestInferAndGenerateExtension) {
  const std::string want = Text(ExpectedIds(Encode("Hello world"), 4));
  auto [status, j] =
      Post("/v2/models/fake/infer",
           {{"id", "r1"},
            {"inputs", json::array({{{"name", "text_input"},
                                     {"shape", {1}},
                                     {"datatype", "BYTES"},
                                     {"data", {"Hello world"}}},
                                    {{"name", "sampling_parameters"},
                                     {"shape", {1}},
                                     {"datatype", "BYTES"},
                                     {"data", {R"({"max_tokens": 4, "temperature": 0})"}}}})}});
  ASSERT_EQ(status, 200) << j;
  EXPECT_EQ(j["id"], "r1");
  EXPECT_EQ(j["outputs"][0]["name"], "text_output");
  EXPECT_EQ(j["outputs"][0]["data"][0], "Hello world" + want);

  auto [gstatus, g] = Post(
      "/v2/models/fake/generate",
      {{"text_input", "Hello world"}, {"parameters", {{"max_tokens", 4}, {"temperature", 0}}}});
  ASSERT_EQ(gstatus, 200) << g;
  EXPECT_EQ(g["model_name"], "fake");
  EXPECT_EQ(g["text_output"], "Hello world" + want);

  auto reply =
      HttpCall(server_.http_port(), "POST", "/v2/models/fake/generate_stream",
               json{{"text_input", "Hello world"}, {"max_tokens", 4}, {"temperature", 0}}.dump());
  ASSERT_EQ(reply.status, 200) << reply.body;
  std::string text;
  for (const auto& e : SseData(reply.body))
    text += json::parse(e)["text_output"].get<std::string>();
  EXPECT_EQ(text, want);

  auto bad = Post("/v2/models/fake/generate", {{"parameters", {{"max_tokens", 4}}}});
  EXPECT_EQ(bad.first, 400);
  EXPECT_THAT(bad.second["error"].get<std::string>(), HasSubstr("text_input"));
  auto tensor = Post("/v2/models/simple/generate", {{"text_input", "x"}});
  EXPECT_EQ(tensor.first, 400);
}

// ---- One request path: the same request is refused alike on every front end ---------------

// A request as each wire carries it; the fields a case leaves unset take working values.
struct Spec {
  std::string model = "fake";
  std::string prompt = "hello";
  json sampling = json::object();  // max_tokens, top_p, min_tokens
  int64_t priority = 0;
};

struct Refusal {
  int code = 0;  // HTTP status or gRPC code
  std::string message;
};

Refusal ViaOpenAi(int port, const Spec& spec) {
  json body = spec.sampling;
  body["model"] = spec.model;
  body["prompt"] = "@PROMPT@";
  if (spec.priority != 0) body["priority"] = spec.priority;
  // The prompt goes in as raw bytes (json would refuse to write invalid UTF-8).
  std::string text = body.dump();
  text.replace(text.find("@PROMPT@"), 8, spec.prompt);
  auto reply = HttpCall(port, "POST", "/v1/completions", text);
  json j = json::parse(reply.body, nullptr, false);
  return {reply.status, j.contains("error") ? j["error"]["message"].get<std::string>() : ""};
}

Refusal ViaKilnV1(v1::Generation::Stub& stub, const Spec& spec) {
  v1::GenerateRequest req;
  req.set_model(spec.model);
  req.set_prompt(spec.prompt);
  req.set_priority(static_cast<uint32_t>(spec.priority));
  auto* s = req.mutable_sampling();
  if (spec.sampling.contains("max_tokens")) s->set_max_tokens(spec.sampling["max_tokens"]);
  if (spec.sampling.contains("top_p")) s->set_top_p(spec.sampling["top_p"]);
  if (spec.sampling.contains("min_tokens")) s->set_min_tokens(spec.sampling["min_tokens"]);
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  grpc::Status st = stub.Generate(&ctx, req, &resp);
  return {st.error_code(), st.error_message()};
}

Refusal ViaKServe(inference::GRPCInferenceService::Stub& stub, const Spec& spec) {
  inference::ModelInferRequest req;
  req.set_model_name(spec.model);
  auto add = [&](const std::string& name, const std::string& value) {
    auto* in = req.add_inputs();
    in->set_name(name);
    in->set_datatype("BYTES");
    in->add_shape(1);
    req.add_raw_input_contents(BytesElement(value));
  };
  add("text_input", spec.prompt);
  if (!spec.sampling.empty()) add("sampling_parameters", spec.sampling.dump());
  if (spec.priority != 0) (*req.mutable_parameters())["priority"].set_int64_param(spec.priority);
  grpc::ClientContext ctx;
  inference::ModelInferResponse resp;
  grpc::Status st = stub.ModelInfer(&ctx, req, &resp);
  return {st.error_code(), st.error_message()};
}

TEST_F(FrontEndsTest, TheSameBadRequestIsRefusedAlikeOnEveryFrontEnd) {
  auto channel = grpc::CreateChannel(server_.grpc_target(), grpc::InsecureChannelCredentials());
  auto kiln_v1 = v1::Generation::NewStub(channel);
  auto kserve = inference::GRPCInferenceService::NewStub(channel);
  std::string long_prompt;
  for (int i = 0; i < 300; ++i) long_prompt += " word";
  struct Case {
    std::string name;
    Spec spec;
    int http;
    grpc::StatusCode grpc;
    std::string message;  // in every front end's message
    bool kiln_v1 = true;  // false: proto3 `string` cannot carry it (invalid UTF-8)
  };
  const std::vector<Case> cases = {
      {"top_p", {.sampling = {{"top_p", 1.5}}}, 400, grpc::INVALID_ARGUMENT, "`top_p` is 1.5"},
      {"max_tokens 0",
       {.sampling = {{"max_tokens", 0}}},
       400,
       grpc::INVALID_ARGUMENT,
       "max_tokens` is 0; it must be at least 1"},
      {"min_tokens over max_tokens",
       {.sampling = {{"max_tokens", 2}, {"min_tokens", 5}}},
       400,
       grpc::INVALID_ARGUMENT,
       "min_tokens"},
      {"prompt over the context",
       {.prompt = long_prompt},
       400,
       grpc::INVALID_ARGUMENT,
       "but model 'fake' has a context of 256 tokens"},
      {"invalid UTF-8",
       {.prompt = "bad \xff text"},
       400,
       grpc::INVALID_ARGUMENT,
       "UTF-8",
       /*kiln_v1=*/false},
      {"priority without levels",
       {.priority = 3},
       400,
       grpc::INVALID_ARGUMENT,
       "priority 3 given but model 'fake' has no priority levels"},
      {"unknown model", {.model = "nope"}, 404, grpc::NOT_FOUND, "'nope'"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const Refusal openai = ViaOpenAi(server_.http_port(), c.spec);
    EXPECT_EQ(openai.code, c.http) << openai.message;
    EXPECT_THAT(openai.message, HasSubstr(c.message));
    if (c.kiln_v1) {
      const Refusal v1 = ViaKilnV1(*kiln_v1, c.spec);
      EXPECT_EQ(v1.code, c.grpc) << v1.message;
      EXPECT_THAT(v1.message, HasSubstr(c.message));
    }
    const Refusal ks = ViaKServe(*kserve, c.spec);
    EXPECT_EQ(ks.code, c.grpc) << ks.message;
    EXPECT_THAT(ks.message, HasSubstr(c.message));
  }
  // A ticket goes back as its handler or reactor ends, just after the client has its answer.
  EXPECT_TRUE(server_.core().limiter->WaitIdle(absl::Now() + absl::Seconds(10)))
      << "every refusal releases its ticket";
}

}  // namespace
}  // namespace kiln::llm
