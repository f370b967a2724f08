#include "models/lora/peft_io.h"

#include <sys/stat.h>

#include <charconv>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/str_join.h"
#include "models/io/durable_file.h"
#include "models/io/errors.h"
#include "models/safetensors/safetensors.h"

namespace kiln::models {
namespace {

using json = nlohmann::json;

constexpr std::string_view kConfigFile = "adapter_config.json";
constexpr std::string_view kWeightsFile = "adapter_model.safetensors";
constexpr std::string_view kLayersPrefix = "base_model.model.model.layers.";

bool IsAttention(std::string_view module) {
  return module == "q_proj" || module == "k_proj" || module == "v_proj" || module == "o_proj";
}

std::string GgufName(int64_t layer, std::string_view module) {
  return Cat("blk.", layer, ".", GgufSuffixForPeftModule(module), ".weight");
}

// "blk.3.attn_q.weight" -> (3, "q_proj"); false for any other name.
bool ParseGgufName(const std::string& name, int64_t& layer, std::string_view& module) {
  std::string_view s = name;
  constexpr std::string_view kBlk = "blk.", kWeight = ".weight";
  if (!s.starts_with(kBlk) || !s.ends_with(kWeight)) return false;
  s = s.substr(kBlk.size(), s.size() - kBlk.size() - kWeight.size());
  const size_t dot = s.find('.');
  if (dot == std::string_view::npos || dot == 0) return false;
  auto [end, ec] = std::from_chars(s.data(), s.data() + dot, layer);
  if (ec != std::errc() || end != s.data() + dot || layer < 0) return false;
  module = PeftModuleForGgufSuffix(s.substr(dot + 1));
  return !module.empty();
}

// "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight" -> (3, "q_proj", 'A').
bool ParsePeftName(std::string_view s, int64_t& layer, std::string_view& module, char& ab) {
  if (!s.starts_with(kLayersPrefix)) return false;
  s.remove_prefix(kLayersPrefix.size());
  const size_t dot = s.find('.');
  if (dot == std::string_view::npos || dot == 0) return false;
  auto [end, ec] = std::from_chars(s.data(), s.data() + dot, layer);
  if (ec != std::errc() || end != s.data() + dot || layer < 0) return false;
  s.remove_prefix(dot + 1);
  for (std::string_view m : PeftModuleNames()) {
    const std::string group = IsAttention(m) ? "self_attn." : "mlp.";
    for (char c : {'A', 'B'}) {
      if (s == Cat(group, m, ".lora_", std::string(1, c), ".weight")) {
        module = m;
        ab = c;
        return true;
      }
    }
  }
  return false;
}

std::string ShapeText(int64_t a, int64_t b) { return Cat("(", a, ", ", b, ")"); }
std::string ShapeText(const std::vector<int64_t>& s) {
  return Cat("(", absl::StrJoin(s, ", "), ")");
}

// Checks a layer against the base model and rank; `where` is "adapter layer blk.3.attn_q".
Status CheckLayerShapes(const std::string& where, std::string_view module,
                        const LoraLayerShape& want, int64_t r, int64_t a_rows, int64_t a_cols,
                        int64_t b_rows, int64_t b_cols) {
  if (a_cols != want.in) {
    return InvalidArgument(where, ": lora_A is ", ShapeText(a_rows, a_cols), " but the model's ",
                           module, " takes ", want.in, " inputs");
  }
  if (b_rows != want.out) {
    return InvalidArgument(where, ": lora_B is ", ShapeText(b_rows, b_cols), " but the model's ",
                           module, " has ", want.out, " outputs");
  }
  if (a_rows != r || b_cols != r) {
    return InvalidArgument(where, ": lora_A is ", ShapeText(a_rows, a_cols), " and lora_B is ",
                           ShapeText(b_rows, b_cols), " but the rank r is ", r);
  }
  return OkStatus();
}

std::vector<float> PermuteRows(const std::vector<float>& w, int64_t rows, int64_t cols,
                               int64_t n_head, bool to_gguf) {
  KILN_CHECK(n_head > 0 && rows % (2 * n_head) == 0, "q/k rows must split into 2 * n_head");
  KILN_CHECK(static_cast<int64_t>(w.size()) == rows * cols, "matrix size must be rows * cols");
  const int64_t d = rows / n_head, half = d / 2;
  std::vector<float> out(w.size());
  for (int64_t h = 0; h < n_head; ++h) {
    for (int64_t p = 0; p < half; ++p) {
      for (int64_t s = 0; s < 2; ++s) {
        const int64_t hf = h * d + s * half + p, gguf = h * d + 2 * p + s;
        const int64_t src = to_gguf ? hf : gguf, dst = to_gguf ? gguf : hf;
        std::copy_n(w.begin() + src * cols, cols, out.begin() + dst * cols);
      }
    }
  }
  return out;
}

// The number of heads whose rows are permuted in `module`'s lora_B, or 0 if none.
int64_t PermutedHeads(const PeftBaseModel& base, std::string_view module) {
  if (!base.qk_rows_permuted) return 0;
  if (module == "q_proj") return base.hparams.num_heads;
  if (module == "k_proj") return base.hparams.num_kv_heads;
  return 0;
}

template <typename T>
StatusOr<T> Field(const json& j, const std::string& file, const char* key, T dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    return InvalidArgument(file, ": \"", key, "\" is ", it->dump(), "; expected a ",
                           std::is_same_v<T, bool>          ? "boolean"
                           : std::is_same_v<T, std::string> ? "string"
                                                            : "number");
  }
}

bool IsEmptyOrNull(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() || it->empty();
}

}  // namespace

