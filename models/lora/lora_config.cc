#include "models/lora/lora_config.h"

#include <cmath>

#include "absl/strings/str_join.h"

namespace kiln::models {
namespace {

struct ModuleName {
  std::string_view peft, gguf;
};
constexpr ModuleName kModules[] = {
    {"q_proj", "attn_q"},      {"k_proj", "attn_k"},      {"v_proj", "attn_v"},
    {"o_proj", "attn_output"}, {"gate_proj", "ffn_gate"}, {"up_proj", "ffn_up"},
    {"down_proj", "ffn_down"},
};

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
  return ResolveTargetModules(target_modules).status();
}

const std::vector<std::string_view>& PeftModuleNames() {
  static const auto* names = [] {
    auto* v = new std::vector<std::string_view>;
    for (const ModuleName& m : kModules) v->push_back(m.peft);
    return v;
  }();
  return *names;
}

const std::string& PeftModuleNameList() {
  // absl::StrJoin cannot join std::string_view with Debian's Abseil (its own string_view).
  static const auto* list = [] {
    auto* s = new std::string;
    for (std::string_view m : PeftModuleNames()) s->append(s->empty() ? "" : " ").append(m);
    return s;
  }();
  return *list;
}

std::string_view GgufSuffixForPeftModule(std::string_view module) {
  for (const ModuleName& m : kModules) {
    if (m.peft == module) return m.gguf;
  }
  return {};
}

std::string_view PeftModuleForGgufSuffix(std::string_view suffix) {
  for (const ModuleName& m : kModules) {
    if (m.gguf == suffix) return m.peft;
  }
  return {};
}

StatusOr<std::vector<std::string>> ResolveTargetModules(const std::vector<std::string>& targets) {
  if (targets.empty()) {
    return InvalidArgument("LoRA target_modules is empty; name modules (", PeftModuleNameList(),
                           ") or all-linear");
  }
  std::vector<bool> on(std::size(kModules), false);
  for (const std::string& t : targets) {
    if (t == "all-linear") {
      on.assign(on.size(), true);
      continue;
    }
    bool found = false;
    for (size_t i = 0; i < std::size(kModules); ++i) {
      if (kModules[i].peft == t) on[i] = found = true;
    }
    if (!found) {
      return InvalidArgument("unknown LoRA target module '", t,
                             "'; allowed: ", PeftModuleNameList(), ", or all-linear");
    }
  }
  std::vector<std::string> out;
  for (size_t i = 0; i < on.size(); ++i) {
    if (on[i]) out.emplace_back(kModules[i].peft);
  }
  return out;
}

}  // namespace kiln::models
