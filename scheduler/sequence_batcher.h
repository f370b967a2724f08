// Sequence batching for stateful tensor models, with Triton's semantics
// (ModelSequenceBatching): the queue and batch-formation rules as pure logic, driven by a
// DynamicBatcher (dynamic_batcher.h) that runs the batches on the model's instances.
//
// Rules:
// - Every request names its sequence (`sequence_id`, an integer or a string; none is an
//   error) and may carry START and END flags. The first request of a sequence must have
//   START; a request for a sequence that is not active (never started, ended, or released as
//   idle) without START is refused. START on an active sequence restarts it in place.
// - A sequence is bound at START to a slot: slots_per_instance() slots on each instance
//   (direct: max_batch_size, 1 without batching; oldest: max_candidate_sequences). When all
//   slots are taken, new sequences wait (their requests queue) for one in arrival order, as
//   Triton's backlog does. END releases the slot once its request has run.
// - Requests of a sequence run in arrival order, one at a time: the next one is not handed
//   out until the batch holding the previous one has finished (Finished()).
// - direct: a batch holds the ready request of each of an instance's slots, in slot order; it
//   waits up to direct.max_queue_delay_microseconds while fewer than
//   minimum_slot_utilization of the slots have one. Slots without a request are not padded:
//   a model that keeps state reads the CORRID control (rows are not slot positions).
// - oldest: a batch takes the instance's candidate sequences' next requests, oldest first,
//   up to max_batch_size; it is sent when full, when every candidate slot is in it, at a
//   preferred_batch_size, or when its oldest request has waited max_queue_delay_microseconds.
// - The controls of sequence_batching.control_input are added to every request handed out, in
//   the model's declared input order: START and END (the request's flags), READY (always
//   true) and CORRID (the sequence id), each of shape [1] ([1, 1] when the model batches).
// - A sequence with no request queued or running for max_sequence_idle_microseconds is
//   released (Expire), freeing its slot.
// - Requests must have batch size 1 (Triton's sequence batcher rule).
//
// Thread-safety: none (RequestQueue); the DynamicBatcher serializes access.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "scheduler/model_stats.h"
#include "scheduler/request_queue.h"

namespace kiln {

class SequenceQueue final : public RequestQueue {
 public:
  struct Options {
    std::string model_name;
    config::SequenceBatchingConfig config;
    int max_batch_size = 0;
    int instance_count = 1;
    // The model's declared inputs, control inputs included (TensorModel::inputs()).
    std::vector<TensorSpec> model_inputs;
    ModelStats* stats = nullptr;  // null: no sequence gauge; else outlives the queue
  };

  // Checks the control inputs against the model's inputs: each names a declared input of
  // shape [1] whose datatype matches the control (int32_false_true: INT32, fp32: FP32, bool:
  // BOOL, CORRID: its data_type). InvalidArgument naming the control input otherwise.
  static StatusOr<std::unique_ptr<SequenceQueue>> Create(Options options);

  // The inputs a client sends: the model's inputs without the control inputs.
  static std::vector<TensorSpec> ClientInputs(const config::SequenceBatchingConfig& config,
                                              const std::vector<TensorSpec>& model_inputs);

  // Errors (InvalidArgument): no sequence id; batch size other than 1; a request without
  // START for a sequence that is not active; a string id when CORRID is an integer type, or
  // an integer id out of its range.
  Status Enqueue(std::unique_ptr<InferenceRequest>& request, SteadyClock::time_point now) override;
  // Answers cancelled queued requests (CANCELLED) and releases idle sequences.
  std::vector<Completion> Expire(SteadyClock::time_point now) override;
  Decision Next(SteadyClock::time_point now, int instance) override;
  void Finished(int instance, SteadyClock::time_point now) override;
  std::optional<SteadyClock::time_point> NextDeadline() const override;
  size_t size() const override { return size_; }
  std::vector<std::unique_ptr<InferenceRequest>> TakeAll() override;

  // Sequences started and not yet ended or released (holding a slot or waiting for one).
  size_t active_sequences() const { return sequences_.size(); }
  // Sequences waiting for a slot.
  size_t waiting_sequences() const { return backlog_.size(); }
  int slots_per_instance() const { return slots_per_instance_; }
  // The slot a sequence holds (-1: waiting for one, or not active). `key` as SequenceKey.
  int SlotOf(const InferenceRequest::Sequence& sequence) const;

 private:
  struct Control {
    config::SequenceControlConfig::Kind kind;
    std::string name;
    DataType datatype;
    std::string false_bytes, true_bytes;  // START, END, READY
  };
  struct Sequence {
    std::string display;  // for messages: 1001 or "abc"
    uint64_t id = 0;
    std::string string_id;
    int slot = -1;  // -1: waiting for a slot
    std::deque<std::unique_ptr<InferenceRequest>> queued;
    bool running = false;  // a request of it is in a batch that has not finished
    bool open = true;      // the last request queued did not carry END
    SteadyClock::time_point last_active;
  };

  explicit SequenceQueue(Options options);
  static std::string Key(const InferenceRequest::Sequence& s);
  Status AddControls(InferenceRequest& r, const Sequence& seq) const;
  void AssignSlot(const std::string& key, Sequence& seq);
  void Release(std::map<std::string, Sequence>::iterator it);
  void PublishGauge();

  Options options_;
  std::vector<Control> controls_;
  int slots_per_instance_ = 1;
  std::map<std::string, Sequence> sequences_;      // by Key()
  std::vector<std::string> slot_owner_;            // key of the sequence in each slot; "" free
  std::deque<std::string> backlog_;                // keys waiting for a slot, in arrival order
  std::vector<std::vector<std::string>> running_;  // per instance: keys in its batch
  size_t size_ = 0;
};

}  // namespace kiln
