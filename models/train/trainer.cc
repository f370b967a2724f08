#include "models/train/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <set>

#include "backends/registry.h"
#include "engine/autograd.h"
#include "engine/compiler/compile.h"
#include "models/arch/arch.h"
#include "models/io/errors.h"
#include "models/lora/lora_dropout.h"
#include "spdlog/spdlog.h"

namespace kiln::models {

struct Trainer::Compiled {
  std::unique_ptr<Program> program;
  int norm_output = -1;        // kStep: the global gradient norm
  int first_grad_output = -1;  // kGradients: one output per trainable tensor, in order
};

Trainer::Trainer(PagedLlmParts parts, const TrainerOptions& options)
    : parts_(std::move(parts)), options_(options) {}

Trainer::~Trainer() = default;

StatusOr<std::unique_ptr<Trainer>> Trainer::Create(PagedLlmParts parts,
                                                   const TrainerOptions& options) {
  if (options.batch_size < 1 || options.seq_len < 2) {
    return InvalidArgument("training needs a batch size >= 1 and a sequence length >= 2 (got ",
                           options.batch_size, " and ", options.seq_len, ")");
  }
  if (options.seq_len > parts.hparams.context_length) {
    return InvalidArgument("sequence length ", options.seq_len,
                           " is more than the model's context (", parts.hparams.context_length,
                           " tokens)");
  }
  if (!(options.max_grad_norm >= 0)) {
    return InvalidArgument("max_grad_norm must be >= 0 (0 turns clipping off), got ",
                           options.max_grad_norm);
  }
  if (options.method == TrainerOptions::Method::kLora) {
    KILN_RETURN_IF_ERROR(options.lora.Validate());
  }
  std::unique_ptr<Trainer> t(new Trainer(std::move(parts), options));
  KILN_RETURN_IF_ERROR(t->Init());
  return t;
}

namespace {

// The name of trainable tensor `name`'s gradient accumulator (Step over micro-batches).
std::string AccumulatorName(const std::string& name) { return name + ".grad_sum"; }

}  // namespace

namespace {

// Rows of the classifier head per chunk: logits and dlogits exist for this many rows at a
// time (2 x 256 x vocabulary x 4 bytes; 100 MB for a 49,152-token vocabulary).
constexpr int64_t kHeadChunkRows = 256;

}  // namespace

ClassifierOutputs ChunkedClassifier(Builder& b, Value logits, Value targets, Value dloss) {
  const Node head = b.graph().node(logits.id);
  const bool linear = head.op == OpKind::kLinear && head.inputs.size() == 2 &&
                      b.shape(logits).size() == 2 && b.shape(logits)[0].TryConstant();
  ClassifierOutputs out;
  if (!linear) {  // any other head: one fused cross-entropy over all rows
    const CrossEntropyOutputs ce = b.FusedCrossEntropy(logits, targets, dloss);
    out.loss = ce.loss;
    out.input = logits;
    out.dinput = ce.dlogits;
    return out;
  }
  const Value x = Value{head.inputs[0]}, w = Value{head.inputs[1]};
  const int64_t rows = *b.shape(logits)[0].TryConstant();
  const bool trainable_head = b.graph().node(w.id).op == OpKind::kState;
  std::vector<Value> losses, dxs;
  for (int64_t r0 = 0; r0 < rows; r0 += kHeadChunkRows) {
    const int64_t n = std::min(kHeadChunkRows, rows - r0);
    const Value xc = b.Slice(x, 0, r0, n);
    const Value lc = b.Named(b.Linear(xc, w), Cat("logits.rows_", r0));
    const Value dl = b.shape(dloss).empty() ? dloss : b.Slice(dloss, 0, r0, n);
    const CrossEntropyOutputs ce = b.FusedCrossEntropy(lc, b.Slice(targets, 0, r0, n), dl);
    losses.push_back(ce.loss);
    dxs.push_back(b.MatMul(ce.dlogits, w));  // d x = dlogits W
    if (trainable_head) {
      const Value dw = b.MatMul(b.Transpose(ce.dlogits, 0, 1), xc);  // d W = dlogits^T x
      out.dweight = out.dweight.valid() ? b.Add(out.dweight, dw) : dw;
    }
  }
  out.loss = losses.size() == 1 ? losses[0] : b.Concat(losses, 0);
  out.input = x;
  out.dinput = dxs.size() == 1 ? dxs[0] : b.Concat(dxs, 0);
  out.weight = w;
  return out;
}

bool NativeTrainingAttention(backend::Device& device, const LlmHParams& hp, int64_t rows,
                             int64_t seq_len) {
  if (const char* v = std::getenv("KILN_FUSED_ATTENTION"); v != nullptr && std::string(v) == "0") {
    return false;
  }
  std::set<int64_t> windows;
  for (int64_t l = 0; l < hp.num_layers; ++l) windows.insert(hp.window(l));
  const int64_t Hq = hp.num_heads, Hkv = hp.num_kv_heads, D = hp.head_dim;
  const TensorType q{DType::kF32, {rows, Hq, seq_len, D}}, kv{DType::kF32, {rows, Hkv, seq_len, D}};
  const TensorType lse{DType::kF32, {rows, Hq, seq_len}}, ids{DType::kI32, {rows * seq_len}};
  const std::vector<TensorType> in = {q, kv, kv, q, q, lse, ids};
  for (int64_t w : windows) {
    Attrs a;
    a.floats = {1.0 / std::sqrt(static_cast<double>(D))};
    a.expr[0] = attn::DocumentMask(0, seq_len, w);
    backend::KernelRequest req;
    req.op = OpKind::kAttentionBackward;
    req.attrs = &a;
    req.inputs = in;
    req.output = q;
    req.name = "training attention probe";
    const StatusOr<backend::Kernel> k = device.GetKernel(req);
    if (!k.ok() || k->name.rfind("ref.", 0) == 0) return false;
  }
  return true;
}

// Builds the graph of one kind of program. Every kind but kApply starts with the same
// forward and loss, so the trainable tensors and weights they name are the same.
StatusOr<Trainer::Compiled*> Trainer::Get(Kind kind) {
  auto& slot = compiled_[static_cast<size_t>(kind)];
  if (slot != nullptr) return slot.get();
  const LlmHParams& hp = parts_.hparams;
  const int64_t R = options_.batch_size, L = options_.seq_len, T = R * L;
  Graph graph;
  Builder b(&graph);
  std::vector<Value> outputs;
  auto compiled = std::make_unique<Compiled>();
  // torch.nn.utils.clip_grad_norm_'s norm and coefficient, in the graph; then one fused
  // optimizer kernel per trainable tensor (engine/optimizer.h).
  auto optimize = [&](std::span<const Value> params, std::span<const Value> grads) {
    ClipGradNormOutputs clip = ClipGradNorm(
        b, grads,
        options_.max_grad_norm > 0 ? options_.max_grad_norm : std::numeric_limits<double>::max());
    const Value hyper = b.Input("optim.hyper", DType::kF64, {3});  // {step, lr, grad_scale}
    const std::vector<std::string> state_names = OptimizerStateNames(options_.optimizer);
    for (size_t i = 0; i < grads.size(); ++i) {
      const TrainableTensor& t = trainable_[i];
      const SymShape shape(t.shape.begin(), t.shape.end());
      std::vector<Value> states;
      for (const std::string& n : state_names) {
        states.push_back(b.State(t.name + "." + n, DType::kF32, shape));
      }
      const OptimizerOutputs o =
          b.OptimizerStep(params[i], grads[i], states, hyper,
                          options_.max_grad_norm > 0 ? clip.coef : Value{}, options_.optimizer);
      outputs.push_back(o.param);
      outputs.insert(outputs.end(), o.states.begin(), o.states.end());
    }
    compiled->norm_output = static_cast<int>(outputs.size());
    outputs.push_back(clip.total_norm);
  };
  if (kind == Kind::kApply) {
    // The accumulated gradients are States; so are the parameters.
    std::vector<Value> params, grads;
    for (const TrainableTensor& t : trainable_) {
      const SymShape shape(t.shape.begin(), t.shape.end());
      params.push_back(b.State(t.name, DType::kF32, shape));
      grads.push_back(b.State(AccumulatorName(t.name), DType::kF32, shape));
    }
    optimize(params, grads);
  } else {
    StepInputs in;
    in.T = T;
    in.S = R;
    in.L = L;
    in.tokens = b.Input("tokens", DType::kI32, {T});                // [T]
    in.positions = b.Input("positions", DType::kI32, {T});          // [T]
    in.doc_ids = b.Input("doc_ids", DType::kI32, {T});              // [T]
    const Value targets = b.Input("targets", DType::kI32, {T});     // [T]
    const Value inv_count = b.Input("inv_count", DType::kF32, {});  // 1 / counted tokens
    TrainGraphOptions to;
    to.fused_attention = fused_attention_;
    to.lora = options_.method == TrainerOptions::Method::kLora ? &options_.lora : nullptr;
    to.full = options_.method == TrainerOptions::Method::kFull;
    if (to.lora != nullptr && to.lora->dropout > 0 && kind != Kind::kLoss &&
        kind != Kind::kLogits) {
      to.dropout_seed = b.Input("lora.dropout_seed", DType::kI64, {1});
    }
    ForwardContext ctx(b, *parts_.files, hp, in, to);
    const Value logits = parts_.arch->build(ctx);  // [T, V]
    KILN_RETURN_IF_ERROR(ctx.status());
    KILN_RETURN_IF_ERROR(b.status());
    if (trainable_.empty()) trainable_ = ctx.trainable();
    ClassifierOutputs head;
    if (kind == Kind::kLogits) {
      outputs.push_back(logits);
    } else {
      head = ChunkedClassifier(b, logits, targets, inv_count);
      outputs.push_back(b.Named(b.Mul(b.Sum(head.loss, {0}), inv_count), "loss"));  // rank 0
    }
    if (kind == Kind::kGradients || kind == Kind::kStep || kind == Kind::kAccumulate) {
      std::vector<Value> wrt;
      for (const TrainableTensor& t : ctx.trainable()) wrt.push_back(t.value);
      const Value seeds[] = {head.dinput};
      const Value outs[] = {head.input};
      GradientOptions gopt;
      if (options_.recompute) {
        gopt.recompute = ScopeRanges(graph, "blk");
      } else if (options_.recompute_cheap) {
        static constexpr std::string_view kCheap[] = {"attn_norm", "ffn_norm", "ffn_act"};
        gopt.recompute_on_read = ValueRanges(graph, kCheap);
      }
      KILN_ASSIGN_OR_RETURN(std::vector<Value> grads, kiln::Gradients(b, outs, seeds, wrt, gopt));
      // The head weight's own gradient (full fine-tuning: the tied embedding or output.weight).
      for (size_t i = 0; i < wrt.size() && head.dweight.valid(); ++i) {
        if (wrt[i].id == head.weight.id) grads[i] = b.Add(grads[i], head.dweight);
      }
      if (kind == Kind::kGradients) {
        compiled->first_grad_output = static_cast<int>(outputs.size());
        outputs.insert(outputs.end(), grads.begin(), grads.end());
      } else if (kind == Kind::kStep) {
        optimize(wrt, grads);
      } else {
        // sum += grad, in place: torch's SGD update p - lr * g with lr = -1 (no momentum, no
        // weight decay) is exactly that addition, one fused kernel per tensor.
        OptimizerParams add = DefaultOptimizerParams(OptimizerKind::kSgd);
        const Value hyper = b.Input("accumulate.hyper", DType::kF64, {3});  // {1, -1, 1}
        for (size_t i = 0; i < grads.size(); ++i) {
          const TrainableTensor& t = trainable_[i];
          const Value sum = b.State(AccumulatorName(t.name), DType::kF32,
                                    SymShape(t.shape.begin(), t.shape.end()));
          outputs.push_back(b.OptimizerStep(sum, grads[i], {}, hyper, Value{}, add).param);
        }
      }
    }
  }
  KILN_RETURN_IF_ERROR(b.status());
  static constexpr const char* kLabels[] = {" (loss)",
                                            " (gradients)",
                                            " (training step)",
                                            " (logits)",
                                            " (accumulate gradients)",
                                            " (optimizer step)"};
  compiler::CompilerOptions copts;
  copts.label = Cat(parts_.info.name, kLabels[static_cast<size_t>(kind)]);
  compiler::CompileReport report;
  KILN_ASSIGN_OR_RETURN(compiled->program,
                        compiler::Compile(graph, outputs, *parts_.device, copts, &report));
  spdlog::debug("{}: {}", copts.label, report.ToString());
  KILN_RETURN_IF_ERROR(BindExternals(*compiled->program));
  if (kind == Kind::kAccumulate) {
    const double add[3] = {1, -1, 1};
    KILN_RETURN_IF_ERROR(Upload(inputs_.at("accumulate.hyper"), add, sizeof(add)));
  }
  slot = std::move(compiled);
  return slot.get();
}

// Binds what the program names: frozen weights (loaded once), trainable tensors, moments and
// accumulators (allocated once, zeroed), inputs (allocated once, rewritten per step).
Status Trainer::BindExternals(Program& p) {
  auto keepalive = std::const_pointer_cast<ModelFiles>(parts_.files);
  for (const ExternalInfo& e : p.externals()) {
    Tensor* bound = nullptr;
    if (e.kind == OpKind::kWeight) {
      auto it = weights_.find(e.name);
      if (it == weights_.end()) {
        const WeightInfo* w = parts_.files->Find(e.name);
        KILN_CHECK(w != nullptr, "the training graph uses a weight the files do not have");
        KILN_ASSIGN_OR_RETURN(Tensor t, parts_.files->Load(*w, *parts_.device, keepalive));
        it = weights_.emplace(e.name, std::move(t)).first;
      }
      bound = &it->second;
    } else {
      auto& pool = e.kind == OpKind::kState ? states_ : inputs_;
      auto it = pool.find(e.name);
      if (it == pool.end()) {
        std::vector<int64_t> shape;
        for (const Dim& d : e.shape) shape.push_back(d.constant());
        KILN_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(*parts_.device, e.dtype, shape));
        KILN_RETURN_IF_ERROR(Zero(t));
        it = pool.emplace(e.name, std::move(t)).first;
      }
      bound = &it->second;
    }
    KILN_RETURN_IF_ERROR(p.Bind(e.name, *bound));
  }
  return OkStatus();
}

