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
// Where PEFT's names put layer N: "base_model.model." + the Hugging Face model's path.
std::string_view LayersPrefix(std::string_view architecture) {
  return architecture == "gpt2" ? "base_model.model.transformer.h."
                                : "base_model.model.model.layers.";
}

std::string TensorName(std::string_view arch, int64_t layer, const LoraModule& m, char ab) {
  return Cat(LayersPrefix(arch), layer, ".", m.path, ".lora_", std::string(1, ab), ".weight");
}

std::string GgufName(int64_t layer, const LoraModule& m) {
  return Cat("blk.", layer, ".", m.gguf, ".weight");
}

// (in, out) of module `m` (by its GGUF weight) in `hp`'s model.
LoraLayerShape ModuleShape(const LlmHParams& hp, const LoraModule& m) {
  const int64_t c = hp.hidden_size, q = hp.num_heads * hp.head_dim,
                kv = hp.num_kv_heads * hp.head_dim, f = hp.ffn_size;
  const std::string_view g = m.gguf;
  if (g == "attn_q") return {c, q};
  if (g == "attn_k" || g == "attn_v") return {c, kv};
  if (g == "attn_qkv") return {c, q + 2 * kv};
  if (g == "attn_output") return {q, c};
  if (g == "ffn_gate") return {c, f};
  if (g == "ffn_up") return {c, hp.fused_gate_up ? 2 * f : f};  // Phi-3: gate and up rows
  if (g == "ffn_down") return {f, c};
  KILN_CHECK(false, "every LoRA module has a shape rule");
  return {};
}

// adapter_config.json's target_modules for a set of modules: each module's name, or its path
// where the set holds only some of the modules of that name (GPT-2's attn.c_proj alone).
std::vector<std::string> TargetNames(std::string_view arch, const std::vector<LoraModule>& on) {
  std::vector<std::string> out;
  for (const LoraModule& m : on) {
    bool all_of_name = true;
    for (const LoraModule& o : LoraModules(arch)) {
      if (o.name != m.name) continue;
      all_of_name &=
          std::any_of(on.begin(), on.end(), [&](const LoraModule& x) { return x.gguf == o.gguf; });
    }
    std::string t(all_of_name ? m.name : m.path);
    if (std::find(out.begin(), out.end(), t) == out.end()) out.push_back(std::move(t));
  }
  return out;
}

bool Contains(const std::vector<LoraModule>& on, const LoraModule& m) {
  return std::any_of(on.begin(), on.end(), [&](const LoraModule& x) { return x.gguf == m.gguf; });
}

// "blk.3.attn_q.weight" -> (3, q_proj); false for any other name.
bool ParseGgufName(std::string_view arch, const std::string& name, int64_t& layer,
                   const LoraModule*& module) {
  std::string_view s = name;
  constexpr std::string_view kBlk = "blk.", kWeight = ".weight";
  if (!s.starts_with(kBlk) || !s.ends_with(kWeight)) return false;
  s = s.substr(kBlk.size(), s.size() - kBlk.size() - kWeight.size());
  const size_t dot = s.find('.');
  if (dot == std::string_view::npos || dot == 0) return false;
  auto [end, ec] = std::from_chars(s.data(), s.data() + dot, layer);
  if (ec != std::errc() || end != s.data() + dot || layer < 0) return false;
  module = LoraModuleForGguf(arch, s.substr(dot + 1));
  return module != nullptr;
}

