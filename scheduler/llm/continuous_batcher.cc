#include "scheduler/llm/continuous_batcher.h"

#include <algorithm>
#include <cstdint>
#include <random>

#include "models/tokenizer/detokenizer.h"
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

}  // namespace

std::string_view FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
    case FinishReason::kNone:
      break;
  }
  return "";
}

struct ContinuousBatcher::Sequence {
  Sequence(std::unique_ptr<GenerateRequest> r, const models::Tokenizer& tok, uint64_t seed)
      : req(std::move(r)),
        tokens(req->prompt),
        prompt_len(static_cast<int32_t>(req->prompt.size())),
        sampler(req->sampling, req->prompt, seed),
        detok(tok, {.skip_special_tokens = true, .strip_leading_space = false}) {}

  int32_t generated() const { return static_cast<int32_t>(tokens.size()) - prompt_len; }

  std::unique_ptr<GenerateRequest> req;
  std::vector<int32_t> tokens;  // prompt, then generated tokens
  int32_t prompt_len;
  int32_t num_computed = 0;      // tokens whose KV is in the cache
  std::vector<int32_t> blocks;   // block table
  std::vector<uint64_t> hashes;  // chained hashes of blocks [0, published)
  int32_t published = 0;
  uint32_t level = 0;  // index into waiting_
  uint64_t arrival = 0;
  models::SequenceSampler sampler;
  models::Detokenizer detok;
  std::vector<int32_t> end_ids;  // EOS (unless ignore_eos) and stop_token_ids
  std::string held;              // text not yet sent: may be the start of a stop string
  int32_t cached_tokens = 0;
  bool admitted = false;  // scheduled at least once
  bool done = false;
  SteadyClock::time_point enqueued, first_scheduled, first_token, last_token;
};

ContinuousBatcher::ContinuousBatcher(std::string model_name,
                                     std::unique_ptr<models::LlmModel> model,
                                     ContinuousBatcherOptions options,
                                     std::unique_ptr<LlmMetrics> metrics)
    : name_(std::move(model_name)),
      model_(std::move(model)),
      options_(options),
      metrics_(std::move(metrics)) {
  waiting_.resize(std::max<uint32_t>(1, options_.priority_levels));
}

