#include "models/lora/lora_config.h"

#include <algorithm>
#include <cmath>

namespace kiln::models {
namespace {

// Per architecture, in canonical order (the order adapters are listed and fixtures index).
const std::vector<LoraModule>& LlamaModules() {
  static const auto* m = new std::vector<LoraModule>{
      {"q_proj", "self_attn.q_proj", "attn_q"},   {"k_proj", "self_attn.k_proj", "attn_k"},
      {"v_proj", "self_attn.v_proj", "attn_v"},   {"o_proj", "self_attn.o_proj", "attn_output"},
      {"gate_proj", "mlp.gate_proj", "ffn_gate"}, {"up_proj", "mlp.up_proj", "ffn_up"},
      {"down_proj", "mlp.down_proj", "ffn_down"},
  };
  return *m;
}

const std::vector<LoraModule>& Gpt2Modules() {
  static const auto* m = new std::vector<LoraModule>{
      {"c_attn", "attn.c_attn", "attn_qkv"},
      {"c_proj", "attn.c_proj", "attn_output"},
      {"c_fc", "mlp.c_fc", "ffn_up"},
      {"c_proj", "mlp.c_proj", "ffn_down"},
  };
  return *m;
}

// Phi-3's fused projections (as PEFT names them on Phi3ForCausalLM).
const std::vector<LoraModule>& Phi3Modules() {
  static const auto* m = new std::vector<LoraModule>{
      {"qkv_proj", "self_attn.qkv_proj", "attn_qkv"},
      {"o_proj", "self_attn.o_proj", "attn_output"},
      {"gate_up_proj", "mlp.gate_up_proj", "ffn_up"},
      {"down_proj", "mlp.down_proj", "ffn_down"},
  };
  return *m;
}

// `a` ends with `b` at a component boundary ("mlp.c_proj" ends with "c_proj"; "xc_proj" not).
bool EndsWithComponent(std::string_view a, std::string_view b) {
  return a == b || (a.size() > b.size() && a.ends_with(b) && a[a.size() - b.size() - 1] == '.');
}

// PEFT's suffix match, in both directions: a target names a module by a suffix of its path,
// or by a full module path that ends in it.
bool Selects(std::string_view target, const LoraModule& m) {
  return EndsWithComponent(m.path, target) || EndsWithComponent(target, m.path);
}

std::string AllowedList(const std::vector<LoraModule>& modules) {
  std::string s;
  for (const LoraModule& m : modules) {
    const bool shared = std::count_if(modules.begin(), modules.end(),
                                      [&](const LoraModule& o) { return o.name == m.name; }) > 1;
    s.append(s.empty() ? "" : " ").append(shared ? m.path : m.name);
  }
  return s;
}

}  // namespace

double LoraConfig::scale() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r);
}

Status LoraConfig::Validate() const {
  if (r <= 0) return InvalidArgument("LoRA rank r must be positive, got ", r);
  if (!(alpha > 0)) return InvalidArgument("lora_alpha must be positive, got ", alpha);
  if (!(dropout >= 0 && dropout < 1)) {
    return InvalidArgument("lora_dropout must be in [0, 1), got ", dropout);
  }
  if (target_modules.empty()) {
    return InvalidArgument("LoRA target_modules is empty; name modules (", PeftModuleNameList(),
                           "; GPT-2: ", AllowedList(Gpt2Modules()), ") or all-linear");
  }
  // Each target must name a module of some architecture; Trainer::Create checks the model's.
  for (const std::string& t : target_modules) {
    if (t == "all-linear") continue;
    if (!ResolveLoraModules("llama", {t}).ok() && !ResolveLoraModules("gpt2", {t}).ok() &&
        !ResolveLoraModules("phi3", {t}).ok()) {
      return InvalidArgument("unknown LoRA target module '", t,
                             "'; allowed: ", PeftModuleNameList(), " (llama and Gemma families), ",
                             AllowedList(Phi3Modules()), " (Phi-3), ", AllowedList(Gpt2Modules()),
                             " (GPT-2), or all-linear");
    }
  }
  return OkStatus();
}

