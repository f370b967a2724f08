// GPT-2: learned position embeddings, pre-LayerNorm blocks with biases, one fused q/k/v
// projection (c_attn) split after the matmul, GELU (tanh approximation, "gelu_new") MLP,
// tied LM head.
//
// Hugging Face stores GPT-2's projections as Conv1D weights [in, out]; they are transposed
// at load to the [out, in] layout every Linear takes (GGUF files are already converted).
#include "absl/strings/str_cat.h"
#include "models/arch/arch.h"
#include "models/io/errors.h"

namespace kiln::models {
namespace {

StatusOr<LlmHParams> Gpt2FromGguf(const GgufFile& g, std::string_view variant) {
  const std::string a(variant);
  LlmHParams hp;
  hp.architecture = a;
  hp.use_rope = false;
  hp.activation = LlmActivation::kGeluTanh;
  KILN_ASSIGN_OR_RETURN(hp.num_layers, GgufInt(g, a + ".block_count"));
  KILN_ASSIGN_OR_RETURN(hp.hidden_size, GgufInt(g, a + ".embedding_length"));
  KILN_ASSIGN_OR_RETURN(hp.ffn_size, GgufInt(g, a + ".feed_forward_length"));
  KILN_ASSIGN_OR_RETURN(hp.num_heads, GgufInt(g, a + ".attention.head_count"));
  hp.num_kv_heads = hp.num_heads;
  KILN_ASSIGN_OR_RETURN(hp.context_length, GgufInt(g, a + ".context_length"));
  KILN_ASSIGN_OR_RETURN(const float eps, g.GetF32Or(a + ".attention.layer_norm_epsilon", 1e-5f));
  hp.norm_eps = eps;
  hp.head_dim = hp.num_heads > 0 ? hp.hidden_size / hp.num_heads : 0;
  const GgufTensor* embd = g.FindTensor("token_embd.weight");
  const int64_t embd_rows = embd != nullptr && embd->dims.size() == 2 ? embd->dims[1] : 0;
  KILN_ASSIGN_OR_RETURN(hp.vocab_size, GgufIntOr(g, a + ".vocab_size", embd_rows));
  hp.attn_qkv_bias = hp.attn_out_bias = hp.mlp_bias = true;
  hp.tied_embeddings = g.FindTensor("output.weight") == nullptr;
  KILN_RETURN_IF_ERROR(ValidateHParams(hp, g.path()));
  if (hp.head_dim * hp.num_heads != hp.hidden_size) {
    return InvalidArgument(g.path(), ": embedding_length ", hp.hidden_size,
                           " is not a multiple of head_count ", hp.num_heads);
  }
  return hp;
}

StatusOr<LlmHParams> Gpt2FromHf(const HfModelConfig& c, std::string_view variant) {
  LlmHParams hp;
  hp.architecture = std::string(variant);
  hp.use_rope = false;
  KILN_ASSIGN_OR_RETURN(hp.vocab_size, c.GetInt("vocab_size"));
  KILN_ASSIGN_OR_RETURN(hp.hidden_size, c.GetInt("n_embd"));
  KILN_ASSIGN_OR_RETURN(hp.num_layers, c.GetInt("n_layer"));
  KILN_ASSIGN_OR_RETURN(hp.num_heads, c.GetInt("n_head"));
  hp.num_kv_heads = hp.num_heads;
  KILN_ASSIGN_OR_RETURN(hp.context_length, HfIntOr(c, "n_positions", 1024));
  KILN_ASSIGN_OR_RETURN(hp.ffn_size, HfIntOr(c, "n_inner", 4 * hp.hidden_size));
  KILN_ASSIGN_OR_RETURN(hp.norm_eps, HfFloatOr(c, "layer_norm_epsilon", 1e-5));
  hp.head_dim = hp.num_heads > 0 ? hp.hidden_size / hp.num_heads : 0;
  auto act = c.GetString("activation_function");
  const std::string activation = act.ok() ? *act : "gelu_new";
  if (activation == "gelu_new" || activation == "gelu_pytorch_tanh" || activation == "gelu_fast") {
    hp.activation = LlmActivation::kGeluTanh;
  } else if (activation == "gelu") {
    hp.activation = LlmActivation::kGeluErf;
  } else {
    return Unimplemented(c.path, ": activation_function '", activation,
                         "' is not supported; supported: gelu_new, gelu_pytorch_tanh, gelu");
  }
  KILN_ASSIGN_OR_RETURN(const bool scale, HfBoolOr(c, "scale_attn_weights", true));
  KILN_ASSIGN_OR_RETURN(const bool by_layer, HfBoolOr(c, "scale_attn_by_inverse_layer_idx", false));
  if (!scale || by_layer) {
    return Unimplemented(c.path,
                         ": only GPT-2's default attention scaling (scale_attn_weights true, "
                         "scale_attn_by_inverse_layer_idx false) is supported");
  }
  hp.attn_qkv_bias = hp.attn_out_bias = hp.mlp_bias = true;
  KILN_ASSIGN_OR_RETURN(hp.tied_embeddings, HfBoolOr(c, "tie_word_embeddings", true));
  KILN_RETURN_IF_ERROR(ValidateHParams(hp, c.path));
  if (hp.head_dim * hp.num_heads != hp.hidden_size) {
    return InvalidArgument(c.path, ": n_embd ", hp.hidden_size, " is not a multiple of n_head ",
                           hp.num_heads);
  }
  return hp;
}

const HfNaming& Gpt2HfNaming() {
  static const HfNaming* naming =
      new HfNaming{.layer_prefixes = {"h."},
                   .global = {{"wte.weight", "token_embd.weight"},
                              {"wpe.weight", "position_embd.weight"},
                              {"ln_f.weight", "output_norm.weight"},
                              {"ln_f.bias", "output_norm.bias"},
                              {"lm_head.weight", "output.weight"}},
                   .per_layer = {{"ln_1.weight", "attn_norm.weight"},
                                 {"ln_1.bias", "attn_norm.bias"},
                                 {"attn.c_attn.weight", "attn_qkv.weight", /*transpose=*/true},
                                 {"attn.c_attn.bias", "attn_qkv.bias"},
                                 {"attn.c_proj.weight", "attn_output.weight", /*transpose=*/true},
                                 {"attn.c_proj.bias", "attn_output.bias"},
                                 {"ln_2.weight", "ffn_norm.weight"},
                                 {"ln_2.bias", "ffn_norm.bias"},
                                 {"mlp.c_fc.weight", "ffn_up.weight", /*transpose=*/true},
                                 {"mlp.c_fc.bias", "ffn_up.bias"},
                                 {"mlp.c_proj.weight", "ffn_down.weight", /*transpose=*/true},
                                 {"mlp.c_proj.bias", "ffn_down.bias"}},
                   // Causal-mask buffers of older exports.
                   .ignored_suffixes = {".attn.bias", ".attn.masked_bias"},
                   .strip_prefixes = {"transformer."}};
  return *naming;
}

Value BuildGpt2(ForwardContext& ctx) {
  Builder& b = ctx.b();
  const LlmHParams& hp = ctx.hp();
  const StepInputs& in = ctx.in();
  const int64_t V = hp.vocab_size, C = hp.hidden_size, H = hp.num_heads, D = hp.head_dim,
                F = hp.ffn_size, P = hp.context_length;
  const Dim& T = in.T;
  const bool tanh_gelu = hp.activation == LlmActivation::kGeluTanh;

  const Value wte = ctx.Weight("token_embd.weight", {V, C});     // (V, C)
  const Value wpe = ctx.Weight("position_embd.weight", {P, C});  // (P, C)
  Value x = b.Named(b.Add(ctx.Embed(wte, in.tokens), ctx.Embed(wpe, in.positions)),
                    "inp_embd");  // [T, C]
  for (int64_t l = 0; l < hp.num_layers; ++l) {
    const std::string blk = absl::StrCat("blk.", l, ".");
    auto w = [&](const char* name, std::vector<int64_t> shape) {
      return ctx.Weight(blk + name, std::move(shape));
    };
    b.SetNameScope(absl::StrCat("blk.", l));
    // Attention with the fused projection: rows [0, C) are q, [C, 2C) k, [2C, 3C) v.
    const Value ln1_w = w("attn_norm.weight", {C});                                   // (C)
    const Value ln1_b = w("attn_norm.bias", {C});                                     // (C)
    const Value w_qkv = w("attn_qkv.weight", {3 * C, C});                             // (3C, C)
    const Value b_qkv = w("attn_qkv.bias", {3 * C});                                  // (3C)
    const Value w_o = w("attn_output.weight", {C, C});                                // (C, C)
    const Value b_o = w("attn_output.bias", {C});                                     // (C)
    const Value h = b.Named(b.LayerNorm(x, ln1_w, ln1_b, hp.norm_eps), "attn_norm");  // [T, C]
    const Value qkv = b.Named(ctx.Linear(h, w_qkv, b_qkv), "qkv");                    // [T, 3C]
    auto part = [&](int64_t i, const char* name) {
      return b.Named(b.Reshape(b.Slice(qkv, 1, i * C, C), {T, H, D}), name);  // [T, H, D]
    };
    const Value q = part(0, "q"), k = part(1, "k"), v = part(2, "v");
    const Value a = ctx.Attend(l, q, k, v);  // [T, H, D]
    const Value attn_out =
        b.Named(ctx.Linear(b.Reshape(a, {T, C}), w_o, b_o), "attn_out");  // [T,C]
    x = b.Named(b.Add(x, attn_out), "ffn_inp");                           // [T,C]
    // MLP.
    const Value ln2_w = w("ffn_norm.weight", {C});                                      // (C)
    const Value ln2_b = w("ffn_norm.bias", {C});                                        // (C)
    const Value w_up = w("ffn_up.weight", {F, C});                                      // (F, C)
    const Value b_up = w("ffn_up.bias", {F});                                           // (F)
    const Value w_down = w("ffn_down.weight", {C, F});                                  // (C, F)
    const Value b_down = w("ffn_down.bias", {C});                                       // (C)
    const Value h2 = b.Named(b.LayerNorm(x, ln2_w, ln2_b, hp.norm_eps), "ffn_norm");    // [T, C]
    const Value up = b.Named(b.Gelu(ctx.Linear(h2, w_up, b_up), tanh_gelu), "ffn_up");  // [T, F]
    const Value down = b.Named(ctx.Linear(up, w_down, b_down), "ffn_out");              // [T, C]
    x = b.Named(b.Add(x, down), "l_out");                                               // [T, C]
  }
  b.SetNameScope("");
  const Value last = b.Named(ctx.LastTokens(x), "last_tokens");                          // [S, C]
  const Value lnf_w = ctx.Weight("output_norm.weight", {C});                             // (C)
  const Value lnf_b = ctx.Weight("output_norm.bias", {C});                               // (C)
  const Value lm_head = hp.tied_embeddings ? wte : ctx.Weight("output.weight", {V, C});  // (V, C)
  const Value norm = b.Named(b.LayerNorm(last, lnf_w, lnf_b, hp.norm_eps), "output_norm");  // [S,C]
  return b.Named(b.Linear(norm, lm_head), "logits");  // [S, V]
}

}  // namespace

const Architecture& Gpt2Architecture() {
  static const Architecture* arch = new Architecture{
      .family = "gpt2",
      .gguf_names = {"gpt2"},
      .hf_model_types = {"gpt2"},
      .from_gguf = Gpt2FromGguf,
      .from_hf = Gpt2FromHf,
      .hf_naming = Gpt2HfNaming,
      .build = BuildGpt2,
  };
  return *arch;
}

}  // namespace kiln::models
