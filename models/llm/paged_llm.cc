#include "models/llm/paged_llm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/builder.h"
#include "engine/compiler/compile.h"
#include "engine/profile.h"
#include "models/io/errors.h"
#include "models/llm/forward.h"
#include "models/lora/peft_io.h"
#include "spdlog/spdlog.h"

namespace kiln::models {

struct PagedLlm::Capture {
  StepBuffers buffers;
  std::unique_ptr<CapturedProgram> graph;
  std::vector<Tensor> outputs;  // logits [P, V] (and the sampling stage's), in the arena
};

namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

PagedLlm::PagedLlm(PagedLlmParts parts, const PagedLlmOptions& options)
    : parts_(std::move(parts)), options_(options) {}

PagedLlm::~PagedLlm() = default;

StatusOr<std::unique_ptr<PagedLlm>> PagedLlm::Create(PagedLlmParts parts,
                                                     const PagedLlmOptions& options) {
  KILN_CHECK(parts.files != nullptr && parts.arch != nullptr && parts.device != nullptr &&
                 parts.tokenizer != nullptr,
             "PagedLlm::Create: incomplete parts");
  if (options.max_num_seqs < 1 || options.max_num_batched_tokens < 1 || options.block_size < 1) {
    return InvalidArgument("max_num_seqs (", options.max_num_seqs, "), max_num_batched_tokens (",
                           options.max_num_batched_tokens, ") and block_size (", options.block_size,
                           ") must be at least 1");
  }
  if (options.kv_dtype != DType::kF32 && options.kv_dtype != DType::kF16 &&
      options.kv_dtype != DType::kBF16) {
    return InvalidArgument("KV cache type ", DTypeName(options.kv_dtype),
                           " is not supported; use f32, f16 or bf16");
  }
  std::unique_ptr<PagedLlm> m(new PagedLlm(std::move(parts), options));
  for (int size : options.capture_batch_sizes) {
    if (size >= 1 && size <= options.max_num_seqs) m->capture_sizes_.push_back(size);
  }
  std::sort(m->capture_sizes_.begin(), m->capture_sizes_.end());
  m->capture_sizes_.erase(std::unique(m->capture_sizes_.begin(), m->capture_sizes_.end()),
                          m->capture_sizes_.end());
  if (options.max_adapters < 0 || options.max_lora_rank < 1) {
    return InvalidArgument("max_adapters (", options.max_adapters, ") must be >= 0 and ",
                           "max_lora_rank (", options.max_lora_rank, ") >= 1");
  }
  m->lora_slots_ = options.max_adapters;
  m->lora_rank_ = options.max_lora_rank;
  if (options.adapter != nullptr) {  // slot 0 of the multi-LoRA mechanism
    m->lora_slots_ = std::max(m->lora_slots_, 1);
    m->lora_rank_ =
        std::max<int32_t>(m->lora_rank_, static_cast<int32_t>(options.adapter->config.r));
  }
  if (m->lora_slots_ == 0) m->lora_rank_ = 0;
  m->slot_adapter_.resize(m->lora_slots_);
  KILN_ASSIGN_OR_RETURN(m->stream_, m->parts_.device->CreateStream());
  KILN_RETURN_IF_ERROR(m->Build(options.block_size));
  if (options.adapter != nullptr) {
    KILN_RETURN_IF_ERROR(m->CheckAdapter(*options.adapter));
    KILN_RETURN_IF_ERROR(m->LoadAdapter(0, options.adapter));
  }
  return m;
}

Status FuseProjections(PagedLlmParts& parts) {
  const LlmHParams& hp = parts.hparams;
  const char* env = std::getenv("KILN_FUSE_PROJECTIONS");
  if ((env != nullptr && std::string_view(env) == "0") || parts.arch->family != "llama" ||
      hp.attn_qkv_bias || hp.mlp_bias || (hp.fused_qkv && hp.fused_gate_up)) {
    return OkStatus();
  }
  // Made non-const by the loader (ModelFiles::Open) and not shared yet.
  ModelFiles& files = *std::const_pointer_cast<ModelFiles>(parts.files);
  // Every layer's groups (joined name, parts); all must join, or none is added.
  std::vector<std::pair<std::string, std::vector<std::string>>> groups;
  for (int64_t l = 0; l < hp.num_layers; ++l) {
    const std::string blk = absl::StrCat("blk.", l, ".");
    if (!hp.fused_qkv) {
      groups.push_back({blk + "attn_qkv.weight",
                        {blk + "attn_q.weight", blk + "attn_k.weight", blk + "attn_v.weight"}});
    }
    if (!hp.fused_gate_up) {
      groups.push_back(
          {blk + "ffn_gate_up.weight", {blk + "ffn_gate.weight", blk + "ffn_up.weight"}});
    }
  }
  for (const auto& [name, group] : groups) {
    if (!files.CanConcatenateRows(group)) {
      spdlog::debug("{}: {} cannot be joined (types or layouts differ)", parts.info.name,
                    absl::StrJoin(group, " | "));
      return OkStatus();
    }
  }
  for (const auto& [name, group] : groups) {
    KILN_RETURN_IF_ERROR(files.AddConcatenatedRows(name, group));
  }
  parts.fused_projections = true;
  return OkStatus();
}

Status PagedLlm::Build(int32_t block_size) {
  const LlmHParams& hp = parts_.hparams;
  block_size_ = block_size;
  s_max_ = options_.max_num_seqs;
  t_max_ = std::max<int64_t>(options_.max_num_batched_tokens,
                             capture_sizes_.empty() ? 0 : capture_sizes_.back());
  mb_max_ = CeilDiv(parts_.info.context_length, block_size);
  // Distinct prompt and output tokens of a sequence, and the tokens of its logit bias.
  p_max_ = parts_.info.context_length + models::kMaxLogitBias;

  // The step graph, with or without the sampling stage; compiled by the compiler (fusion,
  // generated kernels shared by the identical blocks, the AOT table, the disk cache).
  auto build = [&](bool with_sampling, bool with_lora, std::unique_ptr<Program>* program,
                   std::vector<std::string>* weight_names) -> Status {
    Graph graph;
    Builder b(&graph);
    StepInputs in;
    in.T = b.Symbol("T", t_max_);
    in.S = b.Symbol("S", s_max_);
    in.MB = b.Symbol("MB", mb_max_);
    in.NB = b.Symbol("NB", int64_t{1} << 24);
    in.tokens = b.Input("tokens", DType::kI32, {in.T});                   // [T]
    in.positions = b.Input("positions", DType::kI32, {in.T});             // [T]
    in.slot_mapping = b.Input("slot_mapping", DType::kI32, {in.T});       // [T]
    in.block_table = b.Input("block_table", DType::kI32, {in.S, in.MB});  // [S, MB]
    in.seq_lens = b.Input("seq_lens", DType::kI32, {in.S});               // [S]
    in.query_start = b.Input("query_start", DType::kI32, {in.S + 1});     // [S+1]
    LlmHParams bhp = hp;
    bhp.fuse_projections = parts_.fused_projections && !with_lora;
    ForwardContext ctx(b, *parts_.files, bhp, in, block_size, options_.kv_dtype);
    if (with_lora) {
      ctx.SetMultiLora(lora_slots_, lora_rank_,
                       b.Input("lora_scale", DType::kF32, {in.T, lora_slots_ * lora_rank_}));
    }
    const Value logits = parts_.arch->build(ctx);  // [S, V]
    KILN_RETURN_IF_ERROR(ctx.status());
    KILN_RETURN_IF_ERROR(b.status());
    const SymShape want = {in.S, hp.vocab_size};
    if (b.dtype(logits) != DType::kF32 || b.shape(logits) != want) {
      return Internal("architecture ", hp.architecture, " built logits of type ",
                      TypeString(b.dtype(logits), b.shape(logits), graph), "; expected f32[S,",
                      hp.vocab_size, "]");
    }
    std::vector<Value> outputs = {logits};
    if (with_sampling) {
      const SampleOutputs so = AddSamplingStage(b, logits, in.S, b.Symbol("P", p_max_, 0),
                                                b.Symbol("E", kMaxBannedTokens, 0), hp.vocab_size);
      KILN_RETURN_IF_ERROR(b.status());
      outputs.insert(outputs.end(), {so.token, so.logprob, so.top_ids, so.top_logprobs});
    }
    compiler::CompilerOptions copts;
    copts.label = parts_.info.name;
    copts.metrics = options_.metrics;
    compiler::CompileReport report;
    KILN_ASSIGN_OR_RETURN(*program,
                          compiler::Compile(graph, outputs, *parts_.device, copts, &report));
    for (const std::string& name : ctx.weight_names()) {
      if (std::find(weight_names->begin(), weight_names->end(), name) == weight_names->end()) {
        weight_names->push_back(name);
      }
    }
    return AllocateLoraStates(ctx.lora_states());
  };
  std::vector<std::string> weight_names;
  // A device without the stage's kernel (Unimplemented) samples on the host; other errors stop.
  auto host_sampling_if_unimplemented = [&](const Status& s) -> Status {
    if (s.code() != StatusCode::kUnimplemented) return s;
    spdlog::info("{}: {} does not sample in the step program ({}); sampling on the host",
                 parts_.info.name, parts_.device->name(), StatusMessage(s));
    sample_stage_ = false;
    return OkStatus();
  };
  sample_stage_ = options_.sample_on_device;
  // Asked before compiling, so a device that declines the stage compiles the program once.
  if (sample_stage_) {
    KILN_RETURN_IF_ERROR(
        host_sampling_if_unimplemented(HasSamplingKernel(*parts_.device, hp.vocab_size)));
  }
  const bool lora = lora_slots_ > 0;
  // Should the whole program still refuse the stage (an input shape the probe did not have).
  if (sample_stage_) {
    KILN_RETURN_IF_ERROR(
        host_sampling_if_unimplemented(build(true, lora, &program_, &weight_names)));
  }
  if (!sample_stage_) KILN_RETURN_IF_ERROR(build(false, lora, &program_, &weight_names));
  // Steps without an adapter row run a program without the LoRA branch: base-model traffic
  // does not pay for the adapters (only their memory).
  base_program_.reset();
  if (lora) KILN_RETURN_IF_ERROR(build(sample_stage_, false, &base_program_, &weight_names));
  KILN_RETURN_IF_ERROR(LoadWeights(weight_names));
  for (Program* p : programs()) {
    for (const auto& [name, t] : weights_) {
      if (p->FindExternal(name) >= 0) KILN_RETURN_IF_ERROR(p->Bind(name, t));
    }
    for (const auto& [name, t] : lora_) {
      if (p->FindExternal(name) >= 0) KILN_RETURN_IF_ERROR(p->Bind(name, t));
    }
  }
  KILN_ASSIGN_OR_RETURN(direct_, AllocateStepBuffers(t_max_, s_max_, p_max_, kMaxBannedTokens));
  captures_.clear();
  spdlog::debug("{}: step program of {} launches, arena {:.1f} MiB (unplanned {:.1f} MiB){}",
                parts_.info.name, program_->num_launches(), program_->arena_bytes() / 1048576.0,
                program_->unplanned_bytes() / 1048576.0, sample_stage_ ? ", sampling stage" : "");
  return OkStatus();
}

SampleOutputs AddSamplingStage(Builder& b, Value logits, Dim S, Dim P, Dim E, int64_t vocab) {
  return b.Sample(logits, b.Input("sample.params", DType::kF32, {S, sampling::kNumParams}),
                  b.Input("sample.uniforms", DType::kF64, {S}),
                  b.Input("sample.penalty_tokens", DType::kI32, {S, P}),
                  b.Input("sample.penalty_counts", DType::kI32, {S, P}),
                  b.Input("sample.banned", DType::kI32, {S, E}),
                  b.Input("sample.penalty_bias", DType::kF32, {S, P}),
                  b.Input("sample.allowed", DType::kI32, {S, Dim(sampling::AllowedWords(vocab))}));
}

Status HasSamplingKernel(backend::Device& device, int64_t vocab) {
  Graph g;
  Builder b(&g);
  const Value logits = b.Input("logits", DType::kF32, {Dim(1), Dim(vocab)});
  (void)AddSamplingStage(b, logits, Dim(1), Dim(1), Dim(1), vocab);
  KILN_RETURN_IF_ERROR(b.status());
  for (const Node& n : g.nodes()) {
    if (n.op != OpKind::kSample) continue;
    std::vector<TensorType> inputs;
    for (int32_t in : n.inputs) inputs.push_back({g.node(in).dtype, g.node(in).shape});
    const backend::KernelRequest req{n.op, &n.attrs, inputs, {n.dtype, n.shape}, "sample"};
    return device.GetKernel(req).status();
  }
  return Internal("the sampling stage built no sample node");
}

Status PagedLlm::AllocateLoraStates(const std::vector<ForwardContext::LoraState>& states) {
  const int64_t kr = int64_t{lora_slots_} * lora_rank_;
  for (const ForwardContext::LoraState& st : states) {
    for (const auto& [suffix, cols] :
         {std::pair{".lora_A", st.in}, std::pair{".lora_BT", st.out}}) {
      const std::string name = st.stem + suffix;
      if (lora_.count(name)) continue;
      KILN_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(*parts_.device, DType::kF32, {kr, cols}));
      const std::vector<float> zeros(static_cast<size_t>(kr * cols));
      KILN_RETURN_IF_ERROR(
          stream_->CopyToDevice(*t.buffer(), static_cast<size_t>(ByteOffset(t.dtype(), t.offset())),
                                zeros.data(), zeros.size() * sizeof(float)));
      weight_bytes_ += t.nbytes();
      lora_.emplace(name, std::move(t));
    }
  }
  return OkStatus();
}

