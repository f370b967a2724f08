// libFuzzer target: chat template lexer/parser/evaluator on arbitrary template text.
#include <cstddef>
#include <cstdint>
#include <string>

#include "models/chat/jinja.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view src(reinterpret_cast<const char*>(data), size);
  auto t = kiln::models::jinja::Template::Parse(src, "fuzz");
  if (!t.ok()) return 0;
  static const nlohmann::ordered_json ctx = nlohmann::ordered_json::parse(R"({
    "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi ünï"},
                 {"role": "assistant", "content": "ok", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>", "tools": null})");
  (void)(*t)->Render(ctx);
  return 0;
}
