#include "server/llm/openai_http.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "scheduler/generation.h"
#include "scheduler/output_format.h"
#include "server/llm/http_stream.h"
#include "server/llm/openai_embeddings.h"
#include "server/llm/params.h"
#include "server/status_mapping.h"
#include "server/tracing.h"

namespace kiln::llm {
namespace {

using nlohmann::json;
using Responder = std::shared_ptr<http::Responder>;

// OpenAI's documented default for the legacy completions endpoint.
constexpr int32_t kCompletionsDefaultMaxTokens = 16;

int64_t UnixNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void SendJson(const Responder& r, int status, const json& body, http::Headers headers = {}) {
  http::Response resp;
  resp.status = status;
  resp.body = Dump(body);
  resp.headers = std::move(headers);
  r->Send(std::move(resp));
}

void SendError(const Responder& r, const Status& status, http::Headers headers = {}) {
  SendJson(r, ToHttpStatus(status), OpenAiError(status), std::move(headers));
}

// ---- Parsing -------------------------------------------------------------------------------

// A request read off the wire: what the request path takes, and what the response needs.
struct Call {
  bool chat = false;
  std::string model_name;
  std::optional<LlmEndpoint> llm;
  GenerationInput input;
  bool stream = false;
  bool include_usage = false;
  bool echo = false;
  int64_t created = 0;
  int n = 1;  // choices
  // Tool calling (chat with `tools`, tool_choice not "none"): replies are parsed for calls
  // written in the model's format.
  bool tools = false;
  models::ToolCallFormat tool_format = models::ToolCallFormat::kHermes;
};

// OpenAI's limit on `n` (vLLM's too).
constexpr int64_t kMaxChoices = 128;

Status Unsupported(std::string_view field, std::string_view what) {
  return WithParam(InvalidArgument("`", field, "`: ", what, " is not supported by Kiln"), field);
}

// Fields OpenAI defines that Kiln cannot honour: refused when they ask for something, so a
// client never silently gets other behaviour than it asked for.
Status CheckUnsupported(const JsonFields& f, bool chat, int n) {
  if (const json* v = f.Get("tools"); !chat && v && !(v->is_array() && v->empty())) {
    return Unsupported("tools", "tool calling on /v1/completions (use /v1/chat/completions)");
  }
  if (f.Has("functions")) {
    return Unsupported("functions", "the deprecated `functions` (send `tools`)");
  }
  if (!chat) {
    KILN_ASSIGN_OR_RETURN(auto suffix, f.String("suffix"));
    if (suffix && !suffix->empty()) return Unsupported("suffix", "insertion (a suffix)");
    // best_of == n generates n candidates and returns them all: what `n` does (1: the
    // default, no ranking).
    KILN_ASSIGN_OR_RETURN(auto best_of, f.Int("best_of"));
    if (best_of && *best_of != 1 && *best_of != n) {
      return WithParam(InvalidArgument("`best_of` is ", *best_of, " and `n` is ", n,
                                       "; Kiln does not rank extra candidates (best_of must "
                                       "be 1 or equal n)"),
                       "best_of");
    }
  }
  return OkStatus();
}

StatusOr<PromptInput> ReadPrompt(const JsonFields& f, bool chat) {
  PromptInput pr;
  if (chat) {
    pr.kind = PromptInput::Kind::kChat;
    pr.field = "messages";
    const json* messages = f.Get("messages");
    if (!messages) {
      return WithParam(InvalidArgument(f.Present("messages")
                                           ? "`messages` is null; it must be a list of messages"
                                           : "`messages` is missing: send the conversation"),
                       "messages");
    }
    pr.messages = nlohmann::ordered_json(*messages);
    KILN_ASSIGN_OR_RETURN(auto agp, f.Bool("add_generation_prompt"));
    pr.add_generation_prompt = agp.value_or(true);
    return pr;
  }
  const json* p = f.Get("prompt");
  if (!p) {
    return WithParam(InvalidArgument("`prompt` ", f.Present("prompt") ? "is null" : "is missing",
                                     "; it must be a string or a list of token ids"),
                     "prompt");
  }
  auto ids_of = [&](const json& list) -> StatusOr<std::vector<int64_t>> {
    std::vector<int64_t> ids;
    for (const json& e : list) {
      if (!e.is_number_integer() && !e.is_number_unsigned()) {
        return WithParam(InvalidArgument("`prompt` must be a string or a list of token ids"),
                         "prompt");
      }
      ids.push_back(e.is_number_unsigned()
                        ? static_cast<int64_t>(std::min<uint64_t>(e.get<uint64_t>(), INT64_MAX))
                        : e.get<int64_t>());
    }
    return ids;
  };
  const json* one = p;
  if (p->is_array() && !p->empty() && (p->front().is_string() || p->front().is_array())) {
    // A batch of prompts: Kiln takes one per request.
    if (p->size() != 1) {
      return WithParam(InvalidArgument("`prompt` holds ", p->size(),
                                       " prompts; Kiln takes one prompt per request (send them "
                                       "as separate requests)"),
                       "prompt");
    }
    one = &p->front();
  }
  if (one->is_string()) {
    pr.kind = PromptInput::Kind::kText;
    pr.text = one->get<std::string>();
  } else if (one->is_array()) {
    pr.kind = PromptInput::Kind::kTokenIds;
    KILN_ASSIGN_OR_RETURN(pr.token_ids, ids_of(*one));
  } else {
    return WithParam(InvalidArgument("`prompt` must be a string or a list of token ids"), "prompt");
  }
  return pr;
}

// OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` (chat). The tools reach the prompt;
// "required" and a named function constrain the reply with a grammar (the call, with arguments
// matching the function's schema); "none" leaves the tools out.
Status ReadToolFields(const JsonFields& f, std::string_view raw, const LlmEndpoint& llm, Call* c) {
  const json* tools = f.Get("tools");
  const json* choice = f.Get("tool_choice");
  const bool have_tools = tools != nullptr && !(tools->is_array() && tools->empty());
  std::string mode = "auto", only;
  if (choice != nullptr) {
    if (choice->is_string()) {
      mode = choice->get<std::string>();
      if (mode != "none" && mode != "auto" && mode != "required") {
        return WithParam(InvalidArgument("`tool_choice` is \"", ValidUtf8(mode),
                                         "\"; it must be \"none\", \"auto\", \"required\" or "
                                         "{\"type\": \"function\", \"function\": {\"name\": ...}}"),
                         "tool_choice");
      }
    } else if (choice->is_object() && choice->contains("type") && (*choice)["type"] == "function" &&
               choice->contains("function") && (*choice)["function"].is_object() &&
               (*choice)["function"].contains("name") &&
               (*choice)["function"]["name"].is_string()) {
      mode = "named";
      only = (*choice)["function"]["name"].get<std::string>();
    } else {
      return WithParam(
          InvalidArgument("`tool_choice` must be \"none\", \"auto\", \"required\" "
                          "or {\"type\": \"function\", \"function\": {\"name\": ...}}"),
          "tool_choice");
    }
    if (!have_tools && mode != "none") {
      return WithParam(InvalidArgument("`tool_choice` needs `tools`"), "tool_choice");
    }
  }
  KILN_ASSIGN_OR_RETURN(auto parallel, f.Bool("parallel_tool_calls"));
  if (!have_tools || mode == "none") return OkStatus();
  // The tools in the client's key order (the rendered prompt shows them as written).
  nlohmann::ordered_json ordered = nlohmann::ordered_json(*tools);
  if (!raw.empty()) {
    const auto whole = nlohmann::ordered_json::parse(raw, nullptr, false);
    if (whole.is_object() && whole.contains("tools")) ordered = whole["tools"];
  }
  StatusOr<std::vector<models::ToolFunction>> fns = models::ReadTools(ordered);
  if (!fns.ok()) return WithParam(fns.status(), "tools");
  const LlmInfo info = llm.info();
  c->tools = true;
  c->tool_format = info.tool_support.format;
  c->input.prompt.tools = std::move(ordered);
  if (mode == "auto") return OkStatus();
  GenerateRequest& r = c->input.request;
  if (r.sampling.grammar) {
    return WithParam(InvalidArgument("`tool_choice` \"", mode == "named" ? only : mode,
                                     "\" and `response_format` (or `grammar`, `regex`) both "
                                     "constrain the output; give one"),
                     "tool_choice");
  }
  if (mode == "named" &&
      std::none_of(fns->begin(), fns->end(), [&](const auto& fn) { return fn.name == only; })) {
    return WithParam(InvalidArgument("`tool_choice` names the function '", ValidUtf8(only),
                                     "', which is not in `tools`"),
                     "tool_choice");
  }
  KILN_ASSIGN_OR_RETURN(std::string gbnf,
                        models::ToolCallGbnf(c->tool_format, *fns, only, parallel.value_or(true)));
  StatusOr<std::shared_ptr<const grammar::Grammar>> g =
      grammar::CompileConstraint({grammar::Constraint::Kind::kGbnf, gbnf, false});
  if (!g.ok()) return WithParam(Annotate(g.status(), "`tools`"), "tools");
  r.sampling.grammar = *std::move(g);
  return OkStatus();
}

// `raw` is the body's text (for the key order of a JSON Schema, which `body` lost).
StatusOr<Call> Parse(const ServerCore& core, const json& body, std::string_view raw, bool chat) {
  JsonFields f(body);
  Call c;
  c.chat = chat;
  c.created = UnixNow();
  c.input.id_prefix = chat ? "chatcmpl-" : "cmpl-";
  GenerateRequest& r = c.input.request;
  KILN_ASSIGN_OR_RETURN(auto name, f.String("model"));
  c.model_name = name.value_or("");
  KILN_ASSIGN_OR_RETURN(c.llm, LlmEndpoint::Find(*core.repository, c.model_name));

  KILN_ASSIGN_OR_RETURN(auto n, f.Int("n"));
  if (n && (*n < 1 || *n > kMaxChoices)) {
    return WithParam(InvalidArgument("`n` is ", *n, "; it must be in [1, ", kMaxChoices, "]"), "n");
  }
  c.n = static_cast<int>(n.value_or(1));
  KILN_RETURN_IF_ERROR(CheckUnsupported(f, chat, c.n));
  KILN_ASSIGN_OR_RETURN(auto stream, f.Bool("stream"));
  c.stream = stream.value_or(false);
  if (const json* so = f.Get("stream_options")) {
    if (!c.stream) {
      return WithParam(InvalidArgument("`stream_options` is only allowed with `stream`: true"),
                       "stream_options");
    }
    if (!so->is_object()) {
      return WithParam(InvalidArgument("`stream_options` must be an object"), "stream_options");
    }
    KILN_ASSIGN_OR_RETURN(auto usage, JsonFields(*so, "stream_options.").Bool("include_usage"));
    c.include_usage = usage.value_or(false);
  }

  KILN_ASSIGN_OR_RETURN(c.input.prompt, ReadPrompt(f, chat));
  if (chat) {
    KILN_ASSIGN_OR_RETURN(r.max_tokens, f.Int("max_completion_tokens"));
    if (r.max_tokens) r.fields.max_tokens = "max_completion_tokens";
  }
  if (!r.max_tokens) {
    KILN_ASSIGN_OR_RETURN(r.max_tokens, f.Int("max_tokens"));
  }
  r.default_max_tokens = chat ? kDefaultMaxTokens : kCompletionsDefaultMaxTokens;
  KILN_RETURN_IF_ERROR(ReadSamplingFields(f, &r.sampling, raw));

  if (chat) {
    KILN_ASSIGN_OR_RETURN(auto logprobs, f.Bool("logprobs"));
    KILN_ASSIGN_OR_RETURN(auto top, f.Int("top_logprobs"));
    if (top && !logprobs.value_or(false)) {
      return WithParam(InvalidArgument("`top_logprobs` needs `logprobs`: true"), "top_logprobs");
    }
    if (top && (*top < 0 || *top > 20)) {
      return WithParam(InvalidArgument("`top_logprobs` is ", *top, "; it must be in [0, 20]"),
                       "top_logprobs");
    }
    if (logprobs.value_or(false)) r.sampling.logprobs = static_cast<int32_t>(top.value_or(0));
    KILN_RETURN_IF_ERROR(ReadToolFields(f, raw, *c.llm, &c));
  } else {
    KILN_ASSIGN_OR_RETURN(auto logprobs, f.Int("logprobs"));
    if (logprobs && (*logprobs < 0 || *logprobs > 20)) {
      return WithParam(InvalidArgument("`logprobs` is ", *logprobs, "; it must be in [0, 20]"),
                       "logprobs");
    }
    if (logprobs) r.sampling.logprobs = static_cast<int32_t>(*logprobs);
    KILN_ASSIGN_OR_RETURN(auto echo, f.Bool("echo"));
    c.echo = echo.value_or(false);
    if (c.echo && logprobs) {
      return Unsupported("echo", "`echo` together with `logprobs` (prompt logprobs)");
    }
  }
  KILN_ASSIGN_OR_RETURN(auto priority, f.Int("priority"));
  r.priority = priority.value_or(0);
  return c;
}

// ---- Encoding ------------------------------------------------------------------------------

json Usage(const GenerateUsage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

json Bytes(std::string_view s) {
  json out = json::array();
  for (char c : s) out.push_back(static_cast<unsigned char>(c));
  return out;
}

// Logprobs of the tokens a client sees: control tokens (EOS, end of turn) are not part of
// the text, so they are left out here too.
std::vector<const models::SampledToken*> Visible(const TokenTexts& tok,
                                                 const std::vector<models::SampledToken>& lps) {
  std::vector<const models::SampledToken*> out;
  for (const auto& t : lps) {
    if (!tok.IsControl(t.token)) out.push_back(&t);
  }
  return out;
}

// Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}
json ChatLogprobs(const TokenTexts& tok, const std::vector<models::SampledToken>& lps) {
  json content = json::array();
  for (const models::SampledToken* t : Visible(tok, lps)) {
    const std::string_view text = tok.Bytes(t->token);
    json top = json::array();
    for (const auto& alt : t->top) {
      const std::string_view at = tok.Bytes(alt.token);
      top.push_back({{"token", ValidUtf8(at)}, {"logprob", alt.logprob}, {"bytes", Bytes(at)}});
    }
    // `token` reads U+FFFD for part of a character; `bytes` has the exact bytes.
    content.push_back({{"token", ValidUtf8(text)},
                       {"logprob", t->logprob},
                       {"bytes", Bytes(text)},
                       {"top_logprobs", std::move(top)}});
  }
  return {{"content", std::move(content)}};
}

// Characters (code points) in valid UTF-8 text: what a client's string indices count.
size_t CodePoints(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

// Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}; `offset` is the
// character offset of the first token (it continues across streamed chunks). A token that
// holds part of a character reads as U+FFFD, as in the text.
json CompletionLogprobs(const TokenTexts& tok, const std::vector<models::SampledToken>& lps,
                        size_t* offset) {
  json tokens = json::array(), token_lps = json::array(), tops = json::array(),
       offsets = json::array();
  for (const models::SampledToken* t : Visible(tok, lps)) {
    const std::string text = ValidUtf8(tok.Bytes(t->token));
    json top = json::object();
    for (const auto& alt : t->top) top[ValidUtf8(tok.Bytes(alt.token))] = alt.logprob;
    tops.push_back(std::move(top));
    token_lps.push_back(t->logprob);
    offsets.push_back(*offset);
    *offset += CodePoints(text);
    tokens.push_back(text);
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_lps)},
          {"top_logprobs", std::move(tops)},
          {"text_offset", std::move(offsets)}};
}

// What the response encoders need from the parsed call. The token texts belong to the model,
// which outlives every event its batcher delivers.
struct Meta {
  Meta(const Call& c, const PreparedGeneration& p, TokenTexts tokens)
      : chat(c.chat),
        id(p.id()),
        created(c.created),
        model_name(c.model_name),
        tokens(tokens),
        logprobs(p.request().sampling.logprobs >= 0),
        include_usage(c.include_usage),
        echo(c.echo ? p.prompt_text() : ""),
        n(c.n),
        tools(c.tools),
        tool_format(c.tool_format) {}
  const TokenTexts& tok() const { return tokens; }
  json Envelope(std::string_view object) const {
    return {{"id", id}, {"object", object}, {"created", created}, {"model", model_name}};
  }

