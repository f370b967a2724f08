// Turning what a client sent (plain text, token ids or a chat) into the token ids of a
// prompt, and the limits every LLM front end applies to it.
//
// Control tokens: text from a client is tokenized with parse_special = false, so typing
// "<|im_end|>" into a prompt or a message cannot forge the model's markup; it is plain
// text. Chat templates render their own control tokens: the rendered prompt is tokenized
// with parse_special = true, and where a message itself contains control-token text, the
// message contents are tokenized apart from the template's markup (see BuildPrompt). Clients
// that need control tokens in a raw prompt send token ids.
//
// Thread-safety: pure functions over const model state (the tokenizer and chat template are
// safe to use concurrently).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "models/llm/llm_model.h"
#include "nlohmann/json.hpp"
#include "scheduler/llm/continuous_batcher.h"

namespace kiln::llm {

// max_tokens when a request leaves it out: OpenAI's semantics (up to the rest of the context)
// with this cap, so a forgotten limit cannot hold a sequence for a model's whole 128k context.
inline constexpr int32_t kDefaultMaxTokens = 4096;

// Prompt text longer than this many bytes per token of the context is refused without
// tokenizing it (natural text averages about 4; the margin is for pathological tokenizations).
inline constexpr int64_t kMaxPromptBytesPerToken = 64;

// Roles a chat message may have. "developer" (OpenAI's newer name for system) is rendered as
// "system".
inline constexpr std::string_view kChatRoles = "system, user, assistant, tool, developer";

struct PromptRequest {
  enum class Kind { kText, kTokenIds, kChat };
  Kind kind = Kind::kText;
  // The request field the prompt came from ("prompt", "messages", "text_input",
  // "chat.messages"): error messages and OpenAI's `param` name it.
  std::string field = "prompt";
  std::string text;                // kText
  std::vector<int64_t> token_ids;  // kTokenIds (wide, so bad ids are reported, not wrapped)
  // kChat: [{"role": ..., "content": ...}, ...] in OpenAI's shape; content may be a string,
  // null, or a list of {"type": "text", "text": ...} parts. Other keys (name, tool_calls,
  // tool_call_id) pass through to the template.
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  bool add_generation_prompt = true;
  // kText: add BOS/EOS as the tokenizer's configuration asks. Chats never add them: the
  // template writes what the model expects (as transformers' apply_chat_template does).
  bool add_special_tokens = true;
};

struct Prompt {
  std::vector<int32_t> ids;
  // The prompt as text: kText as given, kChat as rendered, kTokenIds decoded (for echo and
  // Triton's exclude_input_in_output = false).
  std::string text;
};

// Validates and tokenizes. InvalidArgument (its param set to the offending field, see
// params.h) for: text longer than kMaxPromptBytesPerToken x the context; an empty prompt or
// message list; a message that is not an object, with a
// missing, non-string or unknown role, or content that is neither a string, null nor a list
// of text parts; token ids outside the vocabulary; invalid UTF-8; a model without a chat
// template (for chats); errors raised by the template itself ("roles must alternate").
StatusOr<Prompt> BuildPrompt(const models::LlmModel& model, std::string_view model_name,
                             const PromptRequest& request);

// The messages as the template sees them: each an object with a string role (developer ->
// system) and string content (text parts joined with "\n"; null stays null). Errors as
// above, naming `field`[i].
StatusOr<nlohmann::ordered_json> NormalizeMessages(const nlohmann::ordered_json& messages,
                                                   std::string_view field);

// Tokens the model's KV cache holds in all (one sequence can use at most this many).
int64_t KvCapacityTokens(const ContinuousBatcher& batcher);

// Checks the prompt against the context and the KV cache and resolves max_tokens:
// `requested` if given (it must be >= 1 and fit: prompt + max_tokens <= context), else
// min(rest of the context, rest of the KV cache, default_max_tokens). Errors are
// InvalidArgument naming both numbers, e.g. "the prompt is 9000 tokens but model 'smollm2'
// has a context of 8192 tokens" (param `prompt_field`) or "`max_tokens` is 100000 but the
// prompt (12 tokens) leaves room for at most 8180 in model 'smollm2''s context of 8192
// tokens" (param `max_tokens_field`).
StatusOr<int32_t> ResolveMaxTokens(const ContinuousBatcher& batcher, int64_t prompt_tokens,
                                   std::optional<int64_t> requested,
                                   std::string_view max_tokens_field, std::string_view prompt_field,
                                   int32_t default_max_tokens = kDefaultMaxTokens);

}  // namespace kiln::llm
