#include "models/train/dataset.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_format.h"
#include "engine/base/json_parse.h"
#include "models/chat/chat_template.h"
#include "models/io/errors.h"
#include "models/tokenizer/tokenizer.h"
#include "models/tokenizer/unicode.h"

namespace kiln::models::train {
namespace {

using json = nlohmann::ordered_json;

// Stands in for invalid UTF-8 bytes so the line still parses and the bad field can be named.
// A noncharacter (U+FDD0): never part of real text.
constexpr std::string_view kBadByte = "\xEF\xB7\x90";

// "developer" is OpenAI's newer name for a system message; it reaches the template as written,
// as transformers' apply_chat_template would pass it.
constexpr std::string_view kRoles[] = {"system", "user", "assistant", "tool", "developer"};
// The keys of a message the chat template sees (besides role); `weight` and others are not.
constexpr const char* kPassedKeys[] = {"content", "tool_calls", "tool_call_id", "name"};

std::string TypeName(const json& j) { return j.type_name(); }

// `line` with each invalid UTF-8 byte replaced by kBadByte.
std::string Sanitize(std::string_view line) {
  std::string out;
  out.reserve(line.size() + 16);
  for (size_t i = 0; i < line.size();) {
    size_t n = utf8::ValidSeqLen(line, i);
    if (n == 0) {
      out += kBadByte;
      ++i;
    } else {
      out.append(line.substr(i, n));
      i += n;
    }
  }
  return out;
}

// The first string field of an example that holds kBadByte ("messages[1].content"), or "".
std::string FindBadField(const json& obj) {
  auto bad = [](const json& v) {
    return v.is_string() && v.get_ref<const std::string&>().find(kBadByte) != std::string::npos;
  };
  if (!obj.is_object()) return "";
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    if (bad(it.value())) return it.key();
    if (it.key() == "messages" && it.value().is_array()) {
      const json& msgs = it.value();
      for (size_t i = 0; i < msgs.size(); ++i) {
        if (!msgs[i].is_object()) continue;
        for (auto m = msgs[i].begin(); m != msgs[i].end(); ++m) {
          if (bad(m.value())) return Cat("messages[", i, "].", m.key());
        }
      }
    }
  }
  return "";
}

// An error about the line at `where` ("train.jsonl:7").
template <typename... A>
Status LineError(std::string_view where, const A&... a) {
  return InvalidArgument(where, ": ", a...);
}

// The example's `tools`, or null when absent or JSON null.
const json* ToolsOf(const json& obj) {
  auto tools = obj.find("tools");
  return tools != obj.end() && !tools->is_null() ? &*tools : nullptr;
}

// The structure of a chat example: every message well-formed, at least one assistant message.
Status CheckMessages(const json& messages, const json* tools, std::string_view where) {
  if (!messages.is_array()) {
    return LineError(where, "`messages` is ", TypeName(messages), "; expected a list of messages");
  }
  if (messages.empty()) return LineError(where, "`messages` is empty");
  if (tools != nullptr && !tools->is_array()) {
    return LineError(where, "`tools` is ", TypeName(*tools), "; expected a list of tool schemas");
  }
  bool has_assistant = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    std::string field = Cat("messages[", i, "]");
    if (!m.is_object()) return LineError(where, field, " is ", TypeName(m), "; expected an object");
    auto role = m.find("role");
    if (role == m.end()) return LineError(where, field, ": missing field `role`");
    if (!role->is_string()) {
      return LineError(where, field, ".role is ", TypeName(*role), "; expected a string");
    }
    const std::string& r = role->get_ref<const std::string&>();
    if (std::find(std::begin(kRoles), std::end(kRoles), r) == std::end(kRoles)) {
      return LineError(where, field, ".role is \"", r,
                       "\"; allowed: system, user, assistant, tool, developer");
    }
    // An assistant message that calls tools may leave content out (OpenAI's format).
    auto tool_calls = m.find("tool_calls");
    const bool calls = r == "assistant" && tool_calls != m.end();
    if (calls && (!tool_calls->is_array() || tool_calls->empty())) {
      return LineError(where, field, ".tool_calls must be a non-empty list (got ",
                       TypeName(*tool_calls), ")");
    }
    auto content = m.find("content");
    if (content == m.end() && !calls) return LineError(where, field, ": missing field `content`");
    if (content != m.end() && !content->is_string() && !(calls && content->is_null())) {
      return LineError(where, field, ".content is ", TypeName(*content), "; expected a string");
    }
    if (auto w = m.find("weight"); w != m.end()) {
      if (r != "assistant") {
        return LineError(where, field, ".weight is only allowed on assistant messages (role is \"",
                         r, "\")");
      }
      if (!w->is_number_integer() || (w->get<int64_t>() != 0 && w->get<int64_t>() != 1)) {
        return LineError(where, field, ".weight is ", w->dump(), "; allowed: 0 or 1");
      }
    }
    has_assistant |= r == "assistant";
  }
  if (!has_assistant) return LineError(where, "no assistant message; nothing to train on");
  return OkStatus();
}

