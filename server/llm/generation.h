// What the LLM front ends (OpenAI HTTP, kiln.v1 gRPC, KServe) share once a request is
// parsed: finding the model, handing a GenerateRequest to its continuous batcher with the
// admission ticket held until the final event, cancelling it, and collecting its events.
//
// Thread-safety: the functions are thread-safe; GenerationResult is a plain value.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "scheduler/llm/generate_request.h"
#include "server/core.h"
#include "server/http/http_server.h"

namespace kiln::llm {

// The ready model `name`, if it generates text. NotFound (unknown name), Unavailable (not
// ready), InvalidArgument (a tensor model: "model 'simple' does not generate text"); the
// error's param is `field`.
StatusOr<std::shared_ptr<Model>> GetLlm(const ServerCore& core, std::string_view name,
                                        std::string_view field = "model");

// Hands `request` to the model's batcher. Its on_event is wrapped so that `ticket` (the
// server's admission, see ServerCore::Admit) is released right after the final event was
// delivered. On error nothing was queued, on_event is never called and the ticket is
// released: InvalidArgument (rejected by the batcher), ResourceExhausted (its queue is
// full), Unavailable (draining).
Status Submit(const std::shared_ptr<Model>& model, std::unique_ptr<GenerateRequest> request,
              InflightLimiter::Ticket ticket);

// Cancels a submitted request: sets its flag and wakes the batcher so it leaves the queue or
// the running batch within one step (its final event then has FinishReason::kCancelled).
// Safe to call more than once, and after the model was unloaded.
void Cancel(const std::shared_ptr<CancelFlag>& flag, const std::weak_ptr<Model>& model);

// A fresh request id: `prefix` + 24 hex digits.
std::string NewRequestId(std::string_view prefix = "");

// Everything a request produced, for the non-streaming APIs.
struct GenerationResult {
  std::string text;
  std::vector<int32_t> token_ids;
  std::vector<models::SampledToken> logprobs;
  FinishReason finish = FinishReason::kNone;
  std::string stop;
  GenerateUsage usage;
  Status status;

  bool done() const { return finish != FinishReason::kNone; }
  // Appends a chunk; the final event also sets finish, stop, usage and status.
  void Add(GenerateEvent&& event);
};

// The status to answer a finished request with: OK for stop/length, the event's error for
// kError, Cancelled for kCancelled.
Status FinalStatus(FinishReason finish, const Status& status);

// A streamed HTTP response whose chunks may be produced (on the batcher's thread) before the
// handler sent its header (on the I/O thread, once the request was queued and could no longer
// be refused with an error status): writes before Start are held and sent after the header.
// Thread-safety: thread-safe; calls are serialized, so the Responder sees them in order.
class HttpStreamGate {
 public:
  explicit HttpStreamGate(std::shared_ptr<http::Responder> responder) : r_(std::move(responder)) {}

  // Sends the header, then `first` (if not empty), then what was written so far.
  void Start(int status, std::string content_type, http::Headers headers, std::string first = "");
  void Write(std::string chunk);
  // Ends the stream (after Start: at once; before: right after the header).
  void Finish();

 private:
  absl::Mutex mu_;
  const std::shared_ptr<http::Responder> r_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::string> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kiln::llm
