#include "models/train/export.h"

#include <filesystem>

#include "backends/registry.h"
#include "models/arch/arch.h"
#include "models/io/durable_file.h"
#include "models/io/errors.h"
#include "models/llm/loader.h"
#include "models/lora/peft_io.h"
#include "models/safetensors/safetensors.h"

namespace kiln::models {

Status CheckHfWritable(const PagedLlmParts& parts) {
  if (!parts.files->is_gguf() || parts.hparams.architecture == "llama") return OkStatus();
  // MakeHfLayout writes a Llama config.json for a GGUF, which only a `llama` GGUF matches
  // (Gemma's norms, Phi-3's fused projections and Qwen's biases would be lost).
  return Unimplemented(parts.files->weights_path(), ": writing a Hugging Face folder from a ",
                       parts.hparams.architecture,
                       " GGUF is not supported (only llama GGUF files); start from the model's "
                       "Hugging Face folder instead");
}

HfLayout MakeHfLayout(const PagedLlmParts& parts) {
  HfLayout h;
  const LlmHParams& hp = parts.hparams;
  const HfNaming& naming = parts.arch->hf_naming();
  for (const HfTensorName& n : naming.global) h.hf_of[std::string(n.gguf)] = std::string(n.hf);
  for (int64_t l = 0; l < hp.num_layers; ++l) {
    for (const HfTensorName& n : naming.per_layer) {
      h.hf_of[Cat("blk.", l, ".", n.gguf)] = Cat(naming.layer_prefixes[0], l, ".", n.hf);
    }
  }
  h.qk_permuted = PeftBaseModel::FromHParams(hp, "").qk_rows_permuted;
  if (!parts.files->is_gguf()) {
    // A folder's weights go back under the names they were read from: two Hugging Face names
    // may map to one GGUF name (Phi-3's mlp.gate_up_proj and Llama's mlp.up_proj: ffn_up).
    for (auto& [gguf, hf] : h.hf_of) {
      if (const WeightInfo* w = parts.files->Find(gguf)) hf = w->stored_name;
    }
    h.config = parts.files->hf()->config.raw;
  } else {
    h.config = {{"architectures", {"LlamaForCausalLM"}},
                {"model_type", "llama"},
                {"hidden_size", hp.hidden_size},
                {"intermediate_size", hp.ffn_size},
                {"num_attention_heads", hp.num_heads},
                {"num_key_value_heads", hp.num_kv_heads},
                {"num_hidden_layers", hp.num_layers},
                {"head_dim", hp.head_dim},
                {"rms_norm_eps", hp.norm_eps},
                {"rope_theta", hp.rope.theta},
                {"vocab_size", hp.vocab_size},
                {"max_position_embeddings", hp.context_length},
                {"tie_word_embeddings", hp.tied_embeddings},
                {"attention_bias", hp.attn_qkv_bias},
                {"mlp_bias", hp.mlp_bias},
                {"torch_dtype", "float32"}};
  }
  return h;
}

namespace {

std::vector<float> QkRowOrder(const std::string& gguf_name, std::vector<float> v,
                              const std::vector<int64_t>& shape, const LlmHParams& hp,
                              const HfLayout& layout, bool to_hf) {
  const bool q = gguf_name.ends_with(".attn_q.weight"), k = gguf_name.ends_with(".attn_k.weight");
  if (!layout.qk_permuted || !(q || k) || shape.size() != 2) return v;
  const int64_t heads = q ? hp.num_heads : hp.num_kv_heads;
  return to_hf ? GgufToHfQkRows(v, shape[0], shape[1], heads)
               : HfToGgufQkRows(v, shape[0], shape[1], heads);
}

}  // namespace

std::vector<float> HfRowOrder(const std::string& gguf_name, std::vector<float> v,
                              const std::vector<int64_t>& shape, const LlmHParams& hp,
                              const HfLayout& layout) {
  return QkRowOrder(gguf_name, std::move(v), shape, hp, layout, /*to_hf=*/true);
}

std::vector<float> ModelRowOrder(const std::string& gguf_name, std::vector<float> v,
                                 const std::vector<int64_t>& shape, const LlmHParams& hp,
                                 const HfLayout& layout) {
  return QkRowOrder(gguf_name, std::move(v), shape, hp, layout, /*to_hf=*/false);
}

Status WriteHfModel(const std::string& out_dir, const std::string& model_path,
                    const PagedLlmParts& parts, const HfLayout& layout,
                    const std::map<std::string, std::vector<float>>& tensors) {
  const LlmHParams& hp = parts.hparams;
  KILN_RETURN_IF_ERROR(CheckHfWritable(parts));
  SafetensorsWriter writer;
  for (const auto& [name, v] : tensors) {
    auto it = layout.hf_of.find(name);
    if (it == layout.hf_of.end())
      return Unimplemented("no Hugging Face name for weight '", name, "'");
    const WeightInfo* w = parts.files->Find(name);
    KILN_CHECK(w != nullptr, "WriteHfModel: a weight the files do not have");
    const std::vector<int64_t> shape = w->LoadedShape();
    const std::vector<float> rows = HfRowOrder(name, v, shape, hp, layout);
    KILN_RETURN_IF_ERROR(writer.AddFloats(it->second, shape, rows.data(), rows.size()));
  }
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return Internal("cannot create '", out_dir, "': ", ec.message());
  KILN_RETURN_IF_ERROR(writer.WriteFile(out_dir + "/model.safetensors"));
  KILN_RETURN_IF_ERROR(WriteFileDurably(out_dir + "/config.json", layout.config.dump(2)));
  if (!parts.files->is_gguf()) {
    for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}) {
      StatusOr<std::string> bytes = ReadWholeFile(model_path + "/" + f);
      if (bytes.ok()) KILN_RETURN_IF_ERROR(WriteFileDurably(out_dir + "/" + f, *bytes));
    }
  }
  return OkStatus();
}