Status PagedLlm::CheckAdapter(const LoraAdapter& adapter) const {
  const std::string& model = parts_.info.name;
  if (lora_slots_ == 0) {
    return FailedPrecondition("model '", model,
                              "' serves no LoRA adapters (max_loaded_adapters is 0)");
  }
  if (adapter.config.r < 1 || adapter.config.r > lora_rank_) {
    return InvalidArgument("the adapter's rank r is ", adapter.config.r, " but model '", model,
                           "' takes ranks 1 to ", lora_rank_, " (max_lora_rank)");
  }
  const std::string& arch = parts_.hparams.architecture;
  for (const auto& [name, layer] : adapter.layers) {
    const size_t dot = name.find('.', 4);
    const size_t end = name.size() - std::string_view(".weight").size();
    const WeightInfo* w = parts_.files->Find(name);
    if (name.rfind("blk.", 0) != 0 || dot == std::string::npos || !name.ends_with(".weight") ||
        LoraModuleForGguf(arch, std::string_view(name).substr(dot + 1, end - dot - 1)) == nullptr ||
        w == nullptr) {
      return InvalidArgument("adapter layer ", name, " is not a layer model '", model,
                             "' can adapt (", arch, " modules: ", LoraModuleList(arch), ")");
    }
    const std::vector<int64_t> shape = w->LoadedShape();  // (out, in)
    if (shape.size() != 2 || shape[0] != layer.out || shape[1] != layer.in) {
      return InvalidArgument("adapter layer ", name, " maps ", layer.in, " inputs to ", layer.out,
                             " outputs but that weight of model '", model, "' is ",
                             ShapeString(shape), " (out, in)");
    }
    const size_t r = static_cast<size_t>(adapter.config.r);
    if (layer.a.size() != r * layer.in || layer.b.size() != r * layer.out) {
      return InvalidArgument("adapter layer ", name, ": lora_A has ", layer.a.size(),
                             " values and lora_B ", layer.b.size(), "; rank ", r, " needs ",
                             r * layer.in, " and ", r * layer.out);
    }
  }
  return OkStatus();
}