// Compiles the gradient-free program first (it creates every trainable tensor), then sets
// their initial values: PEFT's LoRA init, or the model's weights as f32 master copies.
Status Trainer::Init() {
  KILN_ASSIGN_OR_RETURN(stream_, parts_.device->CreateStream());
  compiled_.resize(static_cast<size_t>(Kind::kCount));
  fused_attention_ = NativeTrainingAttention(*parts_.device, parts_.hparams, options_.batch_size,
                                             options_.seq_len);
  KILN_RETURN_IF_ERROR(Get(Kind::kLoss).status());
  if (trainable_.empty()) return InvalidArgument("the training graph has no trainable tensor");
  if (options_.method == TrainerOptions::Method::kLora) {
    // Every explicitly named target module must exist in the model.
    KILN_ASSIGN_OR_RETURN(
        std::vector<LoraModule> modules,
        ResolveLoraModules(parts_.hparams.architecture, options_.lora.target_modules));
    const bool all =
        std::find(options_.lora.target_modules.begin(), options_.lora.target_modules.end(),
                  "all-linear") != options_.lora.target_modules.end();
    for (const LoraModule& m : modules) {
      const std::string suffix = Cat(".", m.gguf, ".lora_A");
      const bool found = std::any_of(trainable_.begin(), trainable_.end(), [&](const auto& t) {
        return t.name.size() > suffix.size() &&
               t.name.compare(t.name.size() - suffix.size(), suffix.size(), suffix) == 0;
      });
      if (!found && !all) {
        return InvalidArgument("LoRA target module '", m.path, "' does not exist in this ",
                               parts_.hparams.architecture, " model");
      }
    }
    // PEFT: A ~ kaiming_uniform(a = sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)); B = 0.
    std::mt19937_64 rng(options_.seed);
    for (const TrainableTensor& t : trainable_) {
      std::vector<float> v(static_cast<size_t>(t.shape[0] * t.shape[1]), 0.0f);
      if (t.name.ends_with(".lora_A")) {
        const double bound = 1.0 / std::sqrt(static_cast<double>(t.shape[1]));
        std::uniform_real_distribution<double> u(-bound, bound);
        for (float& x : v) x = static_cast<float>(u(rng));
      }
      KILN_RETURN_IF_ERROR(Write(t.name, v));
    }
  } else {
    auto keepalive = std::const_pointer_cast<ModelFiles>(parts_.files);
    backend::Registry& registry = backend::Registry::Global();
    registry.RegisterBuiltins();
    KILN_ASSIGN_OR_RETURN(backend::Device * host, registry.GetDevice("ref"));
    for (const TrainableTensor& t : trainable_) {
      const WeightInfo* w = parts_.files->Find(t.name);
      KILN_CHECK(w != nullptr, "a trainable weight the files do not have");
      // Read on the host (the reference device maps the file) and widened to f32.
      KILN_ASSIGN_OR_RETURN(Tensor stored, parts_.files->Load(*w, *host, keepalive));
      KILN_ASSIGN_OR_RETURN(std::vector<double> d, stored.ToDoubles());
      const std::vector<float> f(d.begin(), d.end());
      KILN_RETURN_IF_ERROR(Write(t.name, f));
    }
  }
  return OkStatus();
}

