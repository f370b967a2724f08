// Prometheus metrics of the LLM path, registered once per registry and labelled by model.
// Buckets are in docs/metrics.md.
#pragma once

#include <string>

#include "engine/base/metrics.h"

namespace kiln {

struct LlmMetricFamilies {
  explicit LlmMetricFamilies(metrics::Registry& registry);
  metrics::Family<metrics::Histogram>& ttft;
  metrics::Family<metrics::Histogram>& itl;
  metrics::Family<metrics::Histogram>& e2e;
  metrics::Family<metrics::Histogram>& queue;
  metrics::Family<metrics::Histogram>& prefill;
  metrics::Family<metrics::Histogram>& decode;
  metrics::Family<metrics::Histogram>& step_tokens;
  metrics::Family<metrics::Histogram>& step_seconds;
  metrics::Family<metrics::Counter>& prompt_tokens;
  metrics::Family<metrics::Counter>& generation_tokens;
  metrics::Family<metrics::Counter>& requests;  // by finish reason
  metrics::Family<metrics::Counter>& preemptions;
  metrics::Family<metrics::Counter>& prefix_hits;     // tokens
  metrics::Family<metrics::Counter>& prefix_queries;  // tokens looked up
  metrics::Family<metrics::Counter>& steps;           // by mode: replay | direct
  metrics::Family<metrics::Gauge>& running;
  metrics::Family<metrics::Gauge>& waiting;
  metrics::Family<metrics::Gauge>& kv_usage;
  metrics::Family<metrics::Gauge>& kv_blocks;
  metrics::Family<metrics::Gauge>& adapters_loaded;
  metrics::Family<metrics::Counter>& adapter_loads;
  metrics::Family<metrics::Counter>& spec_draft_tokens;     // speculative decoding
  metrics::Family<metrics::Counter>& spec_accepted_tokens;  // (acceptance = accepted / draft)
};

// One model's children, looked up once.
struct LlmMetrics {
  LlmMetrics(LlmMetricFamilies& f, const std::string& model);
  metrics::Histogram *ttft, *itl, *e2e, *queue, *prefill, *decode, *step_tokens, *step_seconds;
  metrics::Counter *prompt_tokens, *generation_tokens, *preemptions, *prefix_hits, *prefix_queries,
      *replay_steps, *direct_steps;
  metrics::Gauge *running, *waiting, *kv_usage, *kv_blocks, *adapters_loaded;
  metrics::Counter* adapter_loads;
  metrics::Counter *spec_draft_tokens, *spec_accepted_tokens;
  LlmMetricFamilies& families;
  std::string model;
};

}  // namespace kiln