// "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight" -> (3, q_proj, 'A').
bool ParsePeftName(std::string_view arch, std::string_view s, int64_t& layer,
                   const LoraModule*& module, char& ab) {
  const std::string_view prefix = LayersPrefix(arch);
  if (!s.starts_with(prefix)) return false;
  s.remove_prefix(prefix.size());
  const size_t dot = s.find('.');
  if (dot == std::string_view::npos || dot == 0) return false;
  auto [end, ec] = std::from_chars(s.data(), s.data() + dot, layer);
  if (ec != std::errc() || end != s.data() + dot || layer < 0) return false;
  s.remove_prefix(dot + 1);
  for (const LoraModule& m : LoraModules(arch)) {
    for (char c : {'A', 'B'}) {
      if (s == Cat(m.path, ".lora_", std::string(1, c), ".weight")) {
        module = &m;
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
int64_t PermutedHeads(const PeftBaseModel& base, const LoraModule& m) {
  if (!base.qk_rows_permuted) return 0;
  if (m.gguf == "attn_q") return base.hparams.num_heads;
  if (m.gguf == "attn_k") return base.hparams.num_kv_heads;
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
  const LoraModule* found = nullptr;
  for (const LoraModule& m : LoraModules(hp.architecture)) {
    if (m.name != module && m.path != module) continue;
    if (found != nullptr) {
      return InvalidArgument("LoRA module '", module, "' names several modules of ",
                             hp.architecture, "; use one of ", LoraModuleList(hp.architecture));
    }
    found = &m;
  }
  if (found == nullptr) {
    return InvalidArgument("unknown LoRA module '", module, "' for ", hp.architecture,
                           "; allowed: ", LoraModuleList(hp.architecture));
  }
  return ModuleShape(hp, *found);
}

std::string PeftTensorName(int64_t layer, std::string_view module, char ab) {
  for (const LoraModule& m : LoraModules("llama")) {
    if (m.name == module) return TensorName("llama", layer, m, ab);
  }
  return Cat(LayersPrefix("llama"), layer, ".", module, ".lora_", std::string(1, ab), ".weight");
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
  const std::string& arch = base.hparams.architecture;
  KILN_ASSIGN_OR_RETURN(std::vector<LoraModule> targets,
                        ResolveLoraModules(arch, cfg.target_modules));
  const std::vector<std::string> target_names = TargetNames(arch, targets);
  if (adapter.layers.empty()) return InvalidArgument("LoRA adapter has no layers to write");
  SafetensorsWriter st;
  st.SetMetadata("format", "pt");  // what PEFT writes
  const int64_t r = cfg.r;
  for (const auto& [name, layer] : adapter.layers) {
    int64_t index;
    const LoraModule* m = nullptr;
    if (!ParseGgufName(arch, name, index, m)) {
      std::string suffixes;
      for (const LoraModule& x : LoraModules(arch)) suffixes.append(", ").append(x.gguf);
      return InvalidArgument("adapter layer '", name,
                             "' is not a GGUF weight name of a LoRA module", " of ", arch,
                             " (blk.N.<module>.weight", suffixes, ")");
    }
    const std::string_view module = LoraModuleLabel(arch, *m);
    const std::string where = Cat("adapter layer blk.", index, ".", m->gguf);
    if (index >= base.hparams.num_layers) {
      return InvalidArgument(where, ": layer ", index, " is past the model's ",
                             base.hparams.num_layers, " layers");
    }
    if (!Contains(targets, *m)) {
      return InvalidArgument(where, ": ", module, " is not in target_modules (",
                             absl::StrJoin(target_names, " "), ")");
    }
    const LoraLayerShape want = ModuleShape(base.hparams, *m);
    KILN_RETURN_IF_ERROR(CheckLayerShapes(where, module, want, r, r, layer.in, layer.out, r));
    if (static_cast<int64_t>(layer.a.size()) != r * layer.in ||
        static_cast<int64_t>(layer.b.size()) != layer.out * r) {
      return InvalidArgument(where, ": lora_A holds ", layer.a.size(), " values and lora_B ",
                             layer.b.size(), "; expected ", r * layer.in, " and ", layer.out * r);
    }
    KILN_RETURN_IF_ERROR(st.AddFloats(TensorName(arch, index, *m, 'A'), {r, layer.in},
                                      layer.a.data(), layer.a.size()));
    const int64_t heads = PermutedHeads(base, *m);
    const std::vector<float> b = heads > 0 ? GgufToHfQkRows(layer.b, layer.out, r, heads) : layer.b;
    KILN_RETURN_IF_ERROR(
        st.AddFloats(TensorName(arch, index, *m, 'B'), {layer.out, r}, b.data(), b.size()));
  }

  // Keys PEFT has had since 0.10, so older versions load the file too; newer versions write
  // more keys, whose defaults apply when absent (loading is checked with PEFT 0.21.2).
  json config = {
      {"alpha_pattern", json::object()},
      {"auto_mapping", nullptr},
      {"base_model_name_or_path",
       base.name_or_path.empty() ? json(nullptr) : json(base.name_or_path)},
      {"bias", "none"},
      // GPT-2's Conv1D weights are stored (in, out); PEFT sets this for them.
      {"fan_in_fan_out", arch == "gpt2"},
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
      {"target_modules", target_names},
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
  // fan_in_fan_out describes the base weights' layout (GPT-2's Conv1D is (in, out)); lora_A and
  // lora_B are (r, in) and (out, r) either way. Only GPT-2 has such layers.
  if (fan_in_fan_out && base.hparams.architecture != "gpt2") {
    return Unimplemented(config_path,
                         ": fan_in_fan_out is true, which is for Conv1D layers "
                         "(GPT-2), but the model is ",
                         base.hparams.architecture);
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
  const std::string& arch = base.hparams.architecture;
  bool targets_from_tensors = false;
  std::vector<LoraModule> allowed;
  if (auto it = j.find("target_modules"); it != j.end() && it->is_array()) {
    for (const json& m : *it) {
      if (!m.is_string()) {
        return InvalidArgument(config_path, ": target_modules must be a list of strings, got ",
                               it->dump());
      }
      // PEFT matches names by suffix and, for "all-linear", saves full module paths
      // ("model.layers.1.mlp.gate_proj"); ResolveLoraModules matches both.
      const std::string name = m.get<std::string>();
      auto resolved = ResolveLoraModules(arch, {name});
      if (!resolved.ok()) {
        return Unimplemented(config_path, ": target module \"", name,
                             "\" is not one Kiln applies LoRA to in ", arch, " (",
                             LoraModuleList(arch), ")");
      }
      for (const LoraModule& x : *resolved) {
        if (!Contains(allowed, x)) allowed.push_back(x);
      }
    }
    if (allowed.empty()) {
      return InvalidArgument(config_path, ": target_modules is empty; expected ",
                             LoraModuleList(arch), " or all-linear");
    }
  } else if (it != j.end() && it->is_string() && it->get<std::string>() == "all-linear") {
    allowed = LoraModules(arch);
  } else {
    targets_from_tensors = true;
  }
  // In the architecture's canonical order.
  auto canonical = [&](const std::vector<LoraModule>& on) {
    std::vector<LoraModule> out;
    for (const LoraModule& m : LoraModules(arch)) {
      if (Contains(on, m)) out.push_back(m);
    }
    return out;
  };
  allowed = canonical(allowed);
  if (!targets_from_tensors) cfg.target_modules = TargetNames(arch, allowed);
  if (auto it = j.find("target_modules");
      it != j.end() && it->is_string() && it->get<std::string>() == "all-linear") {
    cfg.target_modules = {"all-linear"};
  }
  if (Status s = cfg.Validate(); !s.ok()) return Annotate(s, config_path);

  // adapter_model.safetensors
  KILN_ASSIGN_OR_RETURN(auto st, SafetensorsFile::Open(weights_path));
  struct Pending {
    const SafetensorsTensor* a = nullptr;
    const SafetensorsTensor* b = nullptr;
    int64_t layer;
    const LoraModule* module;
  };
  std::map<std::string, Pending> pending;  // by GGUF name
  std::vector<LoraModule> present;
  for (const SafetensorsTensor& t : st->tensors()) {
    int64_t layer;
    const LoraModule* m = nullptr;
    char ab;
    if (!ParsePeftName(arch, t.name, layer, m, ab)) {
      return InvalidArgument(weights_path, ": tensor \"", t.name,
                             "\" is not a LoRA weight Kiln knows (expected names like ",
                             TensorName(arch, 0, LoraModules(arch)[0], 'A'), " for ",
                             LoraModuleList(arch), ")");
    }
    const std::string_view module = LoraModuleLabel(arch, *m);
    const std::string where = Cat(weights_path, ": adapter layer blk.", layer, ".", m->gguf);
    if (layer >= base.hparams.num_layers) {
      return InvalidArgument(where, ": layer ", layer, " is past the model's ",
                             base.hparams.num_layers, " layers");
    }
    if (!targets_from_tensors && !Contains(allowed, *m)) {
      return InvalidArgument(where, ": ", module,
                             " is not in adapter_config.json's target_modules (",
                             absl::StrJoin(TargetNames(arch, allowed), " "), ")");
    }
    if (t.shape.size() != 2) {
      return InvalidArgument(where, ": lora_", std::string(1, ab), " has shape ",
                             ShapeText(t.shape), "; expected a matrix");
    }
    Pending& p = pending[GgufName(layer, *m)];
    p.layer = layer;
    p.module = m;
    (ab == 'A' ? p.a : p.b) = &t;
    if (!Contains(present, *m)) present.push_back(*m);
  }
  if (pending.empty()) return InvalidArgument(weights_path, ": holds no LoRA tensors");
  for (const auto& [gguf, p] : pending) {
    const std::string where =
        Cat(weights_path, ": adapter layer blk.", p.layer, ".", p.module->gguf);
    if (p.a == nullptr || p.b == nullptr) {
      return InvalidArgument(where, ": has ", p.a ? "lora_A" : "lora_B", " but no ",
                             p.a ? "lora_B" : "lora_A");
    }
    const LoraLayerShape want = ModuleShape(base.hparams, *p.module);
    KILN_RETURN_IF_ERROR(CheckLayerShapes(where, LoraModuleLabel(arch, *p.module), want, cfg.r,
                                          p.a->shape[0], p.a->shape[1], p.b->shape[0],
                                          p.b->shape[1]));
    LoraLayer layer;
    layer.in = want.in;
    layer.out = want.out;
    KILN_ASSIGN_OR_RETURN(layer.a, SafetensorsToFloats(*p.a));
    KILN_ASSIGN_OR_RETURN(layer.b, SafetensorsToFloats(*p.b));
    if (const int64_t heads = PermutedHeads(base, *p.module); heads > 0) {
      layer.b = HfToGgufQkRows(layer.b, layer.out, cfg.r, heads);
    }
    adapter.layers.emplace(gguf, std::move(layer));
  }
  if (targets_from_tensors) cfg.target_modules = TargetNames(arch, canonical(present));
  return adapter;
}

}  // namespace kiln::models
