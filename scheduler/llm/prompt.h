// Turning what a client sent (plain text, token ids or a chat) into the token ids of a
// prompt: the prompt-building part of the request path (scheduler/generation.h).
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

#include "engine/base/status.h"
#include "nlohmann/json.hpp"

namespace kiln {

namespace models {
class LlmModel;
}

// Prompt text longer than this many bytes per token of the context is refused without
// tokenizing it (natural text averages about 4; the margin is for pathological tokenizations).
inline constexpr int64_t kMaxPromptBytesPerToken = 64;

// Roles a chat message may have. "developer" (OpenAI's newer name for system) is rendered as
// "system".
inline constexpr std::string_view kChatRoles = "system, user, assistant, tool, developer";

struct PromptInput {
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
  // kChat: OpenAI's `tools` (checked by the front end, models/chat/tool_calls.h ReadTools), or
  // null. Rendered by the template where it takes `tools`, else written into the system prompt
  // (models::ToolSystemPrompt).
  nlohmann::ordered_json tools = nullptr;
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
// WithParam) for: text longer than kMaxPromptBytesPerToken x the context; an empty message
// list; a message that is not an object, with a
// missing, non-string or unknown role, or content that is neither a string, null nor a list
// of text parts; token ids outside the vocabulary; invalid UTF-8; a model without a chat
// template (for chats); errors raised by the template itself ("roles must alternate"). An
// empty prompt is not an error here (Tokenize answers it); ContinuousBatcher::Check refuses
// it for generation.
StatusOr<Prompt> BuildPrompt(const models::LlmModel& model, std::string_view model_name,
                             const PromptInput& request);

// The messages as the template sees them: each an object with a string role (developer ->
// system) and string content (text parts joined with "\n"; an assistant's null or missing
// content reads as "", as OpenAI takes it; other keys such as tool_calls are kept). Errors
// as above, naming `field`[i].
StatusOr<nlohmann::ordered_json> NormalizeMessages(const nlohmann::ordered_json& messages,
                                                   std::string_view field);

}  // namespace kiln
