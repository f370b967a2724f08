#include "server/kserve_codec.h"

#include <cstring>
#include <limits>

#include "engine/base/json_parse.h"
#include "nlohmann/json.hpp"

namespace kiln {
namespace {

template <typename T>
void AppendRaw(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// Narrows `values` to T, refusing values out of T's range.
template <typename T, typename Src>
Status AppendNarrowed(const google::protobuf::RepeatedField<Src>& values, std::string& out,
                      std::string_view input, std::string_view type) {
  out.reserve(out.size() + values.size() * sizeof(T));
  for (int i = 0; i < values.size(); ++i) {
    const Src v = values[i];
    if (v < static_cast<Src>(std::numeric_limits<T>::min()) ||
        v > static_cast<Src>(std::numeric_limits<T>::max())) {
      return InvalidArgument("input '", ToAbsl(input), "': element ", i, " is ", v,
                             ", out of range for ", ToAbsl(type));
    }
    AppendRaw(out, static_cast<T>(v));
  }
  return OkStatus();
}

// Which typed field carries a datatype, and the number of elements present in it.
struct TypedField {
  const char* name;
  int count;
};

TypedField FieldFor(DataType t, const inference::InferTensorContents& c) {
  switch (t) {
    case DataType::kBool:
      return {"bool_contents", c.bool_contents_size()};
    case DataType::kInt8:
    case DataType::kInt16:
    case DataType::kInt32:
      return {"int_contents", c.int_contents_size()};
    case DataType::kInt64:
      return {"int64_contents", c.int64_contents_size()};
    case DataType::kUint8:
    case DataType::kUint16:
    case DataType::kUint32:
      return {"uint_contents", c.uint_contents_size()};
    case DataType::kUint64:
      return {"uint64_contents", c.uint64_contents_size()};
    case DataType::kFp32:
      return {"fp32_contents", c.fp32_contents_size()};
    case DataType::kFp64:
      return {"fp64_contents", c.fp64_contents_size()};
    case DataType::kBytes:
      return {"bytes_contents", c.bytes_contents_size()};
    default:
      return {nullptr, 0};
  }
}

int TotalTypedElements(const inference::InferTensorContents& c) {
  return c.bool_contents_size() + c.int_contents_size() + c.int64_contents_size() +
         c.uint_contents_size() + c.uint64_contents_size() + c.fp32_contents_size() +
         c.fp64_contents_size() + c.bytes_contents_size();
}

Status TypedToRaw(const inference::ModelInferRequest::InferInputTensor& in, DataType t,
                  int64_t elements, std::string& raw) {
  const auto& c = in.contents();
  const std::string& name = in.name();
  if (t == DataType::kFp16 || t == DataType::kBf16) {
    return InvalidArgument("input '", name, "' is ", DataTypeName(t),
                           ", which has no typed contents field: send it in raw_input_contents");
  }
  TypedField field = FieldFor(t, c);
  if (field.count != TotalTypedElements(c)) {
    return InvalidArgument("input '", name, "' of datatype ", DataTypeName(t),
                           " must carry its values in contents.", field.name,
                           " and no other contents field");
  }
  if (field.count != elements) {
    return InvalidArgument(
        "input '", name, "' has ", field.count, " elements in contents.", field.name,
        " but its shape ",
        ShapeToString(std::vector<int64_t>(in.shape().begin(), in.shape().end())), " has ",
        elements);
  }
  switch (t) {
    case DataType::kBool:
      for (bool v : c.bool_contents()) raw.push_back(v ? 1 : 0);
      return OkStatus();
    case DataType::kInt8:
      return AppendNarrowed<int8_t>(c.int_contents(), raw, name, "INT8");
    case DataType::kInt16:
      return AppendNarrowed<int16_t>(c.int_contents(), raw, name, "INT16");
    case DataType::kInt32:
      return AppendNarrowed<int32_t>(c.int_contents(), raw, name, "INT32");
    case DataType::kInt64:
      return AppendNarrowed<int64_t>(c.int64_contents(), raw, name, "INT64");
    case DataType::kUint8:
      return AppendNarrowed<uint8_t>(c.uint_contents(), raw, name, "UINT8");
    case DataType::kUint16:
      return AppendNarrowed<uint16_t>(c.uint_contents(), raw, name, "UINT16");
    case DataType::kUint32:
      return AppendNarrowed<uint32_t>(c.uint_contents(), raw, name, "UINT32");
    case DataType::kUint64:
      return AppendNarrowed<uint64_t>(c.uint64_contents(), raw, name, "UINT64");
    case DataType::kFp32:
      raw.append(reinterpret_cast<const char*>(c.fp32_contents().data()),
                 4 * c.fp32_contents_size());
      return OkStatus();
    case DataType::kFp64:
      raw.append(reinterpret_cast<const char*>(c.fp64_contents().data()),
                 8 * c.fp64_contents_size());
      return OkStatus();
    case DataType::kBytes:
      for (const std::string& s : c.bytes_contents()) {
        if (s.size() > std::numeric_limits<uint32_t>::max()) {
          return InvalidArgument("input '", name, "': a BYTES element exceeds 4 GiB");
        }
        AppendRaw(raw, static_cast<uint32_t>(s.size()));
        raw += s;
      }
      return OkStatus();
    default:
      return InvalidArgument("input '", name, "': unsupported datatype");
  }
}

StatusOr<ParamValue> FromWire(const inference::InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam:
      return ParamValue(p.bool_param());
    case inference::InferParameter::kInt64Param:
      return ParamValue(p.int64_param());
    case inference::InferParameter::kUint64Param:
      return ParamValue(p.uint64_param());
    case inference::InferParameter::kDoubleParam:
      return ParamValue(p.double_param());
    case inference::InferParameter::kStringParam:
      return ParamValue(p.string_param());
    default:
      return InvalidArgument("parameter without a value");
  }
}

// A non-negative integer parameter, or InvalidArgument naming it.
StatusOr<uint64_t> NonNegativeInteger(std::string_view key, const ParamValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) {
    if (*i < 0) {
      return InvalidArgument("parameter '", ToAbsl(key), "' is ", *i, "; it must not be negative");
    }
    return static_cast<uint64_t>(*i);
  }
  if (const auto* u = std::get_if<uint64_t>(&v)) return *u;
  return InvalidArgument("parameter '", ToAbsl(key), "' must be an integer");
}

DataType ToWireOrder(DataType t) { return t; }

inference::DataType ToConfigType(DataType t) {
  switch (t) {
    case DataType::kBool:
      return inference::TYPE_BOOL;
    case DataType::kUint8:
      return inference::TYPE_UINT8;
    case DataType::kUint16:
      return inference::TYPE_UINT16;
    case DataType::kUint32:
      return inference::TYPE_UINT32;
    case DataType::kUint64:
      return inference::TYPE_UINT64;
    case DataType::kInt8:
      return inference::TYPE_INT8;
    case DataType::kInt16:
      return inference::TYPE_INT16;
    case DataType::kInt32:
      return inference::TYPE_INT32;
    case DataType::kInt64:
      return inference::TYPE_INT64;
    case DataType::kFp16:
      return inference::TYPE_FP16;
    case DataType::kFp32:
      return inference::TYPE_FP32;
    case DataType::kFp64:
      return inference::TYPE_FP64;
    case DataType::kBytes:
      return inference::TYPE_STRING;
    case DataType::kBf16:
      return inference::TYPE_BF16;
    default:
      return inference::TYPE_INVALID;
  }
}

void FillDuration(const DurationStat& d, inference::StatisticDuration* wire) {
  wire->set_count(d.count);
  wire->set_ns(d.ns);
}

void FillSequenceBatching(const config::SequenceBatchingConfig& sb, inference::ModelConfig* wire) {
  using Wire = inference::ModelSequenceBatching;
  auto* w = wire->mutable_sequence_batching();
  w->set_max_sequence_idle_microseconds(sb.max_sequence_idle_microseconds);
  if (sb.strategy == config::SequenceBatchingConfig::Strategy::kDirect) {
    w->mutable_direct()->set_max_queue_delay_microseconds(sb.direct_max_queue_delay_microseconds);
    w->mutable_direct()->set_minimum_slot_utilization(
        static_cast<float>(sb.direct_minimum_slot_utilization));
  } else {
    auto* o = w->mutable_oldest();
    o->set_max_candidate_sequences(sb.oldest_max_candidate_sequences);
    for (int p : sb.oldest_preferred_batch_size) o->add_preferred_batch_size(p);
    o->set_max_queue_delay_microseconds(sb.oldest_max_queue_delay_microseconds);
    o->set_preserve_ordering(sb.oldest_preserve_ordering);
  }
  for (const config::SequenceControlInput& in : sb.control_input) {
    auto* wi = w->add_control_input();
    wi->set_name(in.name);
    for (const config::SequenceControlConfig& c : in.control) {
      auto* wc = wi->add_control();
      wc->set_kind(static_cast<Wire::Control::Kind>(c.kind));  // same order as Triton's enum
      for (int32_t v : c.int32_false_true) wc->add_int32_false_true(v);
      for (float v : c.fp32_false_true) wc->add_fp32_false_true(v);
      for (bool v : c.bool_false_true) wc->add_bool_false_true(v);
      if (!c.data_type.empty()) {
        inference::DataType t = inference::TYPE_INVALID;
        inference::DataType_Parse(c.data_type, &t);
        wc->set_data_type(t);
      }
    }
  }
}

}  // namespace