StatusOr<std::shared_ptr<const LoraAdapter>> PagedLlm::ReadAdapter(const std::string& dir) const {
  KILN_ASSIGN_OR_RETURN(LoraAdapter adapter,
                        ReadPeftAdapter(dir, PeftBaseModel::FromHParams(parts_.hparams, "")));
  if (Status s = CheckAdapter(adapter); !s.ok()) return Annotate(s, dir);
  return std::make_shared<const LoraAdapter>(std::move(adapter));
}

// Writes slot `slot`'s rows of every LoRA State: the adapter's A and B^T, zeros elsewhere.
Status PagedLlm::LoadAdapter(int32_t slot, std::shared_ptr<const LoraAdapter> adapter) {
  if (slot < 0 || slot >= lora_slots_) {
    return InvalidArgument("adapter slot ", slot, " is out of range: model '", parts_.info.name,
                           "' has ", lora_slots_, " slots");
  }
  if (adapter != nullptr) KILN_RETURN_IF_ERROR(CheckAdapter(*adapter));
  const int64_t R = lora_rank_;
  const int64_t r = adapter ? adapter->config.r : 0;
  std::vector<float> rows;
  for (const auto& [name, t] : lora_) {
    const bool is_a = name.ends_with(".lora_A");
    const std::string stem = name.substr(0, name.rfind(".lora_"));
    const int64_t cols = t.shape()[1];
    rows.assign(static_cast<size_t>(R * cols), 0.0f);
    const LoraLayer* layer = nullptr;
    if (adapter != nullptr) {
      auto it = adapter->layers.find(stem + ".weight");
      if (it != adapter->layers.end()) layer = &it->second;
    }
    if (layer != nullptr && is_a) {  // A (r, in): rows as they are
      std::copy(layer->a.begin(), layer->a.end(), rows.begin());
    } else if (layer != nullptr) {  // B (out, r) -> B^T (r, out)
      for (int64_t o = 0; o < cols; ++o) {
        for (int64_t j = 0; j < r; ++j) rows[j * cols + o] = layer->b[o * r + j];
      }
    }
    const size_t offset = static_cast<size_t>(ByteOffset(t.dtype(), t.offset())) +
                          static_cast<size_t>(slot * R * cols) * sizeof(float);
    KILN_RETURN_IF_ERROR(
        stream_->CopyToDevice(*t.buffer(), offset, rows.data(), rows.size() * sizeof(float)));
  }
  KILN_RETURN_IF_ERROR(stream_->Synchronize());
  slot_adapter_[slot] = std::move(adapter);
  return OkStatus();
}

