#include "models/arch/arch.h"

#include <algorithm>

#include "absl/strings/str_join.h"
#include "models/io/errors.h"

namespace kiln::models {

const std::vector<const Architecture*>& Architectures() {
  static const std::vector<const Architecture*>* all =
      new std::vector<const Architecture*>{&LlamaArchitecture(), &Gpt2Architecture()};
  return *all;
}

const Architecture* FindArchitecture(std::string_view name, bool gguf) {
  for (const Architecture* a : Architectures()) {
    const auto& names = gguf ? a->gguf_names : a->hf_model_types;
    if (std::find(names.begin(), names.end(), name) != names.end()) return a;
  }
  return nullptr;
}

std::string SupportedArchitectures(bool gguf) {
  std::vector<std::string> names;
  for (const Architecture* a : Architectures()) {
    for (std::string_view n : gguf ? a->gguf_names : a->hf_model_types) names.emplace_back(n);
  }
  std::sort(names.begin(), names.end());
  return absl::StrJoin(names, ", ");
}

}  // namespace kiln::models

namespace kiln::models {

StatusOr<int64_t> HfIntOr(const HfModelConfig& c, const std::string& key, int64_t fallback) {
  StatusOr<int64_t> v = c.GetInt(key);
  if (absl::IsNotFound(v.status())) return fallback;
  return v;
}

StatusOr<double> HfFloatOr(const HfModelConfig& c, const std::string& key, double fallback) {
  StatusOr<double> v = c.GetFloat(key);
  if (absl::IsNotFound(v.status())) return fallback;
  return v;
}

StatusOr<bool> HfBoolOr(const HfModelConfig& c, const std::string& key, bool fallback) {
  StatusOr<bool> v = c.GetBool(key);
  if (absl::IsNotFound(v.status())) return fallback;
  return v;
}

StatusOr<int64_t> GgufInt(const GgufFile& g, const std::string& key) { return g.GetI64(key); }

StatusOr<int64_t> GgufIntOr(const GgufFile& g, const std::string& key, int64_t fallback) {
  if (!g.Has(key)) return fallback;
  return g.GetI64(key);
}

Status ValidateHParams(const LlmHParams& hp, std::string_view source) {
  auto bad = [&](auto... what) {
    return InvalidArgument(source, ": unusable hyper-parameters for architecture ", hp.architecture,
                           ": ", what...);
  };
  const std::pair<const char*, int64_t> sizes[] = {
      {"vocab_size", hp.vocab_size},     {"hidden_size", hp.hidden_size},
      {"num_layers", hp.num_layers},     {"num_heads", hp.num_heads},
      {"num_kv_heads", hp.num_kv_heads}, {"head_dim", hp.head_dim},
      {"ffn_size", hp.ffn_size},         {"context_length", hp.context_length}};
  for (const auto& [name, v] : sizes) {
    if (v <= 0) return bad(name, " is ", v, "; it must be positive");
  }
  constexpr int64_t kMaxSize = int64_t{1} << 24;
  for (const auto& [name, v] : sizes) {
    if (v > (std::string_view(name) == "context_length" ? int64_t{1} << 30 : kMaxSize)) {
      return bad(name, " is ", v, ", larger than Kiln supports");
    }
  }
  if (hp.num_heads % hp.num_kv_heads != 0) {
    return bad("num_heads (", hp.num_heads, ") must be a multiple of num_kv_heads (",
               hp.num_kv_heads, ")");
  }
  if (hp.use_rope) {
    const int64_t rd = hp.rope.rotary_dim == 0 ? hp.head_dim : hp.rope.rotary_dim;
    if (rd % 2 != 0 || rd > hp.head_dim) {
      return bad("the rotary dimension ", rd, " must be even and at most head_dim ", hp.head_dim);
    }
    if (!(hp.rope.theta > 0) || !(hp.rope.factor > 0)) {
      return bad("rope theta (", hp.rope.theta, ") and scaling factor (", hp.rope.factor,
                 ") must be positive");
    }
  }
  if (!(hp.norm_eps > 0) || hp.norm_eps > 1) {
    return bad("the norm epsilon ", hp.norm_eps, " must be in (0, 1]");
  }
  for (int64_t w : hp.sliding_window) {
    if (w < 0) return bad("a sliding window of ", w, " tokens");
  }
  return OkStatus();
}

}  // namespace kiln::models
