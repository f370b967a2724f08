// Graph capture, device-agnostic: record one run of a Program, replay it many times.
//
// Captured per (program, padded batch size): bind the program's inputs to *static* tensors
// and set its symbols, Capture, then before each replay copy the step's data into those
// static tensors and call Replay. Replay does exactly the recorded work with the recorded
// pointers and sizes — no binding checks, no symbol evaluation.
//
//   KILN_RETURN_IF_ERROR(program->SetSymbol("T", 8));
//   KILN_RETURN_IF_ERROR(program->Bind("tokens", static_tokens));
//   KILN_ASSIGN_OR_RETURN(auto graph, CapturedProgram::Capture(*program, *stream));
//   ... copy the next step's tokens into static_tokens ...
//   KILN_RETURN_IF_ERROR(graph->Replay(*stream));
//
// If the stream supports native capture (CUDA/HIP graphs, OpenCL command buffers, the CPU
// backend's recorded launch lists) it is used; otherwise the engine records the resolved
// launch list itself (a recorded program with pre-bound pointers) and replays it through
// Stream::Run.
//
// Lifetime: the capture refers to the Program's arena and the bound tensors' memory: keep
// the Program and those tensors alive, and do not run the Program and its captures
// concurrently (they share the arena). Rebinding the Program later does not change an
// existing capture. Thread-safety: one thread at a time.
#pragma once

#include <memory>
#include <vector>

#include "engine/backend/backend.h"
#include "engine/program.h"

namespace kiln {

class CapturedProgram {
 public:
  // Records one run of `program` with its current bindings. The work is *not* executed.
  static StatusOr<std::unique_ptr<CapturedProgram>> Capture(Program& program,
                                                            backend::Stream& stream);

  Status Replay(backend::Stream& stream);
  bool native() const { return native_ != nullptr; }
  // Launches recorded (native graphs too: the program's launches at capture).
  int num_launches() const { return num_launches_; }

 private:
  CapturedProgram() = default;
  int num_launches_ = 0;
  std::unique_ptr<backend::ExecGraph> native_;
  // Fallback: deep copies of the resolved launches.
  std::vector<TensorArg> args_;
  std::vector<LaunchArgs> launch_args_;
  std::vector<Launch> launches_;
};

}  // namespace kiln
