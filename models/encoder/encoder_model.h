// Sentence-embedding models: a BERT-family encoder (BertModel: absolute positions, post-
// LayerNorm blocks, GELU MLP, WordPiece tokenizer) with the pooling and normalisation that the
// folder's sentence-transformers configuration asks for.
//
//   KILN_ASSIGN_OR_RETURN(auto model, EncoderModel::Load(config));  // kind: embedding
//   KILN_ASSIGN_OR_RETURN(EncodedText t, model->Tokenize("A sentence."));
//   KILN_ASSIGN_OR_RETURN(std::vector<float> v, model->Embed({t.ids}));  // [1, dim]
//
// The folder is a sentence-transformers export (config.json with model_type "bert",
// tokenizer.json, model.safetensors; modules.json naming a Pooling module's folder with its
// config.json and, optionally, a Normalize module; sentence_bert_config.json's
// max_seq_length) or a plain Hugging Face BertModel folder (then: mean pooling, no
// normalisation, max_position_embeddings tokens). Weights are indexed under llama.cpp's BERT
// GGUF names ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.layer_output_norm.weight").
//
// One step embeds a batch of B texts padded to the longest one's L tokens: the encoder's
// attention is bidirectional over each text's own tokens (attn::KeyPaddingMask), and pooling
// is a [B, L] weight matrix times the last hidden states (mean: 1/len on the text's tokens;
// CLS: 1 on its first), so the graph is compiled once, symbolic in B and L.
//
// Thread-safety: Tokenize and the accessors are thread-safe; Embed runs one batch at a time
// per model (callers serialise, as the dynamic batcher does per instance).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "config/config.h"
#include "engine/base/status.h"

namespace kiln::models {

class Tokenizer;

enum class EmbeddingPooling { kMean, kCls };

struct EncoderInfo {
  std::string name;          // the folder's name
  std::string architecture;  // "bert"
  int32_t dimensions = 0;    // the embedding's size (hidden size)
  int32_t max_tokens = 0;    // per text, [CLS] and [SEP] included
  int32_t num_layers = 0;
  EmbeddingPooling pooling = EmbeddingPooling::kMean;
  bool normalize = false;  // L2-normalised outputs (a sentence-transformers Normalize module)
  int32_t max_batch = 0;   // texts per Embed call
};

// A text as the encoder takes it.
struct EncodedText {
  std::vector<int32_t> ids;  // [CLS] ... [SEP]
  bool truncated = false;    // cut to max_tokens (the last token is still [SEP])
};

class EncoderModel {
 public:
  // Opens `config.path` (see the header comment) and compiles the encoder on `config.backend`
  // with `config.threads` threads; `config.context_length` (> 0) lowers max_tokens and
  // `config.max_batch_size` (> 0) sets max_batch (default 32). Errors name the file and key:
  // not a BERT model, an unsupported position embedding, activation or pooling mode,
  // missing or mis-shaped tensors.
  static StatusOr<std::unique_ptr<EncoderModel>> Load(const config::ModelConfig& config);
  ~EncoderModel();

  const EncoderInfo& info() const { return info_; }
  const Tokenizer& tokenizer() const;

  // What Tokenize refuses, without tokenizing: InvalidArgument for an empty text or invalid
  // UTF-8.
  static Status CheckText(std::string_view text);

  // Tokenizes `text` (special-token text such as "[SEP]" stays plain text) and adds [CLS]
  // and [SEP]. Texts longer than max_tokens are cut (truncated = true); callers that must
  // not truncate refuse those. InvalidArgument for invalid UTF-8 or an empty text.
  StatusOr<EncodedText> Tokenize(std::string_view text) const;

  // The embeddings of `texts` (each from Tokenize: 2..max_tokens ids), row-major
  // [texts.size(), dimensions], pooled and (if info().normalize) L2-normalised. Batches over
  // max_batch run in several steps. InvalidArgument for an empty list or a text of a wrong
  // length.
  StatusOr<std::vector<float>> Embed(std::span<const std::vector<int32_t>> texts);

  struct Impl;

 private:
  explicit EncoderModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  EncoderInfo info_;
};

}  // namespace kiln::models