const std::vector<LoraModule>& LoraModules(std::string_view architecture) {
  if (architecture == "gpt2") return Gpt2Modules();
  if (architecture == "phi3") return Phi3Modules();
  return LlamaModules();
}

std::string_view LoraModuleLabel(std::string_view architecture, const LoraModule& m) {
  const std::vector<LoraModule>& all = LoraModules(architecture);
  const bool shared = std::count_if(all.begin(), all.end(),
                                    [&](const LoraModule& o) { return o.name == m.name; }) > 1;
  return shared ? m.path : m.name;
}

std::string LoraModuleList(std::string_view architecture) {
  return AllowedList(LoraModules(architecture));
}

const LoraModule* LoraModuleForGguf(std::string_view architecture, std::string_view gguf) {
  for (const LoraModule& m : LoraModules(architecture)) {
    if (m.gguf == gguf) return &m;
  }
  return nullptr;
}

StatusOr<std::vector<LoraModule>> ResolveLoraModules(std::string_view architecture,
                                                     const std::vector<std::string>& targets) {
  const std::vector<LoraModule>& modules = LoraModules(architecture);
  if (targets.empty()) {
    return InvalidArgument("LoRA target_modules is empty; name modules (", AllowedList(modules),
                           ") or all-linear");
  }
  std::vector<bool> on(modules.size(), false);
  for (const std::string& t : targets) {
    if (t == "all-linear") {
      on.assign(on.size(), true);
      continue;
    }
    bool found = false;
    for (size_t i = 0; i < modules.size(); ++i) {
      if (Selects(t, modules[i])) on[i] = found = true;
    }
    if (!found) {
      return InvalidArgument("unknown LoRA target module '", t, "' for architecture ", architecture,
                             "; allowed: ", AllowedList(modules), ", or all-linear");
    }
  }
  std::vector<LoraModule> out;
  for (size_t i = 0; i < on.size(); ++i) {
    if (on[i]) out.push_back(modules[i]);
  }
  return out;
}

const std::vector<std::string_view>& PeftModuleNames() {
  static const auto* names = [] {
    auto* v = new std::vector<std::string_view>;
    for (const LoraModule& m : LlamaModules()) v->push_back(m.name);
    return v;
  }();
  return *names;
}

const std::string& PeftModuleNameList() {
  static const auto* list = new std::string(AllowedList(LlamaModules()));
  return *list;
}

std::string_view GgufSuffixForPeftModule(std::string_view module) {
  for (const LoraModule& m : LlamaModules()) {
    if (m.name == module) return m.gguf;
  }
  return {};
}

std::string_view PeftModuleForGgufSuffix(std::string_view suffix) {
  const LoraModule* m = LoraModuleForGguf("llama", suffix);
  return m != nullptr ? m->name : std::string_view();
}

StatusOr<std::vector<std::string>> ResolveTargetModules(const std::vector<std::string>& targets) {
  if (targets.empty()) {
    return InvalidArgument("LoRA target_modules is empty; name modules (", PeftModuleNameList(),
                           ") or all-linear");
  }
  // Only plain names here (peft_io strips module paths to their last component).
  for (const std::string& t : targets) {
    if (t != "all-linear" && GgufSuffixForPeftModule(t).empty()) {
      return InvalidArgument("unknown LoRA target module '", t,
                             "'; allowed: ", PeftModuleNameList(), ", or all-linear");
    }
  }
  KILN_ASSIGN_OR_RETURN(std::vector<LoraModule> modules, ResolveLoraModules("llama", targets));
  std::vector<std::string> out;
  for (const LoraModule& m : modules) out.emplace_back(m.name);
  return out;
}

}  // namespace kiln::models
