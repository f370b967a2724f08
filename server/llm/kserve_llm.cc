#include "server/llm/kserve_llm.h"

#include <cstring>

#include "engine/base/json_parse.h"
#include "scheduler/generation.h"
#include "server/kserve_json.h"
#include "server/llm/http_stream.h"
#include "server/llm/params.h"
#include "server/status_mapping.h"

namespace kiln::llm {
namespace {

using nlohmann::json;
using Responder = std::shared_ptr<http::Responder>;

constexpr std::string_view kFinalParam = "triton_final_response";
constexpr std::string_view kEmptyFinalParam = "triton_enable_empty_final_response";

// The first element of a BYTES tensor (PrepareRequest checked that there is exactly one).
std::string FirstBytes(const std::string& raw) {
  uint32_t len = 0;
  std::memcpy(&len, raw.data(), sizeof(len));
  return raw.substr(sizeof(len), len);
}

// Request parameters that are Triton's own, not sampling keys.
bool TritonKey(std::string_view key) {
  return key == "priority" || key == "timeout" || key == "binary_data_output" ||
         key.rfind("triton_", 0) == 0 || key.rfind("sequence_", 0) == 0;
}

void SendJson(const Responder& r, int status, const json& body) {
  http::Response resp;
  resp.status = status;
  resp.body = body.dump(-1, ' ', false, json::error_handler_t::replace);
  r->Send(std::move(resp));
}

void SendError(const Responder& r, const Status& s) {
  SendJson(r, ToHttpStatus(s), json{{"error", ValidUtf8(StatusMessage(s))}});
}

}  // namespace

StatusOr<TextRequest> ReadKServeRequest(const Model& model, InferenceRequest& request,
                                        const json& parameters) {
  KILN_RETURN_IF_ERROR(PrepareRequest(model.signature(), request));
  TextRequest t;
  t.model_name = request.model_name;
  t.id = request.id;
  t.priority = request.priority;
  t.timeout_us = request.timeout_us;
  t.cancel = request.cancel;
  t.received_at = request.received_at;
  bool have_sampling = false;
  for (const HostTensor& in : request.inputs) {
    if (in.name == "text_input") {
      t.text_input = FirstBytes(in.data);
    } else if (in.name == "stream") {
      t.stream = in.data[0] != 0;
    } else if (in.name == "exclude_input_in_output") {
      t.exclude_input_in_output = in.data[0] != 0;
    } else if (in.name == "sampling_parameters") {
      const std::string text = FirstBytes(in.data);
      if (!text.empty()) {
        KILN_ASSIGN_OR_RETURN(t.sampling, ParseJsonObject(text, "input 'sampling_parameters'",
                                                          "sampling_parameters."));
        have_sampling = true;
      }
    }
  }
  if (!have_sampling) {
    t.sampling = parameters;
    t.sampling_field = "parameters";
  }
  return t;
}

json ParametersJson(const inference::ModelInferRequest& wire) {
  json out = json::object();
  for (const auto& [key, value] : wire.parameters()) {
    if (TritonKey(key)) continue;
    switch (value.parameter_choice_case()) {
      case inference::InferParameter::kBoolParam:
        out[key] = value.bool_param();
        break;
      case inference::InferParameter::kInt64Param:
        out[key] = value.int64_param();
        break;
      case inference::InferParameter::kUint64Param:
        out[key] = value.uint64_param();
        break;
      case inference::InferParameter::kDoubleParam:
        out[key] = value.double_param();
        break;
      case inference::InferParameter::kStringParam: {
        // A list (stop) arrives as a JSON string; anything else stays a (lenient) string.
        // Parsed by the one client-JSON parser, so its nesting is bounded (json_parse.h).
        const std::string& s = value.string_param();
        out[key] = s;
        if (s.starts_with('[')) {
          StatusOr<json> parsed = ParseJsonObject(StrCat("{\"v\":", s, "}"), "");
          if (parsed.ok() && (*parsed)["v"].is_array()) out[key] = std::move((*parsed)["v"]);
        }
        break;
      }
      default:
        break;
    }
  }
  return out;
}

bool EmptyFinalResponseRequested(const inference::ModelInferRequest& wire) {
  auto it = wire.parameters().find(std::string(kEmptyFinalParam));
  return it != wire.parameters().end() && it->second.bool_param();
}

InferenceResponse TextResponse(const std::string& text, bool empty) {
  InferenceResponse resp;
  if (empty) return resp;
  HostTensor out;
  out.name = "text_output";
  out.datatype = DataType::kBytes;
  out.shape = {1};
  const uint32_t len = static_cast<uint32_t>(text.size());
  out.data.resize(sizeof(len));
  std::memcpy(out.data.data(), &len, sizeof(len));
  out.data += text;
  resp.outputs.push_back(std::move(out));
  return resp;
}

void MarkFinal(inference::ModelInferResponse* wire, bool final) {
  (*wire->mutable_parameters())[std::string(kFinalParam)].set_bool_param(final);
}

Status SubmitText(const std::shared_ptr<Model>& model, TextRequest req,
                  InflightLimiter::Ticket ticket, bool may_stream, TextSink sink) {
  KILN_ASSIGN_OR_RETURN(LlmEndpoint llm, LlmEndpoint::Of(model));
  const bool stream = req.stream.value_or(false);
  if (stream && !may_stream) {
    return WithParam(InvalidArgument("input 'stream' is true, but ModelInfer answers once; stream "
                                     "with ModelStreamInfer (gRPC) or generate_stream (REST)"),
                     "stream");
  }
  // Triton's vLLM backend: the prompt comes first unless excluded; by default only when not
  // streaming.
  const bool prepend = req.exclude_input_in_output ? !*req.exclude_input_in_output : !stream;

  GenerationInput in;
  in.prompt.kind = PromptInput::Kind::kText;
  in.prompt.field = "text_input";
  in.prompt.text = std::move(req.text_input);
  GenerateRequest& r = in.request;
  r.trace = std::move(req.trace);
  // A request that named one of the model's LoRA adapters (ModelRepository::GetReady with an
  // adapter) runs with it; the batcher refuses a name that is not one.
  if (!req.model_name.empty() && req.model_name != model->name()) r.adapter = req.model_name;
  JsonFields f(req.sampling, req.sampling_field + ".", /*lenient=*/true);
  KILN_ASSIGN_OR_RETURN(r.max_tokens, f.Int("max_tokens"));
  r.fields.max_tokens = f.Name("max_tokens");
  r.fields.sampling = req.sampling_field;
  KILN_RETURN_IF_ERROR(ReadSamplingFields(f, &r.sampling));
  r.id = req.id;
  r.priority = static_cast<int64_t>(std::min<uint64_t>(req.priority, INT64_MAX));
  if (req.timeout_us && *req.timeout_us > 0) {
    r.deadline = req.received_at + std::chrono::microseconds(*req.timeout_us);
  }
  r.cancel = req.cancel;
  r.received_at = req.received_at;
  KILN_ASSIGN_OR_RETURN(PreparedGeneration prepared, llm.Prepare(std::move(in)));

  // Triton's statistics for the model. The model outlives every event of its batcher.
  ModelStats* stats = &llm.stats();
  const auto received = req.received_at;
  std::string prefix = prepend ? prepared.prompt_text() : std::string();
  auto text = std::make_shared<std::string>();
  auto on_event = [sink = std::move(sink), stats, received, stream, text,
                   prefix = std::move(prefix)](GenerateEvent&& ev) mutable {
    const bool final = ev.finish != FinishReason::kNone;
    if (final) {
      const Status s = FinalStatus(ev.finish, ev.status);
      const auto total = SteadyClock::now() - received;
      if (s.ok()) {
        stats->RequestSucceeded(total, {}, {}, total, {});
      } else {
        stats->RequestFailed(s, total);
        return sink("", true, s);
      }
    }
    if (stream) {
      std::string out = std::move(prefix) + std::move(ev.text);
      prefix.clear();
      if (final || !out.empty()) sink(std::move(out), final, OkStatus());
      return;
    }
    *text += ev.text;
    if (final) sink(std::move(prefix) + std::move(*text), true, OkStatus());
  };
  return llm.Submit(std::move(prepared), std::move(ticket), std::move(on_event));
}

void HandleJsonInfer(const std::shared_ptr<Model>& model, std::unique_ptr<InferenceRequest> request,
                     InflightLimiter::Ticket ticket, const Responder& r,
                     std::vector<std::string> binary_outputs, bool all_binary) {
  auto text = ReadKServeRequest(*model, *request, json::object());
  if (!text.ok()) return SendError(r, text.status());
  const std::string name = request->model_name, id = request->id;
  Status s = SubmitText(model, std::move(*text), std::move(ticket), /*may_stream=*/false,
                        [r, name, id, bin = std::move(binary_outputs), all_binary](
                            std::string out, bool, const Status& status) {
                          if (!status.ok()) return SendError(r, status);
                          JsonInferResponse enc =
                              EncodeJsonInferResponse(name, id, TextResponse(out), bin, all_binary);
                          http::Response hr;
                          hr.body = std::move(enc.body);
                          if (enc.header_length) {
                            hr.content_type = "application/octet-stream";
                            hr.headers.emplace_back("Inference-Header-Content-Length",
                                                    std::to_string(*enc.header_length));
                          }
                          r->Send(std::move(hr));
                        });
  if (!s.ok()) SendError(r, s);
}

void HandleGenerate(const ServerCore& core, const std::shared_ptr<Model>& model,
                    const std::string& name, const http::Request& request, const Responder& r,
                    bool stream_route) {
  auto ticket = core.Admit();
  if (!ticket.ok()) return SendError(r, ticket.status());
  auto body = ParseJsonObject(request.body, "the request body");
  if (!body.ok()) return SendError(r, body.status());
  auto read = [&]() -> StatusOr<TextRequest> {
    TextRequest t;
    t.model_name = name;
    JsonFields f(*body, "", /*lenient=*/true);
    KILN_ASSIGN_OR_RETURN(auto text, f.String("text_input"));
    if (!text) return InvalidArgument("`text_input` is missing: send the prompt");
    t.text_input = std::move(*text);
    KILN_ASSIGN_OR_RETURN(auto id, f.String("id"));
    t.id = id.value_or("");
    // Sampling keys: `parameters` (Triton's generate extension), `sampling_parameters` (as
    // the input tensor would carry them), or top-level keys.
    json params = json::object();
    if (const json* p = f.Get("parameters")) {
      if (!p->is_object()) return InvalidArgument("`parameters` must be an object");
      params = *p;
    }
    JsonFields pf(params, "parameters.", /*lenient=*/true);
    for (const JsonFields* src : {&f, &pf}) {
      KILN_ASSIGN_OR_RETURN(auto stream, src->Bool("stream"));
      if (stream) t.stream = stream;
      KILN_ASSIGN_OR_RETURN(auto exclude, src->Bool("exclude_input_in_output"));
      if (exclude) t.exclude_input_in_output = exclude;
      KILN_ASSIGN_OR_RETURN(auto priority, src->Int("priority"));
      if (priority) {
        if (*priority < 0) return InvalidArgument("`priority` must be >= 0");
        t.priority = static_cast<uint64_t>(*priority);
      }
      KILN_ASSIGN_OR_RETURN(auto timeout, src->Int("timeout"));
      if (timeout) {
        if (*timeout < 0) return InvalidArgument("`timeout` must be >= 0 (microseconds)");
        t.timeout_us = static_cast<uint64_t>(*timeout);
      }
    }
    if (const json* sp = f.Get("sampling_parameters")) {
      if (sp->is_string()) {
        KILN_ASSIGN_OR_RETURN(t.sampling,
                              ParseJsonObject(sp->get<std::string>(), "`sampling_parameters`",
                                              "sampling_parameters."));
      } else if (sp->is_object()) {
        t.sampling = *sp;
      } else {
        return InvalidArgument("`sampling_parameters` must be an object or a JSON string");
      }
    } else {
      t.sampling = params;
      t.sampling_field = "parameters";
      for (const auto& [key, value] : body->items()) {
        if (key != "text_input" && key != "id" && key != "parameters" && !params.contains(key)) {
          t.sampling[key] = value;
        }
      }
    }
    if (stream_route) {
      if (t.stream == false) {
        return InvalidArgument("`stream` is false, but generate_stream streams; use generate");
      }
      t.stream = true;
    }
    return t;
  };
  auto text = read();
  if (!text.ok()) return SendError(r, text.status());
  const bool stream = text->stream.value_or(false);
  r->OnClientGone(Canceller(text->cancel, model));
  const json envelope = {{"model_name", name}, {"model_version", kModelVersion}};
  const std::string id = text->id;

  auto response = [envelope, id](std::string out) {
    json j = envelope;
    if (!id.empty()) j["id"] = id;
    j["text_output"] = std::move(out);
    return j;
  };
  if (!stream) {
    Status s = SubmitText(model, std::move(*text), std::move(*ticket), /*may_stream=*/true,
                          [r, response](std::string out, bool, const Status& status) {
                            if (!status.ok()) return SendError(r, status);
                            SendJson(r, 200, response(std::move(out)));
                          });
    if (!s.ok()) SendError(r, s);
    return;
  }
  auto gate = std::make_shared<HttpStreamGate>(r);
  auto sse = [](const json& j) {
    return "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
  };
  Status s = SubmitText(model, std::move(*text), std::move(*ticket), /*may_stream=*/true,
                        [gate, response, sse](std::string out, bool final, const Status& status) {
                          if (!status.ok()) {
                            if (status.code() != StatusCode::kCancelled) {
                              gate->Write(sse(json{{"error", ValidUtf8(StatusMessage(status))}}));
                            }
                          } else if (!out.empty() || !final) {
                            gate->Write(sse(response(std::move(out))));
                          }
                          if (final) gate->Finish();
                        });
  if (!s.ok()) return SendError(r, s);
  gate->Start(200, "text/event-stream", {{"Cache-Control", "no-cache"}});
}

}  // namespace kiln::llm