  bool chat;
  std::string id;
  int64_t created;
  std::string model_name;
  TokenTexts tokens;
  bool logprobs;
  bool include_usage;
  std::string echo;  // prompt text to put before the completion (completions' echo)
  int n;             // choices
  bool tools;        // parse replies for tool calls (Call::tools)
  models::ToolCallFormat tool_format;
};

// OpenAI's tool_calls entries for parsed calls; `first` numbers them within the choice.
json ToolCallsJson(const std::vector<models::ToolCall>& calls, size_t first, bool with_index) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  json out = json::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    static constexpr char kAlnum[] =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    std::string id = "call_";
    for (int k = 0; k < 24; ++k) id += kAlnum[rng() % (sizeof(kAlnum) - 1)];
    json call = {{"id", std::move(id)},
                 {"type", "function"},
                 {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
    if (with_index) call["index"] = first + i;
    out.push_back(std::move(call));
  }
  return out;
}

// The usage of a request for several choices: the prompt once (choice 0's, with what it took
// from the prefix cache), the completion tokens of every choice.
GenerateUsage ChoicesUsage(std::span<const GenerateUsage> choices) {
  GenerateUsage u = choices.front();
  u.completion_tokens = 0;
  for (const GenerateUsage& c : choices) u.completion_tokens += c.completion_tokens;
  return u;
}

std::string_view FinishName(FinishReason f) {
  return f == FinishReason::kLength ? "length" : "stop";
}

json FullResponse(const Meta& m, std::span<const GenerationResult> results) {
  json out = m.Envelope(m.chat ? "chat.completion" : "text_completion");
  json choices = json::array();
  std::vector<GenerateUsage> usage;
  for (size_t i = 0; i < results.size(); ++i) {
    const GenerationResult& res = results[i];
    json choice = {{"index", i}, {"finish_reason", FinishName(res.finish)}, {"logprobs", nullptr}};
    if (m.chat && m.tools) {
      models::ToolReply reply = models::ParseToolCalls(m.tool_format, res.text);
      choice["message"] = {
          {"role", "assistant"},
          {"content",
           reply.calls.empty() || !reply.content.empty() ? json(reply.content) : json(nullptr)},
          {"refusal", nullptr}};
      if (!reply.calls.empty()) {
        choice["message"]["tool_calls"] = ToolCallsJson(reply.calls, 0, false);
        if (res.finish == FinishReason::kStop) choice["finish_reason"] = "tool_calls";
      }
      if (m.logprobs) choice["logprobs"] = ChatLogprobs(m.tok(), res.logprobs);
    } else if (m.chat) {
      // OpenAI's message always carries `refusal` (null unless the model refused).
      choice["message"] = {{"role", "assistant"}, {"content", res.text}, {"refusal", nullptr}};
      if (m.logprobs) choice["logprobs"] = ChatLogprobs(m.tok(), res.logprobs);
    } else {
      choice["text"] = m.echo + res.text;
      size_t offset = CodePoints(m.echo);
      if (m.logprobs) choice["logprobs"] = CompletionLogprobs(m.tok(), res.logprobs, &offset);
    }
    choices.push_back(std::move(choice));
    usage.push_back(res.usage);
  }
  out["choices"] = std::move(choices);
  out["usage"] = Usage(ChoicesUsage(usage));
  return out;
}

std::string Sse(const json& j) { return "data: " + Dump(j) + "\n\n"; }

// One streamed response: turns the events of its choices into OpenAI's chunks (each with its
// choice's index; the usage chunk and [DONE] once every choice has finished). Events arrive
// on the batcher's thread, and from the request's thread for a choice that could not be
// queued: serialised here. An error or cancellation ends the stream and cancels the other
// choices (`cancel`).
class SseStream {
 public:
  SseStream(Meta meta, const Responder& r, std::shared_ptr<RequestTrace> trace,
            std::function<void()> cancel)
      : meta_(std::move(meta)),
        gate_(r),
        trace_(std::move(trace)),
        cancel_(std::move(cancel)),
        offsets_(static_cast<size_t>(meta_.n), 0),
        usage_(static_cast<size_t>(meta_.n)) {
    if (meta_.tools) {
      for (int i = 0; i < meta_.n; ++i) tool_streams_.emplace_back(meta_.tool_format);
      tool_calls_sent_.assign(static_cast<size_t>(meta_.n), 0);
    }
  }