int64_t Trainer::trainable_parameters() const {
  int64_t n = 0;
  for (const TrainableTensor& t : trainable_) {
    int64_t e = 1;
    for (int64_t d : t.shape) e *= d;
    n += e;
  }
  return n;
}

Status Trainer::Upload(const Tensor& t, const void* src, size_t bytes) {
  if (parts_.device->host_visible()) {
    std::memcpy(t.data(), src, bytes);
    return OkStatus();
  }
  KILN_RETURN_IF_ERROR(
      stream_->CopyToDevice(*t.buffer(), DTypeBytes(t.dtype(), t.offset()), src, bytes));
  return stream_->Synchronize();
}

StatusOr<std::vector<float>> Trainer::Download(const Tensor& t) const {
  if (t.dtype() != DType::kF32) return Internal("trainer: a non-f32 tensor read as f32");
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (parts_.device->host_visible() && t.IsContiguous()) {
    std::memcpy(out.data(), t.data(), out.size() * sizeof(float));
    return out;
  }
  KILN_CHECK(t.IsContiguous(), "trainer: outputs are dense");
  KILN_RETURN_IF_ERROR(stream_->CopyToHost(
      out.data(), *t.buffer(), DTypeBytes(t.dtype(), t.offset()), out.size() * sizeof(float)));
  KILN_RETURN_IF_ERROR(stream_->Synchronize());
  return out;
}

