// Training data for fine-tuning: JSONL files -> tokenized examples with loss masks -> packed
// batches of next-token targets. docs/training.md ("## Data") documents the file formats.
//
//   const std::vector<std::string> files = {"train.jsonl"};
//   std::vector<std::string> warnings;
//   KILN_ASSIGN_OR_RETURN(auto data, DataLoader::FromFiles(files, tokenizer, chat_template,
//                                                         {.max_seq_len = 1024}, &warnings));
//   for (const auto& w : warnings) LOG(WARNING) << w;      // truncated examples
//   if (resuming) {
//     KILN_ASSIGN_OR_RETURN(DataPosition pos, DataPosition::Parse(checkpoint.data_position));
//     KILN_RETURN_IF_ERROR(data->Seek(pos));
//   }
//   TrainBatch b = data->NextBatch(8);                     // one step
//   checkpoint.data_position = data->position().ToString();
//
// Two stages, usable separately:
//   1. TokenizeJsonl / TokenizeFile: each line becomes an Example (token ids + a loss mask).
//      Chat lines are rendered with the model's own chat template; the assistant tokens are
//      found by rendering the conversation prefix by prefix (see TokenizeJsonl).
//   2. DataLoader: shuffles (per epoch, by seed), packs examples into rows of max_seq_len and
//      hands out TrainBatch after TrainBatch across epochs. It takes already tokenized
//      examples, so it can be driven without a model.
//
// Errors are Status values naming file, line and field ("train.jsonl:7: messages[2].role is
// "bot"; allowed: system, user, assistant, tool, developer"); on error nothing partial is returned.
// Nothing here prints: warnings go to the caller's list. The tokenizer and chat template are
// only used during the calls that take them; nothing keeps a reference to them.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/functional/function_ref.h"
#include "engine/base/status.h"

namespace kiln::models {
class Tokenizer;
class ChatTemplate;
}  // namespace kiln::models

namespace kiln::models::train {

// Target of a position that is not trained (PyTorch's cross-entropy ignore_index).
inline constexpr int32_t kIgnoreIndex = -100;
// Document id of padding positions: matches no real document (those are 0, 1, ... per row),
// and the attention mask is same-document AND causal, so padding attends to other padding only.
inline constexpr int32_t kPadDocId = -1;

// One tokenized training example.
struct Example {
  std::vector<int32_t> tokens;
  // loss[t] == 1: tokens[t] is a loss token (predicted from position t-1). Same size as tokens.
  // loss[0] never produces a target (nothing precedes it).
  std::vector<uint8_t> loss;
  // "file:line", for messages.
  std::string source;
};

// Next-token targets of one example: target[t] = tokens[t+1] if loss[t+1] else kIgnoreIndex;
// the last position is kIgnoreIndex. Same size as ex.tokens.
std::vector<int32_t> NextTokenTargets(const Example& ex);
// How many targets NextTokenTargets gives (loss tokens after position 0).
int64_t TargetCount(const Example& ex);

struct TokenizeOptions {
  // Longer examples are cut to their first max_seq_len tokens (with a warning).
  int64_t max_seq_len = 2048;
};

// Parses a JSONL file's text, one example per non-blank line:
//   chat:   {"messages": [{"role": "system"|"user"|"assistant"|"tool"|"developer",
//                          "content": "...",
//                          "weight": 0|1 (optional, assistant messages only)}, ...],
//            "tools": [...] (optional, passed to the template)}
//           An assistant message with "tool_calls" may omit content (or give null); the
//           template sees role, content, tool_calls, tool_call_id and name.
//   legacy: {"prompt": "...", "completion": "..."}
// Chat: the conversation is rendered with `chat_template` (add_generation_prompt false) and
// tokenized as transformers' apply_chat_template does (no BOS/EOS added by the tokenizer,
// special-token text parsed). For each assistant message i with weight != 0 (default 1), the
// loss tokens are tokens(render(messages[:i+1])) minus tokens(render(messages[:i], with the
// generation prompt)), i.e. the reply without its header, cut after the last end-of-generation
// token (Tokenizer::eog_ids(), e.g. ChatML's <|im_end|>), which is a target as in TRL, so the
// model learns to stop; what the template writes after it ("\n") is not. Each prefix's tokens
// must be a prefix of the whole conversation's; a template that breaks this is an error.
// Legacy: tokens(prompt, the tokenizer's BOS if it adds one, special-token text NOT parsed) +
// tokens(completion, likewise, no BOS) + EOS; loss on the completion and EOS.
// Errors: not JSON, not an object, missing or mistyped field, unknown role, weight not 0/1,
// weight on a non-assistant message, no assistant message, invalid UTF-8, every loss token
// masked (all weights 0, or truncation cut them all), no examples at all.
// `name` prefixes messages ("train.jsonl:7: ..."). Appends one warning per truncated example.
// `chat_template` may be null: chat lines then fail ("this model has no chat template").
StatusOr<std::vector<Example>> TokenizeJsonl(std::string_view text, std::string_view name,
                                             const Tokenizer& tokenizer,
                                             const ChatTemplate* chat_template,
                                             const TokenizeOptions& options,
                                             std::vector<std::string>* warnings);
// The lines of a JSONL file's text as TokenizeJsonl reads them: a UTF-8 byte order mark is
// skipped, "\r\n" line ends are accepted, blank lines (spaces and tabs only) are skipped. Calls
// fn(line number from 1, line without its end) for each other line and stops at the first
// error, which it returns. InvalidArgument ("<name>: no examples ...") when no line is left.
Status ForEachJsonlLine(std::string_view text, std::string_view name,
                        absl::FunctionRef<Status(int64_t, std::string_view)> fn);

// The structure of one example line, checked without a tokenizer: every error of TokenizeJsonl
// above except those that need the model (no chat template, no EOS token, the template's
// rendering, no token left to train on). For a check at upload time that agrees with what
// training will accept. `where` prefixes the message ("train.jsonl:7: messages[2].role is
// \"bot\"; allowed: ...").
Status CheckExampleLine(std::string_view line, std::string_view where);

// Reads `path` and calls TokenizeJsonl with it as name.
StatusOr<std::vector<Example>> TokenizeFile(const std::string& path, const Tokenizer& tokenizer,
                                            const ChatTemplate* chat_template,
                                            const TokenizeOptions& options,
                                            std::vector<std::string>* warnings);

// rows * seq_len tokens, row-major. Attention for row r: query i sees key j iff
// doc_ids[r, j] == doc_ids[r, i] && j <= i. Padding: token pad_token_id, target kIgnoreIndex,
// position 0, doc id kPadDocId.
struct TrainBatch {
  int64_t rows = 0;
  int64_t seq_len = 0;
  std::vector<int32_t> tokens;
  std::vector<int32_t> targets;    // kIgnoreIndex where there is no loss
  std::vector<int32_t> positions;  // restart at 0 for every example
  std::vector<int32_t> doc_ids;    // 0, 1, ... per example within a row; kPadDocId for padding
  int64_t target_count = 0;        // targets != kIgnoreIndex (the loss's denominator)
  int64_t example_count = 0;       // examples in the batch
};

struct DataOptions {
  // Row length of every batch (fixed, so the trainer's graph has one shape). Examples must fit.
  int64_t max_seq_len = 2048;
  // Pack several examples per row (greedily, in order, while the next one fits); otherwise one
  // example per row, padded.
  bool pack = true;
  // Epoch e visits the examples in the order of a Fisher-Yates shuffle driven by
  // SplitMix64(seed + e), the same on every platform. shuffle == false: file order.
  uint64_t seed = 0;
  bool shuffle = true;
  int32_t pad_token_id = 0;  // FromFiles sets it: the tokenizer's pad token, else EOS, else 0
};

// Where the loader is: the next batch starts with the `next_example`-th example of epoch
// `epoch`'s order. `fingerprint` identifies the data and options that order depends on, so a
// position cannot be applied to other data.
struct DataPosition {
  int64_t epoch = 0;
  int64_t next_example = 0;
  uint64_t fingerprint = 0;