  // Sends the header and each choice's first chunk: the assistant's turn (chat) or the
  // echoed prompt.
  void Start() {
    std::lock_guard<std::mutex> lock(mu_);
    std::string first;
    for (int i = 0; i < meta_.n; ++i) {
      if (meta_.chat) {
        first += Sse(Chunk(i, {{"role", "assistant"}, {"content", ""}, {"refusal", nullptr}},
                           nullptr, nullptr));
      } else if (!meta_.echo.empty()) {
        first += Sse(Chunk(i, meta_.echo, nullptr, nullptr));
      }
    }
    http::Headers headers = TraceHeaders(trace_.get());
    headers.emplace_back("Cache-Control", "no-cache");
    headers.emplace_back("X-Request-Id", meta_.id);
    gate_.Start(200, "text/event-stream", std::move(headers), std::move(first));
  }

  void OnEvent(int index, GenerateEvent&& ev) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    const bool final = ev.finish != FinishReason::kNone;
    // The response span: from the first chunk serialised to the stream's end.
    if (trace_ && response_start_ == SteadyClock::time_point{}) {
      response_start_ = SteadyClock::now();
    }
    if (final && ev.finish != FinishReason::kStop && ev.finish != FinishReason::kLength) {
      // Cancelled: the client is gone. An error: say so in the stream, as OpenAI does.
      if (ev.finish == FinishReason::kError) {
        gate_.Write(Sse(OpenAiError(FinalStatus(ev.finish, ev.status))));
        gate_.Write("data: [DONE]\n\n");
      }
      Close(FinalStatus(ev.finish, ev.status));
      return;
    }
    json lps = nullptr;
    if (meta_.logprobs && !ev.logprobs.empty()) {
      lps = meta_.chat ? ChatLogprobs(meta_.tok(), ev.logprobs)
                       : CompletionLogprobs(meta_.tok(), ev.logprobs, &offsets_[index]);
    }
    std::string finish(FinishName(ev.finish));
    if (meta_.tools) {
      // Content as soon as it cannot start a call; each call, whole, as one tool_calls delta.
      models::ToolCallStream& ts = tool_streams_[index];
      models::ToolReply reply = ts.Add(ev.text);
      if (final) {
        models::ToolReply rest = ts.Finish();
        reply.content += rest.content;
        for (auto& c : rest.calls) reply.calls.push_back(std::move(c));
      }
      if (!reply.content.empty() || !lps.is_null()) {
        gate_.Write(Sse(Chunk(index, json{{"content", reply.content}}, std::move(lps), nullptr)));
      }
      if (!reply.calls.empty()) {
        size_t& sent = tool_calls_sent_[index];
        gate_.Write(Sse(Chunk(index, json{{"tool_calls", ToolCallsJson(reply.calls, sent, true)}},
                              nullptr, nullptr)));
        sent += reply.calls.size();
      }
      if (final && ts.saw_calls() && ev.finish == FinishReason::kStop) finish = "tool_calls";
    } else if (!ev.text.empty() || !lps.is_null()) {
      gate_.Write(Sse(Chunk(index, meta_.chat ? json{{"content", ev.text}} : json(ev.text),
                            std::move(lps), nullptr)));
    }
    if (!final) return;
    gate_.Write(Sse(Chunk(index, meta_.chat ? json::object() : json(""), nullptr, finish)));
    usage_[index] = ev.usage;
    if (++finished_ < meta_.n) return;
    if (meta_.include_usage) {
      json usage = meta_.Envelope(meta_.chat ? "chat.completion.chunk" : "text_completion");
      usage["choices"] = json::array();
      usage["usage"] = Usage(ChoicesUsage(usage_));
      gate_.Write(Sse(usage));
    }
    gate_.Write("data: [DONE]\n\n");
    Close(OkStatus());
  }

