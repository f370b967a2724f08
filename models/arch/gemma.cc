// The Gemma family: Gemma 2 and Gemma 3 (text) — one graph, flags for the differences.
//
// What sets Gemma apart from the llama family:
//   - RMSNorm computes x_hat * (1 + w) (Hugging Face checkpoints store w; llama.cpp's GGUF
//     converter stores 1 + w, so a GGUF norm is a plain RMSNorm: LlmHParams::norm_weight_offset);
//   - four norms per block: before and after attention (post_attention_norm), before and after
//     the MLP (ffn_norm, post_ffw_norm), the "after" ones applied before the residual add;
//   - the embedding rows are scaled by sqrt(hidden_size); the MLP is GELU (tanh) gated;
//   - the attention scale is query_pre_attn_scalar^-1/2, not head_dim^-1/2;
//   - sliding-window and global layers alternate (Gemma 2: every other layer; Gemma 3: five
//     sliding layers, then a global one), and Gemma 3 gives the sliding layers their own RoPE
//     base frequency (10,000 against 1,000,000);
//   - Gemma 2 soft-caps the attention scores and the final logits, cap * tanh(x / cap) (the
//     attention cap is the attn::SoftCapScore score_mod, compiled into the attention kernel);
//   - Gemma 3 normalizes q and k per head (with the (1 + w) norm) before RoPE.
//
// RoPE rotates the two halves of each head (neox) in both formats: llama.cpp does not permute
// Gemma's q/k rows.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "models/arch/arch.h"
#include "models/io/errors.h"

