// The llama family: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3 — one graph, configuration
// flags for the differences:
//   GQA (num_kv_heads < num_heads), RoPE with linear or llama3 scaling, tied embeddings,
//   Mistral's sliding window (attention mask), Qwen2's q/k/v biases, Qwen3's q/k RMSNorm,
//   Llama's optional attention_bias / mlp_bias.
//
// RoPE layout: llama.cpp's converter permutes the q/k rows of `llama` GGUF files so that RoPE
// rotates interleaved pairs; Qwen2/Qwen3 GGUF files and every Hugging Face checkpoint rotate
// the two halves of each head (neox).
#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "models/arch/arch.h"
#include "models/io/errors.h"

namespace kiln::models {
namespace {

// ---- Hyper-parameters from GGUF ----------------------------------------------------------------

// llama.cpp stores Llama 3.1-style RoPE scaling as a tensor of per-pair frequency divisors
// (`rope_freqs.weight`) instead of metadata. The engine's Rope computes those divisors from
// (factor, low_freq_factor, high_freq_factor, original context); recover them and check that
// they reproduce the tensor.
Status RopeFromFreqFactors(const GgufFile& gguf, const GgufTensor& t, int64_t orig_ctx,
                           LlmHParams& hp) {
  const int64_t rd = hp.rope.rotary_dim == 0 ? hp.head_dim : hp.rope.rotary_dim;
  if (t.type != GgmlType::kF32 || t.n_elements != static_cast<uint64_t>(rd / 2)) {
    return InvalidArgument(gguf.path(), ": tensor 'rope_freqs.weight' must be F32 with ", rd / 2,
                           " elements (rotary dim / 2)");
  }
  const auto* f = static_cast<const float*>(t.data);
  double factor = 1;
  for (int64_t i = 0; i < rd / 2; ++i) factor = std::max<double>(factor, f[i]);
  hp.rope.scaling = RopeParams::Scaling::kLlama3;
  hp.rope.factor = factor;
  hp.rope.low_freq_factor = 1;
  hp.rope.high_freq_factor = 4;
  hp.rope.original_max_position = static_cast<double>(orig_ctx);
  for (int64_t i = 0; i < rd / 2; ++i) {
    const double freq = std::pow(hp.rope.theta, -2.0 * static_cast<double>(i) / rd);
    const double wavelen = 2 * std::numbers::pi / freq;
    const double low = hp.rope.original_max_position / hp.rope.low_freq_factor;
    const double high = hp.rope.original_max_position / hp.rope.high_freq_factor;
    double divisor = 1;
    if (wavelen > low) {
      divisor = factor;
    } else if (wavelen >= high) {
      const double smooth = (hp.rope.original_max_position / wavelen - hp.rope.low_freq_factor) /
                            (hp.rope.high_freq_factor - hp.rope.low_freq_factor);
      divisor = 1 / ((1 - smooth) / factor + smooth);
    }
    if (std::abs(divisor - f[i]) > 1e-3 * divisor) {
      return Unimplemented(gguf.path(), ": rope_freqs.weight[", i, "] = ", f[i],
                           " does not follow llama3 RoPE scaling (factor ", factor,
                           ", low_freq_factor 1, high_freq_factor 4, original context ", orig_ctx,
                           ", which give ", divisor,
                           "); other frequency factors are not supported");
    }
  }
  return OkStatus();
}

StatusOr<LlmHParams> LlamaFromGguf(const GgufFile& g, std::string_view variant) {
  const std::string a(variant);
  LlmHParams hp;
  hp.architecture = a;
  KILN_ASSIGN_OR_RETURN(hp.num_layers, GgufInt(g, a + ".block_count"));
  KILN_ASSIGN_OR_RETURN(hp.hidden_size, GgufInt(g, a + ".embedding_length"));
  KILN_ASSIGN_OR_RETURN(hp.ffn_size, GgufInt(g, a + ".feed_forward_length"));
  KILN_ASSIGN_OR_RETURN(hp.num_heads, GgufInt(g, a + ".attention.head_count"));
  KILN_ASSIGN_OR_RETURN(hp.num_kv_heads,
                        GgufIntOr(g, a + ".attention.head_count_kv", hp.num_heads));
  KILN_ASSIGN_OR_RETURN(hp.context_length, GgufInt(g, a + ".context_length"));
  KILN_ASSIGN_OR_RETURN(const float eps,
                        g.GetF32Or(a + ".attention.layer_norm_rms_epsilon", 1e-5f));
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
  // RoPE.
  KILN_ASSIGN_OR_RETURN(const float theta, g.GetF32Or(a + ".rope.freq_base", 10000.0f));
  hp.rope.theta = theta;
  KILN_ASSIGN_OR_RETURN(const int64_t rope_dims, GgufIntOr(g, a + ".rope.dimension_count", 0));
  hp.rope.rotary_dim = rope_dims == hp.head_dim ? 0 : rope_dims;
  hp.rope.layout =
      variant == "llama" ? RopeParams::Layout::kInterleaved : RopeParams::Layout::kNeox;
  KILN_ASSIGN_OR_RETURN(std::string_view scaling, g.GetStringOr(a + ".rope.scaling.type", "none"));
  KILN_ASSIGN_OR_RETURN(const float factor, g.GetF32Or(a + ".rope.scaling.factor", 1.0f));
  KILN_ASSIGN_OR_RETURN(const int64_t orig_ctx,
                        GgufIntOr(g, a + ".rope.scaling.original_context_length", 8192));
  if (scaling == "linear") {
    if (factor != 1.0f) {
      hp.rope.scaling = RopeParams::Scaling::kLinear;
      hp.rope.factor = factor;
    }
  } else if (scaling != "none" && !scaling.empty()) {
    return Unimplemented(g.path(), ": RoPE scaling '", scaling, "' (", a,
                         ".rope.scaling.type) is not supported; supported: none, linear, and "
                         "llama3 (rope_freqs.weight)");
  }
  if (const GgufTensor* freqs = g.FindTensor("rope_freqs.weight")) {
    KILN_RETURN_IF_ERROR(RopeFromFreqFactors(g, *freqs, orig_ctx, hp));
  }
  KILN_ASSIGN_OR_RETURN(const int64_t window, GgufIntOr(g, a + ".attention.sliding_window", 0));
  if (window > 0) hp.sliding_window.assign(static_cast<size_t>(hp.num_layers), window);
  // Optional tensors decide the optional parts; the variant decides the required ones.
  hp.attn_qkv_bias = variant == "qwen2" || g.FindTensor("blk.0.attn_q.bias") != nullptr;
  hp.attn_out_bias = g.FindTensor("blk.0.attn_output.bias") != nullptr;
  hp.mlp_bias = g.FindTensor("blk.0.ffn_up.bias") != nullptr;
  hp.qk_norm = variant == "qwen3";
  hp.tied_embeddings = g.FindTensor("output.weight") == nullptr;
  KILN_RETURN_IF_ERROR(ValidateHParams(hp, g.path()));
  return hp;
}

// ---- Hyper-parameters from config.json ---------------------------------------------------------

// RoPE from transformers 5's "rope_parameters" or 4's "rope_theta" + "rope_scaling".
Status RopeFromHf(const HfModelConfig& c, LlmHParams& hp) {
  nlohmann::json params = nlohmann::json::object();
  auto it = c.raw.find("rope_parameters");
  if (it != c.raw.end() && it->is_object()) {
    params = *it;
  } else {
    auto sc = c.raw.find("rope_scaling");
    if (sc != c.raw.end() && sc->is_object()) params = *sc;
    KILN_ASSIGN_OR_RETURN(const double theta, HfFloatOr(c, "rope_theta", 10000.0));
    params["rope_theta"] = theta;
  }
  auto num = [&](const char* key, double fallback) -> StatusOr<double> {
    auto v = params.find(key);
    if (v == params.end() || v->is_null()) return fallback;
    if (!v->is_number()) {
      return InvalidArgument(c.path, ": RoPE parameter \"", key, "\" must be a number, got ",
                             v->dump());
    }
    return v->get<double>();
  };
  KILN_ASSIGN_OR_RETURN(hp.rope.theta, num("rope_theta", 10000.0));
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    auto v = params.find(key);
    if (v != params.end() && v->is_string()) {
      type = v->get<std::string>();
      break;
    }
  }
  if (type == "linear") {
    hp.rope.scaling = RopeParams::Scaling::kLinear;
    KILN_ASSIGN_OR_RETURN(hp.rope.factor, num("factor", 1.0));
  } else if (type == "llama3") {
    hp.rope.scaling = RopeParams::Scaling::kLlama3;
    KILN_ASSIGN_OR_RETURN(hp.rope.factor, num("factor", 8.0));
    KILN_ASSIGN_OR_RETURN(hp.rope.low_freq_factor, num("low_freq_factor", 1.0));
    KILN_ASSIGN_OR_RETURN(hp.rope.high_freq_factor, num("high_freq_factor", 4.0));
    KILN_ASSIGN_OR_RETURN(
        hp.rope.original_max_position,
        num("original_max_position_embeddings", static_cast<double>(hp.context_length)));
    if (!(hp.rope.high_freq_factor > hp.rope.low_freq_factor)) {
      return InvalidArgument(c.path, ": llama3 RoPE needs high_freq_factor > low_freq_factor");
    }
  } else if (type != "default") {
    return Unimplemented(c.path, ": RoPE type '", type,
                         "' is not supported; supported: default, linear, llama3");
  }
  KILN_ASSIGN_OR_RETURN(const double partial, HfFloatOr(c, "partial_rotary_factor", 1.0));
  if (partial != 1.0) {
    hp.rope.rotary_dim = static_cast<int64_t>(std::llround(partial * hp.head_dim));
  }
  hp.rope.layout = RopeParams::Layout::kNeox;
  return OkStatus();
}

// Per-layer sliding windows: transformers' "layer_types" when present; else Mistral's
// "sliding_window" on every layer, or Qwen2/3's use_sliding_window from max_window_layers on.
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
  if (variant == "mistral") {
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

StatusOr<LlmHParams> LlamaFromHf(const HfModelConfig& c, std::string_view variant) {
  LlmHParams hp;
  hp.architecture = std::string(variant);
  KILN_ASSIGN_OR_RETURN(hp.vocab_size, c.GetInt("vocab_size"));
  KILN_ASSIGN_OR_RETURN(hp.hidden_size, c.GetInt("hidden_size"));
  KILN_ASSIGN_OR_RETURN(hp.num_layers, c.GetInt("num_hidden_layers"));
  KILN_ASSIGN_OR_RETURN(hp.num_heads, c.GetInt("num_attention_heads"));
  KILN_ASSIGN_OR_RETURN(hp.num_kv_heads, HfIntOr(c, "num_key_value_heads", hp.num_heads));
  KILN_ASSIGN_OR_RETURN(hp.ffn_size, c.GetInt("intermediate_size"));
  KILN_ASSIGN_OR_RETURN(hp.context_length, HfIntOr(c, "max_position_embeddings", 2048));
  KILN_ASSIGN_OR_RETURN(hp.norm_eps, HfFloatOr(c, "rms_norm_eps", 1e-6));
  const int64_t default_head_dim = hp.num_heads > 0 ? hp.hidden_size / hp.num_heads : 0;
  KILN_ASSIGN_OR_RETURN(hp.head_dim, HfIntOr(c, "head_dim", default_head_dim));
  auto act = c.GetString("hidden_act");
  if (act.ok() && *act != "silu") {
    return Unimplemented(c.path, ": hidden_act '", *act, "' is not supported for ", variant,
                         " models; supported: silu");
  }
  KILN_RETURN_IF_ERROR(RopeFromHf(c, hp));
  KILN_RETURN_IF_ERROR(SlidingWindowFromHf(c, variant, hp));
  KILN_ASSIGN_OR_RETURN(const bool attention_bias, HfBoolOr(c, "attention_bias", false));
  hp.attn_qkv_bias = variant == "qwen2" || attention_bias;
  hp.attn_out_bias = attention_bias;
  KILN_ASSIGN_OR_RETURN(hp.mlp_bias, HfBoolOr(c, "mlp_bias", false));
  hp.qk_norm = variant == "qwen3";
  KILN_ASSIGN_OR_RETURN(hp.tied_embeddings, HfBoolOr(c, "tie_word_embeddings", false));
  KILN_RETURN_IF_ERROR(ValidateHParams(hp, c.path));
  return hp;
}

const HfNaming& LlamaHfNaming() {
  static const HfNaming* naming =
      new HfNaming{.layer_prefixes = {"model.layers."},
                   .global = {{"model.embed_tokens.weight", "token_embd.weight"},
                              {"model.norm.weight", "output_norm.weight"},
                              {"lm_head.weight", "output.weight"}},
                   .per_layer = {{"input_layernorm.weight", "attn_norm.weight"},
                                 {"self_attn.q_proj.weight", "attn_q.weight"},
                                 {"self_attn.k_proj.weight", "attn_k.weight"},
                                 {"self_attn.v_proj.weight", "attn_v.weight"},
                                 {"self_attn.o_proj.weight", "attn_output.weight"},
                                 {"self_attn.q_proj.bias", "attn_q.bias"},
                                 {"self_attn.k_proj.bias", "attn_k.bias"},
                                 {"self_attn.v_proj.bias", "attn_v.bias"},
                                 {"self_attn.o_proj.bias", "attn_output.bias"},
                                 {"self_attn.q_norm.weight", "attn_q_norm.weight"},
                                 {"self_attn.k_norm.weight", "attn_k_norm.weight"},
                                 {"post_attention_layernorm.weight", "ffn_norm.weight"},
                                 {"mlp.gate_proj.weight", "ffn_gate.weight"},
                                 {"mlp.up_proj.weight", "ffn_up.weight"},
                                 {"mlp.down_proj.weight", "ffn_down.weight"},
                                 {"mlp.gate_proj.bias", "ffn_gate.bias"},
                                 {"mlp.up_proj.bias", "ffn_up.bias"},
                                 {"mlp.down_proj.bias", "ffn_down.bias"}},
                   .ignored_suffixes = {"rotary_emb.inv_freq"},
                   .strip_prefixes = {}};
  return *naming;
}

// ---- The graph ---------------------------------------------------------------------------------

Value BuildLlama(ForwardContext& ctx) {
  Builder& b = ctx.b();
  const LlmHParams& hp = ctx.hp();
  const StepInputs& in = ctx.in();
  const int64_t V = hp.vocab_size, C = hp.hidden_size, Hq = hp.num_heads, Hkv = hp.num_kv_heads,
                D = hp.head_dim, F = hp.ffn_size;
  const Dim& T = in.T;

  const Value tok_embd = ctx.Weight("token_embd.weight", {V, C});        // (V, C)
  Value x = b.Named(ctx.Embed(tok_embd, in.tokens), "token_embd_rows");  // [T, C]
  for (int64_t l = 0; l < hp.num_layers; ++l) {
    const std::string blk = absl::StrCat("blk.", l, ".");
    auto w = [&](const char* name, std::vector<int64_t> shape) {
      return ctx.Weight(blk + name, std::move(shape));
    };
    auto bias = [&](bool on, const char* name, int64_t n) { return on ? w(name, {n}) : Value{}; };
    b.SetNameScope(absl::StrCat("blk.", l));
    // Attention.
    const Value attn_norm_w = w("attn_norm.weight", {C});                          // (C)
    const Value wq = w("attn_q.weight", {Hq * D, C});                              // (Hq*D, C)
    const Value wk = w("attn_k.weight", {Hkv * D, C});                             // (Hkv*D, C)
    const Value wv = w("attn_v.weight", {Hkv * D, C});                             // (Hkv*D, C)
    const Value wo = w("attn_output.weight", {C, Hq * D});                         // (C, Hq*D)
    const Value bq = bias(hp.attn_qkv_bias, "attn_q.bias", Hq * D);                // (Hq*D)
    const Value bk = bias(hp.attn_qkv_bias, "attn_k.bias", Hkv * D);               // (Hkv*D)
    const Value bv = bias(hp.attn_qkv_bias, "attn_v.bias", Hkv * D);               // (Hkv*D)
    const Value bo = bias(hp.attn_out_bias, "attn_output.bias", C);                // (C)
    const Value h = b.Named(b.RmsNorm(x, attn_norm_w, hp.norm_eps), "attn_norm");  // [T, C]
    Value q = b.Named(b.Reshape(ctx.Linear(h, wq, bq), {T, Hq, D}), "q");          // [T, Hq, D]
    Value k = b.Named(b.Reshape(ctx.Linear(h, wk, bk), {T, Hkv, D}), "k");         // [T, Hkv, D]
    const Value v = b.Named(b.Reshape(ctx.Linear(h, wv, bv), {T, Hkv, D}), "v");   // [T, Hkv, D]
    if (hp.qk_norm) {
      q = b.Named(b.RmsNorm(q, w("attn_q_norm.weight", {D}), hp.norm_eps), "q_norm");  // [T,Hq,D]
      k = b.Named(b.RmsNorm(k, w("attn_k_norm.weight", {D}), hp.norm_eps), "k_norm");  // [T,Hkv,D]
    }
    q = b.Named(b.Rope(q, in.positions, hp.rope), "q_rope");  // [T, Hq, D]
    k = b.Named(b.Rope(k, in.positions, hp.rope), "k_rope");  // [T, Hkv, D]
    const Value a = ctx.Attend(l, q, k, v);                   // [T, Hq, D]
    const Value attn_out =
        b.Named(ctx.Linear(b.Reshape(a, {T, Hq * D}), wo, bo), "attn_out");  // [T, C]
    x = b.Named(b.Add(x, attn_out), "ffn_inp");                              // [T, C]
    // SwiGLU MLP.
    const Value ffn_norm_w = w("ffn_norm.weight", {C});                           // (C)
    const Value w_gate = w("ffn_gate.weight", {F, C});                            // (F, C)
    const Value w_up = w("ffn_up.weight", {F, C});                                // (F, C)
    const Value w_down = w("ffn_down.weight", {C, F});                            // (C, F)
    const Value b_gate = bias(hp.mlp_bias, "ffn_gate.bias", F);                   // (F)
    const Value b_up = bias(hp.mlp_bias, "ffn_up.bias", F);                       // (F)
    const Value b_down = bias(hp.mlp_bias, "ffn_down.bias", C);                   // (C)
    const Value h2 = b.Named(b.RmsNorm(x, ffn_norm_w, hp.norm_eps), "ffn_norm");  // [T, C]
    const Value gate = b.Named(ctx.Linear(h2, w_gate, b_gate), "ffn_gate");       // [T, F]
    const Value up = b.Named(ctx.Linear(h2, w_up, b_up), "ffn_up");               // [T, F]
    const Value act = b.Named(b.Mul(b.Silu(gate), up), "ffn_act");                // [T, F]
    const Value down = b.Named(ctx.Linear(act, w_down, b_down), "ffn_out");       // [T, C]
    x = b.Named(b.Add(x, down), "l_out");                                         // [T, C]
  }
  b.SetNameScope("");
  const Value last = b.Named(ctx.LastTokens(x), "last_tokens");    // [S, C]
  const Value out_norm_w = ctx.Weight("output_norm.weight", {C});  // (C)
  const Value lm_head =
      hp.tied_embeddings ? tok_embd : ctx.Weight("output.weight", {V, C});              // (V, C)
  const Value norm = b.Named(b.RmsNorm(last, out_norm_w, hp.norm_eps), "output_norm");  // [S, C]
  return b.Named(b.Linear(norm, lm_head), "logits");                                    // [S, V]
}

}  // namespace

const Architecture& LlamaArchitecture() {
  static const Architecture* arch = new Architecture{
      .family = "llama",
      .gguf_names = {"llama", "qwen2", "qwen3"},
      .hf_model_types = {"llama", "mistral", "qwen2", "qwen3"},
      .from_gguf = LlamaFromGguf,
      .from_hf = LlamaFromHf,
      .hf_naming = LlamaHfNaming,
      .build = BuildLlama,
  };
  return *arch;
}

}  // namespace kiln::models