 private:
  void Close(const Status& status) {
    closed_ = true;
    gate_.Finish();
    if (!status.ok()) cancel_();  // the other choices, if any
    EndTrace(status);
  }

  void EndTrace(const Status& status) {
    if (!trace_) return;
    trace_->Span("response", response_start_, SteadyClock::now(), {{"kiln.stream", int64_t{1}}});
    trace_->End(status);
  }

  // A chunk of choice `index`: `delta` (chat) or `text` (completions).
  json Chunk(int index, json content, json logprobs, json finish) const {
    json choice = {
        {"index", index}, {"logprobs", std::move(logprobs)}, {"finish_reason", std::move(finish)}};
    json out = meta_.Envelope(meta_.chat ? "chat.completion.chunk" : "text_completion");
    choice[meta_.chat ? "delta" : "text"] = std::move(content);
    out["choices"] = json::array({std::move(choice)});
    if (meta_.include_usage) out["usage"] = nullptr;
    return out;
  }

  const Meta meta_;
  HttpStreamGate gate_;
  const std::shared_ptr<RequestTrace> trace_;  // null: not traced
  const std::function<void()> cancel_;
  std::mutex mu_;
  bool closed_ = false;
  int finished_ = 0;                  // choices
  std::vector<size_t> offsets_;       // completions logprobs: text offset of the next token
  std::vector<GenerateUsage> usage_;  // per choice, from its final event
  std::vector<models::ToolCallStream> tool_streams_;  // per choice, with tools
  std::vector<size_t> tool_calls_sent_;               // per choice: the next call's index
  SteadyClock::time_point response_start_{};          // the first event
};

// The choices of one request (OpenAI's `n`), queued so that they share the prompt's KV
// blocks: choice 0 at once, the others when choice 0 delivers its first event — its
// prompt's full blocks are in the prefix cache by then (ContinuousBatcher publishes them after
// the prefill step), so the others prefill only the last partial block. Every choice's events
// go to `sink(index, event)`; a choice that cannot be queued gets one final error event there
// (and so does every later one, cancelled, when choice 0 ended in an error or a cancellation
// before any token).
class Choices : public std::enable_shared_from_this<Choices> {
 public:
  using Sink = std::function<void(int, GenerateEvent&&)>;
  Choices(LlmEndpoint llm, Sink sink) : llm_(std::move(llm)), sink_(std::move(sink)) {}