// One line parsed and its structure checked (everything that needs no tokenizer): valid UTF-8,
// a JSON object, a chat example (CheckMessages) or prompt and completion strings.
StatusOr<json> ParseExample(std::string_view line, std::string_view where) {
  size_t bad = utf8::FindInvalid(line);
  if (bad != std::string_view::npos) {
    std::string field;
    try {
      field = FindBadField(json::parse(Sanitize(line)));
    } catch (const json::exception&) {
    }
    return LineError(where, field.empty() ? "" : Cat(field, " "), "is not valid UTF-8 (byte 0x",
                     absl::StrFormat("%02X", static_cast<uint8_t>(line[bad])), " at column ",
                     bad + 1, ")");
  }
  // The parser for client JSON: a number beyond a double's range ("x": 1e400) is an error
  // naming the field here too, not an exception (which ended kilnd during an upload).
  StatusOr<json> parsed = ParseOrderedJsonObject(line, "");
  if (!parsed.ok()) return LineError(where, StatusMessage(parsed.status()));
  json obj = *std::move(parsed);
  if (auto messages = obj.find("messages"); messages != obj.end()) {
    KILN_RETURN_IF_ERROR(CheckMessages(*messages, ToolsOf(obj), where));
    return obj;
  }
  auto prompt = obj.find("prompt");
  auto completion = obj.find("completion");
  if (prompt != obj.end() && completion != obj.end()) {
    if (!prompt->is_string()) {
      return LineError(where, "prompt is ", TypeName(*prompt), "; expected a string");
    }
    if (!completion->is_string()) {
      return LineError(where, "completion is ", TypeName(*completion), "; expected a string");
    }
    return obj;
  }
  if (prompt != obj.end()) return LineError(where, "missing field `completion` (next to `prompt`)");
  if (completion != obj.end()) {
    return LineError(where, "missing field `prompt` (next to `completion`)");
  }
  return LineError(where, "expected field `messages` (chat) or `prompt` and `completion` (legacy)");
}

bool IsPrefix(const std::vector<int32_t>& p, const std::vector<int32_t>& full) {
  return p.size() <= full.size() && std::equal(p.begin(), p.end(), full.begin());
}

// Index of the first token where `a` and `b` differ (or the shorter's size).
size_t FirstDifference(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t n = std::min(a.size(), b.size());
  return std::mismatch(a.begin(), a.begin() + n, b.begin()).first - a.begin();
}

class LineTokenizer {
 public:
  LineTokenizer(std::string where, const Tokenizer& tok, const ChatTemplate* tmpl)
      : where_(std::move(where)), tok_(tok), tmpl_(tmpl) {}