ContinuousBatcher::~ContinuousBatcher() {
  if (!thread_.joinable()) return;
  Drain(SteadyClock::now());
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

Status ContinuousBatcher::Start() {
  const int32_t bs = options_.block_size;
  if (bs < 1) return InvalidArgument("block_size must be at least 1");
  const int64_t per_block = model_->KvBytesPerBlock(bs);
  int64_t blocks = options_.num_blocks;
  if (blocks <= 0) blocks = per_block > 0 ? options_.kv_cache_bytes / per_block : 0;
  if (blocks < 1) {
    return InvalidArgument("model '", name_, "': kv_cache_bytes ", options_.kv_cache_bytes,
                           " holds no KV block: one block of ", bs, " tokens needs ", per_block,
                           " bytes");
  }
  blocks = std::min<int64_t>(blocks, 1 << 24);
  KILN_RETURN_IF_ERROR(model_->AllocateKvCache(static_cast<int32_t>(blocks), bs));
  kv_ = std::make_unique<KvBlockManager>(static_cast<int32_t>(blocks), bs,
                                         options_.enable_prefix_caching);
  if (metrics_) metrics_->kv_blocks->Set(static_cast<double>(blocks));
  spdlog::info("model '{}': KV cache of {} blocks x {} tokens ({:.1f} MiB), prefix caching {}",
               name_, blocks, bs, blocks * per_block / 1048576.0,
               options_.enable_prefix_caching ? "on" : "off");
  {
    absl::MutexLock lock(&mu_);
    accepting_ = true;
  }
  thread_ = std::thread([this] { Loop(); });
  return OkStatus();
}

Status ContinuousBatcher::Enqueue(std::unique_ptr<GenerateRequest>& request) {
  GenerateRequest& r = *request;
  const models::LlmModelInfo& info = model_->info();
  const int64_t prompt = static_cast<int64_t>(r.prompt.size());
  if (prompt == 0) return InvalidArgument("the prompt is empty");
  for (int32_t t : r.prompt) {
    if (t < 0 || t >= info.vocab_size) {
      return InvalidArgument("prompt token ", t, " is not in model '", name_, "''s vocabulary of ",
                             info.vocab_size, " tokens");
    }
  }
  if (prompt >= info.context_length) {
    return InvalidArgument("the prompt is ", prompt, " tokens but model '", name_,
                           "' has a context of ", info.context_length, " tokens");
  }
  KILN_RETURN_IF_ERROR(models::ValidateSamplingParams(r.sampling, info.vocab_size));
  const int64_t total = prompt + r.sampling.max_tokens;
  if (total > info.context_length) {
    return InvalidArgument("`max_tokens` is ", r.sampling.max_tokens, " but the prompt (", prompt,
                           " tokens) leaves room for at most ", info.context_length - prompt,
                           " in model '", name_, "''s context of ", info.context_length, " tokens");
  }
  if (kv_->BlocksFor(total) > kv_->num_blocks()) {
    return InvalidArgument("the request needs up to ", kv_->BlocksFor(total), " KV-cache blocks (",
                           total, " tokens) but model '", name_, "''s cache holds ",
                           kv_->num_blocks(), "; lower max_tokens or raise the KV cache size");
  }
  uint32_t level = 0;
  const uint32_t levels = options_.priority_levels;
  if (levels == 0) {
    if (r.priority != 0) {
      return InvalidArgument("priority ", r.priority, " given but model '", name_,
                             "' has no priority levels; omit it or send 0");
    }
  } else {
    const uint32_t p = r.priority == 0 ? options_.default_priority_level : r.priority;
    if (p < 1 || p > levels) {
      return InvalidArgument("priority ", r.priority, " is out of range: model '", name_,
                             "' has priority levels 1 (highest) to ", levels,
                             "; 0 selects the default level ", options_.default_priority_level);
    }
    level = p - 1;
  }
  static thread_local std::mt19937_64 seeds{std::random_device{}()};
  auto seq = std::make_unique<Sequence>(std::move(request), model_->tokenizer(), seeds());
  seq->level = level;
  seq->enqueued = SteadyClock::now();
  const auto& sp = seq->req->sampling;
  if (!sp.ignore_eos) seq->end_ids = info.eos_token_ids;
  seq->end_ids.insert(seq->end_ids.end(), sp.stop_token_ids.begin(), sp.stop_token_ids.end());

  absl::MutexLock lock(&mu_);
  if (!accepting_) {
    request = std::move(seq->req);
    return Unavailable("model '", name_, "' is shutting down");
  }
  if (options_.max_queue_size > 0 && queued_ >= options_.max_queue_size) {
    request = std::move(seq->req);
    return ResourceExhausted("the queue of model '", name_, "' is full (", options_.max_queue_size,
                             " waiting requests, scheduler.max_queue_size); retry later");
  }
  ++queued_;
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

std::deque<std::unique_ptr<ContinuousBatcher::Sequence>>& ContinuousBatcher::QueueFor(
    uint32_t level) {
  return waiting_[level];
}

void ContinuousBatcher::TakeInbox() {
  for (auto& seq : inbox_) {
    seq->arrival = arrivals_++;
    QueueFor(seq->level).push_back(std::move(seq));
  }
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
      const bool work = !running_.empty() || std::any_of(waiting_.begin(), waiting_.end(),
                                                         [](auto& q) { return !q.empty(); });
      if (!work) {
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
      // Drain's deadline passed: end everything now (between steps).
      auto cut = [this](Sequence* seq) {
        Finish(seq, FinishReason::kError,
               Unavailable("cancelled: model '", name_, "' is shutting down"));
      };
      for (auto& seq : running_) cut(seq.get());
      for (auto& q : waiting_) {
        for (auto& seq : q) cut(seq.get());
        q.clear();
      }
      running_.clear();
      {
        absl::MutexLock lock(&mu_);
        queued_ = 0;
      }
      UpdateGauges();
      continue;
    }
    StepOnce();
  }
}

void ContinuousBatcher::Finish(Sequence* seq, FinishReason reason, Status status,
                               std::string stop) {
  if (seq->done) return;
  seq->done = true;
  if (!seq->blocks.empty()) {
    kv_->Release(seq->blocks);
    seq->blocks.clear();
  }
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

void ContinuousBatcher::Preempt(Sequence* seq) {
  // Free everything; keep the tokens. The sequence is recomputed from the start (much of it
  // from the prefix cache, if its blocks survive) when it is admitted again.
  kv_->Release(seq->blocks);
  seq->blocks.clear();
  seq->hashes.clear();
  seq->published = 0;
  seq->num_computed = 0;
  auto it = std::find_if(running_.begin(), running_.end(),
                         [seq](const auto& p) { return p.get() == seq; });
  KILN_CHECK(it != running_.end(), "preempting a sequence that is not running");
  std::unique_ptr<Sequence> owned = std::move(*it);
  running_.erase(it);
  QueueFor(owned->level).push_front(std::move(owned));
  {
    absl::MutexLock lock(&mu_);
    ++queued_;
    ++snapshot_.preemptions;
  }
  if (metrics_) metrics_->preemptions->Increment();
}

void ContinuousBatcher::PublishFullBlocks(Sequence* seq) {
  if (!options_.enable_prefix_caching) return;
  const int32_t bs = options_.block_size;
  const int32_t full = seq->num_computed / bs;
  for (int32_t i = seq->published; i < full; ++i) {
    const uint64_t parent = i == 0 ? options_.prefix_seed : seq->hashes[i - 1];
    const uint64_t h = KvBlockManager::HashBlock(
        parent, std::span<const int32_t>(seq->tokens).subspan(static_cast<size_t>(i) * bs, bs));
    seq->hashes.push_back(h);
    kv_->Publish(seq->blocks[i], h);
  }
  seq->published = std::max(seq->published, full);
}

void ContinuousBatcher::DropCancelledAndExpired() {
  const auto now = SteadyClock::now();
  auto check = [&](Sequence* seq) {
    if (seq->req->cancel->cancelled()) {
      Finish(seq, FinishReason::kCancelled, Cancelled("request cancelled by the client"));
    } else if (seq->req->deadline && now >= *seq->req->deadline) {
      Finish(seq, FinishReason::kError,
             DeadlineExceeded("the request's deadline passed after ",
                              static_cast<int64_t>(Seconds(now - seq->req->received_at) * 1000),
                              " ms (", seq->generated(), " tokens generated)"));
    }
  };
  for (auto& s : running_) check(s.get());
  int32_t dropped = 0;
  for (auto& q : waiting_) {
    for (auto& s : q) check(s.get());
    dropped += static_cast<int32_t>(std::erase_if(q, [](const auto& s) { return s->done; }));
  }
  std::erase_if(running_, [](const auto& s) { return s->done; });
  if (dropped > 0) {
    absl::MutexLock lock(&mu_);
    queued_ -= dropped;
  }
}

bool ContinuousBatcher::StepOnce() {
  DropCancelledAndExpired();
  const auto step_start = SteadyClock::now();
  const int32_t bs = options_.block_size;
  int32_t budget = options_.max_num_batched_tokens;
  // Prompt tokens left for this step: capped when it also decodes (one new token of a running
  // sequence whose known tokens are all computed but the last).
  const bool decodes = std::any_of(running_.begin(), running_.end(), [](const auto& s) {
    return static_cast<int32_t>(s->tokens.size()) - s->num_computed == 1;
  });
  int32_t prefill_left = decodes && options_.max_prefill_tokens_with_decodes > 0
                             ? options_.max_prefill_tokens_with_decodes
                             : INT32_MAX;
  struct Scheduled {
    Sequence* seq;
    int32_t n;
  };
  std::vector<Scheduled> sched;
  bool preempted = false;

  // 1. Running sequences, highest priority and oldest first (running_ is kept in that order).
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Sequence* s = running_[i].get();
    const int32_t left = static_cast<int32_t>(s->tokens.size()) - s->num_computed;
    const int32_t n = std::min({left, budget, left > 1 ? prefill_left : 1});
    if (n <= 0) continue;
    int32_t need = kv_->BlocksFor(s->num_computed + n) - static_cast<int32_t>(s->blocks.size());
    bool self_preempted = false;
    while (need > 0 && !kv_->CanAllocate(need)) {
      Sequence* victim = running_.back().get();
      Preempt(victim);
      preempted = true;
      if (victim == s) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;
    if (need > 0) {
      auto got = kv_->Allocate(need);
      s->blocks.insert(s->blocks.end(), got->begin(), got->end());
    }
    sched.push_back({s, n});
    budget -= n;
    if (left > 1) prefill_left -= n;
  }

  // 2. Waiting sequences, unless this step had to preempt (no room to spare).
  for (size_t level = 0; !preempted && level < waiting_.size(); ++level) {
    auto& q = waiting_[level];
    bool blocked = false;
    while (!q.empty() && budget > 0 && prefill_left > 0 &&
           static_cast<int32_t>(running_.size()) < options_.max_num_seqs) {
      Sequence* s = q.front().get();
      if (s->blocks.empty() && s->num_computed == 0) {
        // Reuse cached blocks of the same prefix; always leave at least one token to run.
        std::vector<uint64_t> hashes = kv_->BlockHashes(s->tokens, options_.prefix_seed);
        std::vector<int32_t> matched = kv_->MatchPrefix(hashes);
        if (!matched.empty() && static_cast<size_t>(matched.size()) * bs >= s->tokens.size()) {
          kv_->Release(std::span<const int32_t>(&matched.back(), 1));
          matched.pop_back();
        }
        s->blocks = matched;
        s->num_computed = static_cast<int32_t>(matched.size()) * bs;
        s->hashes.assign(hashes.begin(), hashes.begin() + matched.size());
        s->published = static_cast<int32_t>(matched.size());
        if (!s->admitted) {
          s->cached_tokens = s->num_computed;
          if (metrics_) {
            metrics_->prefix_queries->Increment(static_cast<double>(hashes.size()) * bs);
            metrics_->prefix_hits->Increment(static_cast<double>(s->num_computed));
          }
        }
      }
      const int32_t n = std::min(
          {static_cast<int32_t>(s->tokens.size()) - s->num_computed, budget, prefill_left});
      const int32_t need =
          kv_->BlocksFor(s->num_computed + n) - static_cast<int32_t>(s->blocks.size());
      if (need > 0 && !kv_->CanAllocate(need)) {
        // Not now: give the shared blocks back rather than hold them while waiting.
        kv_->Release(s->blocks);
        s->blocks.clear();
        s->hashes.clear();
        s->published = 0;
        s->num_computed = 0;
        blocked = true;
        break;
      }
      if (need > 0) {
        auto got = kv_->Allocate(need);
        s->blocks.insert(s->blocks.end(), got->begin(), got->end());
      }
      std::unique_ptr<Sequence> owned = std::move(q.front());
      q.pop_front();
      {
        absl::MutexLock lock(&mu_);
        --queued_;
      }
      if (!owned->admitted) {
        owned->admitted = true;
        owned->first_scheduled = SteadyClock::now();
        if (metrics_) {
          metrics_->queue->Observe(Seconds(owned->first_scheduled - owned->req->received_at));
          metrics_->prompt_tokens->Increment(owned->prompt_len);
        }
      }
      // Keep running_ ordered by (level, arrival): preemption takes from the back.
      auto pos = std::upper_bound(
          running_.begin(), running_.end(), owned, [](const auto& a, const auto& b) {
            return std::tie(a->level, a->arrival) < std::tie(b->level, b->arrival);
          });
      running_.insert(pos, std::move(owned));
      sched.push_back({s, n});
      budget -= n;
      prefill_left -= n;
    }
    if (blocked) break;  // strict priority: nothing of lower priority jumps the queue
  }

  // The gauges show this step's allocations before any of its tokens is streamed (a client
  // that has a token must not read a KV usage of 0).
  UpdateGauges();
  if (sched.empty()) return false;

  // 3. Build the step.
  const int32_t S = static_cast<int32_t>(sched.size());
  std::vector<int32_t> tokens, positions, query_start{0}, seq_lens, slots;
  int32_t max_blocks = 0;
  bool decode_only = true;
  for (const auto& [s, n] : sched) {
    for (int32_t k = 0; k < n; ++k) {
      const int32_t pos = s->num_computed + k;
      tokens.push_back(s->tokens[pos]);
      positions.push_back(pos);
      slots.push_back(s->blocks[pos / bs] * bs + pos % bs);
    }
    query_start.push_back(query_start.back() + n);
    seq_lens.push_back(s->num_computed + n);
    max_blocks = std::max<int32_t>(max_blocks, kv_->BlocksFor(s->num_computed + n));
    decode_only = decode_only && n == 1;
  }
  std::vector<int32_t> table(static_cast<size_t>(S) * max_blocks, -1);
  for (int32_t i = 0; i < S; ++i) {
    const auto& blocks = sched[i].seq->blocks;
    const int32_t used = kv_->BlocksFor(seq_lens[i]);
    std::copy(blocks.begin(), blocks.begin() + used,
              table.begin() + static_cast<size_t>(i) * max_blocks);
  }
  models::StepBatch batch{tokens, positions,  query_start, seq_lens,
                          table,  max_blocks, slots,       decode_only};
  const int32_t vocab = model_->info().vocab_size;
  logits_.resize(static_cast<size_t>(S) * vocab);
  models::StepStats stats;
  Status status = model_->Step(batch, logits_, &stats);
  {
    absl::MutexLock lock(&mu_);
    ++snapshot_.steps;
    if (stats.replayed) ++snapshot_.replays;
  }
  if (metrics_) {
    (stats.replayed ? metrics_->replay_steps : metrics_->direct_steps)->Increment();
    metrics_->step_tokens->Observe(static_cast<double>(tokens.size()));
  }
  if (!status.ok()) {
    spdlog::error("model '{}': step of {} sequences failed: {}", name_, S, StatusMessage(status));
    for (const auto& [s, n] : sched) {
      Finish(s, FinishReason::kError, Internal("model '", name_, "' failed: ", status.message()));
    }
    std::erase_if(running_, [](const auto& s) { return s->done; });
    UpdateGauges();
    return true;
  }

  // 4. Advance, sample, stream.
  const int32_t context = model_->info().context_length;
  for (int32_t i = 0; i < S; ++i) {
    Sequence* s = sched[i].seq;
    s->num_computed += sched[i].n;
    PublishFullBlocks(s);
    if (s->num_computed < static_cast<int32_t>(s->tokens.size())) continue;  // mid-prefill

    std::span<float> row(logits_.data() + static_cast<size_t>(i) * vocab, vocab);
    models::SampledToken t = s->sampler.Sample(row, s->end_ids);
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
    const bool is_end =
        std::find(s->end_ids.begin(), s->end_ids.end(), t.token) != s->end_ids.end();
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
    if (stop_at != std::string::npos) {
      Emit(s, {t.token}, std::move(lps), s->held.substr(0, stop_at));
      Finish(s, FinishReason::kStop, OkStatus(), stop_hit);
      continue;
    }
    const bool at_length = s->generated() >= s->req->sampling.max_tokens ||
                           static_cast<int32_t>(s->tokens.size()) >= context;
    if (is_end || at_length) {
      std::string text = std::move(s->held) + s->detok.Finish();
      Emit(s, {t.token}, std::move(lps), std::move(text));
      Finish(s, is_end ? FinishReason::kStop : FinishReason::kLength, OkStatus(),
             is_end ? std::string(model_->tokenizer().Piece(t.token)) : std::string());
      continue;
    }
    const size_t keep = StopHoldback(s->held, stops);
    std::string out = s->held.substr(0, s->held.size() - keep);
    s->held.erase(0, s->held.size() - keep);
    Emit(s, {t.token}, std::move(lps), std::move(out));
  }
  std::erase_if(running_, [](const auto& s) { return s->done; });
  if (metrics_) metrics_->step_seconds->Observe(Seconds(SteadyClock::now() - step_start));
  UpdateGauges();
  return true;
}

void ContinuousBatcher::UpdateGauges() {
  int32_t waiting = 0;
  for (const auto& q : waiting_) waiting += static_cast<int32_t>(q.size());
  {
    absl::MutexLock lock(&mu_);
    snapshot_.running = static_cast<int32_t>(running_.size());
    snapshot_.waiting = waiting;
    snapshot_.kv_blocks_total = kv_->num_blocks();
    snapshot_.kv_blocks_used = kv_->num_used();
  }
  if (!metrics_) return;
  metrics_->running->Set(static_cast<double>(running_.size()));
  metrics_->waiting->Set(static_cast<double>(waiting));
  metrics_->kv_usage->Set(static_cast<double>(kv_->num_used()) / kv_->num_blocks());
}

}  // namespace kiln