  // Queues choice 0 (`first`) and holds the others with their admission tickets. On error
  // nothing was queued and the sink is never called.
  Status Submit(PreparedGeneration first, std::vector<InflightLimiter::Ticket> tickets) {
    for (int i = 1; i < static_cast<int>(tickets.size()); ++i) {
      rest_.push_back(first.Fork(i));
      tickets_.push_back(std::move(tickets[i]));
    }
    // Written before choice 0 is queued, so its events (which queueing publishes to the
    // batcher's thread) see them.
    pending_.store(!rest_.empty());
    return llm_.Submit(
        std::move(first), std::move(tickets[0]), [self = shared_from_this()](GenerateEvent&& ev) {
          if (!self->pending_.exchange(false)) return self->sink_(0, std::move(ev));
          const bool failed =
              ev.finish == FinishReason::kError || ev.finish == FinishReason::kCancelled;
          const Status why = failed ? FinalStatus(ev.finish, ev.status) : OkStatus();
          self->sink_(0, std::move(ev));
          self->SubmitRest(why);
        });
  }

 private:
  // Once, on choice 0's first event (the batcher's thread; Enqueue does not block).
  void SubmitRest(const Status& choice0) {
    std::vector<PreparedGeneration> rest = std::move(rest_);
    std::vector<InflightLimiter::Ticket> tickets = std::move(tickets_);
    for (size_t i = 0; i < rest.size(); ++i) {
      const int index = static_cast<int>(i) + 1;
      Status s = choice0;
      if (s.ok()) {
        s = llm_.Submit(std::move(rest[i]), std::move(tickets[i]),
                        [self = shared_from_this(), index](GenerateEvent&& ev) {
                          self->sink_(index, std::move(ev));
                        });
      }
      if (!s.ok()) {
        GenerateEvent ev;
        ev.finish =
            s.code() == StatusCode::kCancelled ? FinishReason::kCancelled : FinishReason::kError;
        ev.status = s;
        sink_(index, std::move(ev));
      }
    }
  }