StatusOr<std::vector<float>> Trainer::Read(const std::string& name) const {
  auto it = states_.find(name);
  if (it == states_.end()) return NotFound("no trainable tensor '", name, "'");
  return Download(it->second);
}

Status Trainer::Write(const std::string& name, std::span<const float> values) {
  auto it = states_.find(name);
  if (it == states_.end()) return NotFound("no trainable tensor '", name, "'");
  if (static_cast<int64_t>(values.size()) != it->second.numel()) {
    return InvalidArgument("tensor '", name, "' has ", it->second.numel(), " elements, got ",
                           values.size());
  }
  return Upload(it->second, values.data(), values.size_bytes());
}

std::map<std::string, std::vector<float>> Trainer::OptimizerState() const {
  std::map<std::string, std::vector<float>> out;
  for (const TrainableTensor& t : trainable_) {
    for (const std::string& s : OptimizerStateNames(options_.optimizer)) {
      auto it = states_.find(t.name + "." + s);
      if (it != states_.end()) {
        StatusOr<std::vector<float>> v = Download(it->second);
        if (v.ok()) out[t.name + "." + s] = *std::move(v);
      }
    }
  }
  return out;
}

Status Trainer::SetOptimizerState(const std::map<std::string, std::vector<float>>& state,
                                  int64_t step) {
  KILN_RETURN_IF_ERROR(Get(Kind::kStep).status());  // allocates the moments
  for (const auto& [name, v] : state) {
    auto it = states_.find(name);
    if (it == states_.end())
      return InvalidArgument("optimizer state names unknown tensor '", name, "'");
    if (static_cast<int64_t>(v.size()) != it->second.numel()) {
      return InvalidArgument("optimizer state '", name, "' has ", v.size(), " elements; expected ",
                             it->second.numel());
    }
    KILN_RETURN_IF_ERROR(Upload(it->second, v.data(), v.size() * sizeof(float)));
  }
  step_ = step;
  return OkStatus();
}

