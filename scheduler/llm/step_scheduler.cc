#include "scheduler/llm/step_scheduler.h"

#include <algorithm>
#include <climits>
#include <tuple>

namespace kiln {

void SchedulerOutput::Clear() {
  seqs.clear();
  num_tokens = 0;
  num_rows = 0;
  decode_rows = 0;
  prompt_tokens = 0;
  decode_only = true;
  preempted = 0;
  admitted = 0;
  preempted_seqs.clear();
}

StepScheduler::StepScheduler(const config::LlmSchedulerConfig& config, KvBlockManager* kv)
    : config_(config), kv_(kv) {
  waiting_.resize(std::max<uint32_t>(1, config_.priority_levels));
}

void StepScheduler::Add(std::unique_ptr<Sequence> seq) {
  seq->arrival = arrivals_++;
  waiting_[seq->level].push_back(std::move(seq));
}

int32_t StepScheduler::num_waiting() const {
  int32_t n = 0;
  for (const auto& q : waiting_) n += static_cast<int32_t>(q.size());
  return n;
}

bool StepScheduler::Allocate(Sequence* seq, int32_t tokens) {
  const int32_t need =
      kv_->BlocksFor(seq->num_computed + tokens) - static_cast<int32_t>(seq->blocks.size());
  if (need <= 0) return true;
  auto got = kv_->Allocate(need);
  if (!got) return false;
  seq->blocks.insert(seq->blocks.end(), got->begin(), got->end());
  return true;
}

void StepScheduler::Preempt(Sequence* seq) {
  // Free everything; keep the tokens. The sequence is recomputed from the start (much of it
  // from the prefix cache, if its blocks survive) when it is admitted again.
  kv_->Release(seq->blocks);
  seq->blocks.clear();
  seq->hashes.clear();
  seq->published = 0;
  seq->num_computed = 0;
  seq->draft.clear();
  seq->draft_computed = 0;
  auto it = std::find_if(running_.begin(), running_.end(),
                         [seq](const auto& p) { return p.get() == seq; });
  KILN_CHECK(it != running_.end(), "preempting a sequence that is not running");
  std::unique_ptr<Sequence> owned = std::move(*it);
  running_.erase(it);
  waiting_[owned->level].push_front(std::move(owned));
}

int32_t StepScheduler::Admit(std::deque<std::unique_ptr<Sequence>>& queue, size_t index,
                             int32_t budget) {
  Sequence* s = queue[index].get();
  const int32_t bs = kv_->block_size();
  if (s->blocks.empty() && s->num_computed == 0) {
    // Reuse cached blocks of the same prefix; always leave at least one token to run.
    std::vector<uint64_t> hashes = kv_->BlockHashes(s->tokens, s->prefix_seed);
    std::vector<int32_t> matched = kv_->MatchPrefix(hashes);
    if (!matched.empty() && matched.size() * bs >= s->tokens.size()) {
      kv_->Release(std::span<const int32_t>(&matched.back(), 1));
      matched.pop_back();
    }
    s->blocks = std::move(matched);
    s->num_computed = static_cast<int32_t>(s->blocks.size()) * bs;
    s->hashes.assign(hashes.begin(), hashes.begin() + s->blocks.size());
    s->published = static_cast<int32_t>(s->blocks.size());
  }
  const int32_t n = std::min(s->uncomputed(), budget);
  if (!Allocate(s, n)) {
    // Not now: give the shared blocks back rather than hold them while waiting.
    kv_->Release(s->blocks);
    s->blocks.clear();
    s->hashes.clear();
    s->published = 0;
    s->num_computed = 0;
    return 0;
  }
  if (!s->admitted) s->cached_tokens = s->num_computed;
  std::unique_ptr<Sequence> owned = std::move(queue[index]);
  queue.erase(queue.begin() + static_cast<std::ptrdiff_t>(index));
  // Keep running_ ordered by (level, arrival): preemption takes from the back.
  auto pos =
      std::upper_bound(running_.begin(), running_.end(), owned, [](const auto& a, const auto& b) {
        return std::tie(a->level, a->arrival) < std::tie(b->level, b->arrival);
      });
  running_.insert(pos, std::move(owned));
  return n;
}

void StepScheduler::Schedule(SchedulerOutput* out) {
  out->Clear();
  int32_t budget = config_.max_num_batched_tokens;
  // Prompt tokens left for this step: capped when it also decodes (one new token of a running
  // sequence whose known tokens are all computed but the last), by the prefill limit where it
  // knows one, else by max_prefill_tokens_with_decodes.
  const auto decoding = static_cast<int32_t>(std::count_if(
      running_.begin(), running_.end(), [](const auto& s) { return s->uncomputed() == 1; }));
  int32_t prefill_left = INT32_MAX;
  if (decoding > 0) {
    const int32_t limit = prefill_limit_ ? prefill_limit_(decoding) : -1;
    if (limit >= 0) {
      prefill_left = limit;
    } else if (config_.max_prefill_tokens_with_decodes > 0) {
      prefill_left = config_.max_prefill_tokens_with_decodes;
    }
  }
  auto take = [&](Sequence* s, int32_t n, bool prefill) {
    out->seqs.push_back({s, n, !s->admitted});
    s->admitted = true;
    out->num_tokens += n;
    const auto drafted = static_cast<int32_t>(s->draft.size());
    out->num_rows += 1 + drafted;
    out->decode_only = out->decode_only && n == 1 + drafted;
    budget -= n;
    if (prefill) {
      prefill_left -= n;
      out->prompt_tokens += n;
    } else {
      out->decode_rows += 1 + drafted;
    }
  };
  // Rows (the program's sequence bound) left over for drafted tokens; none while anyone waits.
  int32_t draft_rows = num_waiting() > 0 ? 0 : config_.max_num_seqs - num_running();

  // 1. Running sequences, highest priority and oldest first (running_ is kept in that order).
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Sequence* s = running_[i].get();
    const int32_t left = s->uncomputed();
    int32_t n = std::min({left, budget, left > 1 ? prefill_left : 1});
    if (n <= 0) continue;
    if (!s->draft.empty()) {
      // A decode with drafts: as many as the rows, the budget and free blocks allow.
      const auto d =
          left == 1 ? std::min({static_cast<int32_t>(s->draft.size()), budget - 1, draft_rows}) : 0;
      if (d > 0 && Allocate(s, 1 + d)) {
        n = 1 + d;
        draft_rows -= d;
        s->draft.resize(static_cast<size_t>(d));
      } else {
        s->draft.clear();
      }
    }
    bool self_preempted = false;
    while (!Allocate(s, n)) {
      Sequence* victim = running_.back().get();
      Preempt(victim);
      ++out->preempted;
      out->preempted_seqs.push_back(victim);
      if (victim == s) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;
    take(s, n, left > 1);
  }

  // 2. Waiting sequences, unless this step had to preempt (no room to spare). Strict priority:
  // when the head of a level does not fit, nothing of lower priority jumps the queue.
  for (auto& queue : waiting_) {
    if (out->preempted > 0) break;
    // Sequences the admission check holds back ("not now") are skipped, in place.
    size_t i = 0;
    while (i < queue.size() && budget > 0 && prefill_left > 0 &&
           num_running() < config_.max_num_seqs) {
      Sequence* s = queue[i].get();
      if (s->done || (admission_check_ && !admission_check_(s))) {
        ++i;
        continue;
      }
      const int32_t n = Admit(queue, i, std::min(budget, prefill_left));
      if (n == 0) return;
      ++out->admitted;
      take(s, n, true);
    }
  }
}

void StepScheduler::PublishFullBlocks(Sequence* seq) {
  if (!config_.enable_prefix_caching) return;
  const int32_t bs = kv_->block_size();
  const int32_t full = seq->num_computed / bs;
  for (int32_t i = seq->published; i < full; ++i) {
    const uint64_t parent = i == 0 ? seq->prefix_seed : seq->hashes[i - 1];
    const uint64_t h = KvBlockManager::HashBlock(
        parent, std::span<const int32_t>(seq->tokens).subspan(static_cast<size_t>(i) * bs, bs));
    seq->hashes.push_back(h);
    kv_->Publish(seq->blocks[i], h);
  }
  seq->published = std::max(seq->published, full);
}

void StepScheduler::Free(Sequence* seq) {
  if (seq->blocks.empty()) return;
  kv_->Release(seq->blocks);
  seq->blocks.clear();
}

int32_t StepScheduler::EraseDone() {
  auto done = [](const auto& s) { return s->done; };
  std::erase_if(running_, done);
  int32_t waiting = 0;
  for (auto& q : waiting_) waiting += static_cast<int32_t>(std::erase_if(q, done));
  return waiting;
}

std::vector<std::unique_ptr<Sequence>> StepScheduler::TakeAll() {
  std::vector<std::unique_ptr<Sequence>> all = std::move(running_);
  running_.clear();
  for (auto& q : waiting_) {
    for (auto& s : q) all.push_back(std::move(s));
    q.clear();
  }
  return all;
}

}  // namespace kiln
