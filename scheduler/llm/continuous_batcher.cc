#include "scheduler/llm/continuous_batcher.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>

#include "spdlog/spdlog.h"

namespace kiln {
namespace {

double Seconds(SteadyClock::duration d) { return std::chrono::duration<double>(d).count(); }

absl::Time AbslDeadline(SteadyClock::time_point t) {
  return absl::Now() + absl::FromChrono(t - SteadyClock::now());
}

// Length of the longest suffix of `text` that is a proper prefix of one of `stops`: text
// that might become a stop string and must be held back.
size_t StopHoldback(std::string_view text, const std::vector<std::string>& stops) {
  size_t best = 0;
  for (const std::string& stop : stops) {
    for (size_t k = std::min(stop.size() - 1, text.size()); k > best; --k) {
      if (text.substr(text.size() - k) == std::string_view(stop).substr(0, k)) {
        best = k;
        break;
      }
    }
  }
  return best;
}

// The flight recorder's state of a request that ended so.
FlightRequestState FlightStateOf(FinishReason reason, const Status& status) {
  if (reason == FinishReason::kCancelled) return FlightRequestState::kCancelled;
  if (reason != FinishReason::kError) return FlightRequestState::kFinished;
  return absl::IsDeadlineExceeded(status) ? FlightRequestState::kTimedOut
                                          : FlightRequestState::kFailed;
}

}  // namespace

ContinuousBatcher::ContinuousBatcher(std::string model_name,
                                     std::unique_ptr<models::LlmModel> model,
                                     config::LlmSchedulerConfig config, uint64_t prefix_seed,
                                     std::unique_ptr<LlmMetrics> metrics)
    : name_(std::move(model_name)),
      model_(std::move(model)),
      config_(std::move(config)),
      prefix_seed_(prefix_seed),
      metrics_(std::move(metrics)),
      structured_(std::make_unique<StructuredOutput>(model_->tokenizer(), model_->info().vocab_size,
                                                     model_->info().eos_token_ids)) {}

ContinuousBatcher::~ContinuousBatcher() {
  if (!thread_.joinable()) return;
  Drain(SteadyClock::now());
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

int64_t ContinuousBatcher::KvCacheBytes() const {
  if (config_.kv_cache_bytes != config::kKvCacheAuto) return config_.kv_cache_bytes;
  const int64_t fallback = config::LlmSchedulerConfig{}.kv_cache_bytes;
  StatusOr<backend::DeviceMemoryInfo> mem = model_->DeviceMemory();
  if (!mem.ok()) {
    spdlog::info("model '{}': kv_cache_bytes auto: {}; using {} MiB", name_,
                 StatusMessage(mem.status()), fallback >> 20);
    return fallback;
  }
  const auto bytes =
      static_cast<int64_t>(static_cast<double>(mem->free_bytes) * config_.kv_cache_memory_fraction);
  spdlog::info(
      "model '{}': kv_cache_bytes auto: {} of the device's {:.2f} GiB free ({:.2f} GiB "
      "total) = {:.2f} GiB",
      name_, config_.kv_cache_memory_fraction, mem->free_bytes / 1073741824.0,
      mem->total_bytes / 1073741824.0, bytes / 1073741824.0);
  return bytes;
}

Status ContinuousBatcher::Start() {
  const int32_t bs = config_.block_size;
  if (bs < 1) return InvalidArgument("block_size must be at least 1");
  if (config_.speculative.method == "draft" && draft_ == nullptr) {
    return FailedPrecondition("model '", name_,
                              "': scheduler.speculative.method is draft but no draft model was "
                              "loaded");
  }
  // A draft model keeps a cache of as many blocks (speculative.h): kv_cache_bytes holds both.
  const int64_t per_block =
      model_->KvBytesPerBlock(bs) + (draft_ != nullptr ? draft_->KvBytesPerBlock(bs) : 0);
  const int64_t kv_bytes = KvCacheBytes();
  int64_t blocks = per_block > 0 ? kv_bytes / per_block : 0;
  if (blocks < 1) {
    return InvalidArgument("model '", name_, "': kv_cache_bytes ", kv_bytes,
                           " holds no KV block: one block of ", bs, " tokens needs ", per_block,
                           " bytes", draft_ != nullptr ? " (with the draft model's)" : "");
  }
  blocks = std::min<int64_t>(blocks, 1 << 24);
  KILN_RETURN_IF_ERROR(model_->AllocateKvCache(static_cast<int32_t>(blocks), bs));
  if (draft_ != nullptr) {
    KILN_RETURN_IF_ERROR(
        Annotate(draft_->AllocateKvCache(static_cast<int32_t>(blocks), bs), "the draft model"));
  }
  kv_ = std::make_unique<KvBlockManager>(static_cast<int32_t>(blocks), bs,
                                         config_.enable_prefix_caching);
  scheduler_ = std::make_unique<StepScheduler>(config_, kv_.get());
  if (model_->max_adapters() > 0) {
    adapter_slots_ = std::make_unique<AdapterSlots>(model_->max_adapters());
    scheduler_->set_admission_check([this](Sequence* seq) { return AcquireAdapterSlot(seq); });
  }
  if (config_.target_itl_ms > 0) {
    // Prompt tokens beside decodes from the measured step costs (the static cap until then).
    const double target = config_.target_itl_ms / 1000.0;
    scheduler_->set_prefill_limit([this, target](int32_t decode_rows) {
      return step_cost_.PromptTokensWithin(decode_rows, target, config::kTargetItlMinPromptTokens);
    });
    spdlog::info(
        "model '{}': inter-token latency target {} ms (prompt tokens beside decodes "
        "from measured step costs, at least {})",
        name_, config_.target_itl_ms, config::kTargetItlMinPromptTokens);
  }
  if (metrics_) metrics_->kv_blocks->Set(static_cast<double>(blocks));
  spdlog::info("model '{}': KV cache of {} blocks x {} tokens ({:.1f} MiB{}), prefix caching {}",
               name_, blocks, bs, blocks * per_block / 1048576.0,
               draft_ != nullptr ? ", the draft model's included" : "",
               config_.enable_prefix_caching ? "on" : "off");
  {
    absl::MutexLock lock(&mu_);
    accepting_ = true;
    snapshot_.kv_blocks_total = kv_->num_blocks();
  }
  thread_ = std::thread([this] { Loop(); });
  return OkStatus();
}

Status ContinuousBatcher::SetDraftModel(std::unique_ptr<models::LlmModel> draft) {
  // Drafts are token ids of the target's vocabulary: the draft's must be the same one (the
  // logits' rows, and every token's text; tokenizers of one family with added tokens differ).
  const models::Tokenizer &t = model_->tokenizer(), &d = draft->tokenizer();
  const int32_t tv = model_->info().vocab_size, dv = draft->info().vocab_size;
  if (tv != dv || t.vocab_size() != d.vocab_size()) {
    return InvalidArgument("model '", name_, "': the draft model '", draft->info().name,
                           "' has a vocabulary of ", dv, " tokens (tokenizer ", d.vocab_size(),
                           "), the model ", tv, " (tokenizer ", t.vocab_size(),
                           "); a draft model must share the model's vocabulary");
  }
  for (int32_t id = 0; id < t.vocab_size(); ++id) {
    if (t.Piece(id) != d.Piece(id)) {
      return InvalidArgument("model '", name_, "': the draft model '", draft->info().name,
                             "' has token ", id, " '", ValidUtf8(d.Piece(id)),
                             "' where the model has '", ValidUtf8(t.Piece(id)), "'",
                             "; a draft model must share the model's vocabulary");
    }
  }
  draft_name_ = config_.speculative.draft_model.empty() ? draft->info().name
                                                        : config_.speculative.draft_model;
  if (draft_name_.empty()) draft_name_ = "draft";
  draft_ = std::move(draft);
  return OkStatus();
}

int64_t ContinuousBatcher::kv_capacity_tokens() const {
  return int64_t{kv_->num_blocks()} * kv_->block_size();
}

Status ContinuousBatcher::Check(GenerateRequest& r) const {
  const GenerateRequest::Fields& f = r.fields;
  if (!r.adapter.empty()) {
    if (StatusOr<AdapterEntry> a = FindAdapter(r.adapter); !a.ok()) {
      return WithParam(a.status(), f.adapter);
    }
  }
  const models::LlmModelInfo& info = model_->info();
  const int64_t prompt = static_cast<int64_t>(r.prompt.size());
  if (prompt == 0) {
    return WithParam(
        InvalidArgument("`", f.prompt, "` is empty; the prompt needs at least one token"),
        f.prompt);
  }
  for (size_t i = 0; i < r.prompt.size(); ++i) {
    if (r.prompt[i] < 0 || r.prompt[i] >= info.vocab_size) {
      return NotAToken(f.prompt, i, r.prompt[i], name_, info.vocab_size);
    }
  }
  const int64_t context = info.context_length;
  const int64_t kv = kv_capacity_tokens();
  if (prompt >= context) {
    return WithParam(InvalidArgument("the prompt is ", prompt, " tokens but model '", name_,
                                     "' has a context of ", context,
                                     " tokens (it must leave room for at least one new token)"),
                     f.prompt);
  }
  if (prompt >= kv) {
    return WithParam(
        InvalidArgument("the prompt is ", prompt, " tokens but the KV cache of model '", name_,
                        "' holds ", kv, " tokens (scheduler.kv_cache_bytes); shorten the prompt"),
        f.prompt);
  }
  const int64_t room = std::min(context, kv) - prompt;
  const int64_t fallback = std::min<int64_t>(room, r.default_max_tokens);
  if (r.max_tokens && *r.max_tokens < 1) {
    return WithParam(
        InvalidArgument("`", f.max_tokens, "` is ", *r.max_tokens,
                        "; it must be at least 1 (leave it out for up to ", fallback, ")"),
        f.max_tokens);
  }
  if (r.max_tokens && *r.max_tokens > room) {
    return WithParam(
        InvalidArgument("`", f.max_tokens, "` is ", *r.max_tokens, " but the prompt (", prompt,
                        prompt == 1 ? " token" : " tokens", ") leaves room for at most ", room,
                        " in the ", kv < context ? "KV cache" : "context", " of model '", name_,
                        "' (", std::min(kv, context), " tokens)"),
        f.max_tokens);
  }
  r.sampling.max_tokens = static_cast<int32_t>(r.max_tokens.value_or(fallback));
  // Sampling errors under the client's prefix ("sampling: `top_p` is 0; ..."), param kept.
  auto sampling_error = [&f](const Status& s) {
    return WithParam(f.sampling.empty() ? s : Annotate(s, f.sampling), ParamOf(s));
  };
  if (Status s = models::ValidateSamplingParams(r.sampling, info.vocab_size); !s.ok()) {
    return sampling_error(s);
  }
  if (StatusOr<SpeculationSettings> spec =
          ResolveSpeculation(config_.speculative, r.sampling.speculative, name_, DraftName());
      !spec.ok()) {
    return sampling_error(spec.status());
  }
  const int64_t levels = config_.priority_levels;
  if (r.priority < 0 || r.priority > UINT32_MAX) {
    return WithParam(InvalidArgument("`", f.priority, "` is ", r.priority,
                                     "; it must be >= 0 (0 = the model's default level, 1 = "
                                     "highest)"),
                     f.priority);
  }
  if (levels == 0 && r.priority != 0) {
    return WithParam(InvalidArgument("priority ", r.priority, " given but model '", name_,
                                     "' has no priority levels; omit it or send 0"),
                     f.priority);
  }
  if (levels > 0 && r.priority > levels) {
    return WithParam(
        InvalidArgument("priority ", r.priority, " is out of range: model '", name_,
                        "' has priority levels 1 (highest) to ", levels,
                        "; 0 selects the default level ", config_.default_priority_level),
        f.priority);
  }
  return OkStatus();
}

StatusOr<ContinuousBatcher::AdapterEntry> ContinuousBatcher::FindAdapter(
    std::string_view name) const {
  absl::MutexLock lock(&adapters_mu_);
  if (auto it = adapters_.find(name); it != adapters_.end()) return it->second;
  if (adapters_.empty()) {
    return NotFound("model '", name_, "' has no adapter '", ValidUtf8(name),
                    "'; it serves its base model only");
  }
  std::string names;
  for (const auto& [n, e] : adapters_) names += (names.empty() ? "" : ", ") + n;
  return NotFound("model '", name_, "' has no adapter '", ValidUtf8(name), "'; its adapters are ",
                  names);
}

Status ContinuousBatcher::AddAdapter(std::string name,
                                     std::shared_ptr<const models::LoraAdapter> adapter) {
  KILN_CHECK(adapter != nullptr, "AddAdapter: null adapter");
  if (model_->max_adapters() == 0) {
    return FailedPrecondition("model '", name_,
                              "' serves no LoRA adapters (its max_loaded_adapters is 0)");
  }
  KILN_RETURN_IF_ERROR(model_->CheckAdapter(*adapter));
  absl::MutexLock lock(&adapters_mu_);
  if (adapters_.count(name)) {
    return AlreadyExists("model '", name_, "' already has an adapter '", name, "'");
  }
  adapters_.emplace(std::move(name), AdapterEntry{std::move(adapter), ++adapter_serial_});
  return OkStatus();
}

Status ContinuousBatcher::RemoveAdapter(std::string_view name) {
  absl::MutexLock lock(&adapters_mu_);
  auto it = adapters_.find(name);
  if (it == adapters_.end()) {
    return NotFound("model '", name_, "' has no adapter '", ValidUtf8(name), "'");
  }
  adapters_.erase(it);
  return OkStatus();
}

std::vector<std::string> ContinuousBatcher::AdapterNames() const {
  absl::MutexLock lock(&adapters_mu_);
  std::vector<std::string> names;
  for (const auto& [n, e] : adapters_) names.push_back(n);
  return names;
}

bool ContinuousBatcher::AcquireAdapterSlot(Sequence* seq) {
  if (seq->adapter == nullptr || seq->adapter_slot >= 0) return true;
  const std::optional<AdapterSlots::Grant> grant = adapter_slots_->Acquire(seq->adapter);
  if (!grant) return false;  // every slot is pinned by other adapters' sequences
  if (grant->load) {
    if (Status s = model_->LoadAdapter(grant->slot, seq->adapter); !s.ok()) {
      adapter_slots_->Clear(grant->slot);
      spdlog::error("model '{}': loading adapter '{}' failed: {}", name_, seq->req->adapter,
                    StatusMessage(s));
      Finish(seq, FinishReason::kError,
             Internal("model '", name_, "' failed to load adapter '", seq->req->adapter,
                      "': ", s.message()));
      return false;
    }
    if (metrics_) metrics_->adapter_loads->Increment();
  }
  seq->adapter_slot = grant->slot;
  return true;
}

Status ContinuousBatcher::Enqueue(std::unique_ptr<GenerateRequest>& request) {
  KILN_RETURN_IF_ERROR(Check(*request));
  AdapterEntry adapter;
  if (!request->adapter.empty()) {
    StatusOr<AdapterEntry> a = FindAdapter(request->adapter);  // removed since Check?
    if (!a.ok()) return WithParam(a.status(), request->fields.adapter);
    adapter = *std::move(a);
  }
  static thread_local std::mt19937_64 seeds{std::random_device{}()};
  auto seq = std::make_unique<Sequence>(std::move(request), model_->tokenizer(), seeds());
  const GenerateRequest& r = *seq->req;
  if (config_.priority_levels > 0) {
    seq->level =
        (r.priority == 0 ? config_.default_priority_level : static_cast<uint32_t>(r.priority)) - 1;
  }
  // The base model's blocks are namespaced by the model; an adapter's by the model and the
  // adapter (name and AddAdapter call), never by its slot, which is reused.
  seq->adapter = std::move(adapter.adapter);
  seq->prefix_seed = r.adapter.empty()
                         ? prefix_seed_
                         : prefix_seed_ ^ ((std::hash<std::string>{}(r.adapter) + adapter.serial) *
                                           0x9E3779B97F4A7C15ull);
  seq->enqueued = SteadyClock::now();
  if (!r.sampling.ignore_eos) seq->end_ids = model_->info().eos_token_ids;
  seq->end_ids.insert(seq->end_ids.end(), r.sampling.stop_token_ids.begin(),
                      r.sampling.stop_token_ids.end());
  structured_->Bind(seq.get());
  // Checked by Check; speculation stays off for a grammar (its drafts would need masks).
  if (!seq->matcher) {
    seq->spec = ResolveSpeculation(config_.speculative, r.sampling.speculative, name_, DraftName())
                    .value_or(SpeculationSettings{});
  }

  absl::MutexLock lock(&mu_);
  if (!accepting_) {
    request = std::move(seq->req);
    return Unavailable("model '", name_, "' is shutting down");
  }
  if (config_.max_queue_size > 0 && queued_ >= config_.max_queue_size) {
    request = std::move(seq->req);
    return ResourceExhausted("the queue of model '", name_, "' is full (", config_.max_queue_size,
                             " waiting requests, scheduler.max_queue_size); retry later");
  }
  ++queued_;
  if (recorder_) recorder_->RecordRequest(r.id, FlightRequestState::kQueued);
  inbox_.push_back(std::move(seq));
  wake_ = true;
  return OkStatus();
}

void ContinuousBatcher::WakeUp() {
  absl::MutexLock lock(&mu_);
  wake_ = true;
}

ContinuousBatcher::Snapshot ContinuousBatcher::snapshot() const {
  absl::MutexLock lock(&mu_);
  return snapshot_;
}

bool ContinuousBatcher::AwaitSnapshot(const std::function<bool(const Snapshot&)>& pred,
                                      absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto holds = [this, &pred]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pred(snapshot_); };
  return mu_.AwaitWithTimeout(absl::Condition(&holds), timeout);
}

void ContinuousBatcher::TakeInbox() {
  for (auto& seq : inbox_) scheduler_->Add(std::move(seq));
  inbox_.clear();
}

int ContinuousBatcher::Drain(SteadyClock::time_point deadline) {
  absl::MutexLock lock(&mu_);
  accepting_ = false;
  wake_ = true;
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return idle_ && inbox_.empty(); };
  mu_.AwaitWithDeadline(absl::Condition(&idle), AbslDeadline(deadline));
  if (idle()) return 0;
  // Ask the loop to cut everything off; it answers between steps.
  const int cut = snapshot_.running + snapshot_.waiting + static_cast<int>(inbox_.size());
  stop_ = true;
  wake_ = true;
  mu_.Await(absl::Condition(&idle));
  return cut;
}