PeftBaseModel PeftBaseModel::FromHParams(const LlmHParams& hparams, std::string name_or_path) {
  PeftBaseModel b;
  b.hparams = hparams;
  b.qk_rows_permuted = hparams.use_rope && hparams.rope.layout == RopeParams::Layout::kInterleaved;
  b.name_or_path = std::move(name_or_path);
  return b;
}

StatusOr<LoraLayerShape> PeftModuleShape(const LlmHParams& hp, std::string_view module) {
  if (hp.architecture == "gpt2") {
    return InvalidArgument("LoRA adapters in PEFT format are supported for the llama family, not ",
                           hp.architecture);
  }
  const int64_t c = hp.hidden_size, q = hp.num_heads * hp.head_dim,
                kv = hp.num_kv_heads * hp.head_dim, f = hp.ffn_size;
  if (module == "q_proj") return LoraLayerShape{c, q};
  if (module == "k_proj" || module == "v_proj") return LoraLayerShape{c, kv};
  if (module == "o_proj") return LoraLayerShape{q, c};
  if (module == "gate_proj" || module == "up_proj") return LoraLayerShape{c, f};
  if (module == "down_proj") return LoraLayerShape{f, c};
  return InvalidArgument("unknown LoRA module '", module, "'; allowed: ", PeftModuleNameList());
}

std::string PeftTensorName(int64_t layer, std::string_view module, char ab) {
  return Cat(kLayersPrefix, layer, IsAttention(module) ? ".self_attn." : ".mlp.", module, ".lora_",
             std::string(1, ab), ".weight");
}

std::vector<float> HfToGgufQkRows(const std::vector<float>& w, int64_t rows, int64_t cols,
                                  int64_t n_head) {
  return PermuteRows(w, rows, cols, n_head, /*to_gguf=*/true);
}

std::vector<float> GgufToHfQkRows(const std::vector<float>& w, int64_t rows, int64_t cols,
                                  int64_t n_head) {
  return PermuteRows(w, rows, cols, n_head, /*to_gguf=*/false);
}