void PagedLlm::StageLoraScale(const StepBatch& batch, int32_t rows) {
  const int64_t kr = int64_t{lora_slots_} * lora_rank_;
  h_lora_scale_.assign(static_cast<size_t>(rows * kr), 0.0f);
  const int32_t S = static_cast<int32_t>(batch.query_start.size()) - 1;
  for (int32_t s = 0; s < S; ++s) {
    int32_t slot = batch.adapter_slots.empty() ? -1 : batch.adapter_slots[s];
    if (slot < 0 && options_.adapter != nullptr) slot = 0;  // the default adapter
    if (slot < 0 || slot_adapter_[slot] == nullptr) continue;
    const LoraConfig& c = slot_adapter_[slot]->config;
    const float scale = static_cast<float>(c.scale());
    for (int32_t t = batch.query_start[s]; t < batch.query_start[s + 1]; ++t) {
      float* row = h_lora_scale_.data() + t * kr + int64_t{slot} * lora_rank_;
      std::fill(row, row + c.r, scale);
    }
  }
}

namespace {

// Bytes of [lo, hi) not yet in `counted` (disjoint ranges by start), which then holds them:
// a joined projection that is a view of its parts is not counted twice.
int64_t NewBytes(std::map<uintptr_t, uintptr_t>* counted, uintptr_t lo, uintptr_t hi) {
  auto it = counted->upper_bound(lo);
  if (it != counted->begin() && std::prev(it)->second > lo) --it;
  int64_t covered = 0;
  while (it != counted->end() && it->first < hi) {
    covered += static_cast<int64_t>(std::min(hi, it->second) - std::max(lo, it->first));
    lo = std::min(lo, it->first);
    hi = std::max(hi, it->second);
    it = counted->erase(it);
  }
  const int64_t added = static_cast<int64_t>(hi - lo) - covered;
  counted->emplace(lo, hi);
  return added;
}

}  // namespace

Status PagedLlm::LoadWeights(const std::vector<std::string>& names) {
  auto keepalive = std::const_pointer_cast<ModelFiles>(parts_.files);
  std::map<uintptr_t, uintptr_t> counted;
  for (const auto& [name, t] : weights_) {
    const auto lo = reinterpret_cast<uintptr_t>(t.data());
    NewBytes(&counted, lo, lo + static_cast<uintptr_t>(t.nbytes()));
  }
  for (const std::string& name : names) {
    if (weights_.count(name)) continue;
    const WeightInfo* w = parts_.files->Find(name);
    KILN_CHECK(w != nullptr, "LoadWeights: the graph uses a weight the files do not have");
    KILN_ASSIGN_OR_RETURN(Tensor t, parts_.files->Load(*w, *parts_.device, keepalive));
    const auto lo = reinterpret_cast<uintptr_t>(t.data());
    const int64_t added = NewBytes(&counted, lo, lo + static_cast<uintptr_t>(t.nbytes()));
    weight_bytes_ += added;
    if (t.data() == w->data && !w->copied) mapped_weight_bytes_ += added;
    weights_.emplace(name, std::move(t));
  }
  return OkStatus();
}

StatusOr<PagedLlm::StepBuffers> PagedLlm::AllocateStepBuffers(int64_t tokens, int64_t seqs,
                                                              int64_t penalty_cols,
                                                              int64_t banned_cols) {
  backend::Device& dev = *parts_.device;
  auto alloc = [&](int64_t n, int64_t elem = 4) -> StatusOr<std::shared_ptr<backend::Buffer>> {
    KILN_ASSIGN_OR_RETURN(std::unique_ptr<backend::Buffer> buf,
                          dev.Allocate(static_cast<size_t>(std::max<int64_t>(n, 1) * elem)));
    return std::shared_ptr<backend::Buffer>(std::move(buf));
  };
  StepBuffers s;
  KILN_ASSIGN_OR_RETURN(s.tokens, alloc(tokens));
  KILN_ASSIGN_OR_RETURN(s.positions, alloc(tokens));
  KILN_ASSIGN_OR_RETURN(s.slots, alloc(tokens));
  KILN_ASSIGN_OR_RETURN(s.block_table, alloc(seqs * mb_max_));
  KILN_ASSIGN_OR_RETURN(s.seq_lens, alloc(seqs));
  KILN_ASSIGN_OR_RETURN(s.query_start, alloc(seqs + 1));
  if (sample_stage_) {
    KILN_ASSIGN_OR_RETURN(s.params, alloc(seqs * sampling::kNumParams));
    KILN_ASSIGN_OR_RETURN(s.uniforms, alloc(seqs, 8));
    KILN_ASSIGN_OR_RETURN(s.penalty_tokens, alloc(seqs * penalty_cols));
    KILN_ASSIGN_OR_RETURN(s.penalty_counts, alloc(seqs * penalty_cols));
    KILN_ASSIGN_OR_RETURN(s.penalty_bias, alloc(seqs * penalty_cols));
    KILN_ASSIGN_OR_RETURN(s.banned, alloc(seqs * banned_cols));
    KILN_ASSIGN_OR_RETURN(s.allowed, alloc(seqs * sampling::AllowedWords(parts_.info.vocab_size)));
  }
  if (lora_slots_ > 0) {
    KILN_ASSIGN_OR_RETURN(s.lora_scale, alloc(tokens * lora_slots_ * lora_rank_));
  }
  return s;
}

int64_t PagedLlm::KvBytesPerBlock(int32_t block_size) const {
  const LlmHParams& hp = parts_.hparams;
  return 2 * hp.num_layers *
         DTypeBytes(options_.kv_dtype, int64_t{block_size} * hp.num_kv_heads * hp.head_dim);
}

StatusOr<backend::DeviceMemoryInfo> PagedLlm::DeviceMemory() {
  if (device().host_visible()) {
    return Unimplemented("device ", device().name(),
                         " uses host memory (whose free figure ignores container limits)");
  }
  return device().MemoryInfo();
}