  // REQUIRES: CheckMessages(messages, tools) passed.
  StatusOr<Example> Chat(const json& messages, const json* tools) {
    if (tmpl_ == nullptr) {
      return Error("chat example, but this model has no chat template; use the legacy ",
                   "{\"prompt\", \"completion\"} format or a model with a template");
    }
    tools_ = tools != nullptr ? *tools : json(nullptr);
    json plain = json::array();  // what the template sees: the keys of kPassedKeys
    std::vector<bool> trained(messages.size(), false);
    for (size_t i = 0; i < messages.size(); ++i) {
      const json& m = messages[i];
      const std::string& r = m["role"].get_ref<const std::string&>();
      trained[i] = r == "assistant" && m.value("weight", int64_t{1}) != 0;
      json& out = plain.emplace_back(json{{"role", r}});
      for (const char* key : kPassedKeys) {
        if (auto it = m.find(key); it != m.end()) out[key] = *it;
      }
      if (!out.contains("content")) out["content"] = nullptr;
    }

    Example ex;
    KILN_ASSIGN_OR_RETURN(Rendered full, Render(plain, plain.size(), false));
    ex.tokens = full.tokens;
    ex.loss.assign(ex.tokens.size(), 0);
    const std::vector<int32_t>& eog = tok_.eog_ids();
    for (size_t i = 0; i < plain.size(); ++i) {
      if (!trained[i]) continue;
      KILN_ASSIGN_OR_RETURN(Rendered before, Render(plain, i, true));
      KILN_ASSIGN_OR_RETURN(Rendered upto, Render(plain, i + 1, false));
      KILN_RETURN_IF_ERROR(CheckPrefix(before, upto, i,
                                       Cat("messages[0..", i, ") plus the generation prompt"),
                                       Cat("messages[0..", i, "]")));
      KILN_RETURN_IF_ERROR(
          CheckPrefix(upto, full, i, Cat("messages[0..", i, "]"), "the whole conversation"));
      // The reply ends at the template's end-of-turn token (a target: the model learns to
      // stop); what the template writes after it (ChatML's "\n") is not trained. The last such
      // token, so that one parsed from the content stays in the reply, as transformers'
      // {% generation %} masks have it.
      size_t end = upto.tokens.size();
      for (size_t t = end; t > before.tokens.size(); --t) {
        if (std::find(eog.begin(), eog.end(), upto.tokens[t - 1]) != eog.end()) {
          end = t;
          break;
        }
      }
      for (size_t t = before.tokens.size(); t < end; ++t) ex.loss[t] = 1;
    }
    return ex;
  }

  // REQUIRES: both are strings (ParseExample checked).
  StatusOr<Example> Legacy(const json& prompt, const json& completion) {
    if (tok_.eos_id() < 0) {
      return Error("the model's tokenizer has no EOS token to end the completion");
    }
    // Plain text: special-token text in it is not turned into control tokens.
    Example ex;
    KILN_ASSIGN_OR_RETURN(ex.tokens,
                          Encode(prompt.get_ref<const std::string&>(),
                                 {.add_special_tokens = true, .parse_special = false}, "prompt"));
    KILN_ASSIGN_OR_RETURN(
        std::vector<int32_t> comp,
        Encode(completion.get_ref<const std::string&>(),
               {.add_special_tokens = false, .parse_special = false}, "completion"));
    ex.loss.assign(ex.tokens.size(), 0);
    ex.tokens.insert(ex.tokens.end(), comp.begin(), comp.end());
    ex.tokens.push_back(tok_.eos_id());
    ex.loss.resize(ex.tokens.size(), 1);
    return ex;
  }

  template <typename... A>
  Status Error(const A&... a) const {
    return LineError(where_, a...);
  }

 private:
  StatusOr<std::vector<int32_t>> Encode(const std::string& text, const EncodeOptions& options,
                                        std::string_view what) const {
    auto ids = tok_.Encode(text, options);
    if (!ids.ok()) return Annotate(ids.status(), Cat(where_, ": ", what));
    return ids;
  }

  struct Rendered {
    std::string text;
    std::vector<int32_t> tokens;
  };

  // The first n messages rendered by the chat template, and their tokens.
  StatusOr<Rendered> Render(const json& messages, size_t n, bool generation_prompt) {
    ChatTemplate::Inputs in;
    in.messages = json(messages.begin(), messages.begin() + static_cast<ptrdiff_t>(n));
    in.add_generation_prompt = generation_prompt;
    in.tools = tools_;
    Rendered r;
    auto text = tmpl_->Apply(in);
    if (!text.ok()) return Annotate(text.status(), Cat(where_, ": chat template"));
    r.text = *std::move(text);
    // As transformers' apply_chat_template(tokenize=True): the template writes BOS itself.
    KILN_ASSIGN_OR_RETURN(
        r.tokens,
        Encode(r.text, {.add_special_tokens = false, .parse_special = true}, "rendered chat"));
    return r;
  }

  // OK if `part`'s tokens are a prefix of `whole`'s; otherwise says why the reply of
  // messages[i] cannot be located.
  Status CheckPrefix(const Rendered& part, const Rendered& whole, size_t i,
                     std::string_view part_name, std::string_view whole_name) const {
    if (IsPrefix(part.tokens, whole.tokens)) return OkStatus();
    const bool text_prefix = whole.text.starts_with(part.text);
    return Error("the chat template renders ", part_name, " into tokens that are not a prefix of ",
                 whole_name, "'s (they differ at token ",
                 FirstDifference(part.tokens, whole.tokens),
                 text_prefix ? "; the text is a prefix, but the tokenizer merges differently "
                               "across the end of it"
                             : "; the template renders earlier messages differently once "
                               "more follow",
                 "), so the reply of messages[", i, "] cannot be located");
  }