Status ApplyRequestParameter(std::string_view key, const ParamValue& value,
                             InferenceRequest& request) {
  if (key == "priority") {
    KILN_ASSIGN_OR_RETURN(request.priority, NonNegativeInteger(key, value));
  } else if (key == "timeout") {
    KILN_ASSIGN_OR_RETURN(uint64_t us, NonNegativeInteger(key, value));
    if (us > kMaxRequestTimeoutUs) {
      return InvalidArgument("parameter 'timeout' is ", us, " microseconds; the maximum is ",
                             kMaxRequestTimeoutUs, " (one hour)");
    }
    request.timeout_us = us;
  } else if (key == "sequence_id") {
    // tritonclient sends an integer id as int64 and a string id as a string.
    if (const auto* str = std::get_if<std::string>(&value)) {
      request.sequence.string_id = *str;
      request.sequence.id = 0;
    } else {
      KILN_ASSIGN_OR_RETURN(request.sequence.id, NonNegativeInteger(key, value));
      request.sequence.string_id.clear();
    }
  } else if (key == "sequence_start" || key == "sequence_end") {
    const auto* flag = std::get_if<bool>(&value);
    if (flag == nullptr) return InvalidArgument("parameter '", ToAbsl(key), "' must be a boolean");
    (key == "sequence_start" ? request.sequence.start : request.sequence.end) = *flag;
  }
  return OkStatus();
}

