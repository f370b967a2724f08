#include "scheduler/sequence_batcher.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/strings/str_join.h"
#include "scheduler/batch_queue.h"
#include "spdlog/spdlog.h"

namespace kiln {
namespace {

using Kind = config::SequenceControlConfig::Kind;

template <typename T>
std::string Bytes(T v) {
  std::string out(sizeof(T), '\0');
  std::memcpy(out.data(), &v, sizeof(T));
  return out;
}

// The datatype a control's values (or CORRID's data_type) give its input.
DataType ControlType(const config::SequenceControlConfig& c) {
  if (c.kind == Kind::kCorrid) {
    if (c.data_type == "TYPE_UINT64") return DataType::kUint64;
    if (c.data_type == "TYPE_INT64") return DataType::kInt64;
    if (c.data_type == "TYPE_UINT32") return DataType::kUint32;
    if (c.data_type == "TYPE_INT32") return DataType::kInt32;
    return DataType::kBytes;
  }
  if (!c.int32_false_true.empty()) return DataType::kInt32;
  if (!c.fp32_false_true.empty()) return DataType::kFp32;
  return DataType::kBool;
}

// The raw bytes of value `i` (0: false, 1: true) of a START/END/READY control.
std::string ControlValue(const config::SequenceControlConfig& c, size_t i) {
  if (!c.int32_false_true.empty()) return Bytes<int32_t>(c.int32_false_true[i]);
  if (!c.fp32_false_true.empty()) return Bytes<float>(c.fp32_false_true[i]);
  return Bytes<uint8_t>(c.bool_false_true[i] ? 1 : 0);
}

SteadyClock::duration Chrono(uint64_t us) { return std::chrono::microseconds(us); }

}  // namespace

std::vector<TensorSpec> SequenceQueue::ClientInputs(const config::SequenceBatchingConfig& config,
                                                    const std::vector<TensorSpec>& model_inputs) {
  std::vector<TensorSpec> out;
  for (const TensorSpec& s : model_inputs) {
    if (std::none_of(config.control_input.begin(), config.control_input.end(),
                     [&](const config::SequenceControlInput& c) { return c.name == s.name; })) {
      out.push_back(s);
    }
  }
  return out;
}

StatusOr<std::unique_ptr<SequenceQueue>> SequenceQueue::Create(Options options) {
  for (size_t i = 0; i < options.config.control_input.size(); ++i) {
    const config::SequenceControlInput& in = options.config.control_input[i];
    KILN_CHECK(in.control.size() == 1, "config validation allows one control per input");
    const config::SequenceControlConfig& c = in.control[0];
    const std::string where = StrCat("sequence_batching.control_input[", i, "] (`", in.name, "`, ",
                                     config::SequenceControlKindName(c.kind), ")");
    auto spec = std::find_if(options.model_inputs.begin(), options.model_inputs.end(),
                             [&](const TensorSpec& s) { return s.name == in.name; });
    if (spec == options.model_inputs.end()) {
      std::vector<std::string> names;
      for (const TensorSpec& s : options.model_inputs) names.push_back(s.name);
      return InvalidArgument(where, ": model '", options.model_name, "' has no input '", in.name,
                             "'; its inputs are ", absl::StrJoin(names, ", "));
    }
    const DataType want = ControlType(c);
    if (spec->datatype != want) {
      return InvalidArgument(where, ": the control gives ", DataTypeName(want),
                             " values but input '", in.name, "' is ", DataTypeName(spec->datatype));
    }
    if (spec->any_rank || spec->dims != std::vector<int64_t>{1}) {
      return InvalidArgument(where, ": input '", in.name, "' must have dims [1] to take a control");
    }
  }
  return std::unique_ptr<SequenceQueue>(new SequenceQueue(std::move(options)));
}

SequenceQueue::SequenceQueue(Options options) : options_(std::move(options)) {
  for (const config::SequenceControlInput& in : options_.config.control_input) {
    const config::SequenceControlConfig& c = in.control[0];
    Control control{c.kind, in.name, ControlType(c), {}, {}};
    if (c.kind != Kind::kCorrid) {
      control.false_bytes = ControlValue(c, 0);
      control.true_bytes = ControlValue(c, 1);
    }
    controls_.push_back(std::move(control));
  }
  const bool oldest = options_.config.strategy == config::SequenceBatchingConfig::Strategy::kOldest;
  slots_per_instance_ = oldest ? options_.config.oldest_max_candidate_sequences
                               : std::max(1, options_.max_batch_size);
  slot_owner_.assign(static_cast<size_t>(slots_per_instance_ * options_.instance_count), "");
  running_.resize(static_cast<size_t>(options_.instance_count));
}

std::string SequenceQueue::Key(const InferenceRequest::Sequence& s) {
  // Integer and string ids are different sequences (1 is not "1"), as in Triton.
  return s.string_id.empty() ? StrCat("#", s.id) : StrCat("$", s.string_id);
}

int SequenceQueue::SlotOf(const InferenceRequest::Sequence& s) const {
  auto it = sequences_.find(Key(s));
  return it == sequences_.end() ? -1 : it->second.slot;
}

Status SequenceQueue::Enqueue(std::unique_ptr<InferenceRequest>& request,
                              SteadyClock::time_point now) {
  InferenceRequest& r = *request;
  const std::string& model = options_.model_name;
  if (!r.sequence.has_id()) {
    return InvalidArgument("inference request to model '", model,
                           "' must specify a non-zero or non-empty correlation ID (the "
                           "`sequence_id` parameter): it is a sequence model");
  }
  if (r.batch_size != 1) {
    return InvalidArgument("inference request to model '", model, "' has batch size ", r.batch_size,
                           "; the sequence batcher takes batch size 1 (one request per sequence "
                           "step)");
  }
  const std::string display = r.sequence.string_id.empty()
                                  ? StrCat(r.sequence.id)
                                  : StrCat("\"", r.sequence.string_id, "\"");
  for (const Control& c : controls_) {
    if (c.kind != Kind::kCorrid || c.datatype == DataType::kBytes) continue;
    if (!r.sequence.string_id.empty()) {
      return InvalidArgument("sequence ", display, ": model '", model,
                             "' takes integer sequence ids (its CORRID control input '", c.name,
                             "' is ", DataTypeName(c.datatype), ")");
    }
    const uint64_t max = c.datatype == DataType::kUint64   ? std::numeric_limits<uint64_t>::max()
                         : c.datatype == DataType::kInt64  ? std::numeric_limits<int64_t>::max()
                         : c.datatype == DataType::kUint32 ? std::numeric_limits<uint32_t>::max()
                                                           : std::numeric_limits<int32_t>::max();
    if (r.sequence.id > max) {
      return InvalidArgument("sequence id ", r.sequence.id, " does not fit model '", model,
                             "''s CORRID control input '", c.name, "' (", DataTypeName(c.datatype),
                             ", at most ", max, ")");
    }
  }
  const std::string key = Key(r.sequence);
  auto it = sequences_.find(key);
  if (!r.sequence.start && (it == sequences_.end() || !it->second.open)) {
    return InvalidArgument(
        "inference request for sequence ", display, " to model '", model,
        "' must specify the START flag on the first request of the sequence (the sequence "
        "was never started, has ended, or was released after ",
        options_.config.max_sequence_idle_microseconds,
        " us without requests: max_sequence_idle_microseconds)");
  }
  if (it == sequences_.end()) {
    it = sequences_.emplace(key, Sequence{}).first;
    it->second.display = display;
    it->second.id = r.sequence.id;
    it->second.string_id = r.sequence.string_id;
    AssignSlot(key, it->second);
    PublishGauge();
  }
  Sequence& seq = it->second;
  seq.open = !r.sequence.end;
  seq.last_active = now;
  r.enqueued_at = now;
  seq.queued.push_back(std::move(request));
  ++size_;
  return OkStatus();
}

void SequenceQueue::AssignSlot(const std::string& key, Sequence& seq) {
  for (size_t s = 0; s < slot_owner_.size(); ++s) {
    if (slot_owner_[s].empty()) {
      slot_owner_[s] = key;
      seq.slot = static_cast<int>(s);
      return;
    }
  }
  seq.slot = -1;
  backlog_.push_back(key);
}

void SequenceQueue::Release(std::map<std::string, Sequence>::iterator it) {
  const int slot = it->second.slot;
  if (slot < 0) {
    std::erase(backlog_, it->first);
  } else {
    slot_owner_[static_cast<size_t>(slot)].clear();
  }
  sequences_.erase(it);
  if (slot >= 0 && !backlog_.empty()) {
    // The oldest waiting sequence takes the slot; its idle clock starts now that it can run.
    const std::string next = backlog_.front();
    backlog_.pop_front();
    Sequence& seq = sequences_.at(next);
    slot_owner_[static_cast<size_t>(slot)] = next;
    seq.slot = slot;
  }
  PublishGauge();
}

void SequenceQueue::PublishGauge() {
  if (options_.stats) options_.stats->SetSequencesActive(sequences_.size());
}

std::vector<RequestQueue::Completion> SequenceQueue::Expire(SteadyClock::time_point now) {
  std::vector<Completion> out;
  const auto idle = Chrono(options_.config.max_sequence_idle_microseconds);
  for (auto it = sequences_.begin(); it != sequences_.end();) {
    Sequence& seq = it->second;
    for (auto q = seq.queued.begin(); q != seq.queued.end();) {
      if ((*q)->cancel->cancelled()) {
        out.emplace_back(std::move(*q), Cancelled("request cancelled by the client"));
        q = seq.queued.erase(q);
        --size_;
      } else {
        ++q;
      }
    }
    if (seq.queued.empty() && !seq.running && (!seq.open || now - seq.last_active >= idle)) {
      if (seq.open) {
        spdlog::info("model '{}': sequence {} released after {} us without requests",
                     options_.model_name, seq.display,
                     options_.config.max_sequence_idle_microseconds);
      }
      Release(it++);
    } else {
      ++it;
    }
  }
  return out;
}

std::optional<SteadyClock::time_point> SequenceQueue::NextDeadline() const {
  std::optional<SteadyClock::time_point> out;
  const auto idle = Chrono(options_.config.max_sequence_idle_microseconds);
  for (const auto& [key, seq] : sequences_) {
    if (!seq.queued.empty() || seq.running) continue;
    // An ended sequence (its END cancelled in the queue) is due at once.
    const auto t = seq.open ? seq.last_active + idle : seq.last_active;
    if (!out || t < *out) out = t;
  }
  return out;
}

Status SequenceQueue::AddControls(InferenceRequest& r, const Sequence& seq) const {
  if (controls_.empty()) return OkStatus();
  const std::vector<int64_t> shape =
      options_.max_batch_size > 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{1};
  std::vector<HostTensor> inputs;
  inputs.reserve(options_.model_inputs.size());
  for (const TensorSpec& spec : options_.model_inputs) {
    auto control = std::find_if(controls_.begin(), controls_.end(),
                                [&](const Control& c) { return c.name == spec.name; });
    if (control == controls_.end()) {
      auto given = std::find_if(r.inputs.begin(), r.inputs.end(),
                                [&](const HostTensor& t) { return t.name == spec.name; });
      if (given != r.inputs.end()) inputs.push_back(std::move(*given));
      continue;
    }
    HostTensor t{control->name, control->datatype, shape, {}};
    switch (control->kind) {
      case Kind::kStart:
        t.data = r.sequence.start ? control->true_bytes : control->false_bytes;
        break;
      case Kind::kEnd:
        t.data = r.sequence.end ? control->true_bytes : control->false_bytes;
        break;
      case Kind::kReady:
        t.data = control->true_bytes;
        break;
      case Kind::kCorrid:
        switch (control->datatype) {
          case DataType::kUint64:
            t.data = Bytes<uint64_t>(seq.id);
            break;
          case DataType::kInt64:
            t.data = Bytes<int64_t>(static_cast<int64_t>(seq.id));
            break;
          case DataType::kUint32:
            t.data = Bytes<uint32_t>(static_cast<uint32_t>(seq.id));
            break;
          case DataType::kInt32:
            t.data = Bytes<int32_t>(static_cast<int32_t>(seq.id));
            break;
          default: {  // BYTES: one length-prefixed element
            const std::string s = seq.string_id.empty() ? StrCat(seq.id) : seq.string_id;
            t.data = Bytes<uint32_t>(static_cast<uint32_t>(s.size())) + s;
          }
        }
        break;
    }
    inputs.push_back(std::move(t));
  }
  r.inputs = std::move(inputs);
  return OkStatus();
}

RequestQueue::Decision SequenceQueue::Next(SteadyClock::time_point now, int instance) {
  Decision d;
  if (!running_[static_cast<size_t>(instance)].empty()) return d;  // still running a batch
  // The instance's sequences with a request that may run now.
  std::vector<Sequence*> ready;
  for (int s = instance * slots_per_instance_; s < (instance + 1) * slots_per_instance_; ++s) {
    const std::string& key = slot_owner_[static_cast<size_t>(s)];
    if (key.empty()) continue;
    Sequence& seq = sequences_.at(key);
    if (!seq.running && !seq.queued.empty()) ready.push_back(&seq);
  }
  if (ready.empty()) return d;
  const config::SequenceBatchingConfig& cfg = options_.config;
  const bool oldest = cfg.strategy == config::SequenceBatchingConfig::Strategy::kOldest;
  if (oldest) {
    std::stable_sort(ready.begin(), ready.end(), [](const Sequence* a, const Sequence* b) {
      return a->queued.front()->enqueued_at < b->queued.front()->enqueued_at;
    });
  }
  // Requests that may share a batch with the first (same non-batch shapes).
  const size_t limit = static_cast<size_t>(std::max(1, options_.max_batch_size));
  std::vector<Sequence*> chosen;
  for (Sequence* seq : ready) {
    if (chosen.size() == limit) break;
    if (chosen.empty() || BatchCompatible(*chosen.front()->queued.front(), *seq->queued.front())) {
      chosen.push_back(seq);
    }
  }
  SteadyClock::time_point first = chosen.front()->queued.front()->enqueued_at;
  for (const Sequence* seq : chosen) first = std::min(first, seq->queued.front()->enqueued_at);
  if (oldest) {
    const uint64_t delay = cfg.oldest_max_queue_delay_microseconds;
    const auto& preferred = cfg.oldest_preferred_batch_size;
    const bool send = chosen.size() == limit ||
                      chosen.size() == static_cast<size_t>(slots_per_instance_) ||
                      std::find(preferred.begin(), preferred.end(),
                                static_cast<int>(chosen.size())) != preferred.end() ||
                      now >= first + Chrono(delay);
    if (!send) {
      d.retry_at = first + Chrono(delay);
      return d;
    }
  } else if (cfg.direct_max_queue_delay_microseconds > 0 &&
             static_cast<double>(chosen.size()) <
                 cfg.direct_minimum_slot_utilization * slots_per_instance_ &&
             now < first + Chrono(cfg.direct_max_queue_delay_microseconds)) {
    d.retry_at = first + Chrono(cfg.direct_max_queue_delay_microseconds);
    return d;
  }
  for (Sequence* seq : chosen) {
    std::unique_ptr<InferenceRequest> r = std::move(seq->queued.front());
    seq->queued.pop_front();
    --size_;
    seq->running = true;
    running_[static_cast<size_t>(instance)].push_back(Key(r->sequence));
    // Controls were checked against the model at Create; adding them cannot fail.
    KILN_CHECK(AddControls(*r, *seq).ok(), "control inputs were validated at load");
    d.batch.push_back(std::move(r));
  }
  return d;
}

void SequenceQueue::Finished(int instance, SteadyClock::time_point now) {
  std::vector<std::string>& keys = running_[static_cast<size_t>(instance)];
  for (const std::string& key : keys) {
    auto it = sequences_.find(key);
    if (it == sequences_.end()) continue;
    Sequence& seq = it->second;
    seq.running = false;
    seq.last_active = now;
    // Its END has run and nothing restarted it: the slot goes to the next sequence.
    if (!seq.open && seq.queued.empty()) Release(it);
  }
  keys.clear();
}

std::vector<std::unique_ptr<InferenceRequest>> SequenceQueue::TakeAll() {
  std::vector<std::unique_ptr<InferenceRequest>> out;
  for (auto& [key, seq] : sequences_) {
    for (auto& r : seq.queued) out.push_back(std::move(r));
    seq.queued.clear();
  }
  size_ = 0;
  return out;
}

}  // namespace kiln
