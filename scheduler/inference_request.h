// A tensor inference request as the scheduler sees it, after a front end (gRPC, HTTP) has
// decoded it from the wire, and its response.
//
// Ownership: a front end creates the request, hands it to Model::Infer (on success the
// scheduler owns it) and learns the result only through `on_complete`, which is called
// exactly once — from a scheduler thread, or not at all if Infer returned an error (the
// caller then still owns the request and answers the client itself).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/base/status.h"
#include "models/tensor/tensor_model.h"

namespace kiln {

using SteadyClock = std::chrono::steady_clock;

class RequestTrace;  // scheduler/trace.h

struct InferenceResponse {
  Status status;
  std::vector<HostTensor> outputs;  // the requested outputs, in the order requested
  // Decoupled models (on_response below): the model marked this response its last.
  bool final = false;
};

// Set by a front end when its client goes away (RPC cancelled, HTTP connection closed).
// The scheduler drops a cancelled request from its queue at its next step.
class CancelFlag {
 public:
  void Cancel() { cancelled_.store(true, std::memory_order_release); }
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

 private:
  std::atomic<bool> cancelled_{false};
};

struct InferenceRequest {
  std::string model_name;
  std::string model_version;  // "" means the latest (Kiln serves version "1")
  std::string id;             // client-provided, echoed back

  // Inputs as received; Model::Infer puts them in the model's declared order.
  std::vector<HostTensor> inputs;
  // Output names requested; empty means all outputs in declared order.
  std::vector<std::string> requested_outputs;

  // Request parameters (Triton's names): 0 means the model's default priority level.
  uint64_t priority = 0;
  // Queue timeout in microseconds; honoured only if the model's queue policy allows an
  // override, else the policy's default applies.
  std::optional<uint64_t> timeout_us;

  // Sequence batching (Triton's `sequence_id`, `sequence_start`, `sequence_end` parameters):
  // the id is an unsigned integer or a string; 0 and "" mean "not part of a sequence".
  struct Sequence {
    uint64_t id = 0;
    std::string string_id;  // set instead of `id` for a string sequence id
    bool start = false;
    bool end = false;
    bool has_id() const { return id != 0 || !string_id.empty(); }
  } sequence;

  std::shared_ptr<CancelFlag> cancel = std::make_shared<CancelFlag>();
  std::function<void(InferenceResponse&&)> on_complete;
  // Decoupled models (TensorModel::decoupled) only, and required for them: called once per
  // response the model sends (outputs filtered and ordered as requested; `final` set when the
  // model marked it its last), in order, from a scheduler thread, never concurrently and
  // never after on_complete began. on_complete then ends the request: its status is the
  // model's, its outputs empty.
  std::function<void(InferenceResponse&&)> on_response;

  SteadyClock::time_point received_at = SteadyClock::now();
  // The request's trace (scheduler/trace.h): the scheduler adds its queue and execute spans.
  // Null: not traced.
  std::shared_ptr<RequestTrace> trace;

  // ---- Filled by the scheduler ----
  int64_t batch_size = 1;       // rows along dimension 0; 1 when the model does not batch
  uint32_t priority_level = 0;  // the resolved level (1 = highest), 0 when no levels
  SteadyClock::time_point enqueued_at{};
  std::optional<SteadyClock::time_point> deadline;  // queue timeout, if any
  bool delayed = false;  // timed out under a DELAY policy: runs after everything else
  // Set by whoever answers first (the worker, or a shutdown cutting the request off), so
  // on_complete runs exactly once even when those race.
  std::atomic<bool> answered{false};
};

}  // namespace kiln