Status PagedLlm::AllocateKvCache(int32_t num_blocks, int32_t block_size) {
  if (num_blocks < 1 || block_size < 1) {
    return InvalidArgument("the KV cache needs at least one block of at least one token (got ",
                           num_blocks, " blocks of ", block_size, ")");
  }
  if (block_size != block_size_) KILN_RETURN_IF_ERROR(Build(block_size));
  captures_.clear();
  const LlmHParams& hp = parts_.hparams;
  // One scratch block past the pool for the padding rows of captured steps.
  const int64_t blocks = int64_t{num_blocks} + 1;
  const std::vector<int64_t> shape = {blocks, block_size, hp.num_kv_heads, hp.head_dim};
  k_cache_.clear();
  v_cache_.clear();
  for (Program* p : programs()) KILN_RETURN_IF_ERROR(p->SetSymbol("NB", blocks));
  // Zeros copied to a device cache in pieces (a cache of `kv_cache_bytes: auto` can be tens of
  // GiB on a GPU).
  std::vector<uint8_t> zeros;
  for (int64_t l = 0; l < hp.num_layers; ++l) {
    for (auto* caches : {&k_cache_, &v_cache_}) {
      StatusOr<Tensor> t = Tensor::Empty(*parts_.device, options_.kv_dtype, shape);
      if (!t.ok()) {
        k_cache_.clear();
        v_cache_.clear();
        return ResourceExhausted("KV cache of ", num_blocks, " blocks (",
                                 KvBytesPerBlock(block_size) * num_blocks,
                                 " bytes) cannot be allocated: ", StatusMessage(t.status()));
      }
      // Zeroed, so that a kernel reading a slot nobody wrote sees finite values.
      if (parts_.device->host_visible()) {
        std::memset(t->data(), 0, static_cast<size_t>(t->nbytes()));
      } else {
        const auto bytes = static_cast<size_t>(t->nbytes());
        zeros.resize(std::min<size_t>(std::max(zeros.size(), bytes), size_t{64} << 20));
        for (size_t off = 0; off < bytes; off += zeros.size()) {
          KILN_RETURN_IF_ERROR(stream_->CopyToDevice(*t->buffer(), off, zeros.data(),
                                                     std::min(zeros.size(), bytes - off)));
        }
      }
      caches->push_back(*std::move(t));
    }
    const std::string blk = Cat("blk.", l, ".");
    for (Program* p : programs()) {
      KILN_RETURN_IF_ERROR(p->Bind(blk + "k_cache", k_cache_.back()));
      KILN_RETURN_IF_ERROR(p->Bind(blk + "v_cache", v_cache_.back()));
    }
  }
  KILN_RETURN_IF_ERROR(stream_->Synchronize());
  num_blocks_ = num_blocks;
  return OkStatus();
}

Status PagedLlm::Upload(const StepBuffers& buf, int32_t S, int32_t MB) {
  const size_t T = h_tokens_.size();
  auto put = [&](const std::shared_ptr<backend::Buffer>& dst, const std::vector<int32_t>& src,
                 size_t n) {
    return stream_->CopyToDevice(*dst, 0, src.data(), n * sizeof(int32_t));
  };
  KILN_RETURN_IF_ERROR(put(buf.tokens, h_tokens_, T));
  KILN_RETURN_IF_ERROR(put(buf.positions, h_positions_, T));
  KILN_RETURN_IF_ERROR(put(buf.slots, h_slots_, T));
  KILN_RETURN_IF_ERROR(put(buf.block_table, h_block_table_, static_cast<size_t>(S) * MB));
  KILN_RETURN_IF_ERROR(put(buf.seq_lens, h_seq_lens_, static_cast<size_t>(S)));
  KILN_RETURN_IF_ERROR(put(buf.query_start, h_query_start_, static_cast<size_t>(S) + 1));
  if (run_ == program_.get() && lora_slots_ > 0) {
    KILN_RETURN_IF_ERROR(stream_->CopyToDevice(*buf.lora_scale, 0, h_lora_scale_.data(),
                                               h_lora_scale_.size() * sizeof(float)));
  }
  return OkStatus();
}

Status PagedLlm::BindStep(const StepBuffers& buf, int32_t T, int32_t S, int32_t MB, int32_t P,
                          int32_t E) {
  KILN_RETURN_IF_ERROR(run_->SetSymbol("T", T));
  KILN_RETURN_IF_ERROR(run_->SetSymbol("S", S));
  KILN_RETURN_IF_ERROR(run_->SetSymbol("MB", MB));
  auto bind = [&](const char* name, const std::shared_ptr<backend::Buffer>& b,
                  std::vector<int64_t> shape, DType t = DType::kI32) -> Status {
    KILN_ASSIGN_OR_RETURN(Tensor tensor, Tensor::FromBuffer(b, 0, t, std::move(shape)));
    return run_->Bind(name, tensor);
  };
  KILN_RETURN_IF_ERROR(bind("tokens", buf.tokens, {T}));
  KILN_RETURN_IF_ERROR(bind("positions", buf.positions, {T}));
  KILN_RETURN_IF_ERROR(bind("slot_mapping", buf.slots, {T}));
  KILN_RETURN_IF_ERROR(bind("block_table", buf.block_table, {S, MB}));
  KILN_RETURN_IF_ERROR(bind("seq_lens", buf.seq_lens, {S}));
  KILN_RETURN_IF_ERROR(bind("query_start", buf.query_start, {S + 1}));
  if (run_ == program_.get() && lora_slots_ > 0) {
    KILN_RETURN_IF_ERROR(
        bind("lora_scale", buf.lora_scale, {T, int64_t{lora_slots_} * lora_rank_}, DType::kF32));
  }
  if (sample_stage_) {
    KILN_RETURN_IF_ERROR(run_->SetSymbol("P", P));
    KILN_RETURN_IF_ERROR(run_->SetSymbol("E", E));
    KILN_RETURN_IF_ERROR(bind("sample.params", buf.params, {S, sampling::kNumParams}, DType::kF32));
    KILN_RETURN_IF_ERROR(bind("sample.uniforms", buf.uniforms, {S}, DType::kF64));
    KILN_RETURN_IF_ERROR(bind("sample.penalty_tokens", buf.penalty_tokens, {S, P}));
    KILN_RETURN_IF_ERROR(bind("sample.penalty_counts", buf.penalty_counts, {S, P}));
    KILN_RETURN_IF_ERROR(bind("sample.penalty_bias", buf.penalty_bias, {S, P}, DType::kF32));
    KILN_RETURN_IF_ERROR(bind("sample.banned", buf.banned, {S, E}));
    KILN_RETURN_IF_ERROR(
        bind("sample.allowed", buf.allowed, {S, sampling::AllowedWords(parts_.info.vocab_size)}));
  }
  return OkStatus();
}

