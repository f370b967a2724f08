// A streamed HTTP response (Server-Sent Events) of an LLM request, shared by the OpenAI
// routes and Triton's generate_stream.
//
// Thread-safety: thread-safe; calls are serialized, so the Responder sees them in order.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/http/http_server.h"

namespace kiln::llm {

// A streamed HTTP response whose chunks may be produced (on the batcher's thread) before the
// handler sent its header (on the I/O thread, once the request was queued and could no longer
// be refused with an error status): writes before Start are held and sent after the header.
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
