// The files of a generative model being loaded — a GGUF file or a Hugging Face folder
// (config.json + safetensors) — with its tensors under one naming scheme: GGUF's
// ("token_embd.weight", "blk.3.attn_q.weight"). Architecture files describe how Hugging Face
// names map to it (HfNaming); GGUF files need no mapping.
//
//   KILN_ASSIGN_OR_RETURN(auto files, ModelFiles::Open(path));
//   if (!files->is_gguf()) KILN_RETURN_IF_ERROR(files->IndexSafetensors(naming, num_layers));
//   const WeightInfo* w = files->Find("blk.0.attn_q.weight");
//   KILN_ASSIGN_OR_RETURN(Tensor t, files->Load(*w, device, keepalive));
//
// Weights stay in the file's memory mapping (zero-copy) when the device can wrap host memory
// and the stored type is one the engine runs natively: F32, F16, BF16, Q4_0, Q4_1, Q8_0,
// MXFP4. Converted at load: Q5_0 to Q8_0 exactly (same scale, q - 16), Q5_1 and the K-quants
// Q4_K/Q5_K/Q6_K to Q8_0 (row by row; see LoadedDType), 1-D tensors (norm weights, biases) to
// F32, and Hugging Face GPT-2 Conv1D
// matrices, stored [in, out], transposed to [out, in].
//
// Thread-safety: immutable after Open/IndexSafetensors; const methods are safe to call
// concurrently.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/backend/backend.h"
#include "engine/base/status.h"
#include "engine/dtype.h"
#include "engine/tensor.h"
#include "models/gguf/gguf.h"
#include "models/hf/hf_folder.h"
#include "models/safetensors/safetensors.h"

namespace kiln::models {

// How an architecture's Hugging Face tensor names map to GGUF names.
struct HfTensorName {
  std::string_view hf;     // "model.embed_tokens.weight"; per layer: "self_attn.q_proj.weight"
  std::string_view gguf;   // "token_embd.weight";         per layer: "attn_q.weight"
  bool transpose = false;  // stored [in, out] (GPT-2 Conv1D): transposed to [out, in] at load
};
struct HfNaming {
  // Prefixes of per-layer names, tried in order, each followed by "<layer>.":
  // "model.layers." gives "model.layers.3.self_attn.q_proj.weight".
  std::vector<std::string_view> layer_prefixes;
  std::vector<HfTensorName> global;
  std::vector<HfTensorName> per_layer;  // GGUF side gets "blk.<layer>." prepended
  // Stored tensors that are not weights (rotary caches, attention-mask buffers): suffixes.
  std::vector<std::string_view> ignored_suffixes;
  // Prefixes stripped from stored names before matching ("transformer." for some GPT-2
  // exports that save the base model).
  std::vector<std::string_view> strip_prefixes;
};

// One stored tensor, under its GGUF-style name.
struct WeightInfo {
  std::string name;               // "blk.3.attn_q.weight"
  std::string stored_name;        // the name in the file ("model.layers.3.self_attn.q_proj.weight")
  std::string file;               // the file that holds it, for messages
  DType dtype = DType::kInvalid;  // as stored
  std::vector<int64_t> shape;     // as stored, outermost first (GGUF dims reversed)
  const void* data = nullptr;     // into the file mapping
  uint64_t bytes = 0;
  bool transpose = false;  // stored [K, N]; loaded as [N, K]
  bool copied = false;     // data is ModelFiles' own copy (AddConcatenatedRows), not the file's

  // The shape the model sees (after the transposition, if any).
  std::vector<int64_t> LoadedShape() const;
  // "model.layers.3.self_attn.q_proj.weight (blk.3.attn_q.weight)" or "blk.3.attn_q.weight".
  std::string DisplayName() const;
};

// The dtype a stored tensor is loaded as (see the header comment), or InvalidArgument naming
// the tensor, its type and the supported types.
StatusOr<DType> LoadedDType(const WeightInfo& w);

// "[576, 49152]"
std::string ShapeString(const std::vector<int64_t>& shape);

class ModelFiles {
 public:
  // A GGUF file (recognized by its magic), or a folder with config.json (Hugging Face).
  // Errors: NotFound for a missing path; InvalidArgument for a path that is neither, e.g. a
  // lone .safetensors file (its config.json is needed) — the message says what is expected.
  static StatusOr<std::unique_ptr<ModelFiles>> Open(const std::string& path);

  bool is_gguf() const { return gguf_ != nullptr; }
  const std::string& path() const { return path_; }
  const GgufFile* gguf() const { return gguf_.get(); }
  const HfFolder* hf() const { return hf_ ? &*hf_ : nullptr; }
  // GGUF general.architecture, or config.json model_type.
  const std::string& architecture() const { return architecture_; }
  // general.name, or the folder's base name.
  std::string DisplayModelName() const;

  // Hugging Face folders: opens the safetensors weights and indexes them under GGUF names.
  // Stored names the naming does not know are reported as a warning (they are unused), layers
  // >= num_layers are an error. REQUIRES: !is_gguf().
  Status IndexSafetensors(const HfNaming& naming, int64_t num_layers);

  // nullptr when the model has no tensor of that name.
  const WeightInfo* Find(std::string_view name) const;
  // How a missing tensor is named in messages: its stored name too for Hugging Face folders.
  std::string MissingName(std::string_view name) const;
  // The file messages name for weights (the GGUF file, or the safetensors index/file).
  const std::string& weights_path() const { return weights_path_; }

  // Whether AddConcatenatedRows can join `parts`: each exists, is stored as it loads (no
  // conversion or transposition), and all have one dtype and row length.
  bool CanConcatenateRows(std::span<const std::string> parts) const;
  // Adds `name`: the rows of `parts` one after another (e.g. the q, k and v projections as one
  // weight): the parts' own bytes where they follow one another in the file, otherwise a copy
  // this object owns. Does nothing when `name` exists. ResourceExhausted
  // when the memory cannot be had. REQUIRES: CanConcatenateRows(parts).
  Status AddConcatenatedRows(const std::string& name, std::span<const std::string> parts);

  // The tensor on `device` as `LoadedDType`, zero-copy where possible. `keepalive` is held
  // by buffers that point into the mapping (pass the owner of this ModelFiles).
  StatusOr<Tensor> Load(const WeightInfo& w, backend::Device& device,
                        std::shared_ptr<void> keepalive) const;

 private:
  ModelFiles() = default;
  void IndexGguf();
  std::optional<std::string> MapHfName(const HfNaming& naming, std::string_view stored,
                                       int64_t num_layers, bool* transpose, Status* error) const;

  std::string path_;
  std::string architecture_;
  std::string weights_path_;
  std::unique_ptr<GgufFile> gguf_;
  std::optional<HfFolder> hf_;
  std::unique_ptr<SafetensorsModel> safetensors_;
  std::map<std::string, WeightInfo, std::less<>> weights_;
  std::vector<std::shared_ptr<void>> owned_;  // AddConcatenatedRows' tensors
  std::optional<HfNaming> naming_;            // Hugging Face folders
};

}  // namespace kiln::models
