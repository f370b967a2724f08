#include "scheduler/llm/llm_metrics.h"

namespace kiln {
namespace {

std::vector<double> Latency() {
  return {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
          0.5,   0.75,   1.0,   2.5,  5.0,  7.5,  10,   20,   40,  80,   160, 320};
}
std::vector<double> Tokens() { return metrics::ExponentialBuckets(1, 2, 14); }  // 1 .. 8192

}  // namespace

LlmMetricFamilies::LlmMetricFamilies(metrics::Registry& r)
    : ttft(r.AddHistogram("kiln_llm_time_to_first_token_seconds",
                          "Time from receiving a generation request to its first token.", {"model"},
                          Latency())),
      itl(r.AddHistogram("kiln_llm_inter_token_latency_seconds",
                         "Time between consecutive tokens of one request.", {"model"}, Latency())),
      e2e(r.AddHistogram("kiln_llm_request_duration_seconds",
                         "Time from receiving a generation request to its last token.", {"model"},
                         Latency())),
      queue(r.AddHistogram("kiln_llm_queue_duration_seconds",
                           "Time a request waited before its first step.", {"model"}, Latency())),
      prefill(r.AddHistogram("kiln_llm_prefill_duration_seconds",
                             "Time from a request's first step to its first token.", {"model"},
                             Latency())),
      decode(r.AddHistogram("kiln_llm_decode_duration_seconds",
                            "Time from a request's first token to its last.", {"model"},
                            Latency())),
      step_tokens(r.AddHistogram("kiln_llm_step_tokens",
                                 "Tokens processed per batcher step (prefill + decode).", {"model"},
                                 Tokens())),
      step_seconds(r.AddHistogram("kiln_llm_step_duration_seconds",
                                  "Duration of one batcher step (model forward + sampling).",
                                  {"model"}, Latency())),
      prompt_tokens(r.AddCounter("kiln_llm_prompt_tokens_total",
                                 "Prompt tokens of admitted requests.", {"model"})),
      generation_tokens(
          r.AddCounter("kiln_llm_generation_tokens_total", "Tokens generated.", {"model"})),
      requests(r.AddCounter("kiln_llm_requests_total",
                            "Finished generation requests, by finish reason (stop, length, "
                            "cancelled, error).",
                            {"model", "finish_reason"})),
      preemptions(r.AddCounter("kiln_llm_preemptions_total",
                               "Running requests preempted (KV blocks freed, recomputed later).",
                               {"model"})),
      prefix_hits(r.AddCounter("kiln_llm_prefix_cache_hit_tokens_total",
                               "Prompt tokens served from the prefix cache.", {"model"})),
      prefix_queries(r.AddCounter("kiln_llm_prefix_cache_query_tokens_total",
                                  "Prompt tokens looked up in the prefix cache (full blocks).",
                                  {"model"})),
      steps(r.AddCounter("kiln_llm_steps_total",
                         "Batcher steps, by mode: `replay` ran a captured program, `direct` "
                         "ran the program launch by launch.",
                         {"model", "mode"})),
      running(r.AddGauge("kiln_llm_requests_running", "Requests in the running batch.", {"model"})),
      waiting(
          r.AddGauge("kiln_llm_requests_waiting", "Requests waiting to be scheduled.", {"model"})),
      kv_usage(r.AddGauge("kiln_llm_kv_cache_usage_ratio",
                          "Fraction of KV-cache blocks in use by requests (0..1); cached "
                          "prefix blocks that can be evicted count as free.",
                          {"model"})),
      kv_blocks(r.AddGauge("kiln_llm_kv_cache_blocks", "KV-cache blocks in the pool.", {"model"})),
      adapters_loaded(r.AddGauge("kiln_lora_adapters_loaded",
                                 "LoRA adapters resident in the model's adapter slots.",
                                 {"model"})),
      adapter_loads(r.AddCounter("kiln_lora_adapter_loads_total",
                                 "LoRA adapters uploaded into an adapter slot (LRU misses).",
                                 {"model"})),
      spec_draft_tokens(r.AddCounter("kiln_llm_spec_draft_tokens_total",
                                     "Speculative decoding: drafted tokens verified by a step.",
                                     {"model"})),
      spec_accepted_tokens(r.AddCounter(
          "kiln_llm_spec_accepted_tokens_total",
          "Speculative decoding: drafted tokens accepted (the model produced them itself); "
          "divided by kiln_llm_spec_draft_tokens_total, the acceptance rate.",
          {"model"})) {}

LlmMetrics::LlmMetrics(LlmMetricFamilies& f, const std::string& m)
    : ttft(f.ttft.WithLabels({m})),
      itl(f.itl.WithLabels({m})),
      e2e(f.e2e.WithLabels({m})),
      queue(f.queue.WithLabels({m})),
      prefill(f.prefill.WithLabels({m})),
      decode(f.decode.WithLabels({m})),
      step_tokens(f.step_tokens.WithLabels({m})),
      step_seconds(f.step_seconds.WithLabels({m})),
      prompt_tokens(f.prompt_tokens.WithLabels({m})),
      generation_tokens(f.generation_tokens.WithLabels({m})),
      preemptions(f.preemptions.WithLabels({m})),
      prefix_hits(f.prefix_hits.WithLabels({m})),
      prefix_queries(f.prefix_queries.WithLabels({m})),
      replay_steps(f.steps.WithLabels({m, "replay"})),
      direct_steps(f.steps.WithLabels({m, "direct"})),
      running(f.running.WithLabels({m})),
      waiting(f.waiting.WithLabels({m})),
      kv_usage(f.kv_usage.WithLabels({m})),
      kv_blocks(f.kv_blocks.WithLabels({m})),
      adapters_loaded(f.adapters_loaded.WithLabels({m})),
      adapter_loads(f.adapter_loads.WithLabels({m})),
      spec_draft_tokens(f.spec_draft_tokens.WithLabels({m})),
      spec_accepted_tokens(f.spec_accepted_tokens.WithLabels({m})),
      families(f),
      model(m) {}

}  // namespace kiln