StatusOr<LoraAdapter> Trainer::ExportAdapter() const {
  if (options_.method != TrainerOptions::Method::kLora) {
    return FailedPrecondition("only a LoRA run has an adapter");
  }
  LoraAdapter adapter;
  adapter.config = options_.lora;
  for (const TrainableTensor& t : trainable_) {
    if (!t.name.ends_with(".lora_A")) continue;
    const std::string stem = t.name.substr(0, t.name.size() - 7);
    LoraLayer& layer = adapter.layers[stem + ".weight"];
    KILN_ASSIGN_OR_RETURN(layer.a, Read(stem + ".lora_A"));
    KILN_ASSIGN_OR_RETURN(layer.b, Read(stem + ".lora_B"));
    layer.in = t.shape[1];
    layer.out = static_cast<int64_t>(layer.b.size()) / options_.lora.r;
  }
  return adapter;
}

Status Trainer::ImportAdapter(const LoraAdapter& adapter) {
  if (options_.method != TrainerOptions::Method::kLora) {
    return FailedPrecondition("only a LoRA run has an adapter");
  }
  if (adapter.config.r != options_.lora.r) {
    return InvalidArgument("the adapter has rank ", adapter.config.r, " but this run uses ",
                           options_.lora.r);
  }
  for (const auto& [name, layer] : adapter.layers) {
    const std::string stem = name.substr(0, name.size() - std::string_view(".weight").size());
    KILN_RETURN_IF_ERROR(Annotate(Write(stem + ".lora_A", layer.a), Cat("adapter layer ", stem)));
    KILN_RETURN_IF_ERROR(Annotate(Write(stem + ".lora_B", layer.b), Cat("adapter layer ", stem)));
  }
  return OkStatus();
}