std::pair<int32_t, int32_t> PagedLlm::StageSampling(const StepSampling* sampling, int32_t S,
                                                    int32_t rows) {
  int32_t P = 0, E = 0;
  if (sampling != nullptr) {
    for (int32_t s = 0; s < S; ++s) {
      P = std::max(P, sampling->penalty_start[s + 1] - sampling->penalty_start[s]);
      E = std::max(E, sampling->banned_start[s + 1] - sampling->banned_start[s]);
    }
  }
  sampling::RowParams greedy;
  greedy.temperature = 0;
  h_params_.resize(static_cast<size_t>(rows) * sampling::kNumParams);
  h_uniforms_.assign(rows, 0.0);
  h_penalty_tokens_.assign(static_cast<size_t>(rows) * P, -1);
  h_penalty_counts_.assign(static_cast<size_t>(rows) * P, 0);
  h_penalty_bias_.assign(static_cast<size_t>(rows) * P, 0.0f);
  h_banned_.assign(static_cast<size_t>(rows) * E, -1);
  // Grammar masks: all tokens allowed, but in the rows of constrained sequences (staged only
  // when some row is constrained; UploadSampling keeps an all-ones buffer as it is).
  const size_t W = static_cast<size_t>(sampling::AllowedWords(parts_.info.vocab_size));
  step_constrained_ = sampling != nullptr && sampling->allowed_words > 0;
  if (step_constrained_) {
    h_allowed_.assign(static_cast<size_t>(rows) * W, ~0u);
    std::copy_n(sampling->allowed.begin(), static_cast<size_t>(S) * W, h_allowed_.begin());
  }
  for (int32_t s = 0; s < rows; ++s) {
    const bool real = sampling != nullptr && s < S;
    sampling::PackParams(real ? sampling->params[s] : greedy,
                         h_params_.data() + static_cast<size_t>(s) * sampling::kNumParams);
    if (!real) continue;
    h_uniforms_[s] = sampling->uniforms[s];
    for (int32_t j = sampling->penalty_start[s], k = 0; j < sampling->penalty_start[s + 1];
         ++j, ++k) {
      h_penalty_tokens_[static_cast<size_t>(s) * P + k] = sampling->penalties[j].token;
      h_penalty_counts_[static_cast<size_t>(s) * P + k] = sampling->penalties[j].count;
      h_penalty_bias_[static_cast<size_t>(s) * P + k] = sampling->penalties[j].bias;
    }
    for (int32_t j = sampling->banned_start[s], k = 0; j < sampling->banned_start[s + 1];
         ++j, ++k) {
      h_banned_[static_cast<size_t>(s) * E + k] = sampling->banned[j];
    }
  }
  return {P, E};
}

Status PagedLlm::UploadSampling(const StepBuffers& buf, int32_t rows, int32_t P, int32_t E) {
  auto put = [&](const std::shared_ptr<backend::Buffer>& dst, const void* src, size_t bytes) {
    return bytes == 0 ? OkStatus() : stream_->CopyToDevice(*dst, 0, src, bytes);
  };
  const size_t r = static_cast<size_t>(rows);
  KILN_RETURN_IF_ERROR(put(buf.params, h_params_.data(), r * sampling::kNumParams * 4));
  KILN_RETURN_IF_ERROR(put(buf.uniforms, h_uniforms_.data(), r * 8));
  KILN_RETURN_IF_ERROR(put(buf.penalty_tokens, h_penalty_tokens_.data(), r * P * 4));
  KILN_RETURN_IF_ERROR(put(buf.penalty_counts, h_penalty_counts_.data(), r * P * 4));
  KILN_RETURN_IF_ERROR(put(buf.penalty_bias, h_penalty_bias_.data(), r * P * 4));
  KILN_RETURN_IF_ERROR(put(buf.banned, h_banned_.data(), r * E * 4));
  // The masks: this step's rows when some are constrained; else all ones, written once over
  // the whole buffer and kept until a constrained step overwrites it.
  const backend::Buffer* allowed = buf.allowed.get();
  if (step_constrained_) {
    KILN_RETURN_IF_ERROR(put(buf.allowed, h_allowed_.data(), h_allowed_.size() * 4));
    allowed_all_ones_.erase(allowed);
  } else if (!allowed_all_ones_.contains(allowed)) {
    h_allowed_.assign(allowed->size() / 4, ~0u);
    KILN_RETURN_IF_ERROR(put(buf.allowed, h_allowed_.data(), h_allowed_.size() * 4));
    allowed_all_ones_.insert(allowed);
  }
  return OkStatus();
}

Status PagedLlm::ReadResult(const std::vector<Tensor>& outs, int32_t rows,
                            const StepResult& result) {
  auto read = [&](const Tensor& t, void* dst, size_t bytes) {
    return stream_->CopyToHost(dst, *t.buffer(),
                               static_cast<size_t>(ByteOffset(t.dtype(), t.offset())), bytes);
  };
  const size_t r = static_cast<size_t>(rows);
  if (!result.logits.empty()) {
    const Tensor& out = outs[0];
    const int64_t V = parts_.info.vocab_size;
    if (out.dtype() != DType::kF32 || !out.IsContiguous() || out.rank() != 2 ||
        out.shape()[1] != V || out.shape()[0] < rows) {
      return Internal("unexpected logits tensor ", out.DebugString());
    }
    KILN_RETURN_IF_ERROR(read(out, result.logits.data(), r * static_cast<size_t>(V) * 4));
  }
  if (!result.sampled.empty()) {
    const int32_t W = sampling::kMaxLogprobs;
    h_token_.resize(r);
    h_logprob_.resize(r);
    KILN_RETURN_IF_ERROR(read(outs[1], h_token_.data(), r * 4));
    KILN_RETURN_IF_ERROR(read(outs[2], h_logprob_.data(), r * 4));
    bool any_top = false;
    for (int32_t s = 0; s < rows; ++s) any_top |= result.sampling->params[s].logprobs > 0;
    if (any_top) {
      h_top_ids_.resize(r * W);
      h_top_logprobs_.resize(r * W);
      KILN_RETURN_IF_ERROR(read(outs[3], h_top_ids_.data(), r * W * 4));
      KILN_RETURN_IF_ERROR(read(outs[4], h_top_logprobs_.data(), r * W * 4));
    }
    KILN_RETURN_IF_ERROR(stream_->Synchronize());
    for (int32_t s = 0; s < rows; ++s) {
      SampledToken& t = result.sampled[s];
      t.token = h_token_[s];
      t.logprob = h_logprob_[s];
      t.top.clear();
      const int32_t n = std::min(result.sampling->params[s].logprobs, W);
      for (int32_t i = 0; i < n; ++i) {
        const int32_t id = h_top_ids_[static_cast<size_t>(s) * W + i];
        if (id < 0) break;
        t.top.push_back({id, h_top_logprobs_[static_cast<size_t>(s) * W + i]});
      }
    }
  }
  return stream_->Synchronize();
}