namespace kiln::models {
namespace {

constexpr double kGemma3LocalTheta = 10000.0;     // rope_local_base_freq (llama.cpp: fixed)
constexpr double kGemma3GlobalTheta = 1000000.0;  // transformers' default rope_theta

// Per-layer windows from a repeating pattern: layer l is sliding unless (l + 1) % period == 0
// (transformers' sliding_window_pattern, llama.cpp's swa pattern).
std::vector<int64_t> AlternatingWindows(int64_t layers, int64_t period, int64_t window) {
  std::vector<int64_t> w(static_cast<size_t>(layers), 0);
  for (int64_t l = 0; l < layers; ++l) w[l] = (l + 1) % period != 0 ? window : 0;
  return w;
}

// ---- Hyper-parameters from GGUF ----------------------------------------------------------------

StatusOr<LlmHParams> GemmaFromGguf(const GgufFile& g, std::string_view variant) {
  const std::string a(variant);
  LlmHParams hp;
  KILN_RETURN_IF_ERROR(DecoderSizesFromGguf(g, variant, 1e-6f, hp));
  hp.activation = LlmActivation::kGeluTanh;
  KILN_ASSIGN_OR_RETURN(const float theta,
                        g.GetF32Or(a + ".rope.freq_base", variant == "gemma3" ? 1e6f : 1e4f));
  hp.rope.theta = theta;
  hp.rope.layout = RopeParams::Layout::kNeox;
  KILN_ASSIGN_OR_RETURN(std::string_view scaling, g.GetStringOr(a + ".rope.scaling.type", "none"));
  KILN_ASSIGN_OR_RETURN(const float factor, g.GetF32Or(a + ".rope.scaling.factor", 1.0f));
  if (scaling == "linear" && factor != 1.0f) {
    hp.rope.scaling = RopeParams::Scaling::kLinear;
    hp.rope.factor = factor;
  } else if (scaling != "none" && scaling != "linear" && !scaling.empty()) {
    return Unimplemented(g.path(), ": RoPE scaling '", scaling, "' (", a,
                         ".rope.scaling.type) is not supported for ", a,
                         "; supported: none, linear");
  }
  // The sliding-window pattern: llama.cpp's fixed period (2 for Gemma 2, 6 for Gemma 3), or
  // the file's own `attention.sliding_window_pattern` (a period, or one bool per layer).
  KILN_ASSIGN_OR_RETURN(const int64_t window, GgufIntOr(g, a + ".attention.sliding_window", 0));
  if (window < 0) {
    return InvalidArgument(g.path(), ": ", a, ".attention.sliding_window is ", window,
                           "; it must be a positive number of tokens (or absent)");
  }
  const std::string pattern_key = a + ".attention.sliding_window_pattern";
  if (window > 0) {
    hp.sliding_window = AlternatingWindows(hp.num_layers, variant == "gemma2" ? 2 : 6, window);
    if (const GgufValue* pattern = g.Find(pattern_key)) {
      if (pattern->is_array()) {
        if (pattern->element_type() != GgufValueType::kBool) {
          return InvalidArgument(g.path(), ": ", pattern_key,
                                 " must be a period or one bool per layer, got ",
                                 pattern->DebugString());
        }
        if (pattern->array_size() != static_cast<uint64_t>(hp.num_layers)) {
          return InvalidArgument(g.path(), ": ", pattern_key, " has ", pattern->array_size(),
                                 " entries for ", hp.num_layers, " layers (", a, ".block_count)");
        }
        for (int64_t l = 0; l < hp.num_layers; ++l) {
          hp.sliding_window[l] = pattern->element(static_cast<uint64_t>(l)).as_bool() ? window : 0;
        }
      } else {
        KILN_ASSIGN_OR_RETURN(const int64_t period, GgufInt(g, pattern_key));
        if (period <= 0) {
          return InvalidArgument(g.path(), ": ", pattern_key, " is ", period,
                                 "; it must be positive");
        }
        hp.sliding_window = AlternatingWindows(hp.num_layers, period, window);
      }
    }
  }
  if (variant == "gemma3") {
    RopeParams local = hp.rope;
    local.theta = kGemma3LocalTheta;
    local.scaling = RopeParams::Scaling::kNone;
    local.factor = 1;
    hp.rope_sliding = local;
    hp.qk_norm = true;
  }
  // llama.cpp's rule (GGUF has no query_pre_attn_scalar): the 27B models (46 layers for
  // Gemma 2, 62 for Gemma 3) scale by (hidden / heads)^-1/2, the others by head_dim^-1/2.
  const bool is_27b = hp.num_layers == (variant == "gemma2" ? 46 : 62);
  const int64_t scalar = is_27b && hp.num_heads > 0 ? hp.hidden_size / hp.num_heads : hp.head_dim;
  hp.attn_scale = scalar > 0 ? 1.0 / std::sqrt(static_cast<double>(scalar)) : 0;
  KILN_ASSIGN_OR_RETURN(const float attn_cap, g.GetF32Or(a + ".attn_logit_softcapping", 0.0f));
  KILN_ASSIGN_OR_RETURN(const float final_cap, g.GetF32Or(a + ".final_logit_softcapping", 0.0f));
  hp.attn_softcap = attn_cap;
  hp.final_softcap = final_cap;
  hp.embed_scale = std::sqrt(static_cast<double>(hp.hidden_size));
  hp.norm_weight_offset = 0;  // the converter stored 1 + w
  hp.tied_embeddings = g.FindTensor("output.weight") == nullptr;
  KILN_RETURN_IF_ERROR(ValidateHParams(hp, g.path()));
  return hp;
}

// ---- Hyper-parameters from config.json ---------------------------------------------------------

// An optional positive number: `fallback` when absent or null; an error naming the key when it
// is present and not positive.
StatusOr<double> PositiveOr(const HfModelConfig& c, const std::string& key, double fallback) {
  auto it = c.raw.find(key);
  if (it == c.raw.end() || it->is_null()) return fallback;
  KILN_ASSIGN_OR_RETURN(const double v, c.GetFloat(key));
  if (!(v > 0) || !std::isfinite(v)) {
    return InvalidArgument(c.path, ": \"", key, "\" is ", v, "; it must be positive (or null)");
  }
  return v;
}

StatusOr<LlmHParams> GemmaFromHf(const HfModelConfig& c, std::string_view variant) {
  LlmHParams hp;
  hp.architecture = variant == "gemma2" ? "gemma2" : "gemma3";
  KILN_RETURN_IF_ERROR(
      DecoderSizesFromHf(c, /*default_context=*/8192, /*default_head_dim=*/256, hp));
  // transformers reads hidden_activation (hidden_act in older configs).
  std::string act = "gelu_pytorch_tanh";
  for (const char* key : {"hidden_activation", "hidden_act"}) {
    auto v = c.GetString(key);
    if (v.ok()) {
      act = *v;
      break;
    }
  }
  if (act == "gelu_pytorch_tanh" || act == "gelu_new" || act == "gelu_fast") {
    hp.activation = LlmActivation::kGeluTanh;
  } else if (act == "gelu") {
    hp.activation = LlmActivation::kGeluErf;
  } else {
    return Unimplemented(c.path, ": hidden_activation '", act, "' is not supported for ", variant,
                         " models; supported: gelu_pytorch_tanh, gelu");
  }
  KILN_ASSIGN_OR_RETURN(const bool bidirectional,
                        HfBoolOr(c, "use_bidirectional_attention", false));
  if (bidirectional) {
    return Unimplemented(c.path,
                         ": use_bidirectional_attention (an embedding model such as "
                         "EmbeddingGemma) is not supported by the generative loader");
  }
  KILN_ASSIGN_OR_RETURN(const bool attention_bias, HfBoolOr(c, "attention_bias", false));
  if (attention_bias) {
    return Unimplemented(c.path, ": attention_bias is not supported for ", variant, " models");
  }
  const bool gemma3 = hp.architecture == "gemma3";
  HfRopeDefaults two_ropes;
  if (gemma3) {
    two_ropes.enabled = true;
    two_ropes.global_theta = kGemma3GlobalTheta;
    two_ropes.local_theta = kGemma3LocalTheta;
  }
  KILN_RETURN_IF_ERROR(RopeFromHf(c, hp, two_ropes));
  // Windows: "layer_types" (what transformers writes); older configs give only the period.
  if (c.raw.contains("layer_types")) {
    KILN_RETURN_IF_ERROR(SlidingWindowFromHf(c, variant, hp));
  } else {
    KILN_ASSIGN_OR_RETURN(const int64_t window, HfIntOr(c, "sliding_window", 4096));
    KILN_ASSIGN_OR_RETURN(const int64_t period,
                          HfIntOr(c, "sliding_window_pattern", gemma3 ? 6 : 2));
    if (window <= 0 || period <= 0) {
      return InvalidArgument(c.path, ": \"sliding_window\" (", window,
                             ") and \"sliding_window_pattern\" (", period, ") must be positive");
    }
    hp.sliding_window = AlternatingWindows(hp.num_layers, period, window);
  }
  KILN_ASSIGN_OR_RETURN(const double scalar,
                        PositiveOr(c, "query_pre_attn_scalar", static_cast<double>(hp.head_dim)));
  hp.attn_scale = 1.0 / std::sqrt(scalar);
  KILN_ASSIGN_OR_RETURN(hp.attn_softcap, PositiveOr(c, "attn_logit_softcapping", 0));
  KILN_ASSIGN_OR_RETURN(hp.final_softcap, PositiveOr(c, "final_logit_softcapping", 0));
  hp.qk_norm = gemma3;
  hp.embed_scale = std::sqrt(static_cast<double>(hp.hidden_size));
  hp.norm_weight_offset = 1;  // Hugging Face stores w of x_hat * (1 + w)
  KILN_ASSIGN_OR_RETURN(hp.tied_embeddings, HfBoolOr(c, "tie_word_embeddings", true));
  KILN_RETURN_IF_ERROR(ValidateHParams(hp, c.path));
  return hp;
}

const HfNaming& GemmaHfNaming() {
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
                                 {"self_attn.q_norm.weight", "attn_q_norm.weight"},
                                 {"self_attn.k_norm.weight", "attn_k_norm.weight"},
                                 {"post_attention_layernorm.weight", "post_attention_norm.weight"},
                                 {"pre_feedforward_layernorm.weight", "ffn_norm.weight"},
                                 {"post_feedforward_layernorm.weight", "post_ffw_norm.weight"},
                                 {"mlp.gate_proj.weight", "ffn_gate.weight"},
                                 {"mlp.up_proj.weight", "ffn_up.weight"},
                                 {"mlp.down_proj.weight", "ffn_down.weight"}},
                   .ignored_suffixes = {"rotary_emb.inv_freq"},
                   .strip_prefixes = {}};
  return *naming;
}