size_t Trainer::step_arena_bytes() const {
  size_t bytes = 0;
  for (const Kind kind : {Kind::kStep, Kind::kAccumulate, Kind::kApply}) {
    const auto& c = compiled_[static_cast<size_t>(kind)];
    if (c != nullptr) bytes = std::max(bytes, c->program->arena_bytes());
  }
  return bytes;
}

StatusOr<int64_t> Trainer::CheckBatch(const TrainBatch& batch) const {
  const int64_t T = options_.batch_size * options_.seq_len;
  if (batch.rows != options_.batch_size || batch.seq_len != options_.seq_len ||
      static_cast<int64_t>(batch.tokens.size()) != T ||
      static_cast<int64_t>(batch.targets.size()) != T ||
      static_cast<int64_t>(batch.positions.size()) != T ||
      static_cast<int64_t>(batch.doc_ids.size()) != T) {
    return InvalidArgument("a training batch must have ", options_.batch_size, " rows of ",
                           options_.seq_len, " tokens (got ", batch.rows, " x ", batch.seq_len,
                           ")");
  }
  const int64_t vocab = parts_.hparams.vocab_size;
  for (int64_t i = 0; i < T; ++i) {
    if (batch.tokens[i] < 0 || batch.tokens[i] >= vocab ||
        (batch.targets[i] != train::kIgnoreIndex &&
         (batch.targets[i] < 0 || batch.targets[i] >= vocab))) {
      return InvalidArgument("token ", i, " of the batch is outside the vocabulary (", vocab,
                             " tokens)");
    }
  }
  return std::count_if(batch.targets.begin(), batch.targets.end(),
                       [](int32_t t) { return t != train::kIgnoreIndex; });
}