Status PagedLlm::CheckBatch(const StepBatch& batch) const {
  if (num_blocks_ == 0) return FailedPrecondition("Step before AllocateKvCache");
  const int64_t T = static_cast<int64_t>(batch.tokens.size());
  const int64_t S = static_cast<int64_t>(batch.query_start.size()) - 1;
  const int64_t MB = batch.max_blocks_per_seq;
  if (T < 1 || S < 1 || batch.positions.size() != batch.tokens.size() ||
      batch.slot_mapping.size() != batch.tokens.size() ||
      static_cast<int64_t>(batch.seq_lens.size()) != S ||
      static_cast<int64_t>(batch.block_table.size()) != S * MB || MB < 1) {
    return InvalidArgument("inconsistent step batch: ", T, " tokens, ", batch.positions.size(),
                           " positions, ", batch.slot_mapping.size(), " slots, ", S, " sequences, ",
                           batch.seq_lens.size(), " seq_lens, block table of ",
                           batch.block_table.size(), " for ", MB, " blocks per sequence");
  }
  if (!batch.adapter_slots.empty() && static_cast<int64_t>(batch.adapter_slots.size()) != S) {
    return InvalidArgument("inconsistent step batch: ", batch.adapter_slots.size(),
                           " adapter slots for ", S, " sequences");
  }
  for (size_t s = 0; s < batch.adapter_slots.size(); ++s) {
    const int32_t slot = batch.adapter_slots[s];
    if (slot < -1 || slot >= max_adapters()) {
      return InvalidArgument("sequence ", s, " of the step asks for adapter slot ", slot,
                             " but model '", parts_.info.name, "' has ", max_adapters(),
                             " (-1 = the base model)");
    }
  }
  if (T > t_max_ || S > s_max_ || MB > mb_max_) {
    return InvalidArgument("step of ", T, " tokens, ", S, " sequences and ", MB,
                           " blocks per sequence exceeds what the model was compiled for (", t_max_,
                           " tokens, ", s_max_, " sequences, ", mb_max_,
                           " blocks: max_num_batched_tokens, max_num_seqs, context_length)");
  }
  return OkStatus();
}

Status PagedLlm::Step(const StepBatch& batch, std::span<float> logits, StepStats* stats) {
  KILN_RETURN_IF_ERROR(CheckBatch(batch));
  const int64_t S = static_cast<int64_t>(batch.query_start.size()) - 1;
  if (logits.size() < static_cast<size_t>(S * parts_.info.vocab_size)) {
    return InvalidArgument("logits span of ", logits.size(), " floats; ", S, " x ",
                           parts_.info.vocab_size, " needed");
  }
  return RunStep(batch, {logits, nullptr, {}}, stats);
}

Status PagedLlm::StepAndSample(const StepBatch& batch, const StepSampling& sampling,
                               std::span<SampledToken> sampled, StepStats* stats) {
  if (!sample_stage_) {
    return FailedPrecondition("model '", parts_.info.name, "' has no sampling stage");
  }
  KILN_RETURN_IF_ERROR(CheckBatch(batch));
  const size_t S = batch.query_start.size() - 1;
  if (sampling.params.size() != S || sampling.uniforms.size() != S ||
      sampling.penalty_start.size() != S + 1 || sampling.banned_start.size() != S + 1 ||
      sampled.size() < S ||
      static_cast<size_t>(sampling.penalty_start[S]) > sampling.penalties.size() ||
      static_cast<size_t>(sampling.banned_start[S]) > sampling.banned.size()) {
    return InvalidArgument("inconsistent step sampling for ", S,
                           " sequences: ", sampling.params.size(), " params, ",
                           sampling.uniforms.size(), " uniforms, ", sampled.size(), " results");
  }
  for (size_t s = 0; s < S; ++s) {
    const int32_t p = sampling.penalty_start[s + 1] - sampling.penalty_start[s];
    const int32_t e = sampling.banned_start[s + 1] - sampling.banned_start[s];
    if (p < 0 || p > p_max_ || e < 0 || e > kMaxBannedTokens) {
      return InvalidArgument("sequence ", s, " of the step has ", p, " penalty tokens and ", e,
                             " banned tokens; at most ", p_max_, " and ", kMaxBannedTokens);
    }
  }
  return RunStep(batch, {{}, &sampling, sampled}, stats);
}

Status PagedLlm::RunStep(const StepBatch& batch, const StepResult& result, StepStats* stats) {
  run_ = program_.get();
  if (base_program_ != nullptr && options_.adapter == nullptr &&
      std::all_of(batch.adapter_slots.begin(), batch.adapter_slots.end(),
                  [](int32_t slot) { return slot < 0; })) {
    run_ = base_program_.get();
  }
  const int64_t T = static_cast<int64_t>(batch.tokens.size());
  const int64_t S = static_cast<int64_t>(batch.query_start.size()) - 1;
  // Captured programs sample without penalty or ban columns.
  bool plain = true;
  if (result.sampling != nullptr) {
    plain = result.sampling->penalty_start.back() == result.sampling->penalty_start.front() &&
            result.sampling->banned_start.back() == result.sampling->banned_start.front();
  }
  // A profiled run (KILN_PROFILE) times each launch through Program::Run, so it runs direct.
  if (plain && batch.decode_only && T == S && !capture_sizes_.empty() &&
      LaunchProfile::Get() == nullptr && S <= capture_sizes_.back()) {
    const int32_t padded =
        *std::lower_bound(capture_sizes_.begin(), capture_sizes_.end(), static_cast<int32_t>(S));
    // On the host every padded row is GEMV work (5 streams padded to 8 took 43 ms a step
    // against 22 for 4), and a replay saves little over a direct run (6 streams ran as fast
    // with no captures as with every size captured): replay only a capture of the step's own
    // size there. Accelerators run a few more rows almost for free.
    if (padded == S || !device().host_visible()) {
      return RunCaptured(batch, padded, result, stats);
    }
  }
  return RunDirect(batch, result, stats);
}