void ContinuousBatcher::Loop() {
  for (;;) {
    bool cut_off = false;
    {
      absl::MutexLock lock(&mu_);
      TakeInbox();
      if (!scheduler_->has_work()) {
        idle_ = true;
        if (stop_) return;
        auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return wake_ || stop_ || !inbox_.empty();
        };
        mu_.Await(absl::Condition(&woken));
        wake_ = false;
        continue;
      }
      idle_ = false;
      wake_ = false;
      cut_off = stop_;
    }
    if (cut_off) {
      CutOffEverything();
    } else {
      StepOnce();
    }
  }
}

void ContinuousBatcher::CutOffEverything() {
  // Drain's deadline passed: end everything now (between steps).
  for (auto& seq : scheduler_->TakeAll()) {
    Finish(seq.get(), FinishReason::kError,
           Unavailable("cancelled: model '", name_, "' is shutting down"));
  }
  {
    absl::MutexLock lock(&mu_);
    queued_ = 0;
  }
  UpdateGauges();
}

void ContinuousBatcher::Finish(Sequence* seq, FinishReason reason, Status status,
                               std::string stop) {
  if (seq->done) return;
  seq->done = true;
  if (recorder_) {
    recorder_->RecordRequest(seq->req->id, FlightStateOf(reason, status), step_id_,
                             reason == FinishReason::kError
                                 ? std::string_view(absl::StatusCodeToString(status.code()))
                                 : FinishReasonName(reason));
  }
  scheduler_->Free(seq);
  if (seq->adapter_slot >= 0) {
    adapter_slots_->Release(seq->adapter_slot);
    seq->adapter_slot = -1;
  }
  StepTrace::Finished(*seq, reason);  // tracing
  GenerateEvent ev;
  ev.finish = reason;
  ev.status = std::move(status);
  ev.stop = std::move(stop);
  ev.usage = {seq->prompt_len, seq->generated(), seq->cached_tokens};
  const auto now = SteadyClock::now();
  if (metrics_) {
    metrics_->families.requests.WithLabels({name_, std::string(FinishReasonName(reason))})
        ->Increment();
    metrics_->e2e->Observe(Seconds(now - seq->req->received_at));
    if (seq->generated() > 0)
      metrics_->decode->Observe(Seconds(seq->last_token - seq->first_token));
  }
  if (seq->req->on_event) seq->req->on_event(std::move(ev));
}

