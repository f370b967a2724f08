#include "models/arch/arch.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_join.h"
#include "models/io/errors.h"

namespace kiln::models {

const std::vector<const Architecture*>& Architectures() {
  static const std::vector<const Architecture*>* all = new std::vector<const Architecture*>{
      &LlamaArchitecture(), &GemmaArchitecture(), &Gpt2Architecture()};
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

Status DecoderSizesFromGguf(const GgufFile& g, std::string_view variant, float default_eps,
                            LlmHParams& hp) {
  const std::string a(variant);
  hp.architecture = a;
  KILN_ASSIGN_OR_RETURN(hp.num_layers, GgufInt(g, a + ".block_count"));
  KILN_ASSIGN_OR_RETURN(hp.hidden_size, GgufInt(g, a + ".embedding_length"));
  KILN_ASSIGN_OR_RETURN(hp.ffn_size, GgufInt(g, a + ".feed_forward_length"));
  KILN_ASSIGN_OR_RETURN(hp.num_heads, GgufInt(g, a + ".attention.head_count"));
  KILN_ASSIGN_OR_RETURN(hp.num_kv_heads,
                        GgufIntOr(g, a + ".attention.head_count_kv", hp.num_heads));
  KILN_ASSIGN_OR_RETURN(hp.context_length, GgufInt(g, a + ".context_length"));
  KILN_ASSIGN_OR_RETURN(const float eps,
                        g.GetF32Or(a + ".attention.layer_norm_rms_epsilon", default_eps));
  hp.norm_eps = eps;
  const int64_t default_head_dim = hp.num_heads > 0 ? hp.hidden_size / hp.num_heads : 0;
  KILN_ASSIGN_OR_RETURN(hp.head_dim, GgufIntOr(g, a + ".attention.key_length", default_head_dim));
  KILN_ASSIGN_OR_RETURN(const int64_t v_dim,
                        GgufIntOr(g, a + ".attention.value_length", hp.head_dim));
  if (v_dim != hp.head_dim) {
    return Unimplemented(g.path(), ": attention.value_length ", v_dim, " differs from key_length ",
                         hp.head_dim, "; not supported");
  }
  const GgufTensor* embd = g.FindTensor("token_embd.weight");
  const int64_t embd_rows = embd != nullptr && embd->dims.size() == 2 ? embd->dims[1] : 0;
  KILN_ASSIGN_OR_RETURN(hp.vocab_size, GgufIntOr(g, a + ".vocab_size", embd_rows));
  return OkStatus();
}

Status DecoderSizesFromHf(const HfModelConfig& c, int64_t default_context, int64_t default_head_dim,
                          LlmHParams& hp) {
  KILN_ASSIGN_OR_RETURN(hp.vocab_size, c.GetInt("vocab_size"));
  KILN_ASSIGN_OR_RETURN(hp.hidden_size, c.GetInt("hidden_size"));
  KILN_ASSIGN_OR_RETURN(hp.num_layers, c.GetInt("num_hidden_layers"));
  KILN_ASSIGN_OR_RETURN(hp.num_heads, c.GetInt("num_attention_heads"));
  KILN_ASSIGN_OR_RETURN(hp.num_kv_heads, HfIntOr(c, "num_key_value_heads", hp.num_heads));
  KILN_ASSIGN_OR_RETURN(hp.ffn_size, c.GetInt("intermediate_size"));
  KILN_ASSIGN_OR_RETURN(hp.context_length, HfIntOr(c, "max_position_embeddings", default_context));
  KILN_ASSIGN_OR_RETURN(hp.norm_eps, HfFloatOr(c, "rms_norm_eps", 1e-6));
  if (default_head_dim == 0 && hp.num_heads > 0) default_head_dim = hp.hidden_size / hp.num_heads;
  KILN_ASSIGN_OR_RETURN(hp.head_dim, HfIntOr(c, "head_dim", default_head_dim));
  return OkStatus();
}

namespace {

// RoPE from one transformers parameter object ({"rope_type", "rope_theta", "factor", ...});
// `theta` when it names no rope_theta.
Status RopeFromHfObject(const HfModelConfig& c, const nlohmann::json& params, double theta,
                        const LlmHParams& hp, RopeParams& rope) {
  auto num = [&](const char* key, double fallback) -> StatusOr<double> {
    auto v = params.find(key);
    if (v == params.end() || v->is_null()) return fallback;
    if (!v->is_number()) {
      return InvalidArgument(c.path, ": RoPE parameter \"", key, "\" must be a number, got ",
                             v->dump());
    }
    return v->get<double>();
  };
  KILN_ASSIGN_OR_RETURN(rope.theta, num("rope_theta", theta));
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    auto v = params.find(key);
    if (v != params.end() && v->is_string()) {
      type = v->get<std::string>();
      break;
    }
  }
  if (type == "linear") {
    rope.scaling = RopeParams::Scaling::kLinear;
    KILN_ASSIGN_OR_RETURN(rope.factor, num("factor", 1.0));
  } else if (type == "llama3") {
    rope.scaling = RopeParams::Scaling::kLlama3;
    KILN_ASSIGN_OR_RETURN(rope.factor, num("factor", 8.0));
    KILN_ASSIGN_OR_RETURN(rope.low_freq_factor, num("low_freq_factor", 1.0));
    KILN_ASSIGN_OR_RETURN(rope.high_freq_factor, num("high_freq_factor", 4.0));
    KILN_ASSIGN_OR_RETURN(rope.original_max_position, num("original_max_position_embeddings",
                                                          static_cast<double>(hp.context_length)));
    if (!(rope.high_freq_factor > rope.low_freq_factor)) {
      return InvalidArgument(c.path, ": llama3 RoPE needs high_freq_factor > low_freq_factor");
    }
  } else if (type != "default") {
    return Unimplemented(c.path, ": RoPE type '", type,
                         "' is not supported; supported: default, linear, llama3");
  }
  // transformers 5 keeps partial_rotary_factor among the RoPE parameters, 4 at the top level.
  KILN_ASSIGN_OR_RETURN(const double top_partial, HfFloatOr(c, "partial_rotary_factor", 1.0));
  KILN_ASSIGN_OR_RETURN(const double partial, num("partial_rotary_factor", top_partial));
  if (!(partial > 0 && partial <= 1)) {
    return InvalidArgument(c.path, ": partial_rotary_factor ", partial, " must be in (0, 1]");
  }
  if (partial != 1.0) rope.rotary_dim = static_cast<int64_t>(std::llround(partial * hp.head_dim));
  rope.layout = RopeParams::Layout::kNeox;
  return OkStatus();
}

}  // namespace

Status RopeFromHf(const HfModelConfig& c, LlmHParams& hp, const HfRopeDefaults& two_ropes) {
  auto it = c.raw.find("rope_parameters");
  const bool v5 = it != c.raw.end() && it->is_object();
  if (!two_ropes.enabled) {
    nlohmann::json params = nlohmann::json::object();
    if (v5) {
      params = *it;
    } else {
      auto sc = c.raw.find("rope_scaling");
      if (sc != c.raw.end() && sc->is_object()) params = *sc;
    }
    KILN_ASSIGN_OR_RETURN(const double theta, HfFloatOr(c, "rope_theta", 10000.0));
    return RopeFromHfObject(c, params, theta, hp, hp.rope);
  }
  // Two RoPEs (Gemma 3): transformers 5 keys rope_parameters by layer type; 4 has rope_theta
  // and rope_scaling for the global layers and rope_local_base_freq for the sliding ones.
  nlohmann::json global = nlohmann::json::object(), local = nlohmann::json::object();
  if (v5 && (it->contains("full_attention") || it->contains("sliding_attention"))) {
    for (const char* key : {"full_attention", "sliding_attention"}) {
      auto p = it->find(key);
      if (p == it->end()) continue;
      if (!p->is_object()) {
        return InvalidArgument(c.path, ": \"rope_parameters\".\"", key, "\" must be an object");
      }
      (std::string_view(key) == "full_attention" ? global : local) = *p;
    }
  } else if (v5) {
    global = *it;
  } else {
    auto sc = c.raw.find("rope_scaling");
    if (sc != c.raw.end() && sc->is_object()) global = *sc;
  }
  KILN_ASSIGN_OR_RETURN(const double theta, HfFloatOr(c, "rope_theta", two_ropes.global_theta));
  KILN_ASSIGN_OR_RETURN(const double local_theta,
                        HfFloatOr(c, "rope_local_base_freq", two_ropes.local_theta));
  KILN_RETURN_IF_ERROR(RopeFromHfObject(c, global, theta, hp, hp.rope));
  RopeParams sliding;
  KILN_RETURN_IF_ERROR(RopeFromHfObject(c, local, local_theta, hp, sliding));
  hp.rope_sliding = sliding;
  return OkStatus();
}

Status SlidingWindowFromHf(const HfModelConfig& c, std::string_view variant, LlmHParams& hp) {
  KILN_ASSIGN_OR_RETURN(const int64_t window, HfIntOr(c, "sliding_window", 0));
  const size_t L = static_cast<size_t>(hp.num_layers);
  auto types = c.raw.find("layer_types");
  if (types != c.raw.end() && types->is_array()) {
    if (types->size() != L) {
      return InvalidArgument(c.path, ": \"layer_types\" has ", types->size(), " entries for ", L,
                             " layers");
    }
    hp.sliding_window.assign(L, 0);
    for (size_t i = 0; i < L; ++i) {
      const auto& t = (*types)[i];
      const std::string s = t.is_string() ? t.get<std::string>() : t.dump();
      if (s == "sliding_attention") {
        if (window <= 0) {
          return InvalidArgument(c.path, ": layer ", i,
                                 " uses sliding_attention but \"sliding_window\" is not set");
        }
        hp.sliding_window[i] = window;
      } else if (s != "full_attention") {
        return Unimplemented(c.path, ": layer type '", s, "' (layer ", i,
                             ") is not supported; supported: full_attention, sliding_attention");
      }
    }
    return OkStatus();
  }
  if (variant == "mistral" || variant == "phi3") {  // every layer when set
    if (window > 0) hp.sliding_window.assign(L, window);
    return OkStatus();
  }
  KILN_ASSIGN_OR_RETURN(const bool use, HfBoolOr(c, "use_sliding_window", false));
  if (use && window > 0) {
    KILN_ASSIGN_OR_RETURN(const int64_t from, HfIntOr(c, "max_window_layers", 0));
    hp.sliding_window.assign(L, 0);
    for (size_t i = static_cast<size_t>(std::max<int64_t>(from, 0)); i < L; ++i) {
      hp.sliding_window[i] = window;
    }
  }
  return OkStatus();
}

void ApplyAttentionConfig(const config::AttentionConfig& a, LlmHParams& hp) {
  const size_t layers = static_cast<size_t>(hp.num_layers);
  if (a.mask == "causal") {
    hp.sliding_window.clear();
    hp.attention_chunk = 0;
  } else if (a.mask == "sliding_window") {
    hp.sliding_window.assign(layers, a.window);
    hp.attention_chunk = 0;
  } else if (a.mask == "chunked") {
    hp.sliding_window.clear();
    hp.attention_chunk = a.chunk;
  }
  if (a.score == "none" || a.score == "softcap" || a.score == "alibi") {
    hp.attn_softcap = a.score == "softcap" ? a.softcap : 0;
    hp.alibi = a.score == "alibi";
  }
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
  if (!hp.sliding_window.empty() &&
      hp.sliding_window.size() != static_cast<size_t>(hp.num_layers)) {
    return bad("the sliding-window pattern has ", hp.sliding_window.size(), " entries for ",
               hp.num_layers, " layers");
  }
  const std::pair<const char*, double> positive[] = {{"the attention scale", hp.attn_scale},
                                                     {"the attention soft-cap", hp.attn_softcap},
                                                     {"the final-logit soft-cap", hp.final_softcap},
                                                     {"the embedding scale", hp.embed_scale}};
  for (const auto& [name, v] : positive) {
    // 0 means "off" (or the default scale) for all but the embedding scale.
    if (!std::isfinite(v) || v < 0 || (v == 0 && std::string_view(name) == "the embedding scale")) {
      return bad(name, " is ", v, "; it must be positive");
    }
  }
  if (hp.attention_chunk < 0) return bad("an attention chunk of ", hp.attention_chunk, " tokens");
  return OkStatus();
}

}  // namespace kiln::models
