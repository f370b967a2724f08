// The llama family: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3 — one graph,
// configuration flags for the differences:
//   GQA (num_kv_heads < num_heads), RoPE with linear or llama3 scaling (over part of each
//   head with partial_rotary_factor), tied embeddings, Mistral's and Phi-3's sliding window
//   (attention mask), Qwen2's q/k/v biases, Qwen3's q/k RMSNorm, Llama's optional
//   attention_bias / mlp_bias, Phi-3's fused projections (one qkv_proj, one gate_up_proj; the
//   fused weights are split after the matmul, as transformers does).
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
  KILN_RETURN_IF_ERROR(DecoderSizesFromGguf(g, variant, 1e-5f, hp));
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
  if (g.FindTensor("rope_factors_long.weight") != nullptr ||
      g.FindTensor("rope_factors_short.weight") != nullptr) {
    return Unimplemented(g.path(),
                         ": LongRoPE (tensors rope_factors_long/short.weight, the "
                         "128k-context Phi-3 models) is not supported");
  }
  // Optional tensors decide the optional parts; the variant decides the required ones.
  hp.fused_qkv = g.FindTensor("blk.0.attn_qkv.weight") != nullptr;
  hp.fused_gate_up = variant == "phi3" && g.FindTensor("blk.0.ffn_gate.weight") == nullptr;
  if ((hp.fused_qkv && g.FindTensor("blk.0.attn_qkv.bias") != nullptr) ||
      (hp.fused_gate_up && g.FindTensor("blk.0.ffn_up.bias") != nullptr)) {
    return Unimplemented(g.path(),
                         ": biases on fused projections (blk.0.attn_qkv.bias or a "
                         "fused ffn_up.bias) are not supported");
  }
  hp.attn_qkv_bias = variant == "qwen2" || g.FindTensor("blk.0.attn_q.bias") != nullptr;
  hp.attn_out_bias = g.FindTensor("blk.0.attn_output.bias") != nullptr;
  hp.mlp_bias = g.FindTensor("blk.0.ffn_up.bias") != nullptr;
  hp.qk_norm = variant == "qwen3";
  hp.tied_embeddings = g.FindTensor("output.weight") == nullptr;
  KILN_RETURN_IF_ERROR(ValidateHParams(hp, g.path()));
  return hp;
}

// ---- Hyper-parameters from config.json ---------------------------------------------------------

