#include "scheduler/llm/testing/fake_llm.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "engine/testing/source_dir.h"
#include "models/chat/chat_template.h"
#include "nlohmann/json.hpp"

namespace kiln::llm_testing {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int32_t NextToken(std::span<const int32_t> context, int64_t adapter_rank, int32_t repeat_period) {
  if (repeat_period > 0 && context.size() >= static_cast<size_t>(repeat_period)) {
    return context[context.size() - static_cast<size_t>(repeat_period)];
  }
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : context) h = (h ^ static_cast<uint32_t>(t)) * 1099511628211ull;
  return 300 + static_cast<int32_t>((h + 97 * static_cast<uint64_t>(adapter_rank)) % 2600);
}

void StoreMax(std::atomic<int32_t>& a, int32_t v) {
  int32_t cur = a.load();
  while (v > cur && !a.compare_exchange_weak(cur, v)) {
  }
}

}  // namespace

void StepGate::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  allowed_ = 0;
}

void StepGate::Open() {
  absl::MutexLock lock(&mu_);
  closed_ = false;
}

void StepGate::Allow(int64_t n) {
  absl::MutexLock lock(&mu_);
  allowed_ += n;
}

void StepGate::AwaitArrivals(int64_t n) {
  absl::MutexLock lock(&mu_);
  auto arrived = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return arrivals_ >= n; };
  mu_.Await(absl::Condition(&arrived));
}

int64_t StepGate::arrivals() const {
  absl::MutexLock lock(&mu_);
  return arrivals_;
}

void StepGate::Pass() {
  absl::MutexLock lock(&mu_);
  ++arrivals_;
  auto may_pass = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !closed_ || allowed_ > 0; };
  mu_.Await(absl::Condition(&may_pass));
  if (closed_) --allowed_;
}

std::unique_ptr<models::Tokenizer> LoadFixtureTokenizer() {
  auto tok = models::Tokenizer::FromHfJson(
      ReadFile(std::string(TestSourceDir()) +
               "/tests/fixtures/tokenizer/bpe_bytelevel.tokenizer.json"),
      nullptr, "bpe_bytelevel");
  KILN_CHECK(tok.ok(), "fixture tokenizer failed to load");
  return std::move(*tok);
}

FakeLlm::FakeLlm(FakeLlmOptions options) : options_(std::move(options)) {
  slots_.resize(std::max(options_.max_adapters, 0));
  tokenizer_ = LoadFixtureTokenizer();
  info_.architecture = "fake";
  info_.name = "fake";
  info_.vocab_size = std::max(tokenizer_->vocab_size(), options_.vocab_size);
  info_.context_length = options_.context_length;
  info_.eos_token_ids = {kFakeEos};
  if (options_.chat_template) {
    auto t = models::ChatTemplate::Parse(
        ReadFile(std::string(TestSourceDir()) + "/tests/fixtures/chat/templates/smollm2.jinja"));
    KILN_CHECK(t.ok(), "fixture chat template failed to parse");
    template_ = std::move(*t);
  }
}

FakeLlm::~FakeLlm() = default;

Status FakeLlm::AllocateKvCache(int32_t num_blocks, int32_t block_size) {
  block_size_ = block_size;
  kv_.assign(static_cast<size_t>(num_blocks) * block_size, {-1, -1});
  return OkStatus();
}

Status FakeLlm::Step(const models::StepBatch& b, std::span<float> logits,
                     models::StepStats* stats) {
  options_.gate->Pass();
  const int32_t S = static_cast<int32_t>(b.seq_lens.size());
  int32_t prefill = 0;  // prompt tokens: rows of sequences with more than one new token
  bool decodes = false;
  for (int32_t i = 0; i < S; ++i) {
    const int32_t n = b.query_start[i + 1] - b.query_start[i];
    if (n == 1) {
      decodes = true;
    } else {
      prefill += n;
    }
  }
  if (const int64_t us = options_.step_delay_us->load() +
                         int64_t{options_.prompt_token_delay_us->load()} * prefill;
      us > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  }
  for (int32_t slot : b.adapter_slots) {
    if (slot != -1 && (slot < 0 || slot >= options_.max_adapters || slots_[slot] == nullptr)) {
      return InvalidArgument("adapter slot ", slot, " asked of model 'fake', which has ",
                             options_.max_adapters, " slots (or the slot is empty)");
    }
  }
  for (size_t i = 0; i < b.tokens.size(); ++i) {
    if (b.slot_mapping[i] < 0 || b.slot_mapping[i] >= static_cast<int32_t>(kv_.size())) {
      return Internal("slot ", b.slot_mapping[i], " out of range");
    }
    kv_[b.slot_mapping[i]] = {b.tokens[i], b.positions[i]};
  }
  std::fill(logits.begin(), logits.end(), 0.0f);
  const int eos_at = options_.eos_at->load();
  for (int32_t s = 0; s < S; ++s) {
    std::vector<int32_t> context;
    for (int32_t p = 0; p < b.seq_lens[s]; ++p) {
      const int32_t block =
          b.block_table[static_cast<size_t>(s) * b.max_blocks_per_seq + p / block_size_];
      if (block < 0) return Internal("block table hole at position ", p);
      const auto [token, pos] = kv_[static_cast<size_t>(block) * block_size_ + p % block_size_];
      if (pos != p) {
        return Internal("sequence ", s, " position ", p, " reads the KV of position ", pos);
      }
      context.push_back(token);
    }
    const int32_t slot = b.adapter_slots.empty() ? -1 : b.adapter_slots[s];
    int32_t next =
        NextToken(context, slot < 0 ? 0 : slots_[slot]->config.r, options_.repeat_period);
    if (eos_at > 0 && static_cast<int>(context.size()) >= eos_at) next = kFakeEos;
    const auto len = static_cast<int32_t>(context.size());
    if (options_.wrong_every > 0 && len % options_.wrong_every == 0) next = 300 + (next + 1) % 2600;
    // A peaked but not one-hot distribution, so logprobs have alternatives.
    float* row = logits.data() + static_cast<size_t>(s) * info_.vocab_size;
    row[next] = 10.0f;
    row[(next + 1) % info_.vocab_size] = 5.0f;
  }
  if (stats != nullptr && b.decode_only && S <= 8) {
    stats->replayed = true;
    stats->padded_seqs = S <= 1 ? 1 : S <= 2 ? 2 : S <= 4 ? 4 : 8;
  }
  FakeLlmStats& seen = *options_.stats;
  if (decodes) {
    StoreMax(seen.max_prefill_with_decodes, prefill);
    if (prefill > 0) {
      absl::MutexLock lock(&seen.mu);
      seen.prefill_beside_decodes.push_back(prefill);
    }
  }
  StoreMax(seen.max_seqs_in_step, S);
  StoreMax(seen.max_tokens_in_step, static_cast<int32_t>(b.tokens.size()));
  ++seen.steps;
  return OkStatus();
}