void ContinuousBatcher::Emit(Sequence* seq, std::vector<int32_t> ids,
                             std::vector<models::SampledToken> lps, std::string text) {
  if (ids.empty() && text.empty()) return;
  GenerateEvent ev;
  ev.token_ids = std::move(ids);
  ev.logprobs = std::move(lps);
  ev.text = std::move(text);
  if (seq->req->on_event) seq->req->on_event(std::move(ev));
}

void ContinuousBatcher::DropCancelledAndExpired() {
  const auto now = SteadyClock::now();
  scheduler_->ForEach([&](Sequence* seq) {
    if (seq->req->cancel->cancelled()) {
      Finish(seq, FinishReason::kCancelled, Cancelled("request cancelled by the client"));
    } else if (seq->req->deadline && now >= *seq->req->deadline) {
      Finish(seq, FinishReason::kError,
             DeadlineExceeded("the request's deadline passed after ",
                              static_cast<int64_t>(Seconds(now - seq->req->received_at) * 1000),
                              " ms (", seq->generated(), " tokens generated)"));
    }
  });
  if (const int32_t dropped = scheduler_->EraseDone(); dropped > 0) {
    absl::MutexLock lock(&mu_);
    queued_ -= dropped;
  }
}

void ContinuousBatcher::StepOnce() {
  FlightStepTimes flight;  // flight recorder
  if (recorder_) {
    flight.begin = SteadyClock::now();
    recorder_->BeginWork(0, FlightRecorder::WorkKind::kStep, ++step_id_, flight.begin);
  }
  DropCancelledAndExpired();
  const auto step_start = SteadyClock::now();
  ProposeDrafts();
  Schedule();
  if (recorder_) FlightStepBegin(flight);
  if (sched_.empty()) return;
  if (draft_ != nullptr) GenerateDrafts();
  trace_.Scheduled(sched_, step_start);  // tracing
  const models::StepBatch& batch = builder_.Build(sched_, config_.block_size);
  // Structured output: the masks of the sequences that get a token this step.
  for (const auto& e : sched_.seqs) {
    if (e.seq->matcher && e.seq->uncomputed() == e.num_tokens) structured_->PrepareMask(e.seq);
  }
  if (recorder_) flight.built = SteadyClock::now();
  StepOutput out;
  const auto run_start = SteadyClock::now();
  const bool ran = Run(batch, &out);
  // The step cost model (speculative decoding, the ITL target): what a decode step of this
  // many rows takes, and what prompt tokens add to one.
  if (ran) {
    const double run_seconds = Seconds(SteadyClock::now() - run_start);
    if (sched_.decode_only) {
      step_cost_.Observe(sched_.num_rows, run_seconds);
    } else {
      step_cost_.ObserveMixed(sched_.decode_rows, sched_.prompt_tokens, run_seconds);
    }
  }
  if (recorder_) flight.ran = SteadyClock::now();
  if (ran) ProcessOutputs(sched_, out);
  if (recorder_) FlightStepEnd(flight, out, ran);
  trace_.Stepped(sched_, step_start, out);
  if (const int32_t dropped = scheduler_->EraseDone(); dropped > 0) {  // e.g. a failed upload
    absl::MutexLock lock(&mu_);
    queued_ -= dropped;
  }
  if (metrics_) metrics_->step_seconds->Observe(Seconds(SteadyClock::now() - step_start));
  UpdateGauges();
}