  const LlmEndpoint llm_;
  const Sink sink_;
  std::atomic<bool> pending_{false};      // rest_ not yet queued
  std::vector<PreparedGeneration> rest_;  // choices 1.., until choice 0's first event
  std::vector<InflightLimiter::Ticket> tickets_;
};

// Every choice's result, answered once all have finished.
struct Collected {
  std::mutex mu;
  std::vector<GenerationResult> results;
  int finished = 0;
};

void Generate(const ServerCore& core, const http::Request& req, const Responder& r, bool chat) {
  std::shared_ptr<RequestTrace> trace = BeginHttpTrace(core, req);
  auto fail = [&](const Status& s) {
    if (trace) trace->End(s);
    SendError(r, s, TraceHeaders(trace.get()));
  };
  auto ticket = core.Admit();
  if (!ticket.ok()) return fail(ticket.status());
  auto body = ParseJsonObject(req.body, "the request body");
  if (!body.ok()) return fail(body.status());
  auto call = Parse(core, *body, req.body, chat);
  if (!call.ok()) return fail(call.status());
  // One admission per choice: n choices are n sequences in the batch.
  std::vector<InflightLimiter::Ticket> tickets;
  tickets.push_back(*std::move(ticket));
  for (int i = 1; i < call->n; ++i) {
    auto more = core.Admit();
    if (!more.ok()) return fail(more.status());
    tickets.push_back(*std::move(more));
  }
  const LlmEndpoint& llm = *call->llm;
  call->input.request.trace = trace;
  auto prepared = llm.Prepare(std::move(call->input));
  if (!prepared.ok()) return fail(prepared.status());
  const std::function<void()> cancel = prepared->Canceller();  // every choice
  r->OnClientGone(cancel);
  Meta meta(*call, *prepared, llm.tokens());

  if (call->stream) {
    auto stream = std::make_shared<SseStream>(std::move(meta), r, trace, cancel);
    auto choices = std::make_shared<Choices>(
        llm, [stream](int i, GenerateEvent&& ev) { stream->OnEvent(i, std::move(ev)); });
    Status s = choices->Submit(std::move(*prepared), std::move(tickets));
    if (!s.ok()) return fail(s);
    stream->Start();
    return;
  }
  auto collected = std::make_shared<Collected>();
  collected->results.resize(static_cast<size_t>(call->n));
  auto choices = std::make_shared<Choices>(
      llm, [collected, r, meta = std::move(meta), trace, cancel](int i, GenerateEvent&& ev) {
        std::unique_lock<std::mutex> lock(collected->mu);
        GenerationResult& result = collected->results[static_cast<size_t>(i)];
        result.Add(std::move(ev));
        if (!result.done()) return;
        if (!FinalStatus(result.finish, result.status).ok()) cancel();  // the other choices
        if (++collected->finished < meta.n) return;
        lock.unlock();  // every choice has finished: nothing else writes
        const auto start = SteadyClock::now();
        Status s;
        for (const GenerationResult& c : collected->results) {
          // An error rather than a cancellation it caused in the other choices.
          const Status cs = FinalStatus(c.finish, c.status);
          if (s.ok() || (s.code() == StatusCode::kCancelled && !cs.ok())) s = cs;
        }
        http::Headers headers = TraceHeaders(trace.get());
        if (!s.ok()) {
          SendError(r, s, std::move(headers));
        } else {
          headers.emplace_back("X-Request-Id", meta.id);
          SendJson(r, 200, FullResponse(meta, collected->results), std::move(headers));
        }
        if (trace) {
          trace->Span("response", start, SteadyClock::now(), {{"kiln.stream", int64_t{0}}});
          trace->End(s);
        }
      });
  Status s = choices->Submit(std::move(*prepared), std::move(tickets));
  if (!s.ok()) fail(s);
}

// A LoRA adapter is listed as vLLM does: its own id, `root` its folder, `parent` the base.
json ModelObject(const LlmEndpoint& m, int64_t created, const ModelRepository& repository) {
  json o = {{"id", m.name()},
            {"object", "model"},
            {"created", created},
            {"owned_by", "kiln"},
            {"root", m.model().config().path},
            {"max_model_len", m.info().context_length}};
  if (!m.adapter().empty()) {
    if (auto a = repository.FindLoraAdapter(m.adapter())) o["root"] = a->path;
    o["parent"] = m.model().name();
  }
  return o;
}

// An embedding model (`kind: embedding`) in /v1/models.
json EmbeddingModelObject(const Model& m, int64_t created) {
  return {{"id", m.name()},          {"object", "model"},
          {"created", created},      {"owned_by", "kiln"},
          {"root", m.config().path}, {"dimensions", m.signature().outputs.at(0).dims.at(0)}};
}

void SendMethodNotAllowed(const Responder& r, const http::Request& req, std::string_view allow) {
  json err = OpenAiError(
      InvalidArgument("method ", req.method, " is not allowed on ", req.path, "; use ", allow));
  SendJson(r, 405, err, {{"Allow", std::string(allow)}});
}

}  // namespace

