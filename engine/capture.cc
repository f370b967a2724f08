#include "engine/capture.h"

namespace kiln {

StatusOr<std::unique_ptr<CapturedProgram>> CapturedProgram::Capture(Program& program,
                                                                    backend::Stream& stream) {
  KILN_RETURN_IF_ERROR(program.Prepare());
  std::unique_ptr<CapturedProgram> c(new CapturedProgram());
  c->num_launches_ = static_cast<int>(program.launches().size());
  if (stream.SupportsCapture()) {
    KILN_RETURN_IF_ERROR(stream.BeginCapture());
    const Status run = stream.Run(program.launches());
    StatusOr<std::unique_ptr<backend::ExecGraph>> graph = stream.EndCapture();
    KILN_RETURN_IF_ERROR(run);
    if (!graph.ok()) return graph.status();
    c->native_ = *std::move(graph);
    return c;
  }
  // Engine-side recording: copy every launch's arguments so later rebinding of the Program
  // (which rewrites its own argument blocks) cannot change what we replay.
  const std::span<const Launch> launches = program.launches();
  size_t total = 0;
  for (const Launch& l : launches) {
    total += static_cast<size_t>(l.args->num_inputs + l.args->num_extra_outputs);
  }
  c->args_.reserve(total);  // pointers into args_ must stay valid
  c->launch_args_.reserve(launches.size());
  for (const Launch& l : launches) {
    LaunchArgs a = *l.args;
    a.inputs = c->args_.data() + c->args_.size();
    for (int i = 0; i < l.args->num_inputs; ++i) c->args_.push_back(l.args->inputs[i]);
    a.extra_outputs = a.num_extra_outputs > 0 ? c->args_.data() + c->args_.size() : nullptr;
    for (int i = 0; i < l.args->num_extra_outputs; ++i) {
      c->args_.push_back(l.args->extra_outputs[i]);
    }
    c->launch_args_.push_back(a);
    c->launches_.push_back({l.fn, &c->launch_args_.back()});
  }
  return c;
}

Status CapturedProgram::Replay(backend::Stream& stream) {
  if (native_) return native_->Replay(stream);
  return stream.Run(launches_);
}

}  // namespace kiln