void ContinuousBatcher::Schedule() {
  scheduler_->Schedule(&sched_);
  {
    absl::MutexLock lock(&mu_);
    queued_ += sched_.preempted - sched_.admitted;
    snapshot_.preemptions += sched_.preempted;
  }
  if (metrics_) {
    if (sched_.preempted > 0) metrics_->preemptions->Increment(sched_.preempted);
    const int32_t bs = config_.block_size;
    for (const auto& e : sched_.seqs) {
      if (!e.first_time) continue;
      Sequence* s = e.seq;
      s->first_scheduled = SteadyClock::now();
      metrics_->queue->Observe(Seconds(s->first_scheduled - s->req->received_at));
      metrics_->prompt_tokens->Increment(s->prompt_len);
      metrics_->prefix_queries->Increment(static_cast<double>(s->prompt_len / bs * bs));
      metrics_->prefix_hits->Increment(static_cast<double>(s->cached_tokens));
    }
  } else {
    for (const auto& e : sched_.seqs) {
      if (e.first_time) e.seq->first_scheduled = SteadyClock::now();
    }
  }
  // The gauges show this step's allocations before any of its tokens is streamed (a client
  // that has a token must not read a KV usage of 0).
  UpdateGauges();
}

void ContinuousBatcher::ProposeDrafts() {
  const int32_t context = model_->info().context_length;
  // The step so far: a row and at least a token per decoding sequence; drafts add to both.
  // A prompt still being prefilled has the step's spare tokens instead (its TTFT).
  int32_t rows = 0;
  bool prefilling = false;
  scheduler_->ForEachRunning([&](Sequence* s) {
    s->draft.clear();
    rows += s->uncomputed() == 1 ? 1 : 0;
    prefilling = prefilling || s->uncomputed() > 1;
  });
  // Nor while a request waits (StepScheduler would drop the drafts: skip the lookups).
  if (prefilling || scheduler_->num_waiting() > 0) return;
  double tokens = rows;
  // Draft model: one draft step per drafted token, and a catch-up per token it has not seen,
  // in one-row target steps (0 until measured).
  const double one_row = step_cost_.OneRowSeconds();
  const double per_draft = one_row > 0 ? draft_step_seconds_ / one_row : 0.0;
  const double per_catch_up = one_row > 0 ? draft_catch_up_seconds_ / one_row : 0.0;
  int32_t catch_up_budget = config_.max_num_batched_tokens;
  draft_rows_.clear();
  scheduler_->ForEachRunning([&](Sequence* s) {
    if (s->spec.num_tokens == 0 || s->uncomputed() != 1 || s->generated() == 0) return;
    const bool model_draft = s->spec.method == SpeculationSettings::Method::kDraft;
    // A step yields up to drafts + 1 tokens: stay within max_tokens and the context.
    const int32_t room = std::min(s->req->sampling.max_tokens - s->generated(),
                                  context - static_cast<int32_t>(s->tokens.size())) -
                         1;
    int32_t k = std::min(room, s->spec.num_tokens);
    const double rate = s->acceptance.rate();
    if (model_draft) s->draft_computed = std::min(s->draft_computed, s->num_computed);
    const int32_t behind = model_draft ? s->num_computed - s->draft_computed : 0;
    if (s->spec.adaptive && k > 0) {
      k = model_draft ? ChooseDraftLength(rate, k, step_cost_, rows, tokens, per_draft,
                                          per_catch_up * behind)
                      : ChooseDraftLength(rate, k, step_cost_, rows, tokens);
    }
    if (k <= 0) {
      s->acceptance.Idle();
      return;
    }
    if (model_draft) {
      // The draft's cache first takes the tokens the target computed without it; a sequence
      // drafts once it has them all (GenerateDrafts fills the placeholders).
      if (behind > 0) {
        const int32_t n = std::min(behind, catch_up_budget);
        if (n == 0) return;
        catch_up_budget -= n;
        draft_rows_.push_back({s, s->draft_computed, n});
        if (n < behind) return;
      }
      s->draft.assign(static_cast<size_t>(k), s->tokens.back());
    } else {
      ProposeNgram(s->tokens, s->spec, k, &s->draft);
    }
    const auto d = static_cast<int32_t>(s->draft.size());
    rows += d;
    for (int32_t i = 1; i <= d; ++i) tokens += std::pow(rate, i);
  });
  if (!draft_rows_.empty()) CatchUpDrafts();
}