Status Trainer::Zero(const Tensor& t) {
  if (parts_.device->host_visible() && t.IsContiguous()) {
    std::memset(t.data(), 0, static_cast<size_t>(t.nbytes()));
    return OkStatus();
  }
  const std::vector<uint8_t> zeros(static_cast<size_t>(t.nbytes()));
  return Upload(t, zeros.data(), zeros.size());
}

Status Trainer::PutHyper(double lr) {
  const double hyper[3] = {static_cast<double>(step_ + 1), lr, 1.0};
  return Upload(inputs_.at("optim.hyper"), hyper, sizeof(hyper));
}

StatusOr<double> Trainer::ReadScalar(const Program& p, int output) const {
  KILN_ASSIGN_OR_RETURN(Tensor t, p.Output(output));
  KILN_ASSIGN_OR_RETURN(std::vector<float> v, Download(t));
  return v.at(0);
}

StatusOr<TrainStepResult> Trainer::Run(Kind kind, const TrainBatch& batch, double lr,
                                       std::map<std::string, std::vector<float>>* out,
                                       int64_t count, int64_t micro_batch) {
  KILN_ASSIGN_OR_RETURN(const int64_t own, CheckBatch(batch));
  if (count == 0) count = own;
  if (count == 0 && kind != Kind::kLogits) {
    return InvalidArgument("the batch has no counted (target) token");
  }
  KILN_ASSIGN_OR_RETURN(Compiled * c, Get(kind));
  auto put = [&](const char* name, const void* src, size_t bytes) -> Status {
    auto it = inputs_.find(name);
    if (it == inputs_.end()) return OkStatus();
    return Upload(it->second, src, bytes);
  };
  const size_t bytes = batch.tokens.size() * sizeof(int32_t);
  KILN_RETURN_IF_ERROR(put("tokens", batch.tokens.data(), bytes));
  KILN_RETURN_IF_ERROR(put("targets", batch.targets.data(), bytes));
  KILN_RETURN_IF_ERROR(put("positions", batch.positions.data(), bytes));
  KILN_RETURN_IF_ERROR(put("doc_ids", batch.doc_ids.data(), bytes));
  const float inv = count > 0 ? 1.0f / static_cast<float>(count) : 0.0f;
  KILN_RETURN_IF_ERROR(put("inv_count", &inv, sizeof(inv)));
  const int64_t dropout_seed = LoraDropoutStepSeed(options_.seed, step_ + 1, micro_batch);
  KILN_RETURN_IF_ERROR(put("lora.dropout_seed", &dropout_seed, sizeof(dropout_seed)));
  if (kind == Kind::kStep) KILN_RETURN_IF_ERROR(PutHyper(lr));
  KILN_RETURN_IF_ERROR(c->program->Run(*stream_));
  KILN_RETURN_IF_ERROR(stream_->Synchronize());
  TrainStepResult r;
  r.tokens = own;
  KILN_ASSIGN_OR_RETURN(Tensor first, c->program->Output(0));
  KILN_ASSIGN_OR_RETURN(std::vector<float> fv, Download(first));
  if (kind == Kind::kLogits) {
    (*out)["logits"] = std::move(fv);
    return r;
  }
  r.loss = fv[0];
  if (kind == Kind::kStep) {
    KILN_ASSIGN_OR_RETURN(r.grad_norm, ReadScalar(*c->program, c->norm_output));
    ++step_;
  }
  if (kind == Kind::kGradients && out != nullptr) {
    out->clear();
    for (size_t i = 0; i < trainable_.size(); ++i) {
      KILN_ASSIGN_OR_RETURN(Tensor g,
                            c->program->Output(c->first_grad_output + static_cast<int>(i)));
      KILN_ASSIGN_OR_RETURN((*out)[trainable_[i].name], Download(g));
    }
  }
  return r;
}