Status ExportMerged(const std::string& model_path, const std::string& adapter_dir,
                    const std::string& out_dir) {
  config::ModelConfig mc;
  mc.path = model_path;
  mc.backend = "ref";
  KILN_ASSIGN_OR_RETURN(PagedLlmParts parts, OpenLlmParts(mc));
  KILN_RETURN_IF_ERROR(CheckHfWritable(parts));  // before reading and merging every weight
  KILN_ASSIGN_OR_RETURN(
      LoraAdapter adapter,
      ReadPeftAdapter(adapter_dir, PeftBaseModel::FromHParams(parts.hparams, model_path)));
  const HfLayout layout = MakeHfLayout(parts);
  auto keepalive = std::const_pointer_cast<ModelFiles>(parts.files);
  std::map<std::string, std::vector<float>> tensors;
  for (const auto& [gguf, hf] : layout.hf_of) {
    const WeightInfo* w = parts.files->Find(gguf);
    if (w == nullptr) continue;  // optional tensors (biases, an untied head) the model lacks
    KILN_ASSIGN_OR_RETURN(Tensor t, parts.files->Load(*w, *parts.device, keepalive));
    KILN_ASSIGN_OR_RETURN(std::vector<double> d, t.ToDoubles());
    std::vector<float> v(d.begin(), d.end());
    if (auto it = adapter.layers.find(gguf); it != adapter.layers.end()) {
      // W[o, i] += scale * sum_k B[o, k] A[k, i], in double, rows in the model's order.
      const LoraLayer& l = it->second;
      const int64_t r = adapter.config.r;
      const double scale = adapter.config.scale();
      for (int64_t o = 0; o < l.out; ++o) {
        for (int64_t i = 0; i < l.in; ++i) {
          double acc = 0;
          for (int64_t k = 0; k < r; ++k) acc += double{l.b[o * r + k]} * l.a[k * l.in + i];
          v[o * l.in + i] = static_cast<float>(v[o * l.in + i] + scale * acc);
        }
      }
    }
    tensors.emplace(gguf, std::move(v));
  }
  return WriteHfModel(out_dir, model_path, parts, layout, tensors);
}

}  // namespace kiln::models