namespace {
// The draft model's time averages: the first measurement, then an exponential moving average.
void Average(double* avg, double x) { *avg = *avg > 0 ? 0.8 * *avg + 0.2 * x : x; }
}  // namespace

Status ContinuousBatcher::RunDraft(std::span<const StepBatchBuilder::Row> rows) {
  const models::StepBatch& batch = draft_builder_.BuildRows(rows, config_.block_size);
  draft_logits_.resize(rows.size() * static_cast<size_t>(draft_->info().vocab_size));
  models::StepStats stats;
  return draft_->Step(batch, draft_logits_, &stats);
}

void ContinuousBatcher::CatchUpDrafts() {
  const auto start = SteadyClock::now();
  if (Status st = RunDraft(draft_rows_); !st.ok()) {
    spdlog::warn("model '{}': the draft model's step failed, drafting nothing this step: {}", name_,
                 st.ToString());
    for (const StepBatchBuilder::Row& r : draft_rows_) r.seq->draft.clear();
    return;
  }
  int32_t tokens = 0;
  for (const StepBatchBuilder::Row& r : draft_rows_) {
    r.seq->draft_computed += r.n;
    tokens += r.n;
  }
  Average(&draft_catch_up_seconds_, Seconds(SteadyClock::now() - start) / tokens);
}