json OpenAiError(const Status& status) {
  const int http = ToHttpStatus(status);
  const std::string param = ParamOf(status);
  std::string_view type = "server_error";
  json code = nullptr;
  switch (http) {
    case 400:
      type = "invalid_request_error";
      break;
    case 401:  // as OpenAI answers a missing or wrong key
      type = "invalid_request_error";
      code = "invalid_api_key";
      break;
    case 403:
      type = "invalid_request_error";
      code = "insufficient_permissions";
      break;
    case 404:  // an unknown model, or an unknown route, file or job
      type = "invalid_request_error";
      code = param == "model" ? "model_not_found" : "not_found";
      break;
    case 429:
      type = "rate_limit_error";
      code = "rate_limit_exceeded";
      break;
    case 499:
      type = "cancelled";
      break;
    case 501:
      type = "not_implemented";
      break;
    case 503:
      type = "service_unavailable";
      break;
    case 504:
      type = "timeout";
      break;
  }
  return {{"error",
           {{"message", ValidUtf8(StatusMessage(status))},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", std::move(code)}}}};
}

OpenAiApi::OpenAiApi(ServerCore* core) : core_(core), created_(UnixNow()) {}

bool OpenAiApi::Handle(http::Request& req, const std::shared_ptr<http::Responder>& r) const {
  std::vector<std::string> seg;
  for (absl::string_view s : absl::StrSplit(ToAbsl(req.path), '/', absl::SkipEmpty())) {
    seg.emplace_back(s);
  }
  if (seg.empty() || seg[0] != "v1") return false;
  const bool get = req.method == "GET";
  const bool post = req.method == "POST";
  if (seg.size() == 2 && seg[1] == "models") {
    if (!get) return SendMethodNotAllowed(r, req, "GET"), true;
    json data = json::array();
    for (auto& m : core_->repository->ReadyModels()) {
      if (auto llm = LlmEndpoint::Of(std::move(m)); llm.ok()) {
        data.push_back(ModelObject(*llm, created_, *core_->repository));
      }
    }
    for (const LoraAdapterInfo& a : core_->repository->LoraAdapters()) {
      if (auto llm = LlmEndpoint::Find(*core_->repository, a.name); llm.ok()) {
        data.push_back(ModelObject(*llm, created_, *core_->repository));
      }
    }
    for (auto& m : core_->repository->ReadyModels()) {
      if (m->is_embedding()) {
        data.push_back(EmbeddingModelObject(*m, created_));
      }
    }
    SendJson(r, 200, {{"object", "list"}, {"data", std::move(data)}});
    return true;
  }
  if (seg.size() == 3 && seg[1] == "models") {
    if (!get) return SendMethodNotAllowed(r, req, "GET"), true;
    if (auto m = core_->repository->GetReady(seg[2]); m.ok() && (*m)->is_embedding()) {
      SendJson(r, 200, EmbeddingModelObject(**m, created_));
      return true;
    }
    auto model = LlmEndpoint::Find(*core_->repository, seg[2]);
    if (!model.ok()) {
      SendError(r, model.status().code() == StatusCode::kInvalidArgument
                       ? WithParam(NotFound(model.status().message()), "model")
                       : model.status());
      return true;
    }
    SendJson(r, 200, ModelObject(*model, created_, *core_->repository));
    return true;
  }
  const bool completions = seg.size() == 2 && seg[1] == "completions";
  const bool chat = seg.size() == 3 && seg[1] == "chat" && seg[2] == "completions";
  if (completions || chat) {
    if (!post) return SendMethodNotAllowed(r, req, "POST"), true;
    Generate(*core_, req, r, chat);
    return true;
  }
  if (seg.size() == 2 && seg[1] == "embeddings") {
    if (!post) return SendMethodNotAllowed(r, req, "POST"), true;
    HandleEmbeddings(*core_, req, r);
    return true;
  }
  const bool load = seg.size() == 2 && seg[1] == "load_lora_adapter";
  if (load || (seg.size() == 2 && seg[1] == "unload_lora_adapter")) {
    if (!post) return SendMethodNotAllowed(r, req, "POST"), true;
    LoraAdapterRoute(req, r, load);
    return true;
  }
  SendError(r, NotFound("no route for ", req.method, " ", req.path,
                        "; the OpenAI-compatible API serves /v1/models, /v1/completions, "
                        "/v1/chat/completions, /v1/embeddings, /v1/load_lora_adapter and "
                        "/v1/unload_lora_adapter"));
  return true;
}

// vLLM's runtime adapter routes: {"lora_name", "lora_path"} (and Kiln's optional
// "base_model", needed only when several LLMs are served). Success answers 200 with vLLM's
// plain-text message.
void OpenAiApi::LoraAdapterRoute(const http::Request& req,
                                 const std::shared_ptr<http::Responder>& r, bool load) const {
  StatusOr<json> body = ParseJsonObject(req.body, "the request body");
  if (!body.ok()) return SendError(r, body.status());
  auto field = [&](const char* key) -> std::string {
    auto it = body->find(key);
    return it != body->end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  const std::string name = field("lora_name");
  if (name.empty()) {
    return SendError(r,
                     WithParam(InvalidArgument("`lora_name` (a string) is required"), "lora_name"));
  }
  auto success = [](std::string text) {
    http::Response ok;
    ok.content_type = "text/plain; charset=utf-8";
    ok.body = std::move(text);
    return ok;
  };
  // Both wait on the repository's adapter lock, which a load holds while it reads weights:
  // answered from a thread of their own (as model loads are), never from an I/O thread.
  if (!load) {
    std::thread([core = core_, r, name, success] {
      Status s = core->repository->RemoveLoraAdapter(name);
      if (!s.ok()) return SendError(r, WithParam(s, "lora_name"));
      r->Send(success("Success: LoRA adapter '" + name + "' removed successfully."));
    }).detach();
    return;
  }
  const std::string path = field("lora_path");
  if (path.empty()) {
    return SendError(r, WithParam(InvalidArgument("`lora_path` (a PEFT adapter folder on the "
                                                  "server) is required"),
                                  "lora_path"));
  }
  std::string base = field("base_model");
  if (base.empty()) {
    std::vector<std::string> llms;
    for (auto& m : core_->repository->ReadyModels()) {
      if (m->is_llm()) llms.push_back(m->name());
    }
    if (llms.size() != 1) {
      return SendError(r, WithParam(InvalidArgument("this server serves ", llms.size(),
                                                    " LLMs; say which one the adapter is for "
                                                    "with `base_model`"),
                                    "base_model"));
    }
    base = llms[0];
  }
  std::thread([core = core_, r, name, base, path, success] {
    Status s = core->repository->AddLoraAdapter(name, base, path);
    if (!s.ok()) {
      // A taken or malformed name is about lora_name, an unknown base about base_model;
      // everything else (no folder, no adapter_config.json, shapes) about lora_path.
      const std::string param = ParamOf(s).empty()
                                    ? (s.code() == StatusCode::kAlreadyExists        ? "lora_name"
                                       : s.code() == StatusCode::kFailedPrecondition ? "base_model"
                                                                                     : "lora_path")
                                    : ParamOf(s);
      return SendError(r, WithParam(s, param));
    }
    r->Send(success("Success: LoRA adapter '" + name + "' added successfully."));
  }).detach();
}

}  // namespace kiln::llm