  std::string where_;
  json tools_ = nullptr;  // the example's `tools`, passed to every rendering
  const Tokenizer& tok_;
  const ChatTemplate* tmpl_;
};

StatusOr<Example> TokenizeLine(std::string_view line, const std::string& where,
                               const Tokenizer& tok, const ChatTemplate* tmpl) {
  KILN_ASSIGN_OR_RETURN(json obj, ParseExample(line, where));
  LineTokenizer lt(where, tok, tmpl);
  if (auto messages = obj.find("messages"); messages != obj.end()) {
    return lt.Chat(*messages, ToolsOf(obj));
  }
  return lt.Legacy(obj["prompt"], obj["completion"]);
}

uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

struct Fnv1a {
  uint64_t h = 0xCBF29CE484222325ull;
  void Add(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001B3ull;
  }
  template <typename T>
  void Add(const T& v) {
    Add(&v, sizeof(v));
  }
};

}  // namespace

std::vector<int32_t> NextTokenTargets(const Example& ex) {
  std::vector<int32_t> targets(ex.tokens.size(), kIgnoreIndex);
  for (size_t t = 0; t + 1 < ex.tokens.size(); ++t) {
    if (ex.loss[t + 1] != 0) targets[t] = ex.tokens[t + 1];
  }
  return targets;
}

int64_t TargetCount(const Example& ex) {
  int64_t n = 0;
  for (size_t t = 1; t < ex.loss.size(); ++t) n += ex.loss[t] != 0;
  return n;
}

Status ForEachJsonlLine(std::string_view text, std::string_view name,
                        absl::FunctionRef<Status(int64_t, std::string_view)> fn) {
  if (text.starts_with("\xEF\xBB\xBF")) text.remove_prefix(3);  // a UTF-8 byte order mark
  int64_t line_no = 0;
  bool any = false;
  for (size_t start = 0; start < text.size();) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(start, end - start);
    start = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    any = true;
    KILN_RETURN_IF_ERROR(fn(line_no, line));
  }
  if (!any) {
    return InvalidArgument(name, ": no examples (the file is empty or has only blank lines)");
  }
  return OkStatus();
}

Status CheckExampleLine(std::string_view line, std::string_view where) {
  return ParseExample(line, where).status();
}

StatusOr<std::vector<Example>> TokenizeJsonl(std::string_view text, std::string_view name,
                                             const Tokenizer& tokenizer,
                                             const ChatTemplate* chat_template,
                                             const TokenizeOptions& options,
                                             std::vector<std::string>* warnings) {
  if (options.max_seq_len < 2) {
    return InvalidArgument("max_seq_len is ", options.max_seq_len, "; it must be at least 2");
  }
  std::vector<Example> examples;
  std::vector<std::string> new_warnings;
  KILN_RETURN_IF_ERROR(
      ForEachJsonlLine(text, name, [&](int64_t line_no, std::string_view line) -> Status {
        std::string where = Cat(name, ":", line_no);
        KILN_ASSIGN_OR_RETURN(Example ex, TokenizeLine(line, where, tokenizer, chat_template));
        ex.source = where;
        const int64_t n = static_cast<int64_t>(ex.tokens.size());
        const bool truncated = n > options.max_seq_len;
        if (truncated) {
          ex.tokens.resize(options.max_seq_len);
          ex.loss.resize(options.max_seq_len);
          new_warnings.push_back(Cat(where, ": example has ", n,
                                     " tokens; truncated to max_seq_len ", options.max_seq_len));
        }
        if (TargetCount(ex) == 0) {
          return InvalidArgument(where, ": no token to train on: ",
                                 truncated ? Cat("every loss token is past max_seq_len ",
                                                 options.max_seq_len, " and was cut")
                                           : "every assistant message has weight 0");
        }
        examples.push_back(std::move(ex));
        return OkStatus();
      }));
  if (warnings != nullptr) {
    warnings->insert(warnings->end(), new_warnings.begin(), new_warnings.end());
  }
  return examples;
}

StatusOr<std::vector<Example>> TokenizeFile(const std::string& path, const Tokenizer& tokenizer,
                                            const ChatTemplate* chat_template,
                                            const TokenizeOptions& options,
                                            std::vector<std::string>* warnings) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(path, ": cannot open the training data file");
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return InvalidArgument(path, ": read error");
  return TokenizeJsonl(ss.str(), path, tokenizer, chat_template, options, warnings);
}

