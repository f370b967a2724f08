#include "engine/compiler/testing/llama_graph.h"

#include <cmath>
#include <cstring>
#include <random>

namespace kiln::compiler::testing {

StatusOr<LlamaGraph> BuildLlama(const LlamaConfig& c) {
  LlamaGraph m;
  Builder b(&m.graph);
  const Dim T = b.Symbol("T", c.max_tokens);
  const Dim S = b.Symbol("S", c.max_seqs);
  const Value tokens = b.Input("tokens", DType::kI32, {T});
  const Value positions = b.Input("positions", DType::kI32, {T});
  const Value slots = b.Input("slot_mapping", DType::kI32, {T});
  const Value block_table = b.Input("block_table", DType::kI32, {S, c.max_blocks_per_seq});
  const Value seq_lens = b.Input("seq_lens", DType::kI32, {S});
  const Value query_start = b.Input("query_start", DType::kI32, {S + 1});
  Value h = b.Named(b.Gather(b.Weight("token_embd.weight", c.dtype, {c.vocab, c.dim}), tokens),
                    "token_embd");  // [T, C]
  RopeParams rope;
  rope.theta = 10000;
  AttentionParams ap;
  ap.mask_mod = attn::CausalMask();
  const int64_t q_dim = c.heads * c.head_dim, kv_dim = c.kv_heads * c.head_dim;
  for (int l = 0; l < c.layers; ++l) {
    const std::string p = StrCat("blk.", l, ".");
    auto w = [&](const char* name, SymShape shape, DType t) {
      return b.Weight(StrCat(p, name, ".weight"), t, std::move(shape));
    };
    const Value x = b.Named(b.RmsNorm(h, w("attn_norm", {c.dim}, c.dtype), c.eps),
                            p + "attn_norm");  // [T, C]
    const Value q = b.Rope(b.Reshape(b.Linear(x, w("attn_q", {q_dim, c.dim}, c.weight_dtype)),
                                     {T, c.heads, c.head_dim}),
                           positions, rope);  // [T, Hq, D]
    const Value k = b.Rope(b.Reshape(b.Linear(x, w("attn_k", {kv_dim, c.dim}, c.weight_dtype)),
                                     {T, c.kv_heads, c.head_dim}),
                           positions, rope);  // [T, Hkv, D]
    const Value v = b.Reshape(b.Linear(x, w("attn_v", {kv_dim, c.dim}, c.weight_dtype)),
                              {T, c.kv_heads, c.head_dim});  // [T, Hkv, D]
    const SymShape cache_shape = {c.num_blocks, c.block_size, c.kv_heads, c.head_dim};
    const Value kc = b.KvWrite(b.State(p + "k_cache", c.dtype, cache_shape), k, slots);
    const Value vc = b.KvWrite(b.State(p + "v_cache", c.dtype, cache_shape), v, slots);
    const Value a =
        b.Named(b.PagedAttention(q, kc, vc, block_table, seq_lens, query_start, ap), p + "attn");
    const Value o =
        b.Linear(b.Reshape(a, {T, q_dim}), w("attn_output", {c.dim, q_dim}, c.weight_dtype));
    h = b.Named(b.Add(h, o), p + "attn_residual");  // [T, C]
    const Value x2 = b.Named(b.RmsNorm(h, w("ffn_norm", {c.dim}, c.dtype), c.eps), p + "ffn_norm");
    const Value gate = b.Linear(x2, w("ffn_gate", {c.ffn, c.dim}, c.weight_dtype));  // [T, F]
    const Value up = b.Linear(x2, w("ffn_up", {c.ffn, c.dim}, c.weight_dtype));      // [T, F]
    const Value down =
        b.Linear(b.Mul(b.Silu(gate), up), w("ffn_down", {c.dim, c.ffn}, c.weight_dtype));
    h = b.Named(b.Add(h, down), p + "ffn_residual");  // [T, C]
  }
  const Value norm =
      b.Named(b.RmsNorm(h, b.Weight("output_norm.weight", c.dtype, {c.dim}), c.eps), "output_norm");
  m.logits =
      c.lm_head
          ? b.Named(b.Linear(norm, b.Weight("output.weight", c.weight_dtype, {c.vocab, c.dim})),
                    "logits")
          : norm;
  KILN_RETURN_IF_ERROR(b.status());
  return m;
}

namespace {

// A dense tensor on `device` holding `bytes` (its elements' host encoding): written in place on
// host-visible devices, copied through a stream to the others.
StatusOr<Tensor> Upload(backend::Device& device, DType dtype, std::vector<int64_t> shape,
                        const void* bytes) {
  KILN_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(device, dtype, std::move(shape)));
  if (device.host_visible()) {
    std::memcpy(t.data(), bytes, t.nbytes());
    return t;
  }
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<backend::Stream> stream, device.CreateStream());
  KILN_RETURN_IF_ERROR(stream->CopyToDevice(*t.buffer(), 0, bytes, t.nbytes()));
  return t;
}

}  // namespace