Status PagedLlm::RunDirect(const StepBatch& batch, const StepResult& result, StepStats* stats) {
  const int32_t T = static_cast<int32_t>(batch.tokens.size());
  const int32_t S = static_cast<int32_t>(batch.query_start.size()) - 1;
  const int32_t MB = batch.max_blocks_per_seq;
  h_tokens_.assign(batch.tokens.begin(), batch.tokens.end());
  h_positions_.assign(batch.positions.begin(), batch.positions.end());
  h_slots_.assign(batch.slot_mapping.begin(), batch.slot_mapping.end());
  h_block_table_.assign(batch.block_table.begin(), batch.block_table.end());
  h_seq_lens_.assign(batch.seq_lens.begin(), batch.seq_lens.end());
  h_query_start_.assign(batch.query_start.begin(), batch.query_start.end());
  if (run_ == program_.get() && lora_slots_ > 0) StageLoraScale(batch, T);
  KILN_RETURN_IF_ERROR(Upload(direct_, S, MB));
  int32_t P = 0, E = 0;
  if (sample_stage_) {
    std::tie(P, E) = StageSampling(result.sampling, S, S);
    KILN_RETURN_IF_ERROR(UploadSampling(direct_, S, P, E));
  }
  KILN_RETURN_IF_ERROR(BindStep(direct_, T, S, MB, P, E));
  KILN_RETURN_IF_ERROR(run_->Run(*stream_));
  std::vector<Tensor> outs;
  for (int i = 0; i < run_->num_outputs(); ++i) {
    KILN_ASSIGN_OR_RETURN(Tensor t, run_->Output(i));
    outs.push_back(std::move(t));
  }
  KILN_RETURN_IF_ERROR(ReadResult(outs, S, result));
  if (stats != nullptr) {
    stats->replayed = false;
    stats->padded_seqs = S;
    stats->launches = run_->num_launches();
  }
  return OkStatus();
}

Status PagedLlm::RunCaptured(const StepBatch& batch, int32_t padded, const StepResult& result,
                             StepStats* stats) {
  const int32_t S = static_cast<int32_t>(batch.query_start.size()) - 1;
  const int32_t MB = static_cast<int32_t>(mb_max_);
  const int32_t scratch_block = num_blocks_;
  // Real rows, then padding rows: token 0 at position 0 in the scratch block's first slot, a
  // one-token context (so attention is well defined) that no real sequence can see.
  h_tokens_.assign(batch.tokens.begin(), batch.tokens.end());
  h_positions_.assign(batch.positions.begin(), batch.positions.end());
  h_slots_.assign(batch.slot_mapping.begin(), batch.slot_mapping.end());
  h_seq_lens_.assign(batch.seq_lens.begin(), batch.seq_lens.end());
  h_tokens_.resize(padded, 0);
  h_positions_.resize(padded, 0);
  h_slots_.resize(padded, scratch_block * block_size_);
  h_seq_lens_.resize(padded, 1);
  h_query_start_.resize(static_cast<size_t>(padded) + 1);
  for (int32_t i = 0; i <= padded; ++i) h_query_start_[i] = i;
  h_block_table_.assign(static_cast<size_t>(padded) * MB, -1);
  for (int32_t s = 0; s < S; ++s) {
    std::copy_n(batch.block_table.begin() + static_cast<size_t>(s) * batch.max_blocks_per_seq,
                batch.max_blocks_per_seq, h_block_table_.begin() + static_cast<size_t>(s) * MB);
  }
  for (int32_t s = S; s < padded; ++s) h_block_table_[static_cast<size_t>(s) * MB] = scratch_block;
  // Decode-only: one token a sequence.
  if (run_ == program_.get() && lora_slots_ > 0) StageLoraScale(batch, padded);
  // Padding rows sample greedily and plainly, like every row of a Step.
  if (sample_stage_) StageSampling(result.sampling, S, padded);

  // Captures of the base program (without LoRA) are keyed apart.
  const int32_t key = run_ == program_.get() ? padded : -padded;
  auto it = captures_.find(key);
  if (it == captures_.end()) {
    auto c = std::make_unique<Capture>();
    KILN_ASSIGN_OR_RETURN(c->buffers, AllocateStepBuffers(padded, padded, 0, 0));
    KILN_RETURN_IF_ERROR(BindStep(c->buffers, padded, padded, MB, 0, 0));
    KILN_ASSIGN_OR_RETURN(c->graph, CapturedProgram::Capture(*run_, *stream_));
    for (int i = 0; i < run_->num_outputs(); ++i) {
      KILN_ASSIGN_OR_RETURN(Tensor t, run_->Output(i));
      c->outputs.push_back(std::move(t));
    }
    spdlog::debug("{}: captured the decode step for batch size {} ({} launches{})",
                  parts_.info.name, padded, c->graph->num_launches(),
                  c->graph->native() ? ", native" : "");
    it = captures_.emplace(key, std::move(c)).first;
  }
  Capture& c = *it->second;
  KILN_RETURN_IF_ERROR(Upload(c.buffers, padded, MB));
  if (sample_stage_) KILN_RETURN_IF_ERROR(UploadSampling(c.buffers, padded, 0, 0));
  KILN_RETURN_IF_ERROR(c.graph->Replay(*stream_));
  KILN_RETURN_IF_ERROR(ReadResult(c.outputs, S, result));
  if (stats != nullptr) {
    stats->replayed = true;
    stats->padded_seqs = padded;
    stats->launches = c.graph->num_launches();
  }
  return OkStatus();
}

}  // namespace kiln::models