StatusOr<bool> TakeShmParam(std::string_view what, std::string_view key, const ParamValue& value,
                            ShmParams& p) {
  if (key == "shared_memory_region") {
    const auto* s = std::get_if<std::string>(&value);
    if (s == nullptr) {
      return InvalidArgument(what, ": parameter 'shared_memory_region' must be a string");
    }
    p.region = *s;
    return true;
  }
  if (key != "shared_memory_byte_size" && key != "shared_memory_offset") return false;
  auto v = NonNegativeInteger(key, value);
  if (!v.ok()) return Annotate(v.status(), what);
  (key == "shared_memory_offset" ? p.offset : p.byte_size) = *v;
  return true;
}

StatusOr<std::optional<SharedMemoryBlock>> ResolveShm(const SharedMemoryManager* shm,
                                                      std::string_view what, const ShmParams& p) {
  if (!p.any()) return std::optional<SharedMemoryBlock>();
  if (!p.region || !p.byte_size) {
    return InvalidArgument(what,
                           ": shared memory needs both parameters shared_memory_region and "
                           "shared_memory_byte_size (shared_memory_offset is optional)");
  }
  if (shm == nullptr) {
    return InvalidArgument(what, ": shared memory region '", *p.region, "' is not registered");
  }
  KILN_ASSIGN_OR_RETURN(SharedMemoryBlock b,
                        shm->Block(*p.region, p.offset.value_or(0), *p.byte_size, what));
  return std::optional<SharedMemoryBlock>(std::move(b));
}