StatusOr<std::map<std::string, Tensor>> RandomWeights(const Graph& g, backend::Device& device,
                                                      uint64_t seed) {
  std::map<std::string, Tensor> out;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0, 1);
  for (OpKind kind : {OpKind::kWeight, OpKind::kState}) {
    for (int32_t id : g.Sources(kind)) {
      const Node& n = g.node(id);
      std::vector<int64_t> shape = EvalShape(n.shape, g.SymbolMaxValues());
      int64_t count = 1;
      for (int64_t d : shape) count *= d;
      const bool norm = n.name.find("norm") != std::string::npos;
      const double scale =
          kind == OpKind::kState ? 0.0 : (norm ? 0.1 : 1.0 / std::sqrt(shape.back()));
      std::vector<float> v(count);
      for (float& x : v) x = static_cast<float>((norm ? 1.0 : 0.0) + scale * normal(rng));
      std::vector<uint8_t> bytes(DTypeBytes(n.dtype, count));
      KILN_RETURN_IF_ERROR(ConvertElements(DType::kF32, v.data(), n.dtype, bytes.data(), count));
      KILN_ASSIGN_OR_RETURN(Tensor t, Upload(device, n.dtype, shape, bytes.data()));
      out.emplace(n.name, std::move(t));
    }
  }
  return out;
}

StatusOr<std::map<std::string, Tensor>> StepInputs(const LlamaConfig& c, backend::Device& device,
                                                   int64_t seqs, int64_t new_tokens,
                                                   int64_t context) {
  const int64_t T = seqs * new_tokens;
  const int64_t per_seq_blocks = (context + new_tokens + c.block_size - 1) / c.block_size;
  if (per_seq_blocks > c.max_blocks_per_seq || per_seq_blocks * seqs > c.num_blocks) {
    return InvalidArgument("StepInputs: the cache is too small for ", seqs, " x ",
                           context + new_tokens, " tokens");
  }
  std::vector<double> tokens, positions, slots, table(seqs * c.max_blocks_per_seq, 0), lens, qs;
  qs.push_back(0);
  for (int64_t s = 0; s < seqs; ++s) {
    for (int64_t j = 0; j < c.max_blocks_per_seq; ++j) {
      table[s * c.max_blocks_per_seq + j] = j < per_seq_blocks ? s * per_seq_blocks + j : 0;
    }
    for (int64_t t = 0; t < new_tokens; ++t) {
      const int64_t pos = context + t;
      tokens.push_back(static_cast<double>((s * 31 + t * 7 + 3) % c.vocab));
      positions.push_back(static_cast<double>(pos));
      slots.push_back(static_cast<double>((s * per_seq_blocks + pos / c.block_size) * c.block_size +
                                          pos % c.block_size));
    }
    lens.push_back(static_cast<double>(context + new_tokens));
    qs.push_back(static_cast<double>((s + 1) * new_tokens));
  }
  std::map<std::string, Tensor> in;
  auto put = [&](const char* name, std::vector<int64_t> shape,
                 const std::vector<double>& v) -> Status {
    const std::vector<int32_t> i32(v.begin(), v.end());
    KILN_ASSIGN_OR_RETURN(Tensor t, Upload(device, DType::kI32, shape, i32.data()));
    in.emplace(name, std::move(t));
    return OkStatus();
  };
  KILN_RETURN_IF_ERROR(put("tokens", {T}, tokens));
  KILN_RETURN_IF_ERROR(put("positions", {T}, positions));
  KILN_RETURN_IF_ERROR(put("slot_mapping", {T}, slots));
  KILN_RETURN_IF_ERROR(put("block_table", {seqs, c.max_blocks_per_seq}, table));
  KILN_RETURN_IF_ERROR(put("seq_lens", {seqs}, lens));
  KILN_RETURN_IF_ERROR(put("query_start", {seqs + 1}, qs));
  return in;
}

}  // namespace kiln::compiler::testing