std::string DataPosition::ToString() const {
  return absl::StrFormat("epoch=%d next_example=%d fingerprint=%016x", epoch, next_example,
                         fingerprint);
}

StatusOr<DataPosition> DataPosition::Parse(std::string_view text) {
  DataPosition p;
  std::string s(text);
  long long epoch = 0, next = 0;
  unsigned long long fp = 0;
  int consumed = -1;
  if (std::sscanf(s.c_str(), "epoch=%lld next_example=%lld fingerprint=%16llx%n", &epoch, &next,
                  &fp, &consumed) != 3 ||
      consumed != static_cast<int>(s.size()) || epoch < 0 || next < 0) {
    return InvalidArgument("data position \"", s,
                           "\" is not of the form \"epoch=E next_example=N fingerprint=HEX\"");
  }
  p.epoch = epoch;
  p.next_example = next;
  p.fingerprint = fp;
  return p;
}

DataLoader::DataLoader(std::vector<Example> examples, const DataOptions& options)
    : examples_(std::move(examples)), options_(options) {
  Fnv1a f;
  f.Add(options_.max_seq_len);
  f.Add(options_.pack);
  f.Add(options_.seed);
  f.Add(options_.shuffle);
  f.Add(examples_.size());
  for (const Example& ex : examples_) {
    f.Add(ex.tokens.size());
    f.Add(ex.tokens.data(), ex.tokens.size() * sizeof(int32_t));
    f.Add(ex.loss.data(), ex.loss.size());
  }
  fingerprint_ = f.h;
  StartEpoch(0);
}

StatusOr<std::unique_ptr<DataLoader>> DataLoader::Create(std::vector<Example> examples,
                                                         const DataOptions& options) {
  if (options.max_seq_len < 2) {
    return InvalidArgument("max_seq_len is ", options.max_seq_len, "; it must be at least 2");
  }
  if (examples.empty()) return InvalidArgument("no training examples");
  for (size_t i = 0; i < examples.size(); ++i) {
    const Example& ex = examples[i];
    std::string what = ex.source.empty() ? Cat("example ", i) : ex.source;
    if (ex.tokens.empty()) return InvalidArgument(what, ": example has no tokens");
    if (ex.loss.size() != ex.tokens.size()) {
      return InvalidArgument(what, ": loss mask has ", ex.loss.size(), " entries for ",
                             ex.tokens.size(), " tokens");
    }
    if (static_cast<int64_t>(ex.tokens.size()) > options.max_seq_len) {
      return InvalidArgument(what, ": example has ", ex.tokens.size(),
                             " tokens; more than max_seq_len ", options.max_seq_len);
    }
    if (TargetCount(ex) == 0) return InvalidArgument(what, ": example has no token to train on");
  }
  return std::unique_ptr<DataLoader>(new DataLoader(std::move(examples), options));
}

StatusOr<std::unique_ptr<DataLoader>> DataLoader::FromFiles(std::span<const std::string> paths,
                                                            const Tokenizer& tokenizer,
                                                            const ChatTemplate* chat_template,
                                                            const DataOptions& options,
                                                            std::vector<std::string>* warnings) {
  if (paths.empty()) return InvalidArgument("no training data files given");
  std::vector<Example> all;
  std::vector<std::string> new_warnings;
  for (const std::string& path : paths) {
    KILN_ASSIGN_OR_RETURN(std::vector<Example> examples,
                          TokenizeFile(path, tokenizer, chat_template,
                                       {.max_seq_len = options.max_seq_len}, &new_warnings));
    std::move(examples.begin(), examples.end(), std::back_inserter(all));
  }
  DataOptions o = options;
  o.pad_token_id = tokenizer.pad_id() >= 0 ? tokenizer.pad_id() : std::max(tokenizer.eos_id(), 0);
  KILN_ASSIGN_OR_RETURN(auto loader, Create(std::move(all), o));
  if (warnings != nullptr) {
    warnings->insert(warnings->end(), new_warnings.begin(), new_warnings.end());
  }
  return loader;
}