Status ReadShmInput(const SharedMemoryBlock& block, HostTensor& t, uint64_t* budget) {
  const int64_t elem = DataTypeSize(t.datatype);
  const auto elements = ElementCount(t.shape);
  if (elem > 0 && elements &&
      (*elements > std::numeric_limits<int64_t>::max() / elem ||
       block.size != static_cast<uint64_t>(*elements * elem))) {
    return InvalidArgument("input '", t.name, "': shared_memory_byte_size is ", block.size,
                           " (shared memory region '", block.region, "') but shape ",
                           ShapeToString(t.shape), " of ", DataTypeName(t.datatype), " has ",
                           *elements, " x ", elem, " bytes");
  }
  if (block.size > *budget) {
    return InvalidArgument("input '", t.name, "': ", block.size,
                           " bytes from shared memory region '", block.region,
                           "' are more than the request may read from shared memory (", *budget,
                           " bytes left of the server's largest request, server.grpc."
                           "max_message_bytes / server.http.max_body_bytes)");
  }
  *budget -= block.size;
  KILN_ASSIGN_OR_RETURN(t.data, block.Read());
  return OkStatus();
}

Status CheckShmOutputsDisjoint(const ShmOutputs& outputs) {
  if (outputs.size() < 2) return OkStatus();
  std::vector<SharedMemoryBlock> blocks;
  std::vector<std::string> what;
  for (const auto& o : outputs) {
    blocks.push_back(o.block);
    what.push_back(StrCat("output '", o.name, "'"));
  }
  return CheckDisjoint(blocks, what);
}