Status WritePeftAdapter(const std::string& dir, const LoraAdapter& adapter,
                        const PeftBaseModel& base) {
  const LoraConfig& cfg = adapter.config;
  KILN_RETURN_IF_ERROR(cfg.Validate());
  KILN_ASSIGN_OR_RETURN(std::vector<std::string> targets, ResolveTargetModules(cfg.target_modules));
  if (adapter.layers.empty()) return InvalidArgument("LoRA adapter has no layers to write");
  SafetensorsWriter st;
  st.SetMetadata("format", "pt");  // what PEFT writes
  const int64_t r = cfg.r;
  for (const auto& [name, layer] : adapter.layers) {
    int64_t index;
    std::string_view module;
    if (!ParseGgufName(name, index, module)) {
      return InvalidArgument("adapter layer '", name,
                             "' is not a GGUF weight name of a LoRA module (blk.N.attn_q.weight, "
                             "attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down)");
    }
    const std::string where =
        Cat("adapter layer blk.", index, ".", GgufSuffixForPeftModule(module));
    if (index >= base.hparams.num_layers) {
      return InvalidArgument(where, ": layer ", index, " is past the model's ",
                             base.hparams.num_layers, " layers");
    }
    if (std::find(targets.begin(), targets.end(), module) == targets.end()) {
      return InvalidArgument(where, ": ", module, " is not in target_modules (",
                             absl::StrJoin(targets, " "), ")");
    }
    KILN_ASSIGN_OR_RETURN(LoraLayerShape want, PeftModuleShape(base.hparams, module));
    KILN_RETURN_IF_ERROR(CheckLayerShapes(where, module, want, r, r, layer.in, layer.out, r));
    if (static_cast<int64_t>(layer.a.size()) != r * layer.in ||
        static_cast<int64_t>(layer.b.size()) != layer.out * r) {
      return InvalidArgument(where, ": lora_A holds ", layer.a.size(), " values and lora_B ",
                             layer.b.size(), "; expected ", r * layer.in, " and ", layer.out * r);
    }
    KILN_RETURN_IF_ERROR(st.AddFloats(PeftTensorName(index, module, 'A'), {r, layer.in},
                                      layer.a.data(), layer.a.size()));
    const int64_t heads = PermutedHeads(base, module);
    const std::vector<float> b = heads > 0 ? GgufToHfQkRows(layer.b, layer.out, r, heads) : layer.b;
    KILN_RETURN_IF_ERROR(
        st.AddFloats(PeftTensorName(index, module, 'B'), {layer.out, r}, b.data(), b.size()));
  }

  // Keys PEFT has had since 0.10, so older versions load the file too; newer versions write
  // more keys, whose defaults apply when absent (loading is checked with PEFT 0.21.2).
  json config = {
      {"alpha_pattern", json::object()},
      {"auto_mapping", nullptr},
      {"base_model_name_or_path",
       base.name_or_path.empty() ? json(nullptr) : json(base.name_or_path)},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"layer_replication", nullptr},
      {"layers_pattern", nullptr},
      {"layers_to_transform", nullptr},
      {"loftq_config", json::object()},
      {"lora_alpha", cfg.alpha},
      {"lora_dropout", cfg.dropout},
      {"megatron_config", nullptr},
      {"megatron_core", "megatron.core"},
      {"modules_to_save", nullptr},
      {"peft_type", "LORA"},
      {"r", cfg.r},
      {"rank_pattern", json::object()},
      {"revision", nullptr},
      {"target_modules", targets},
      {"task_type", "CAUSAL_LM"},
      {"use_dora", false},
      {"use_rslora", cfg.use_rslora},
  };
  // PEFT writes integral alphas as integers ("lora_alpha": 16).
  if (cfg.alpha < 1e15 && cfg.alpha == std::floor(cfg.alpha)) {
    config["lora_alpha"] = static_cast<int64_t>(cfg.alpha);
  }

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Internal(dir, ": cannot create the adapter directory: ", ec.message());
  KILN_RETURN_IF_ERROR(WriteFileDurably(Cat(dir, "/", kConfigFile), config.dump(2) + "\n"));
  KILN_RETURN_IF_ERROR(st.WriteFile(Cat(dir, "/", kWeightsFile)));
  return FsyncDirectory(dir);
}