  // "epoch=2 next_example=17 fingerprint=0123456789abcdef"; Parse accepts exactly that.
  std::string ToString() const;
  static StatusOr<DataPosition> Parse(std::string_view text);
  bool operator==(const DataPosition&) const = default;
};

// Hands out training batches in a deterministic order across epochs.
// Thread-safety: not thread-safe; one consumer (the trainer loop). const methods may run
// concurrently with each other.
class DataLoader {
 public:
  // Takes ownership of the examples. InvalidArgument if there are none, or one is empty, longer
  // than max_seq_len, has loss.size() != tokens.size() or no target (names its source).
  static StatusOr<std::unique_ptr<DataLoader>> Create(std::vector<Example> examples,
                                                      const DataOptions& options);
  // Tokenizes every file (in order, examples concatenated) and creates the loader.
  // options.max_seq_len also truncates; pad_token_id comes from the tokenizer.
  static StatusOr<std::unique_ptr<DataLoader>> FromFiles(std::span<const std::string> paths,
                                                         const Tokenizer& tokenizer,
                                                         const ChatTemplate* chat_template,
                                                         const DataOptions& options,
                                                         std::vector<std::string>* warnings);

  // The next batch_size rows (seq_len = max_seq_len). Rows never mix epochs; a batch may:
  // when an epoch runs out the next one starts (reshuffled). REQUIRES: batch_size > 0.
  TrainBatch NextBatch(int64_t batch_size);

  // Every example once, in file order, packed the same way; the last batch may have fewer
  // rows. For validation. REQUIRES: batch_size > 0.
  std::vector<TrainBatch> OnePass(int64_t batch_size) const;

  // How many rows epoch `epoch` packs into (with pack, it depends on the epoch's order), e.g.
  // for the number of steps of a learning-rate schedule: an epoch is
  // RowsInEpoch(e) / batch_size steps on average (batches run on into the next epoch).
  int64_t RowsInEpoch(int64_t epoch) const;

  DataPosition position() const;
  // Continue from `pos` (from position() of a loader over the same data and options), so a
  // resumed run sees exactly the batches an uninterrupted one would. InvalidArgument when the
  // fingerprint differs or next_example is out of range.
  Status Seek(const DataPosition& pos);

  int64_t example_count() const { return static_cast<int64_t>(examples_.size()); }
  const DataOptions& options() const { return options_; }
  const std::vector<Example>& examples() const { return examples_; }

 private:
  DataLoader(std::vector<Example> examples, const DataOptions& options);
  // The order in which epoch `epoch` visits the examples.
  std::vector<int64_t> EpochOrder(int64_t epoch) const;
  void StartEpoch(int64_t epoch);
  // Packs examples_[order[*next]], ... into row `row` of `batch` while they fit; advances *next.
  // batch == nullptr: only advances (counts a row).
  void FillRow(std::span<const int64_t> order, int64_t* next, TrainBatch* batch, int64_t row) const;
  TrainBatch EmptyBatch(int64_t rows) const;

  std::vector<Example> examples_;
  DataOptions options_;
  uint64_t fingerprint_ = 0;
  int64_t epoch_ = 0;
  int64_t next_ = 0;
  std::vector<int64_t> order_;  // examples of epoch_, in visiting order
};

}  // namespace kiln::models::train