const ShmOutput* FindShmOutput(const ShmOutputs* targets, std::string_view name) {
  if (targets == nullptr) return nullptr;
  for (const auto& t : *targets) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

Status WriteShmOutputs(const ShmOutputs& targets, const std::vector<HostTensor>& outputs) {
  for (const HostTensor& t : outputs) {
    const ShmOutput* target = FindShmOutput(&targets, t.name);
    if (target != nullptr && t.data.size() > target->block.size) {
      return InvalidArgument("output '", t.name, "' has ", t.data.size(),
                             " bytes but shared_memory_byte_size is ", target->block.size,
                             " (shared memory region '", target->block.region,
                             "'); give the output at least ", t.data.size(), " bytes");
    }
  }
  for (const HostTensor& t : outputs) {
    if (const ShmOutput* target = FindShmOutput(&targets, t.name)) {
      KILN_RETURN_IF_ERROR(target->block.Write(t.data));
    }
  }
  return OkStatus();
}

Status RefuseShmOutputs(const ShmOutputs& outputs, const std::string& model) {
  if (outputs.empty()) return OkStatus();
  return InvalidArgument("output '", outputs.front().name, "': model '", model,
                         "' is an LLM, whose outputs cannot be written to shared memory (region '",
                         outputs.front().block.region, "'); request them without shared memory");
}

StatusOr<std::unique_ptr<InferenceRequest>> DecodeInferRequest(inference::ModelInferRequest& wire,
                                                               const SharedMemoryManager* shm,
                                                               ShmOutputs* shm_outputs) {
  auto req = std::make_unique<InferenceRequest>();
  req->model_name = wire.model_name();
  req->model_version = wire.model_version();
  req->id = wire.id();
  for (const auto& [key, param] : wire.parameters()) {
    KILN_ASSIGN_OR_RETURN(ParamValue v, FromWire(param));
    KILN_RETURN_IF_ERROR(ApplyRequestParameter(key, v, *req));
  }
  // Shared-memory inputs first: they have no raw_input_contents entry.
  std::vector<std::optional<SharedMemoryBlock>> in_shm(wire.inputs_size());
  uint64_t shm_budget = shm != nullptr ? shm->max_input_bytes() : 0;
  int raw_expected = 0;
  for (int i = 0; i < wire.inputs_size(); ++i) {
    const auto& in = wire.inputs(i);
    const std::string what = StrCat("input '", in.name(), "'");
    ShmParams p;
    for (const auto& [key, param] : in.parameters()) {
      KILN_ASSIGN_OR_RETURN(ParamValue v, FromWire(param));
      KILN_RETURN_IF_ERROR(TakeShmParam(what, key, v, p).status());
    }
    KILN_ASSIGN_OR_RETURN(in_shm[i], ResolveShm(shm, what, p));
    if (in_shm[i] && TotalTypedElements(in.contents()) > 0) {
      return InvalidArgument(what, " is in shared memory region '", in_shm[i]->region,
                             "' but also has contents; send one or the other");
    }
    if (!in_shm[i]) ++raw_expected;
  }
  const bool raw = wire.raw_input_contents_size() > 0;
  if (raw && wire.raw_input_contents_size() != raw_expected) {
    const bool all_raw = raw_expected == wire.inputs_size();
    return InvalidArgument(
        "the request has ", raw_expected, " inputs", all_raw ? "" : " not in shared memory",
        " but ", wire.raw_input_contents_size(),
        " raw_input_contents entries; there must be one per ", all_raw ? "input" : "such input");
  }
  req->inputs.reserve(wire.inputs_size());
  int raw_index = 0;
  for (int i = 0; i < wire.inputs_size(); ++i) {
    auto& in = *wire.mutable_inputs(i);
    auto type = ParseDataType(in.datatype());
    if (!type) {
      return InvalidArgument("input '", in.name(), "' has unknown datatype '", in.datatype(),
                             "'; expected one of ", AllDataTypeNames());
    }
    HostTensor t;
    t.name = in.name();
    t.datatype = *type;
    t.shape.assign(in.shape().begin(), in.shape().end());
    auto elements = ElementCount(t.shape);
    if (!elements) {
      return InvalidArgument("input '", in.name(), "' has shape ", ShapeToString(t.shape),
                             ": dimensions must be non-negative and the element count must "
                             "fit in 64 bits");
    }
    if (in_shm[i]) {
      KILN_RETURN_IF_ERROR(ReadShmInput(*in_shm[i], t, &shm_budget));
    } else if (raw) {
      if (TotalTypedElements(in.contents()) > 0) {
        return InvalidArgument("input '", in.name(),
                               "' has typed contents but the request also uses "
                               "raw_input_contents; use one or the other for all inputs");
      }
      // The request message is ours until the RPC finishes: take its bytes without a copy.
      t.data.swap(*wire.mutable_raw_input_contents(raw_index++));
    } else {
      KILN_RETURN_IF_ERROR(TypedToRaw(in, *type, *elements, t.data));
    }
    req->inputs.push_back(std::move(t));
  }
  for (const auto& out : wire.outputs()) {
    const std::string what = StrCat("output '", out.name(), "'");
    ShmParams p;
    for (const auto& [key, param] : out.parameters()) {
      if (key == "classification") {
        return InvalidArgument(what, ": the classification extension is not supported by Kiln");
      }
      KILN_ASSIGN_OR_RETURN(ParamValue v, FromWire(param));
      KILN_RETURN_IF_ERROR(TakeShmParam(what, key, v, p).status());
    }
    KILN_ASSIGN_OR_RETURN(auto block, ResolveShm(shm, what, p));
    if (block) {
      KILN_CHECK(shm_outputs != nullptr, "DecodeInferRequest: shm given without shm_outputs");
      shm_outputs->push_back({out.name(), *std::move(block)});
    }
    req->requested_outputs.push_back(out.name());
  }
  if (shm_outputs != nullptr) KILN_RETURN_IF_ERROR(CheckShmOutputsDisjoint(*shm_outputs));
  return req;
}

void EncodeInferResponse(const std::string& model_name, const std::string& id,
                         InferenceResponse&& response, inference::ModelInferResponse* wire,
                         const ShmOutputs* shm_outputs) {
  wire->set_model_name(model_name);
  wire->set_model_version(std::string(kModelVersion));
  wire->set_id(id);
  for (HostTensor& t : response.outputs) {
    auto* out = wire->add_outputs();
    out->set_name(t.name);
    out->set_datatype(std::string(DataTypeName(ToWireOrder(t.datatype))));
    for (int64_t d : t.shape) out->add_shape(d);
    if (const ShmOutput* shm = FindShmOutput(shm_outputs, t.name)) {
      auto& params = *out->mutable_parameters();
      params["shared_memory_region"].set_string_param(shm->block.region);
      params["shared_memory_byte_size"].set_int64_param(static_cast<int64_t>(t.data.size()));
      params["shared_memory_offset"].set_int64_param(static_cast<int64_t>(shm->block.offset));
      wire->add_raw_output_contents();
      continue;
    }
    wire->add_raw_output_contents(std::move(t.data));
  }
}

StatusOr<config::ModelConfig> ParseLoadConfig(const std::string& name, const std::string& text,
                                              const config::ModelConfig* current) {
  KILN_ASSIGN_OR_RETURN(
      nlohmann::json j,
      ParseJsonObject(
          text,
          StrCat("parameter 'config' of the load request for '", name, "' (",
                 current ? "the keys of its `models:` entry to change" : "one entry of `models:`",
                 ")"),
          "config."));
  if (auto it = j.find("name"); it != j.end() && *it != name) {
    return InvalidArgument("parameter 'config' names model ", it->dump(),
                           " but the request loads '", name, "'");
  }
  // The text itself is parsed (not j.dump()): error positions then point into what was sent.
  const std::string where = StrCat("<load ", name, ">");
  if (current) return config::MergeModelConfig(*current, text, where);
  if (!j.contains("name")) {
    j["name"] = name;
    return config::ParseModelConfig(j.dump(), where);
  }
  return config::ParseModelConfig(text, where);
}

std::vector<int64_t> MetadataShape(const ModelSignature& sig, const TensorSpec& spec) {
  std::vector<int64_t> shape;
  if (sig.max_batch_size > 0) shape.push_back(-1);
  if (spec.any_rank) {
    shape.push_back(-1);
  } else {
    shape.insert(shape.end(), spec.dims.begin(), spec.dims.end());
  }
  return shape;
}

void FillModelMetadata(const Model& model, inference::ModelMetadataResponse* wire) {
  const ModelSignature& sig = model.signature();
  wire->set_name(model.name());
  wire->add_versions(std::string(kModelVersion));
  wire->set_platform(model.platform());
  auto fill = [&](const TensorSpec& spec, inference::ModelMetadataResponse::TensorMetadata* t) {
    t->set_name(spec.name);
    t->set_datatype(std::string(DataTypeName(spec.datatype)));
    for (int64_t d : MetadataShape(sig, spec)) t->add_shape(d);
  };
  for (const auto& s : sig.inputs) fill(s, wire->add_inputs());
  for (const auto& s : sig.outputs) fill(s, wire->add_outputs());
}

void FillModelConfig(const Model& model, inference::ModelConfig* wire) {
  const ModelSignature& sig = model.signature();
  const config::ModelConfig& cfg = model.config();
  wire->set_name(model.name());
  wire->set_platform(model.platform());
  wire->set_backend("kiln");
  wire->set_max_batch_size(sig.max_batch_size);
  // LLMs follow Triton's decoupled convention too (streamed text).
  if (sig.decoupled || model.is_llm()) {
    wire->mutable_model_transaction_policy()->set_decoupled(true);
  }
  for (const auto& s : sig.inputs) {
    auto* in = wire->add_input();
    in->set_name(s.name);
    in->set_data_type(ToConfigType(s.datatype));
    in->set_optional(s.optional);
    if (s.any_rank) {
      in->add_dims(-1);
    } else {
      for (int64_t d : s.dims) in->add_dims(d);
    }
  }
  for (const auto& s : sig.outputs) {
    auto* out = wire->add_output();
    out->set_name(s.name);
    out->set_data_type(ToConfigType(s.datatype));
    if (s.any_rank) {
      out->add_dims(-1);
    } else {
      for (int64_t d : s.dims) out->add_dims(d);
    }
  }
  auto* group = wire->add_instance_group();
  group->set_name(model.name());
  group->set_count(cfg.instance_count);
  group->set_kind(inference::ModelInstanceGroup::KIND_CPU);
  if (cfg.dynamic_batching) {
    const auto& b = *cfg.dynamic_batching;
    auto* db = wire->mutable_dynamic_batching();
    for (int p : b.preferred_batch_size) db->add_preferred_batch_size(p);
    db->set_max_queue_delay_microseconds(b.max_queue_delay_microseconds);
    db->set_preserve_ordering(b.preserve_ordering);
    db->set_priority_levels(b.priority_levels);
    db->set_default_priority_level(b.default_priority_level);
    auto fill_policy = [](const config::QueuePolicy& p, inference::ModelQueuePolicy* w) {
      w->set_timeout_action(p.timeout_action == config::QueuePolicy::TimeoutAction::kDelay
                                ? inference::ModelQueuePolicy::DELAY
                                : inference::ModelQueuePolicy::REJECT);
      w->set_default_timeout_microseconds(p.default_timeout_microseconds);
      w->set_allow_timeout_override(p.allow_timeout_override);
      w->set_max_queue_size(p.max_queue_size);
    };
    fill_policy(b.default_queue_policy, db->mutable_default_queue_policy());
    for (const auto& [level, policy] : b.priority_queue_policy) {
      fill_policy(policy, &(*db->mutable_priority_queue_policy())[level]);
    }
  }
  if (cfg.sequence_batching) FillSequenceBatching(*cfg.sequence_batching, wire);
  (*wire->mutable_parameters())["kind"].set_string_value(cfg.kind);
  if (!cfg.builtin.empty()) (*wire->mutable_parameters())["builtin"].set_string_value(cfg.builtin);
}

void FillModelStatistics(const Model& model, inference::ModelStatistics* wire) {
  ModelStatsSnapshot s = model.Stats();
  wire->set_name(model.name());
  wire->set_version(std::string(kModelVersion));
  wire->set_last_inference(s.last_inference_ms);
  wire->set_inference_count(s.inference_count);
  wire->set_execution_count(s.execution_count);
  auto* st = wire->mutable_inference_stats();
  FillDuration(s.success, st->mutable_success());
  FillDuration(s.fail, st->mutable_fail());
  FillDuration(s.queue, st->mutable_queue());
  FillDuration(s.compute_input, st->mutable_compute_input());
  FillDuration(s.compute_infer, st->mutable_compute_infer());
  FillDuration(s.compute_output, st->mutable_compute_output());
  st->mutable_cache_hit();
  st->mutable_cache_miss();
  for (const auto& [size, b] : s.batches) {
    auto* bs = wire->add_batch_stats();
    bs->set_batch_size(size);
    FillDuration(b.compute_input, bs->mutable_compute_input());
    FillDuration(b.compute_infer, bs->mutable_compute_infer());
    FillDuration(b.compute_output, bs->mutable_compute_output());
  }
}

}  // namespace kiln
