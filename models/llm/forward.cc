#include "models/llm/forward.h"

#include <algorithm>
#include <cmath>

#include "models/io/errors.h"
#include "models/lora/lora_dropout.h"

namespace kiln::models {

ForwardContext::ForwardContext(Builder& b, const ModelFiles& files, const LlmHParams& hp,
                               const StepInputs& in, int64_t block_size, DType kv_dtype)
    : b_(b), files_(files), hp_(hp), in_(in), block_size_(block_size), kv_dtype_(kv_dtype) {}

ForwardContext::ForwardContext(Builder& b, const ModelFiles& files, const LlmHParams& hp,
                               const StepInputs& in, const TrainGraphOptions& train)
    : b_(b), files_(files), hp_(hp), in_(in), training_(true), train_(train) {
  if (train.lora == nullptr) return;
  StatusOr<std::vector<LoraModule>> modules =
      ResolveLoraModules(hp.architecture, train.lora->target_modules);
  if (!modules.ok()) {
    Fail(modules.status());
    return;
  }
  for (int64_t l = 0; l < hp.num_layers; ++l) {
    for (const LoraModule& m : *modules) adapted_.push_back(Cat("blk.", l, ".", m.gguf, ".weight"));
  }
}

void ForwardContext::Fail(Status s) {
  if (status_.ok()) {
    status_ = std::move(s);
  } else {
    ++more_errors_;
  }
}

Status ForwardContext::status() const {
  if (status_.ok() || more_errors_ == 0) return status_;
  return Status(status_.code(), Cat(StatusMessage(status_), " (and ", more_errors_, " more problem",
                                    more_errors_ == 1 ? "" : "s", ")"));
}

Value ForwardContext::Source(std::string_view name, std::vector<int64_t> shape, bool required) {
  const WeightInfo* w = files_.Find(name);
  if (w == nullptr) {
    if (required) {
      Fail(InvalidArgument(files_.weights_path(), ": missing tensor '", files_.MissingName(name),
                           "' (architecture ", hp_.architecture, " with ", hp_.num_layers,
                           " layers needs it)"));
    }
    return {};
  }
  if (w->LoadedShape() != shape) {
    std::vector<int64_t> expected = shape;
    if (w->transpose) std::reverse(expected.begin(), expected.end());
    Fail(InvalidArgument(files_.weights_path(), ": tensor '", w->DisplayName(), "' has shape ",
                         ShapeString(w->shape), " but the model's hyper-parameters need ",
                         ShapeString(expected)));
    return {};
  }
  StatusOr<DType> dtype = LoadedDType(*w);
  if (!dtype.ok()) {
    Fail(dtype.status());
    return {};
  }
  if (std::find(weight_names_.begin(), weight_names_.end(), name) == weight_names_.end()) {
    weight_names_.emplace_back(name);
  }
  SymShape s(shape.begin(), shape.end());
  // Weights carry their GGUF names whatever the current name scope.
  const std::string scope = b_.name_scope();
  b_.SetNameScope("");
  Value v;
  if (train_.full) {  // master weights: f32, updated in place by the optimizer
    v = b_.State(name, DType::kF32, std::move(s));
    if (std::none_of(trainable_.begin(), trainable_.end(),
                     [&](const TrainableTensor& t) { return t.name == name; })) {
      trainable_.push_back({std::string(name), v, shape});
    }
  } else {
    v = b_.Weight(name, *dtype, std::move(s));
  }
  b_.SetNameScope(scope);
  if (v.valid()) weight_of_[v.id] = std::string(name);
  return v;
}

Value ForwardContext::Weight(std::string_view name, std::vector<int64_t> shape) {
  return Source(name, std::move(shape), /*required=*/true);
}

Value ForwardContext::OptionalWeight(std::string_view name, std::vector<int64_t> shape) {
  return Source(name, std::move(shape), /*required=*/false);
}

Value ForwardContext::Linear(Value x, Value w, Value bias) {
  Builder& b = b_;
  Value y = b.Linear(x, w, bias);
  if (!w.valid() || (training_ ? train_.lora == nullptr : lora_slots_ == 0)) return y;
  auto it = weight_of_.find(w.id);
  if (it == weight_of_.end()) return y;
  const std::string& name = it->second;
  const std::string stem = name.substr(0, name.size() - std::string_view(".weight").size());
  const SymShape ws = b.shape(w);
  const int64_t out = ws[0].constant(), in = ws[1].constant();
  const std::string scope = b.name_scope();
  if (!training_) {
    // Multi-LoRA (SetMultiLora): only the modules LoRA can adapt, never the LM head.
    const size_t dot = stem.find('.', 4);
    if (stem.rfind("blk.", 0) != 0 || dot == std::string::npos ||
        LoraModuleForGguf(hp_.architecture, std::string_view(stem).substr(dot + 1)) == nullptr) {
      return y;
    }
    const int64_t kr = lora_slots_ * lora_rank_;
    b.SetNameScope("");
    const Value a = b.State(stem + ".lora_A", DType::kF32, {kr, in});     // (K*R, in)
    const Value bt = b.State(stem + ".lora_BT", DType::kF32, {kr, out});  // (K*R, out)
    b.SetNameScope(scope);
    lora_states_.push_back({stem, in, out});
    const Value xa = b.Mul(b.Linear(x, a), lora_scale_);        // [T, K*R]
    const Value d = b.Named(b.MatMul(xa, bt), stem + ".lora");  // [T, out]
    return b.Add(y, d);
  }
  if (std::find(adapted_.begin(), adapted_.end(), name) == adapted_.end()) return y;
  // PEFT's LoRA: result = base(x) + lora_B(lora_A(dropout(x))) * scaling.
  const LoraConfig* lora = train_.lora;
  const int64_t r = lora->r;
  b.SetNameScope("");
  // Trainable: f32 States.
  const Value a = b.State(stem + ".lora_A", DType::kF32, {r, in});    // (r, in)
  const Value bb = b.State(stem + ".lora_B", DType::kF32, {out, r});  // (out, r)
  trainable_.push_back({stem + ".lora_A", a, {r, in}});
  trainable_.push_back({stem + ".lora_B", bb, {out, r}});
  b.SetNameScope(scope);
  Value xin = x;
  if (lora->dropout > 0 && train_.dropout_seed.valid()) {
    // dropout(x): x times a keep mask / (1 - p) hashed from (step seed, module, element).
    const SymShape xs = b.shape(x);
    Expr flat = Expr::Index(0);
    for (size_t axis = 1; axis < xs.size(); ++axis) {
      flat = flat * Expr::Int(xs[axis].constant()) + Expr::Index(static_cast<int>(axis));
    }
    const Expr mask = LoraDropoutMaskExpr(Expr::Load(0, Expr::Int(0), DType::kI64),
                                          LoraDropoutModuleId(stem), flat, lora->dropout);
    const Value aux[] = {train_.dropout_seed};
    xin = b.Mul(x, b.Named(b.MapIndices(mask, xs, DType::kF32, aux), stem + ".lora_dropout"));
  }
  // The scaling is applied to lora_A's output, [..., r], instead of lora_B's, [..., out]: the
  // same product up to rounding, and neither the forward's epilogue nor the backward
  // multiplies a [tokens, out] tensor by it (-2% of a SmolLM2 step).
  const Value xa = b.Named(b.MulScalar(b.Linear(xin, a), lora->scale()), stem + ".lora_a");
  const Value d = b.Named(b.Linear(xa, bb), stem + ".lora_b");  // [..., out]
  return b.Add(y, d);
}

Value ForwardContext::Attend(int64_t layer, Value q, Value k, Value v) {
  Builder& b = b_;
  if (training_) return AttendTrain(layer, q, k, v);
  const std::string scope = b.name_scope();
  b.SetNameScope("");
  const std::string blk = Cat("blk.", layer, ".");
  const SymShape cache_shape = {in_.NB, block_size_, hp_.num_kv_heads, hp_.head_dim};
  Value k_cache = b.State(blk + "k_cache", kv_dtype_, cache_shape);  // [NB, BS, Hkv, D]
  Value v_cache = b.State(blk + "v_cache", kv_dtype_, cache_shape);  // [NB, BS, Hkv, D]
  // KvWrite returns the written cache: attention reads that value, so it runs after the write.
  k_cache = b.Named(b.KvWrite(k_cache, k, in_.slot_mapping), blk + "k_cache_write");
  v_cache = b.Named(b.KvWrite(v_cache, v, in_.slot_mapping), blk + "v_cache_write");
  AttentionParams p = AttentionFor(layer);
  const Value out = b.Named(
      b.PagedAttention(q, k_cache, v_cache, in_.block_table, in_.seq_lens, in_.query_start, p),
      blk + "attn");  // [T, Hq, D]
  b.SetNameScope(scope);
  return out;
}

AttentionParams ForwardContext::AttentionFor(int64_t layer) const {
  AttentionParams p;
  p.scale =
      hp_.attn_scale > 0 ? hp_.attn_scale : 1.0 / std::sqrt(static_cast<double>(hp_.head_dim));
  const int64_t window = hp_.window(layer);
  p.mask_mod = window > 0 ? attn::SlidingWindowMask(window) : attn::CausalMask();
  if (hp_.attention_chunk > 0) {
    const Expr chunked = attn::ChunkedMask(hp_.attention_chunk);
    p.mask_mod = window > 0 ? And(chunked, p.mask_mod) : chunked;
  }
  if (hp_.alibi) p.score_mod = attn::AlibiScore(hp_.num_heads);
  if (hp_.attn_softcap > 0) {
    const Expr cap = attn::SoftCapScore(hp_.attn_softcap);
    p.score_mod = p.score_mod ? attn::Then(p.score_mod, cap) : cap;
  }
  return p;
}

// Rows of L tokens attend densely within themselves, masked causally and to the token's own
// packed example (attn::DocumentMask over doc_ids), with the layer's score_mod.
Value ForwardContext::AttendTrain(int64_t layer, Value q, Value k, Value v) {
  Builder& b = b_;
  const Dim &S = in_.S, &L = in_.L, &T = in_.T;
  auto rows = [&](Value x, int64_t heads) {  // [T, H, D] -> [S, H, L, D]
    return b.Permute(b.Reshape(x, {S, L, heads, hp_.head_dim}), {0, 2, 1, 3});
  };
  if (hp_.attention_chunk > 0) {
    // Chunks would have to restart with each packed example's positions.
    Fail(Unimplemented("chunked attention (attention_chunk ", hp_.attention_chunk,
                       ") is not supported in training"));
    return {};
  }
  // The fused op where the device has a native attention_backward kernel and no score_mod is
  // set; otherwise matmul, softmax and a mask map (AttentionDecomposed), whose backward keeps
  // the probabilities and whose products run on the backend's GEMM.
  const AttentionParams serving = AttentionFor(layer);
  Attrs attrs;
  attrs.floats = {serving.scale};
  attrs.expr[0] = attn::DocumentMask(0, L.constant(), hp_.window(layer));
  attrs.expr[1] = serving.score_mod;
  const Value aux[] = {in_.doc_ids};
  Value o;  // [S, Hq, L, D]
  if (train_.fused_attention && !attrs.expr[1]) {
    AttentionParams p{attrs.floats[0], attrs.expr[0], {}};
    p.fused_backward = true;
    o = b.Attention(rows(q, hp_.num_heads), rows(k, hp_.num_kv_heads), rows(v, hp_.num_kv_heads), p,
                    aux);
  } else {
    o = AttentionDecomposed(b, rows(q, hp_.num_heads), rows(k, hp_.num_kv_heads),
                            rows(v, hp_.num_kv_heads), attrs, aux);
  }
  return b.Named(b.Reshape(b.Permute(o, {0, 2, 1, 3}), {T, hp_.num_heads, hp_.head_dim}),
                 Cat("blk.", layer, ".attn"));  // [T, Hq, D]
}

Value ForwardContext::LastTokens(Value h) {
  Builder& b = b_;
  if (training_) return h;
  // query_start[1..S] - 1: the last new token of each sequence.
  const Value last = b.Named(b.AddScalar(b.Slice(in_.query_start, 0, 1, in_.S), -1),
                             "last_token_rows");  // [S] i32
  return b.Gather(h, last);                       // [S, C]
}

Value ForwardContext::Embed(Value table, Value ids) {
  Builder& b = b_;
  if (!table.valid()) return {};
  const DType t = b.dtype(table);
  if (IsQuantized(t)) return b.Gather(table, ids, DType::kF32);  // dequantized rows
  const Value rows = b.Gather(table, ids);
  return t == DType::kF32 ? rows : b.Cast(rows, DType::kF32);
}

}  // namespace kiln::models