// ---- The graph ---------------------------------------------------------------------------------

Value BuildGemma(ForwardContext& ctx) {
  Builder& b = ctx.b();
  const LlmHParams& hp = ctx.hp();
  const StepInputs& in = ctx.in();
  const int64_t V = hp.vocab_size, C = hp.hidden_size, Hq = hp.num_heads, Hkv = hp.num_kv_heads,
                D = hp.head_dim, F = hp.ffn_size;
  const Dim& T = in.T;
  // Gemma's RMSNorm: x_hat * (1 + w), the offset added in f32 (as transformers does).
  auto norm = [&](Value x, const std::string& weight, int64_t n, const char* name) {
    Value w = ctx.Weight(weight, {n});
    if (hp.norm_weight_offset != 0 && w.valid()) {
      if (b.dtype(w) != DType::kF32) w = b.Cast(w, DType::kF32);
      w = b.AddScalar(w, hp.norm_weight_offset);
    }
    return b.Named(b.RmsNorm(x, w, hp.norm_eps), name);
  };
  const bool tanh_gelu = hp.activation == LlmActivation::kGeluTanh;

  const Value tok_embd = ctx.Weight("token_embd.weight", {V, C});  // (V, C)
  Value x = b.Named(b.MulScalar(ctx.Embed(tok_embd, in.tokens), hp.embed_scale),
                    "token_embd_rows");  // [T, C]
  for (int64_t l = 0; l < hp.num_layers; ++l) {
    const std::string blk = absl::StrCat("blk.", l, ".");
    auto w = [&](const char* name, std::vector<int64_t> shape) {
      return ctx.Weight(blk + name, std::move(shape));
    };
    b.SetNameScope(absl::StrCat("blk.", l));
    // Attention, normalized before and after.
    const Value h = norm(x, blk + "attn_norm.weight", C, "attn_norm");  // [T, C]
    Value q = b.Named(b.Reshape(ctx.Linear(h, w("attn_q.weight", {Hq * D, C})), {T, Hq, D}),
                      "q");  // [T, Hq, D]
    Value k = b.Named(b.Reshape(ctx.Linear(h, w("attn_k.weight", {Hkv * D, C})), {T, Hkv, D}),
                      "k");  // [T, Hkv, D]
    const Value v = b.Named(b.Reshape(ctx.Linear(h, w("attn_v.weight", {Hkv * D, C})), {T, Hkv, D}),
                            "v");  // [T,Hkv,D]
    if (hp.qk_norm) {
      q = norm(q, blk + "attn_q_norm.weight", D, "q_norm");  // [T, Hq, D]
      k = norm(k, blk + "attn_k_norm.weight", D, "k_norm");  // [T, Hkv, D]
    }
    q = b.Named(b.Rope(q, in.positions, hp.rope_for(l)), "q_rope");  // [T, Hq, D]
    k = b.Named(b.Rope(k, in.positions, hp.rope_for(l)), "k_rope");  // [T, Hkv, D]
    const Value a = ctx.Attend(l, q, k, v);  // [T, Hq, D], scale and soft-cap from hp
    const Value attn_out = b.Named(
        ctx.Linear(b.Reshape(a, {T, Hq * D}), w("attn_output.weight", {C, Hq * D})), "attn_out");
    x = b.Named(b.Add(x, norm(attn_out, blk + "post_attention_norm.weight", C, "attn_post_norm")),
                "ffn_inp");  // [T, C]
    // GELU-gated MLP, normalized before and after.
    const Value h2 = norm(x, blk + "ffn_norm.weight", C, "ffn_norm");                      // [T, C]
    const Value gate = b.Named(ctx.Linear(h2, w("ffn_gate.weight", {F, C})), "ffn_gate");  // [T, F]
    const Value up = b.Named(ctx.Linear(h2, w("ffn_up.weight", {F, C})), "ffn_up");        // [T, F]
    const Value act = b.Named(b.Mul(b.Gelu(gate, tanh_gelu), up), "ffn_act");              // [T, F]
    const Value down = b.Named(ctx.Linear(act, w("ffn_down.weight", {C, F})), "ffn_out");  // [T, C]
    x = b.Named(b.Add(x, norm(down, blk + "post_ffw_norm.weight", C, "ffn_post_norm")),
                "l_out");  // [T, C]
  }
  b.SetNameScope("");
  const Value last = b.Named(ctx.LastTokens(x), "last_tokens");  // [S, C]
  const Value lm_head =
      hp.tied_embeddings ? tok_embd : ctx.Weight("output.weight", {V, C});  // (V, C)
  const Value out = norm(last, "output_norm.weight", C, "output_norm");     // [S, C]
  Value logits = b.Linear(out, lm_head);                                    // [S, V]
  if (hp.final_softcap > 0) {  // cap * tanh(logits / cap)
    logits = b.MulScalar(b.Tanh(b.MulScalar(logits, 1.0 / hp.final_softcap)), hp.final_softcap);
  }
  return b.Named(logits, "logits");
}

}  // namespace

const Architecture& GemmaArchitecture() {
  static const Architecture* arch = new Architecture{
      .family = "gemma",
      .gguf_names = {"gemma2", "gemma3"},
      .hf_model_types = {"gemma2", "gemma3_text"},
      .from_gguf = GemmaFromGguf,
      .from_hf = GemmaFromHf,
      .hf_naming = GemmaHfNaming,
      .build = BuildGemma,
  };
  return *arch;
}

}  // namespace kiln::models