void ContinuousBatcher::GenerateDrafts() {
  // The sequences whose drafts are placeholders (ProposeDrafts), as scheduled: Schedule may
  // have trimmed them to the blocks it could have.
  std::vector<Sequence*>& seqs = draft_seqs_;
  seqs.clear();
  for (const SchedulerOutput::Entry& e : sched_.seqs) {
    Sequence* s = e.seq;
    if (!s->draft.empty() && s->spec.method == SpeculationSettings::Method::kDraft) {
      seqs.push_back(s);
    }
  }
  if (seqs.empty()) return;
  const auto start = SteadyClock::now();
  const int32_t vocab = draft_->info().vocab_size;
  // Step i feeds each sequence's token at position num_computed + i (t0, then draft i) and
  // takes draft i + 1, greedily, from its logits.
  int32_t steps = 0;
  for (;; ++steps) {
    draft_rows_.clear();
    for (Sequence* s : seqs) {
      if (static_cast<int32_t>(s->draft.size()) > steps) {
        draft_rows_.push_back({s, s->num_computed + steps, 1});
      }
    }
    if (draft_rows_.empty()) break;
    if (Status st = RunDraft(draft_rows_); !st.ok()) {
      // The placeholders stay (verification rejects what does not match): slower, still right.
      spdlog::warn("model '{}': the draft model's step failed: {}", name_, st.ToString());
      break;
    }
    for (size_t r = 0; r < draft_rows_.size(); ++r) {
      Sequence* s = draft_rows_[r].seq;
      const float* row = draft_logits_.data() + r * static_cast<size_t>(vocab);
      s->draft[static_cast<size_t>(steps)] =
          static_cast<int32_t>(std::max_element(row, row + vocab) - row);
      s->draft_computed = draft_rows_[r].from + 1;
    }
  }
  if (steps > 0) Average(&draft_step_seconds_, Seconds(SteadyClock::now() - start) / steps);
}

