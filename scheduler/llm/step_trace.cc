#include "scheduler/llm/step_trace.h"

#include <algorithm>

#include "scheduler/llm/sequence.h"

namespace kiln {
namespace {

RequestTrace* Recorded(const Sequence& seq) {
  RequestTrace* t = seq.req->trace.get();
  return t != nullptr && t->recording() ? t : nullptr;
}

}  // namespace

void StepTrace::Scheduled(const SchedulerOutput& sched, SteadyClock::time_point step_start) {
  ++step_;
  prefill_.assign(sched.seqs.size(), 0);
  for (size_t i = 0; i < sched.seqs.size(); ++i) {
    const Sequence& s = *sched.seqs[i].seq;
    // Decode: only the newest sampled token is uncomputed. Anything else computes prompt (or,
    // after a preemption, prompt and generated tokens again): a prefill chunk.
    const bool decode = s.generated() > 0 && s.uncomputed() == 1;
    prefill_[i] = decode ? 0 : 1;
    RequestTrace* t = Recorded(s);
    if (t == nullptr || !decode) continue;
    if (t->llm.decode_steps++ == 0) t->llm.decode_start = step_start;
  }
}

void StepTrace::Stepped(const SchedulerOutput& sched, SteadyClock::time_point step_start,
                        const StepOutput& out) {
  const auto end = SteadyClock::now();
  int32_t prefills = 0;
  std::string requests;
  for (size_t i = 0; i < sched.seqs.size(); ++i) {
    const SchedulerOutput::Entry& e = sched.seqs[i];
    const bool prefill = i < prefill_.size() && prefill_[i];
    prefills += prefill;
    if (sink_ != nullptr && sink_->capturing() && i < 8) {
      requests += (requests.empty() ? "" : ",") + e.seq->req->id;
    }
    RequestTrace* t = Recorded(*e.seq);
    if (t == nullptr) continue;
    if (e.first_time && !t->llm.queued_span) {
      t->llm.queued_span = true;
      t->Span("queue", e.seq->enqueued, e.seq->first_scheduled);
    }
    if (prefill) {
      t->Span("prefill", step_start, end,
              {{"kiln.tokens", int64_t{e.num_tokens}},
               {"kiln.chunk", int64_t{t->llm.prefill_chunks++}},
               {"kiln.cached_tokens", int64_t{e.seq->cached_tokens}},
               {"kiln.step", static_cast<int64_t>(step_)}});
    }
  }
  if (sink_ == nullptr || !sink_->capturing()) return;
  if (sched.seqs.size() > 8) requests += ",...";
  SpanRecord s;
  s.name = sched.decode_only ? "decode step" : "step";
  s.lane = lane_;
  s.span_id = TraceSink::NewSpanId();
  s.start_ns = SteadyNanos(step_start);
  s.end_ns = SteadyNanos(end);
  s.attrs = {{"step", static_cast<int64_t>(step_)},
             {"sequences", static_cast<int64_t>(sched.seqs.size())},
             {"prefill_sequences", int64_t{prefills}},
             {"decode_sequences", static_cast<int64_t>(sched.seqs.size()) - prefills},
             {"tokens", int64_t{sched.num_tokens}},
             {"admitted", int64_t{sched.admitted}},
             {"preempted", int64_t{sched.preempted}},
             {"replayed", int64_t{out.stats.replayed}},
             {"requests", std::move(requests)}};
  sink_->Record(std::move(s));
}

SteadyClock::time_point StepTrace::DetokenizeStart(const Sequence& seq) {
  return Recorded(seq) != nullptr ? SteadyClock::now() : SteadyClock::time_point{};
}

void StepTrace::DetokenizeEnd(const Sequence& seq, SteadyClock::time_point start) {
  if (start == SteadyClock::time_point{}) return;
  RequestTrace::LlmState& st = seq.req->trace->llm;
  const auto now = SteadyClock::now();
  if (st.detokenized++ == 0) st.first_token = start;
  st.detokenize_ns += SteadyNanos(now) - SteadyNanos(start);
}

void StepTrace::Finished(const Sequence& seq, FinishReason reason) {
  RequestTrace* t = Recorded(seq);
  if (t == nullptr) return;
  t->Attr("kiln.model", seq.req->model_name);
  t->Attr("kiln.request_id", seq.req->id);
  t->Attr("kiln.prompt_tokens", int64_t{seq.prompt_len});
  t->Attr("kiln.completion_tokens", int64_t{seq.generated()});
  t->Attr("kiln.cached_tokens", int64_t{seq.cached_tokens});
  t->Attr("kiln.finish_reason", std::string(FinishReasonName(reason)));
  const auto now = SteadyClock::now();
  RequestTrace::LlmState& st = t->llm;
  if (!st.queued_span) {  // never scheduled: it ended in the queue
    st.queued_span = true;
    t->Span("queue", seq.enqueued, now);
  }
  if (st.decode_steps > 0) {
    t->Span("decode", st.decode_start, now,
            {{"kiln.decode_steps", st.decode_steps},
             {"kiln.tokens", int64_t{std::max(0, seq.generated() - 1)}}});
  }
  if (st.detokenized > 0) {
    t->Span("detokenize", st.first_token,
            st.first_token + std::chrono::nanoseconds(st.detokenize_ns),
            {{"kiln.detokenize_calls", st.detokenized}});
  }
}

}  // namespace kiln