StatusOr<LoraAdapter> ReadPeftAdapter(const std::string& dir, const PeftBaseModel& base) {
  const std::string config_path = Cat(dir, "/", kConfigFile);
  const std::string weights_path = Cat(dir, "/", kWeightsFile);
  std::error_code ec;
  if (!std::filesystem::exists(config_path, ec)) {
    return NotFound(config_path, ": no such file (a PEFT adapter directory holds ", kConfigFile,
                    " and ", kWeightsFile, ")");
  }
  if (!std::filesystem::exists(weights_path, ec)) {
    if (std::filesystem::exists(Cat(dir, "/adapter_model.bin"), ec)) {
      return NotFound(weights_path, ": no such file; ", dir,
                      " has a pickled adapter_model.bin, which Kiln does not read (save it "
                      "again with save_pretrained(..., safe_serialization=True))");
    }
    return NotFound(weights_path, ": no such file");
  }

  // adapter_config.json
  KILN_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(config_path));
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    return InvalidArgument(config_path, ": not valid JSON: ", e.what());
  }
  if (!j.is_object()) return InvalidArgument(config_path, ": expected a JSON object");
  KILN_ASSIGN_OR_RETURN(std::string peft_type, Field<std::string>(j, config_path, "peft_type", ""));
  if (peft_type != "LORA") {
    return InvalidArgument(config_path, ": peft_type is \"", peft_type,
                           "\"; Kiln reads LoRA adapters (\"LORA\")");
  }
  LoraAdapter adapter;
  LoraConfig& cfg = adapter.config;
  if (!j.contains("r") || !j["r"].is_number_integer()) {
    return InvalidArgument(config_path, ": \"r\" must be a positive integer, got ",
                           j.contains("r") ? j["r"].dump() : "nothing");
  }
  cfg.r = j["r"].get<int64_t>();
  KILN_ASSIGN_OR_RETURN(cfg.alpha, Field<double>(j, config_path, "lora_alpha", 8.0));
  KILN_ASSIGN_OR_RETURN(cfg.dropout, Field<double>(j, config_path, "lora_dropout", 0.0));
  KILN_ASSIGN_OR_RETURN(cfg.use_rslora, Field<bool>(j, config_path, "use_rslora", false));
  KILN_ASSIGN_OR_RETURN(std::string bias, Field<std::string>(j, config_path, "bias", "none"));
  KILN_ASSIGN_OR_RETURN(bool dora, Field<bool>(j, config_path, "use_dora", false));
  KILN_ASSIGN_OR_RETURN(bool fan_in_fan_out, Field<bool>(j, config_path, "fan_in_fan_out", false));
  if (bias != "none") {
    return Unimplemented(config_path, ": bias is \"", bias, "\"; Kiln applies only \"none\"");
  }
  if (dora) return Unimplemented(config_path, ": use_dora is true; Kiln does not apply DoRA");
  if (fan_in_fan_out) {
    return Unimplemented(config_path,
                         ": fan_in_fan_out is true (GPT-2 Conv1D layers); "
                         "Kiln reads llama-family adapters");
  }
  for (const char* key : {"rank_pattern", "alpha_pattern", "modules_to_save"}) {
    if (!IsEmptyOrNull(j, key)) {
      return Unimplemented(config_path, ": \"", key, "\" is ", j[key].dump(),
                           "; Kiln supports one rank and alpha for all layers and no "
                           "modules_to_save");
    }
  }
  // target_modules: a list of names, or a string (a regex, or "all-linear"), in which case
  // the tensors present decide.
  bool targets_from_tensors = false;
  if (auto it = j.find("target_modules"); it != j.end() && it->is_array()) {
    cfg.target_modules.clear();
    for (const json& m : *it) {
      if (!m.is_string()) {
        return InvalidArgument(config_path, ": target_modules must be a list of strings, got ",
                               it->dump());
      }
      // PEFT matches names by suffix and, for "all-linear", saves full module paths
      // ("model.layers.1.mlp.gate_proj"): keep the last component.
      const std::string name = m.get<std::string>();
      const size_t dot = name.rfind('.');
      std::string module = dot == std::string::npos ? name : name.substr(dot + 1);
      if (GgufSuffixForPeftModule(module).empty() && module != "all-linear") {
        return Unimplemented(config_path, ": target module \"", name,
                             "\" is not one Kiln applies LoRA to (", PeftModuleNameList(), ")");
      }
      if (std::find(cfg.target_modules.begin(), cfg.target_modules.end(), module) ==
          cfg.target_modules.end()) {
        cfg.target_modules.push_back(std::move(module));
      }
    }
    if (auto resolved = ResolveTargetModules(cfg.target_modules); !resolved.ok()) {
      return Annotate(resolved.status(), config_path);
    } else {
      cfg.target_modules = *resolved;
    }
  } else if (it != j.end() && it->is_string() && it->get<std::string>() == "all-linear") {
    cfg.target_modules = {"all-linear"};
  } else {
    targets_from_tensors = true;
  }
  if (Status s = cfg.Validate(); !s.ok()) return Annotate(s, config_path);

  // adapter_model.safetensors
  KILN_ASSIGN_OR_RETURN(auto st, SafetensorsFile::Open(weights_path));
  KILN_ASSIGN_OR_RETURN(std::vector<std::string> allowed, ResolveTargetModules(cfg.target_modules));
  struct Pending {
    const SafetensorsTensor* a = nullptr;
    const SafetensorsTensor* b = nullptr;
    int64_t layer;
    std::string_view module;
  };
  std::map<std::string, Pending> pending;  // by GGUF name
  std::set<std::string> present_modules;
  for (const SafetensorsTensor& t : st->tensors()) {
    int64_t layer;
    std::string_view module;
    char ab;
    if (!ParsePeftName(t.name, layer, module, ab)) {
      return InvalidArgument(weights_path, ": tensor \"", t.name,
                             "\" is not a LoRA weight Kiln knows (expected names like ",
                             PeftTensorName(0, "q_proj", 'A'), " for ", PeftModuleNameList(), ")");
    }
    const std::string gguf = GgufName(layer, module);
    const std::string where =
        Cat(weights_path, ": adapter layer blk.", layer, ".", GgufSuffixForPeftModule(module));
    if (layer >= base.hparams.num_layers) {
      return InvalidArgument(where, ": layer ", layer, " is past the model's ",
                             base.hparams.num_layers, " layers");
    }
    if (!targets_from_tensors &&
        std::find(allowed.begin(), allowed.end(), module) == allowed.end()) {
      return InvalidArgument(where, ": ", module,
                             " is not in adapter_config.json's target_modules (",
                             absl::StrJoin(allowed, " "), ")");
    }
    if (t.shape.size() != 2) {
      return InvalidArgument(where, ": lora_", std::string(1, ab), " has shape ",
                             ShapeText(t.shape), "; expected a matrix");
    }
    Pending& p = pending[gguf];
    p.layer = layer;
    p.module = module;
    (ab == 'A' ? p.a : p.b) = &t;
    present_modules.insert(std::string(module));
  }
  if (pending.empty()) return InvalidArgument(weights_path, ": holds no LoRA tensors");
  for (const auto& [gguf, p] : pending) {
    const std::string where =
        Cat(weights_path, ": adapter layer blk.", p.layer, ".", GgufSuffixForPeftModule(p.module));
    if (p.a == nullptr || p.b == nullptr) {
      return InvalidArgument(where, ": has ", p.a ? "lora_A" : "lora_B", " but no ",
                             p.a ? "lora_B" : "lora_A");
    }
    KILN_ASSIGN_OR_RETURN(LoraLayerShape want, PeftModuleShape(base.hparams, p.module));
    KILN_RETURN_IF_ERROR(CheckLayerShapes(where, p.module, want, cfg.r, p.a->shape[0],
                                          p.a->shape[1], p.b->shape[0], p.b->shape[1]));
    LoraLayer layer;
    layer.in = want.in;
    layer.out = want.out;
    KILN_ASSIGN_OR_RETURN(layer.a, SafetensorsToFloats(*p.a));
    KILN_ASSIGN_OR_RETURN(layer.b, SafetensorsToFloats(*p.b));
    if (const int64_t heads = PermutedHeads(base, p.module); heads > 0) {
      layer.b = HfToGgufQkRows(layer.b, layer.out, cfg.r, heads);
    }
    adapter.layers.emplace(gguf, std::move(layer));
  }
  if (targets_from_tensors) {
    cfg.target_modules.clear();
    for (std::string_view m : PeftModuleNames()) {
      if (present_modules.count(std::string(m))) cfg.target_modules.emplace_back(m);
    }
  }
  return adapter;
}

}  // namespace kiln::models