std::vector<int64_t> DataLoader::EpochOrder(int64_t epoch) const {
  std::vector<int64_t> order(examples_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  if (!options_.shuffle) return order;
  // Fisher-Yates with SplitMix64 (std::shuffle's algorithm differs between standard
  // libraries). The modulo's bias is below 2^-40 for any realistic dataset size.
  uint64_t state = options_.seed + static_cast<uint64_t>(epoch);
  for (size_t i = order.size(); i > 1; --i) {
    size_t j = SplitMix64(&state) % i;
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

void DataLoader::StartEpoch(int64_t epoch) {
  epoch_ = epoch;
  next_ = 0;
  order_ = EpochOrder(epoch);
}

int64_t DataLoader::RowsInEpoch(int64_t epoch) const {
  std::vector<int64_t> order = EpochOrder(epoch);
  int64_t rows = 0;
  for (int64_t next = 0; next < static_cast<int64_t>(order.size()); ++rows) {
    FillRow(order, &next, nullptr, 0);
  }
  return rows;
}

TrainBatch DataLoader::EmptyBatch(int64_t rows) const {
  TrainBatch b;
  b.rows = rows;
  b.seq_len = options_.max_seq_len;
  const size_t n = static_cast<size_t>(rows * b.seq_len);
  b.tokens.assign(n, options_.pad_token_id);
  b.targets.assign(n, kIgnoreIndex);
  b.positions.assign(n, 0);
  b.doc_ids.assign(n, kPadDocId);
  return b;
}

void DataLoader::FillRow(std::span<const int64_t> order, int64_t* next, TrainBatch* b,
                         int64_t row) const {
  int64_t offset = 0;
  int32_t doc = 0;
  while (*next < static_cast<int64_t>(order.size())) {
    const Example& ex = examples_[order[*next]];
    const int64_t n = static_cast<int64_t>(ex.tokens.size());
    if (offset + n > options_.max_seq_len || (!options_.pack && doc > 0)) break;
    if (b != nullptr) {
      std::vector<int32_t> targets = NextTokenTargets(ex);
      const int64_t base = row * b->seq_len + offset;
      for (int64_t t = 0; t < n; ++t) {
        b->tokens[base + t] = ex.tokens[t];
        b->targets[base + t] = targets[t];
        b->positions[base + t] = static_cast<int32_t>(t);
        b->doc_ids[base + t] = doc;
        b->target_count += targets[t] != kIgnoreIndex;
      }
      ++b->example_count;
    }
    ++*next;
    offset += n;
    ++doc;
  }
}

TrainBatch DataLoader::NextBatch(int64_t batch_size) {
  KILN_CHECK(batch_size > 0, "NextBatch: batch_size must be positive");
  TrainBatch b = EmptyBatch(batch_size);
  for (int64_t row = 0; row < batch_size; ++row) {
    if (next_ >= static_cast<int64_t>(order_.size())) StartEpoch(epoch_ + 1);
    FillRow(order_, &next_, &b, row);
  }
  return b;
}

std::vector<TrainBatch> DataLoader::OnePass(int64_t batch_size) const {
  KILN_CHECK(batch_size > 0, "OnePass: batch_size must be positive");
  std::vector<int64_t> order(examples_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::vector<TrainBatch> batches;
  int64_t next = 0;
  while (next < static_cast<int64_t>(order.size())) {
    TrainBatch b = EmptyBatch(batch_size);
    int64_t rows = 0;
    while (rows < batch_size && next < static_cast<int64_t>(order.size())) {
      FillRow(order, &next, &b, rows++);
    }
    if (rows < batch_size) {  // the last batch: drop the rows nothing was packed into
      const size_t n = static_cast<size_t>(rows * b.seq_len);
      b.rows = rows;
      b.tokens.resize(n);
      b.targets.resize(n);
      b.positions.resize(n);
      b.doc_ids.resize(n);
    }
    batches.push_back(std::move(b));
  }
  return batches;
}

DataPosition DataLoader::position() const {
  return {.epoch = epoch_, .next_example = next_, .fingerprint = fingerprint_};
}

Status DataLoader::Seek(const DataPosition& pos) {
  if (pos.fingerprint != fingerprint_) {
    return InvalidArgument("data position ", pos.ToString(),
                           " was saved for other training data or options (this ",
                           "data's fingerprint is ", absl::StrFormat("%016x", fingerprint_),
                           "); resume with the same files, max_seq_len, pack, shuffle and seed");
  }
  if (pos.epoch < 0 || pos.next_example < 0 || pos.next_example > example_count()) {
    return InvalidArgument("data position ", pos.ToString(), " is out of range (", example_count(),
                           " examples)");
  }
  StartEpoch(pos.epoch);
  next_ = pos.next_example;
  return OkStatus();
}

}  // namespace kiln::models::train