StatusOr<LlmHParams> LlamaFromHf(const HfModelConfig& c, std::string_view variant) {
  LlmHParams hp;
  hp.architecture = std::string(variant);
  KILN_RETURN_IF_ERROR(DecoderSizesFromHf(c, /*default_context=*/2048, /*default_head_dim=*/0, hp));
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
  hp.fused_qkv = hp.fused_gate_up = variant == "phi3";
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
                                 {"self_attn.qkv_proj.weight", "attn_qkv.weight"},
                                 {"mlp.gate_up_proj.weight", "ffn_up.weight"},
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
    const Value wo = w("attn_output.weight", {C, Hq * D});                         // (C, Hq*D)
    const Value bq = bias(hp.attn_qkv_bias, "attn_q.bias", Hq * D);                // (Hq*D)
    const Value bk = bias(hp.attn_qkv_bias, "attn_k.bias", Hkv * D);               // (Hkv*D)
    const Value bv = bias(hp.attn_qkv_bias, "attn_v.bias", Hkv * D);               // (Hkv*D)
    const Value bo = bias(hp.attn_out_bias, "attn_output.bias", C);                // (C)
    const Value h = b.Named(b.RmsNorm(x, attn_norm_w, hp.norm_eps), "attn_norm");  // [T, C]
    Value q_heads, k_heads, v_heads;  // [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
    if (hp.fused_qkv || hp.fuse_projections) {
      const Value wqkv = w("attn_qkv.weight", {(Hq + 2 * Hkv) * D, C});  // (q|k|v rows, C)
      const Value qkv = b.Named(ctx.Linear(h, wqkv), "qkv");             // [T, (Hq+2Hkv)*D]
      // Heads first, then slices of heads: strided views the kernels read in place (a slice of
      // columns reshaped into heads would be copied).
      const Value heads = b.Reshape(qkv, {T, Hq + 2 * Hkv, D});  // [T, Hq+2Hkv, D]
      q_heads = b.Slice(heads, 1, 0, Hq);
      k_heads = b.Slice(heads, 1, Hq, Hkv);
      v_heads = b.Slice(heads, 1, Hq + Hkv, Hkv);
    } else {
      q_heads = b.Reshape(ctx.Linear(h, w("attn_q.weight", {Hq * D, C}), bq), {T, Hq, D});
      k_heads = b.Reshape(ctx.Linear(h, w("attn_k.weight", {Hkv * D, C}), bk), {T, Hkv, D});
      v_heads = b.Reshape(ctx.Linear(h, w("attn_v.weight", {Hkv * D, C}), bv), {T, Hkv, D});
    }
    Value q = b.Named(q_heads, "q");        // [T, Hq, D]
    Value k = b.Named(k_heads, "k");        // [T, Hkv, D]
    const Value v = b.Named(v_heads, "v");  // [T, Hkv, D]
    if (hp.qk_norm) {
      q = b.Named(b.RmsNorm(q, w("attn_q_norm.weight", {D}), hp.norm_eps), "q_norm");  // [T,Hq,D]
      k = b.Named(b.RmsNorm(k, w("attn_k_norm.weight", {D}), hp.norm_eps), "k_norm");  // [T,Hkv,D]
    }
    q = b.Named(b.Rope(q, in.positions, hp.rope_for(l)), "q_rope");  // [T, Hq, D]
    k = b.Named(b.Rope(k, in.positions, hp.rope_for(l)), "k_rope");  // [T, Hkv, D]
    const Value a = ctx.Attend(l, q, k, v);                          // [T, Hq, D]
    const Value attn_out =
        b.Named(ctx.Linear(b.Reshape(a, {T, Hq * D}), wo, bo), "attn_out");  // [T, C]
    x = b.Named(b.Add(x, attn_out), "ffn_inp");                              // [T, C]
    // SwiGLU MLP.
    const Value ffn_norm_w = w("ffn_norm.weight", {C});                           // (C)
    const Value w_down = w("ffn_down.weight", {C, F});                            // (C, F)
    const Value b_gate = bias(hp.mlp_bias, "ffn_gate.bias", F);                   // (F)
    const Value b_up = bias(hp.mlp_bias, "ffn_up.bias", F);                       // (F)
    const Value b_down = bias(hp.mlp_bias, "ffn_down.bias", C);                   // (C)
    const Value h2 = b.Named(b.RmsNorm(x, ffn_norm_w, hp.norm_eps), "ffn_norm");  // [T, C]
    Value gate, up;                                                               // [T, F]
    if (hp.fused_gate_up || hp.fuse_projections) {
      const char* name = hp.fused_gate_up ? "ffn_up.weight" : "ffn_gate_up.weight";
      const Value gu = b.Named(ctx.Linear(h2, w(name, {2 * F, C})), "ffn_gate_up");
      gate = b.Named(b.Slice(gu, 1, 0, F), "ffn_gate");  // [T, F]: the first half
      up = b.Named(b.Slice(gu, 1, F, F), "ffn_up");      // [T, F]
    } else {
      gate = b.Named(ctx.Linear(h2, w("ffn_gate.weight", {F, C}), b_gate), "ffn_gate");  // (F, C)
      up = b.Named(ctx.Linear(h2, w("ffn_up.weight", {F, C}), b_up), "ffn_up");          // (F, C)
    }
    const Value act = b.Named(b.Mul(b.Silu(gate), up), "ffn_act");           // [T, F]
    const Value down = b.Named(ctx.Linear(act, w_down, b_down), "ffn_out");  // [T, C]
    x = b.Named(b.Add(x, down), "l_out");                                    // [T, C]
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
      .gguf_names = {"llama", "qwen2", "qwen3", "phi3"},
      .hf_model_types = {"llama", "mistral", "qwen2", "qwen3", "phi3"},
      .from_gguf = LlamaFromGguf,
      .from_hf = LlamaFromHf,
      .hf_naming = LlamaHfNaming,
      .build = BuildLlama,
  };
  return *arch;
}

}  // namespace kiln::models
