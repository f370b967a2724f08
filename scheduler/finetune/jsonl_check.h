// The upload-time check of a fine-tuning file (POST /v1/files with purpose "fine-tune"): its
// structure as OpenAI's chat or prompt/completion JSONL, without a tokenizer, so a malformed
// file is refused when it is sent rather than when a job later tokenizes it.
//
//   KILN_RETURN_IF_ERROR(CheckFineTuneJsonl(content, "train.jsonl"));
//
// The rules are training's own (models/train/dataset.h, CheckExampleLine): a file that passes
// fails training only for what needs the base model (no chat template, no token left to train
// on, a template that cannot be rendered prefix by prefix).
#pragma once

#include <string_view>

#include "engine/base/status.h"

namespace kiln::finetune {

// OK, or InvalidArgument with param "file" naming the line and the key:
//   train.jsonl: line 7: messages[2].role is "bot"; allowed: system, user, assistant, tool, ...
// Every non-blank line must be a JSON object with either "messages" (a non-empty list of
// messages with a known role and string content, at least one from the assistant; "weight"
// 0 or 1 on assistant messages only) or "prompt" and "completion" strings. Invalid UTF-8 and
// a file without examples are refused. A UTF-8 byte order mark and "\r\n" are accepted.
// `name` is what the message calls the file (the uploaded file name). Thread-safe.
Status CheckFineTuneJsonl(std::string_view text, std::string_view name);

}  // namespace kiln::finetune
