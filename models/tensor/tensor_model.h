// Tensor models: non-generative models served through KServe ModelInfer and the dynamic
// batcher (Triton's "tensor in, tensor out" models). The built-in smoke-test models
// (`simple`, `identity_fp32`, `sleep_us`) implement this interface.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/status.h"
#include "models/tensor/datatype.h"

namespace kiln {

// An input or output as the model declares it.
struct TensorSpec {
  std::string name;
  DataType datatype = DataType::kInvalid;
  // Dimensions without the batch dimension; -1 marks a variable-size dimension.
  std::vector<int64_t> dims;
  // True: any rank and any dims are accepted (dims is then {-1} for metadata purposes).
  bool any_rank = false;
  // True: a request may leave this input out.
  bool optional = false;
};

// A tensor on the host with raw contents (see datatype.h for the layout).
struct HostTensor {
  std::string name;
  DataType datatype = DataType::kInvalid;
  std::vector<int64_t> shape;  // full shape, including the batch dimension if any
  std::string data;            // raw bytes
};

// Where a decoupled model sends its responses (see TensorModel::decoupled). Owned by the
// caller of ExecuteDecoupled and valid only during that call.
// Thread-safety: called from the thread running ExecuteDecoupled.
class ResponseSender {
 public:
  virtual ~ResponseSender() = default;

  // Sends one response holding `outputs` (one tensor per declared output, in declaration
  // order; the caller keeps those the client asked for). `final`: this is the request's last
  // response. Returns Cancelled once the client is gone or the server cut the request off:
  // the model should then stop and return. FailedPrecondition after a final response.
  virtual Status Send(std::vector<HostTensor> outputs, bool final) = 0;

  // Whether the client went away (or the server is shutting down); a model that waits between
  // responses polls this so that a closed stream stops it promptly.
  virtual bool cancelled() const = 0;
};

class TensorModel {
 public:
  virtual ~TensorModel() = default;

  // The platform string reported in metadata (e.g. "kiln_builtin").
  virtual std::string_view platform() const = 0;
  virtual const std::vector<TensorSpec>& inputs() const = 0;
  virtual const std::vector<TensorSpec>& outputs() const = 0;

  // Runs one batch. `inputs` holds one tensor per declared input, in declaration order, each
  // already validated against its spec; when the model batches, requests are concatenated
  // along dimension 0. Appends one tensor per declared output, in order, with the same
  // leading batch dimension.
  // Thread-safety: each instance is called from one thread at a time; the batcher creates
  // one instance per configured `instance_count`.
  virtual Status Execute(std::span<const HostTensor> inputs, std::vector<HostTensor>* outputs) = 0;

  // Checks one request's contents beyond what the signature states (values the model cannot
  // take) before it is queued, so that a bad request fails alone, with an InvalidArgument
  // naming the input, rather than failing the batch it would have joined. `inputs` as for
  // Execute, for one request. Default: every value is fine.
  // Thread-safety: may be called from any thread, concurrently with Execute.
  virtual Status CheckRequest(std::span<const HostTensor> inputs) const {
    (void)inputs;
    return OkStatus();
  }

  // Decoupled models (Triton's `model_transaction_policy { decoupled: true }`) answer a
  // request with zero, one or many responses, sent through ExecuteDecoupled as they are
  // ready, rather than one response from Execute. Such a model is served only over streaming
  // RPCs (gRPC ModelStreamInfer) and does not batch (max_batch_size 0).
  virtual bool decoupled() const { return false; }

  // REQUIRES: decoupled(). Runs one request: `inputs` as for Execute, without a batch
  // dimension. Sends each response through `sender`; returning ends the request (the front
  // end then tells the client no more responses follow, if it asked to be told). An error
  // ends it too, after the responses already sent.
  virtual Status ExecuteDecoupled(std::span<const HostTensor> inputs, ResponseSender& sender) {
    (void)inputs;
    (void)sender;
    return Unimplemented("this model is not decoupled");
  }
};

// Names accepted by CreateBuiltinModel, in a stable order.
std::span<const std::string_view> BuiltinModelNames();

// Creates a built-in model instance:
//   simple         INT32 INPUT0[16], INPUT1[16] -> OUTPUT0 = INPUT0 + INPUT1,
//                  OUTPUT1 = INPUT0 - INPUT1 (wrapping, as Triton's QA model)
//   identity_fp32  FP32 INPUT0 (any shape) -> OUTPUT0 = INPUT0
//   sleep_us       INT32 SLEEP_US[1] -> sleeps the largest value in the batch (microseconds,
//                  clamped to [0, 10 s]), returns OUTPUT0 = SLEEP_US
//   simple_sequence  INT32 INPUT[1] with control inputs START[1], READY[1] -> OUTPUT =
//                  READY ? INPUT + START : 0 (Triton's QA sequence model; serve it with
//                  sequence_batching, see sequence_models.cc)
// and Triton's QA and example models (triton_qa_models.h):
//   simple_string, simple_int8, simple_identity, custom_identity_int32, repeat_int32
// NotFound for other names.
StatusOr<std::unique_ptr<TensorModel>> CreateBuiltinModel(std::string_view name);

// The built-in `simple_sequence` (sequence_models.cc).
std::unique_ptr<TensorModel> CreateSimpleSequenceModel();

}  // namespace kiln