bool ContinuousBatcher::Run(const models::StepBatch& batch, StepOutput* out) {
  const auto S = static_cast<int32_t>(batch.seq_lens.size());  // rows
  out->vocab_size = model_->info().vocab_size;
  Status status;
  if (model_->samples_on_device()) {
    // Only token ids (and asked-for logprobs) come back.
    sampled_.resize(S);
    status = model_->StepAndSample(batch, sampling_.Build(sched_), sampled_, &out->stats);
    out->sampled = sampled_;
  } else {
    logits_.resize(static_cast<size_t>(S) * out->vocab_size);
    out->logits = logits_;
    status = model_->Step(batch, out->logits, &out->stats);
  }
  {
    absl::MutexLock lock(&mu_);
    ++snapshot_.steps;
    if (out->stats.replayed) ++snapshot_.replays;
  }
  if (metrics_) {
    (out->stats.replayed ? metrics_->replay_steps : metrics_->direct_steps)->Increment();
    metrics_->step_tokens->Observe(static_cast<double>(batch.tokens.size()));
  }
  if (status.ok()) return true;
  spdlog::error("model '{}': step of {} rows failed: {}", name_, S, StatusMessage(status));
  for (const auto& e : sched_.seqs) {
    Finish(e.seq, FinishReason::kError, Internal("model '", name_, "' failed: ", status.message()));
  }
  return false;
}

void ContinuousBatcher::ProcessOutputs(const SchedulerOutput& sched, const StepOutput& out) {
  int32_t row = 0;
  uint64_t drafted = 0, accepted = 0;
  for (const SchedulerOutput::Entry& e : sched.seqs) {
    Sequence* s = e.seq;
    const auto d = static_cast<int32_t>(s->draft.size());
    if (d == 0) {
      s->num_computed += e.num_tokens;
      scheduler_->PublishFullBlocks(s);
      const int32_t r = row++;
      if (s->uncomputed() > 0) continue;  // mid-prefill: no token yet
      TakeToken(s, NextToken(out, r, *s));
      continue;
    }
    // Verification (speculative.h): row j's token stands while it equals draft j - 1 ...
    const int32_t first = row;
    row += d + 1;
    drafted += static_cast<uint64_t>(d);
    int32_t taken = 0;     // drafts accepted
    s->num_computed += 1;  // the pending token
    for (int32_t j = 0; j <= d; ++j) {
      scheduler_->PublishFullBlocks(s);  // before a token that may end the sequence
      const models::SampledToken t = NextToken(out, first + j, *s, j);
      const bool match = j < d && t.token == s->draft[static_cast<size_t>(j)];
      if (!TakeToken(s, t) || !match) break;
      // ... and then the KV the step computed for it (row j + 1's input) is the sequence's.
      ++taken;
      s->num_computed += 1;
    }
    accepted += static_cast<uint64_t>(taken);
    s->acceptance.Observe(d, taken);
    s->draft.clear();
    // The draft model's keys and values stand where the tokens were accepted (speculative.h).
    s->draft_computed = std::min(s->draft_computed, s->num_computed);
    if (!s->done) scheduler_->PublishFullBlocks(s);
  }
  if (drafted > 0) {
    if (metrics_) {
      metrics_->spec_draft_tokens->Increment(static_cast<double>(drafted));
      metrics_->spec_accepted_tokens->Increment(static_cast<double>(accepted));
    }
    absl::MutexLock lock(&mu_);
    snapshot_.draft_tokens += drafted;
    snapshot_.accepted_tokens += accepted;
  }
}

bool ContinuousBatcher::TakeToken(Sequence* s, const models::SampledToken& t) {
  if (t.token == sampling::kNoToken) {
    // Only a grammar can forbid every token: nothing in this vocabulary continues it.
    Finish(s, FinishReason::kError,
           !s->grammar_status.ok()
               ? s->grammar_status
               : InvalidArgument("the output's grammar allows no token of model '", name_,
                                 "' after ", s->generated(), " tokens"));
    return false;
  }
  s->sampler.Accept(t.token);
  s->tokens.push_back(t.token);
  const auto now = SteadyClock::now();
  if (s->generated() == 1) {
    s->first_token = now;
    if (metrics_) {
      metrics_->ttft->Observe(Seconds(now - s->req->received_at));
      metrics_->prefill->Observe(Seconds(now - s->first_scheduled));
    }
  } else if (metrics_) {
    metrics_->itl->Observe(Seconds(now - s->last_token));
  }
  s->last_token = now;
  if (metrics_) metrics_->generation_tokens->Increment();

  std::vector<models::SampledToken> lps;
  if (s->req->sampling.logprobs >= 0) lps.push_back(t);
  const bool is_end = std::find(s->end_ids.begin(), s->end_ids.end(), t.token) != s->end_ids.end();
  if (s->matcher) {
    if (Status st = structured_->Accept(s, t.token, is_end); !st.ok()) {
      Finish(s, FinishReason::kError, st);
      return false;
    }
  }
  // A structured output that is complete ends here, as if its EOS had been sampled.
  const bool complete = !is_end && s->matcher && s->matcher->complete();
  const auto detok_start = StepTrace::DetokenizeStart(*s);  // tracing
  if (!is_end) s->held += s->detok.Add(t.token);
  const auto& stops = s->req->sampling.stop;
  // A stop string ends the text before it.
  size_t stop_at = std::string::npos;
  std::string stop_hit;
  for (const auto& stop : stops) {
    size_t p = s->held.find(stop);
    if (p != std::string::npos && p < stop_at) {
      stop_at = p;
      stop_hit = stop;
    }
  }
  StepTrace::DetokenizeEnd(*s, detok_start);  // tracing
  if (stop_at != std::string::npos) {
    Emit(s, {t.token}, std::move(lps), s->held.substr(0, stop_at));
    Finish(s, FinishReason::kStop, OkStatus(), stop_hit);
    return false;
  }
  const bool at_length = s->generated() >= s->req->sampling.max_tokens ||
                         static_cast<int32_t>(s->tokens.size()) >= model_->info().context_length;
  if (is_end || at_length || complete) {
    std::string text = std::move(s->held) + s->detok.Finish();
    Emit(s, {t.token}, std::move(lps), std::move(text));
    Finish(s, is_end || complete ? FinishReason::kStop : FinishReason::kLength, OkStatus(),
           is_end ? std::string(model_->tokenizer().Piece(t.token)) : std::string());
    return false;
  }
  const size_t keep = StopHoldback(s->held, stops);
  std::string text = s->held.substr(0, s->held.size() - keep);
  s->held.erase(0, s->held.size() - keep);
  Emit(s, {t.token}, std::move(lps), std::move(text));
  return true;
}

