// The continuous batcher's part of per-request traces (scheduler/trace.h): the queue span, a
// span per prefill chunk, one decode span and one detokenize span per request, and — while a
// /debug/trace capture runs — a span per step saying what it computed.
//
// Decode is one span per request covering all its decode steps (attribute kiln.decode_steps),
// not a span per step: a long generation would otherwise cost a span record per token and
// flood the bounded export queue. The per-step picture is in the step lane of a capture.
// Detokenisation happens a token at a time between steps, so the detokenize span starts at
// the first token and lasts the sum of those pieces (kiln.detokenize_calls of them).
//
// Thread-safety: the batcher's loop thread only (set_sink before the loop starts).
#pragma once

#include <string>
#include <vector>

#include "scheduler/llm/generate_request.h"
#include "scheduler/llm/model_step.h"
#include "scheduler/llm/step_scheduler.h"
#include "scheduler/trace.h"

namespace kiln {

class StepTrace {
 public:
  // `sink` may be null (no step spans); `model` names the loop's lane.
  void set_sink(TraceSink* sink, const std::string& model) {
    sink_ = sink;
    lane_ = "model " + model;
  }

  // After Schedule: counts decode steps, notes which sequences run a prefill chunk.
  void Scheduled(const SchedulerOutput& sched, SteadyClock::time_point step_start);
  // After the step's outputs: queue and prefill-chunk spans, and the step span (capturing).
  void Stepped(const SchedulerOutput& sched, SteadyClock::time_point step_start,
               const StepOutput& out);
  // Around one token's detokenisation (and stop-string search): Start returns the time, or
  // a zero time point when the request is not recorded; End adds the elapsed time.
  static SteadyClock::time_point DetokenizeStart(const Sequence& seq);
  static void DetokenizeEnd(const Sequence& seq, SteadyClock::time_point start);
  // When the sequence ends (before its final event): decode and detokenize spans, the root's
  // model and usage attributes.
  static void Finished(const Sequence& seq, FinishReason reason);

 private:
  TraceSink* sink_ = nullptr;
  std::string lane_;
  std::vector<char> prefill_;  // per scheduled sequence of this step
  uint64_t step_ = 0;
};

}  // namespace kiln
