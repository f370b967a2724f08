#include "scheduler/model.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_join.h"
#include "scheduler/llm/continuous_batcher.h"
#include "scheduler/sequence_batcher.h"
#include "spdlog/spdlog.h"

namespace kiln {
namespace {

std::string Names(const std::vector<TensorSpec>& specs) {
  std::vector<std::string> names;
  for (const auto& s : specs) names.push_back(s.name);
  return absl::StrJoin(names, ", ");
}

// The shape a client must send: [-1, dims...] when the model batches.
std::vector<int64_t> ExpectedShape(const ModelSignature& sig, const TensorSpec& spec) {
  std::vector<int64_t> shape;
  if (sig.max_batch_size > 0) shape.push_back(-1);
  shape.insert(shape.end(), spec.dims.begin(), spec.dims.end());
  return shape;
}

Status CheckInput(const ModelSignature& sig, const TensorSpec& spec, const HostTensor& t) {
  if (t.datatype != spec.datatype) {
    return InvalidArgument("input '", spec.name, "' has datatype ", DataTypeName(t.datatype),
                           " but model '", sig.name, "' expects ", DataTypeName(spec.datatype));
  }
  for (int64_t d : t.shape) {
    if (d < 0) {
      return InvalidArgument("input '", spec.name, "' has shape ", ShapeToString(t.shape),
                             "; dimensions must not be negative");
    }
  }
  const bool batched = sig.max_batch_size > 0;
  if (batched) {
    if (t.shape.empty()) {
      return InvalidArgument("input '", spec.name, "' has no batch dimension: model '", sig.name,
                             "' expects shape ", ShapeToString(ExpectedShape(sig, spec)));
    }
    if (t.shape[0] < 1) {
      return InvalidArgument("input '", spec.name, "' has batch size 0; it must be at least 1");
    }
    if (t.shape[0] > sig.max_batch_size) {
      return InvalidArgument("input '", spec.name, "' has batch size ", t.shape[0], " (shape ",
                             ShapeToString(t.shape), ") but model '", sig.name,
                             "' accepts at most ", sig.max_batch_size, " (max_batch_size)");
    }
  }
  if (!spec.any_rank) {
    const size_t offset = batched ? 1 : 0;
    bool match = t.shape.size() == spec.dims.size() + offset;
    for (size_t i = 0; match && i < spec.dims.size(); ++i) {
      match = spec.dims[i] == -1 || spec.dims[i] == t.shape[i + offset];
    }
    if (!match) {
      return InvalidArgument(
          "input '", spec.name, "' has shape ", ShapeToString(t.shape), " but model '", sig.name,
          "' expects ", ShapeToString(ExpectedShape(sig, spec)),
          batched ? " (-1 = any size; the first dimension is the batch)" : " (-1 = any size)");
    }
  }
  auto elements = ElementCount(t.shape);
  if (!elements) {
    return InvalidArgument("input '", spec.name, "' has shape ", ShapeToString(t.shape),
                           " whose element count overflows");
  }
  if (t.datatype == DataType::kBytes) {
    auto count = CountBytesElements(t.data);
    if (!count.ok()) return Annotate(count.status(), absl::StrCat("input '", spec.name, "'"));
    if (*count != *elements) {
      return InvalidArgument("input '", spec.name, "' holds ", *count,
                             " BYTES elements but its shape ", ShapeToString(t.shape), " has ",
                             *elements);
    }
    return OkStatus();
  }
  const int64_t elem = DataTypeSize(t.datatype);
  const int64_t have = static_cast<int64_t>(t.data.size());
  if (*elements > have / elem || *elements * elem != have) {
    const bool overflow = *elements > std::numeric_limits<int64_t>::max() / elem;
    return InvalidArgument(
        "input '", spec.name, "' has ", have, " bytes of contents but shape ",
        ShapeToString(t.shape), " of ", DataTypeName(t.datatype), " needs ",
        overflow ? std::string("more than 2^63") : absl::StrCat(*elements * elem));
  }
  return OkStatus();
}

}  // namespace

Status PrepareRequest(const ModelSignature& sig, InferenceRequest& r) {
  std::vector<HostTensor> ordered(sig.inputs.size());
  std::vector<bool> seen(sig.inputs.size(), false);
  for (HostTensor& t : r.inputs) {
    auto it = std::find_if(sig.inputs.begin(), sig.inputs.end(),
                           [&](const TensorSpec& s) { return s.name == t.name; });
    if (it == sig.inputs.end()) {
      return InvalidArgument("model '", sig.name, "' has no input '", t.name, "'; its inputs are ",
                             Names(sig.inputs));
    }
    const size_t i = it - sig.inputs.begin();
    if (seen[i]) return InvalidArgument("input '", t.name, "' is given more than once");
    seen[i] = true;
    KILN_RETURN_IF_ERROR(CheckInput(sig, *it, t));
    ordered[i] = std::move(t);
  }
  for (size_t i = 0; i < sig.inputs.size(); ++i) {
    if (!seen[i] && !sig.inputs[i].optional) {
      return InvalidArgument("missing input '", sig.inputs[i].name, "': model '", sig.name,
                             "' expects ", Names(sig.inputs));
    }
  }
  // Optional inputs left out are dropped from the declared order.
  std::erase_if(ordered, [](const HostTensor& t) { return t.name.empty(); });
  r.inputs = std::move(ordered);
  r.batch_size = 1;
  if (sig.max_batch_size > 0 && !r.inputs.empty()) {
    r.batch_size = r.inputs[0].shape[0];
    for (const HostTensor& t : r.inputs) {
      if (t.shape[0] != r.batch_size) {
        return InvalidArgument("inputs disagree on the batch size: '", r.inputs[0].name, "' has ",
                               r.batch_size, ", '", t.name, "' has ", t.shape[0]);
      }
    }
  }
  for (size_t i = 0; i < r.requested_outputs.size(); ++i) {
    const std::string& name = r.requested_outputs[i];
    if (std::none_of(sig.outputs.begin(), sig.outputs.end(),
                     [&](const TensorSpec& s) { return s.name == name; })) {
      return InvalidArgument("model '", sig.name, "' has no output '", name, "'; its outputs are ",
                             Names(sig.outputs));
    }
    if (std::find(r.requested_outputs.begin(), r.requested_outputs.begin() + i, name) !=
        r.requested_outputs.begin() + i) {
      return InvalidArgument("output '", name, "' is requested more than once");
    }
  }
  return OkStatus();
}

ModelSignature LlmSignature(const std::string& name) {
  ModelSignature sig;
  sig.name = name;
  sig.max_batch_size = 0;
  sig.inputs = {{"text_input", DataType::kBytes, {1}},
                {"stream", DataType::kBool, {1}, false, /*optional=*/true},
                {"sampling_parameters", DataType::kBytes, {1}, false, /*optional=*/true},
                {"exclude_input_in_output", DataType::kBool, {1}, false, /*optional=*/true}};
  sig.outputs = {{"text_output", DataType::kBytes, {-1}}};
  return sig;
}

uint64_t LlmPrefixSeed(const config::ModelConfig& config) {
  return std::hash<std::string>{}(config.name + '\0' + config.path);
}

Model::Model(config::ModelConfig config, InferenceMetricFamilies* families)
    : config_(std::move(config)), stats_(config_.name, families) {}

Model::~Model() = default;

StatusOr<std::shared_ptr<Model>> Model::Load(const config::ModelConfig& config,
                                             const ModelDeps& deps) {
  std::shared_ptr<Model> model(new Model(config, deps.tensor_metrics));
  if (config.kind == "llm") {
    if (!deps.llm_loader) {
      return Unimplemented("model '", config.name, "': this server cannot load LLMs");
    }
    KILN_ASSIGN_OR_RETURN(std::unique_ptr<models::LlmModel> llm, deps.llm_loader(config));
    model->platform_ = "kiln_llm";
    model->signature_ = LlmSignature(config.name);
    std::unique_ptr<LlmMetrics> metrics;
    if (deps.llm_metrics) metrics = std::make_unique<LlmMetrics>(*deps.llm_metrics, config.name);
    model->llm_ = std::make_unique<ContinuousBatcher>(config.name, std::move(llm), config.scheduler,
                                                      LlmPrefixSeed(config), std::move(metrics));
    if (const std::string& draft_path = config.scheduler.speculative.draft_model;
        !draft_path.empty()) {
      // The draft model (speculative "draft"): another llm entry's settings when it names one,
      // else the model's with the path; either way without adapters or speculation of its own.
      std::optional<config::ModelConfig> named;
      if (deps.find_model && draft_path != config.name) named = deps.find_model(draft_path);
      if (named && named->kind != "llm") {
        return InvalidArgument("model '", config.name, "': scheduler.speculative.draft_model '",
                               draft_path, "' names a model of kind ", named->kind,
                               "; a draft model is a generative (kind llm) model");
      }
      config::ModelConfig dc = named ? *named : config;
      if (!named) dc.path = draft_path;
      dc.name = StrCat(config.name, ".draft");
      dc.adapters.clear();
      dc.max_loaded_adapters = 0;
      dc.sampling = "host";  // drafts are the argmax of its logits
      dc.scheduler.speculative = {};
      StatusOr<std::unique_ptr<models::LlmModel>> draft = deps.llm_loader(dc);
      if (!draft.ok()) {
        return Annotate(draft.status(), StrCat("model '", config.name, "': its draft model (",
                                               draft_path, ", scheduler.speculative.draft_model)"));
      }
      KILN_RETURN_IF_ERROR(model->llm_->SetDraftModel(*std::move(draft)));
      spdlog::info("model '{}': draft model {} ({}) for speculative decoding", config.name,
                   draft_path, dc.path);
    }
    if (deps.flight_recorder_entries > 0) {
      model->recorder_ = std::make_unique<FlightRecorder>(
          config.name, "llm",
          FlightRecorder::Options{deps.flight_recorder_entries, 1, config.scheduler.max_num_seqs,
                                  deps.watchdog_seconds});
      model->llm_->set_flight_recorder(model->recorder_.get());
    }
    model->llm_->set_trace_sink(deps.tracer);
    KILN_RETURN_IF_ERROR(Annotate(model->llm_->Start(), StrCat("model '", config.name, "'")));
    for (const config::LoraAdapterConfig& a : config.adapters) {
      StatusOr<std::shared_ptr<const models::LoraAdapter>> adapter =
          model->llm_->model().ReadAdapter(a.path);
      Status s =
          adapter.ok() ? model->llm_->AddAdapter(a.name, *std::move(adapter)) : adapter.status();
      if (!s.ok() && a.runtime) {
        spdlog::warn("model '{}': adapter '{}' ({}) is not served any more: {}", config.name,
                     a.name, a.path, s.ToString());
        continue;
      }
      KILN_RETURN_IF_ERROR(
          Annotate(s, StrCat("model '", config.name, "': adapter '", a.name, "' (", a.path, ")")));
    }
    return model;
  }
  const bool builtin = config.kind == "builtin";
  if (!builtin && !deps.tensor_loader) {
    return Unimplemented("model '", config.name, "': kind '", config.kind,
                         "' cannot be served by this build");
  }
  if (config.dynamic_batching && config.dynamic_batching->preserve_ordering &&
      (config.instance_count > 1 || config.dynamic_batching->priority_levels > 1)) {
    return InvalidArgument(
        "model '", config.name,
        "': preserve_ordering needs instance_count 1 and at most one priority level (responses "
        "are then in request order by construction); Kiln does not reorder responses");
  }
  std::vector<std::unique_ptr<TensorModel>> instances;
  for (int i = 0; i < config.instance_count; ++i) {
    auto inst = builtin ? CreateBuiltinModel(config.builtin) : deps.tensor_loader(config);
    if (!inst.ok()) return Annotate(inst.status(), StrCat("model '", config.name, "'"));
    instances.push_back(std::move(*inst));
  }
  const TensorModel& first = *instances.front();
  model->platform_ = std::string(first.platform());
  model->signature_ = {config.name, config.max_batch_size, first.inputs(), first.outputs(),
                       first.decoupled()};
  if (first.decoupled() && config.max_batch_size > 0) {
    return InvalidArgument("model '", config.name, "': built-in '", config.builtin,
                           "' is decoupled (it answers a request with zero, one or many "
                           "responses) and does not batch; set max_batch_size: 0");
  }
  if (deps.flight_recorder_entries > 0) {
    model->recorder_ = std::make_unique<FlightRecorder>(
        config.name, "tensor",
        FlightRecorder::Options{deps.flight_recorder_entries, config.instance_count,
                                std::max(1, config.max_batch_size)});
  }
  if (config.sequence_batching && first.decoupled()) {
    return InvalidArgument("model '", config.name, "': built-in '", config.builtin,
                           "' is decoupled; sequence_batching is for models that answer each "
                           "request once");
  }
  if (config.sequence_batching) {
    // Clients send the model's inputs less the control inputs the sequence batcher adds.
    model->signature_.inputs =
        SequenceQueue::ClientInputs(*config.sequence_batching, first.inputs());
    auto queue =
        SequenceQueue::Create({config.name, *config.sequence_batching, config.max_batch_size,
                               config.instance_count, first.inputs(), &model->stats_});
    if (!queue.ok()) return Annotate(queue.status(), StrCat("model '", config.name, "'"));
    model->batcher_ = std::make_unique<DynamicBatcher>(*std::move(queue), std::move(instances),
                                                       &model->stats_, model->recorder_.get());
    return model;
  }
  BatchQueue::Options options{config.max_batch_size, config.dynamic_batching};
  model->batcher_ = std::make_unique<DynamicBatcher>(std::move(options), std::move(instances),
                                                     &model->stats_, model->recorder_.get());
  return model;
}

Status Model::Infer(std::unique_ptr<InferenceRequest>& request) {
  Status status = batcher_ ? PrepareRequest(signature_, *request)
                           : FailedPrecondition("model '", name(),
                                                "' is an LLM: send text_input (KServe) or use "
                                                "the generation APIs");
  if (status.ok() && signature_.decoupled && !request->on_response) {
    status = FailedPrecondition("model '", name(),
                                "' is decoupled (zero, one or many responses per request); send "
                                "its requests over a streaming RPC (gRPC ModelStreamInfer)");
  }
  if (status.ok()) status = batcher_->Enqueue(request);
  // Refused requests count as failures too (the caller answers them).
  if (!status.ok()) stats_.RequestFailed(status, SteadyClock::now() - request->received_at);
  return status;
}

void Model::WakeUp() {
  if (batcher_) batcher_->WakeUp();
  if (llm_) llm_->WakeUp();
}

size_t Model::pending() const {
  if (batcher_) return batcher_->pending();
  const auto snap = llm_->snapshot();
  return static_cast<size_t>(snap.running + snap.waiting);
}

bool Model::AwaitExecuting(size_t n, absl::Duration timeout) const {
  if (batcher_) return batcher_->AwaitExecuting(n, timeout);
  return llm_->AwaitSnapshot(
      [n](const ContinuousBatcher::Snapshot& s) { return static_cast<size_t>(s.running) == n; },
      timeout);
}

int Model::Drain(SteadyClock::time_point deadline) {
  return batcher_ ? batcher_->Drain(deadline) : llm_->Drain(deadline);
}

}  // namespace kiln