Status FakeLlm::CheckAdapter(const models::LoraAdapter& adapter) const {
  if (options_.max_adapters == 0) return FailedPrecondition("model 'fake' serves no adapters");
  if (adapter.config.r < 1 || adapter.config.r > 16) {
    return InvalidArgument("the adapter's rank r is ", adapter.config.r,
                           " but model 'fake' takes ranks 1 to 16 (max_lora_rank)");
  }
  return OkStatus();
}

StatusOr<std::shared_ptr<const models::LoraAdapter>> FakeLlm::ReadAdapter(
    const std::string& dir) const {
  std::ifstream in(dir + "/adapter_config.json");
  if (!in.good()) return NotFound(dir, "/adapter_config.json: no such file");
  const nlohmann::json config = nlohmann::json::parse(in, nullptr, false);
  if (config.is_discarded() || !config.contains("r") || !config["r"].is_number_integer()) {
    return InvalidArgument(dir, "/adapter_config.json: no integer `r`");
  }
  auto adapter = std::make_shared<models::LoraAdapter>();
  adapter->config.r = config["r"].get<int64_t>();
  KILN_RETURN_IF_ERROR(CheckAdapter(*adapter));
  return adapter;
}

Status FakeLlm::LoadAdapter(int32_t slot, std::shared_ptr<const models::LoraAdapter> adapter) {
  if (slot < 0 || slot >= options_.max_adapters) {
    return InvalidArgument("adapter slot ", slot, " out of range");
  }
  if (adapter != nullptr) {
    KILN_RETURN_IF_ERROR(CheckAdapter(*adapter));
    ++options_.stats->adapter_loads;
  }
  slots_.resize(options_.max_adapters);
  slots_[slot] = std::move(adapter);
  return OkStatus();
}

std::vector<int32_t> FakeLlm::Continue(std::vector<int32_t> context, int n, int eos_at,
                                       int64_t adapter_rank, int32_t repeat_period) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    int32_t next = NextToken(context, adapter_rank, repeat_period);
    if (eos_at > 0 && static_cast<int>(context.size()) >= eos_at) next = kFakeEos;
    out.push_back(next);
    context.push_back(next);
    if (next == kFakeEos) break;
  }
  return out;
}

Status FakeLlm::StepAndSample(const models::StepBatch& b, const models::StepSampling& sampling,
                              std::span<models::SampledToken> sampled, models::StepStats* stats) {
  if (!options_.sample_on_device) return FailedPrecondition("the fake samples on the host");
  const size_t S = b.seq_lens.size(), V = static_cast<size_t>(info_.vocab_size);
  if (sampling.params.size() != S || sampling.uniforms.size() != S || sampled.size() < S) {
    return InvalidArgument("inconsistent step sampling");
  }
  logits_.resize(S * V);
  KILN_RETURN_IF_ERROR(Step(b, logits_, stats));
  sampling::Scratch scratch;
  for (size_t s = 0; s < S; ++s) {
    const std::span<float> raw(logits_.data() + s * V, V);
    std::vector<float> row(raw.begin(), raw.end());
    const sampling::RowParams& p = sampling.params[s];
    sampling::ApplyPenalties(
        p, row,
        sampling.penalties.subspan(sampling.penalty_start[s],
                                   sampling.penalty_start[s + 1] - sampling.penalty_start[s]),
        sampling.banned.subspan(sampling.banned_start[s],
                                sampling.banned_start[s + 1] - sampling.banned_start[s]));
    if (sampling.allowed_words > 0) {
      const size_t W = static_cast<size_t>(sampling.allowed_words);
      sampling::ApplyAllowed(row, sampling.allowed.subspan(s * W, W));
    }
    models::SampledToken& t = sampled[s];
    t = {};
    t.token = sampling::Pick(p, row, sampling.uniforms[s], scratch);
    if (p.logprobs >= 0) models::ComputeLogprobs(raw, t.token, p.logprobs, &t);
  }
  return OkStatus();
}

}  // namespace kiln::llm_testing