void ContinuousBatcher::UpdateGauges() {
  const int32_t running = scheduler_->num_running();
  const int32_t waiting = scheduler_->num_waiting();
  const int32_t used = kv_->num_used();
  // Metrics first: whoever sees the snapshot change also sees the gauges.
  if (metrics_) {
    if (adapter_slots_) metrics_->adapters_loaded->Set(adapter_slots_->num_loaded());
    metrics_->running->Set(static_cast<double>(running));
    metrics_->waiting->Set(static_cast<double>(waiting));
    metrics_->kv_usage->Set(static_cast<double>(used) / kv_->num_blocks());
  }
  absl::MutexLock lock(&mu_);
  snapshot_.running = running;
  snapshot_.waiting = waiting;
  snapshot_.kv_blocks_total = kv_->num_blocks();
  snapshot_.kv_blocks_used = used;
}

// ---- Flight recorder (scheduler/flight_recorder.h) ----

void ContinuousBatcher::FlightStepBegin(FlightStepTimes& t) {
  t.scheduled = SteadyClock::now();
  for (const Sequence* seq : sched_.preempted_seqs) {
    recorder_->RecordRequest(seq->req->id, FlightRequestState::kPreempted, step_id_);
  }
  FlightEvent e;
  e.kind = FlightEventKind::kStepBegin;
  e.seqs = static_cast<int32_t>(sched_.seqs.size());
  uint64_t adapter_slots = 0;  // exact for up to 64 slots
  // Running sequences come first, then the `admitted` ones (step_scheduler.h).
  const size_t first_admitted = sched_.seqs.size() - static_cast<size_t>(sched_.admitted);
  for (size_t i = 0; i < sched_.seqs.size(); ++i) {
    const SchedulerOutput::Entry& entry = sched_.seqs[i];
    const Sequence* seq = entry.seq;
    if (i >= first_admitted) {
      recorder_->RecordRequest(
          seq->req->id,
          entry.first_time ? FlightRequestState::kAdmitted : FlightRequestState::kResumed,
          step_id_);
    }
    // A decode computes the one token it sampled last step (and its drafts, speculative.h);
    // anything else is prompt.
    (seq->uncomputed() == 1 && seq->generated() > 0 ? e.decode_tokens : e.prefill_tokens) +=
        entry.num_tokens;
    if (seq->adapter_slot >= 0) adapter_slots |= uint64_t{1} << (seq->adapter_slot % 64);
  }
  e.adapters = std::popcount(adapter_slots);
  // Requests: a running sequence that no step included for the watchdog's limit (the token
  // budget went to those ahead of it) is reported once.
  for (const SchedulerOutput::Entry& entry : sched_.seqs) entry.seq->flight_progress = t.scheduled;
  if (const double limit = recorder_->options().watchdog_seconds; limit > 0) {
    scheduler_->ForEachRunning([&](Sequence* seq) {
      const double idle = std::chrono::duration<double>(t.scheduled - seq->flight_progress).count();
      if (seq->flight_reported || idle < limit) return;
      seq->flight_reported = true;
      recorder_->ReportStuckRequest(seq->req->id, idle);
    });
  }
  e.admitted = sched_.admitted;
  e.preempted = sched_.preempted;
  e.kv_blocks_used = kv_->num_used();
  e.kv_blocks_total = kv_->num_blocks();
  e.schedule_ns = std::chrono::nanoseconds(t.scheduled - t.begin).count();
  if (sched_.empty()) {
    recorder_->EndWork(0, {}, /*record=*/false);  // nothing ran: no step to show
    return;
  }
  recorder_->SetWorkRequests(
      0, e.seqs, [this](int i) -> std::string_view { return sched_.seqs[i].seq->req->id; }, e);
}

void ContinuousBatcher::FlightStepEnd(const FlightStepTimes& t, const StepOutput& out, bool ok) {
  const SteadyClock::time_point processed = SteadyClock::now();
  FlightEvent e;
  e.kind = FlightEventKind::kStepEnd;
  e.ok = ok;
  e.seqs = static_cast<int32_t>(sched_.seqs.size());
  e.replayed = out.stats.replayed;
  e.padded_seqs = out.stats.padded_seqs;
  e.launches = out.stats.launches;
  e.kv_blocks_used = kv_->num_used();
  e.kv_blocks_total = kv_->num_blocks();
  e.build_ns = std::chrono::nanoseconds(t.built - t.scheduled).count();
  e.run_ns = std::chrono::nanoseconds(t.ran - t.built).count();
  e.process_ns = std::chrono::nanoseconds(processed - t.ran).count();
  e.total_ns = std::chrono::nanoseconds(processed - t.begin).count();
  recorder_->EndWork(0, e);
}

}  // namespace kiln