StatusOr<TrainStepResult> Trainer::Step(const TrainBatch& batch, double lr) {
  if (!(lr > 0)) return InvalidArgument("the learning rate must be positive, got ", lr);
  return Run(Kind::kStep, batch, lr, nullptr);
}

StatusOr<TrainStepResult> Trainer::Step(std::span<const TrainBatch> micro_batches, double lr) {
  if (micro_batches.size() == 1) return Step(micro_batches[0], lr);
  if (!(lr > 0)) return InvalidArgument("the learning rate must be positive, got ", lr);
  if (micro_batches.empty()) return InvalidArgument("a training step needs a batch");
  int64_t total = 0;
  std::vector<int64_t> counts;
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    StatusOr<int64_t> n = CheckBatch(micro_batches[i]);
    if (!n.ok()) return Annotate(n.status(), Cat("micro-batch ", i + 1));
    counts.push_back(*n);
    total += *n;
  }
  if (total == 0) return InvalidArgument("the step's micro-batches have no counted token");
  KILN_ASSIGN_OR_RETURN(Compiled * apply, Get(Kind::kApply));
  KILN_RETURN_IF_ERROR(Get(Kind::kAccumulate).status());
  // The sums start at zero each step (an earlier step that failed half way leaves nothing).
  for (const TrainableTensor& t : trainable_) {
    KILN_RETURN_IF_ERROR(Zero(states_.at(AccumulatorName(t.name))));
  }
  TrainStepResult r;
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    if (counts[i] == 0) continue;  // adds nothing
    KILN_ASSIGN_OR_RETURN(TrainStepResult part, Run(Kind::kAccumulate, micro_batches[i], lr,
                                                    nullptr, total, static_cast<int64_t>(i)));
    r.loss += part.loss;  // each part is its tokens' loss sum / total
    r.tokens += part.tokens;
  }
  KILN_RETURN_IF_ERROR(PutHyper(lr));
  KILN_RETURN_IF_ERROR(apply->program->Run(*stream_));
  KILN_RETURN_IF_ERROR(stream_->Synchronize());
  KILN_ASSIGN_OR_RETURN(r.grad_norm, ReadScalar(*apply->program, apply->norm_output));
  ++step_;
  return r;
}

StatusOr<TrainStepResult> Trainer::Evaluate(const TrainBatch& batch) {
  return Run(Kind::kLoss, batch, 0, nullptr);
}

StatusOr<std::vector<float>> Trainer::Logits(const TrainBatch& batch) {
  std::map<std::string, std::vector<float>> out;
  KILN_RETURN_IF_ERROR(Run(Kind::kLogits, batch, 0, &out).status());
  return std::move(out["logits"]);
}

StatusOr<TrainStepResult> Trainer::Gradients(const TrainBatch& batch,
                                             std::map<std::string, std::vector<float>>* grads) {
  return Run(Kind::kGradients, batch, 0, grads);
}

}  // namespace kiln::models
