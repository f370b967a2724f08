#include "server/http_frontend.h"

#include <charconv>
#include <cstdlib>
#include <thread>

#include "absl/strings/str_split.h"
#include "engine/base/json_parse.h"
#include "nlohmann/json.hpp"
#include "server/auth.h"
#include "server/finetune/finetune_http.h"
#include "server/finetune/forms.h"
#include "server/flight_service.h"
#include "server/http/http_server.h"
#include "server/http_routes.h"
#include "server/kserve_codec.h"
#include "server/kserve_json.h"
#include "server/llm/kserve_llm.h"
#include "server/llm/openai_http.h"
#include "server/logging.h"
#include "server/openapi.h"
#include "server/proto_json.h"
#include "server/shared_memory.h"
#include "server/status_mapping.h"
#include "server/tracing.h"
#include "spdlog/spdlog.h"

namespace kiln {
namespace {

using nlohmann::json;
using Responder = std::shared_ptr<http::Responder>;

void SendJson(const Responder& r, int status, const json& body) {
  http::Response resp;
  resp.status = status;
  resp.body = body.dump(-1, ' ', false, json::error_handler_t::replace);
  r->Send(std::move(resp));
}

void SendError(const Responder& r, const Status& status) {
  SendJson(r, ToHttpStatus(status), json{{"error", std::string(StatusMessage(status))}});
}

// An error answered before dispatch (no such route, no key, wrong scope), in the shape of
// the API the path belongs to: OpenAI's error object under /v1, KServe's {"error": "..."}
// elsewhere. A 401 names the scheme it wants (RFC 6750).
void SendRouteError(const Responder& r, std::string_view path, const Status& status) {
  const bool openai = path == "/v1" || path.starts_with("/v1/");
  const json body =
      openai ? llm::OpenAiError(status) : json{{"error", std::string(StatusMessage(status))}};
  http::Response resp;
  resp.status = ToHttpStatus(status);
  resp.body = body.dump(-1, ' ', false, json::error_handler_t::replace);
  if (status.code() == StatusCode::kUnauthenticated) {
    resp.headers.emplace_back("WWW-Authenticate", "Bearer");
  }
  r->Send(std::move(resp));
}

// Looks `req` up in the route table (server/http_routes.h) and checks its API key for the
// route's class. A path no route matches is answered 404 here, so the table is the authority
// on what is served; a wrong method takes the class of the path's first route (the handler
// then answers the method error). Returns false when it answered the request itself.
bool Admit(const ServerCore& core, RoutePort port, const http::Request& req, const Responder& r) {
  const HttpRoute* route = FindHttpRoute(port, req.method, req.path);
  if (route == nullptr) route = FindHttpRoutePath(port, req.path);
  if (route == nullptr) {
    SendRouteError(r, req.path, NotFound("no route for ", req.method, " ", req.path));
    return false;
  }
  if (core.auth == nullptr) return true;
  StatusOr<std::string> key =
      core.auth->Check(AuthProtocol::kHttp, req.Header("Authorization"), route->access, req.remote,
                       StrCat(req.method, " ", req.path));
  if (!key.ok()) {
    SendRouteError(r, req.path, key.status());
    return false;
  }
  return true;
}

// A method none of the path's routes takes: 405 with the methods they do take (RFC 9110).
void SendMethodNotAllowed(const Responder& r, const http::Request& req, const std::string& allow) {
  http::Response resp;
  resp.status = 405;
  resp.body = json{{"error", StrCat("method ", req.method, " is not allowed on ", req.path,
                                    "; use ", allow)}}
                  .dump(-1, ' ', false, json::error_handler_t::replace);
  resp.headers.emplace_back("Allow", allow);
  r->Send(std::move(resp));
}

void SendEmpty(const Responder& r, int status) {
  http::Response resp;
  resp.status = status;
  resp.content_type = "text/plain";
  r->Send(std::move(resp));
}

// The path split on '/', without empty segments: "/v2/models/m/ready" -> v2, models, m, ready.
std::vector<std::string> Segments(std::string_view path) {
  std::vector<std::string> out;
  for (absl::string_view s : absl::StrSplit(ToAbsl(path), '/', absl::SkipEmpty())) {
    out.emplace_back(s);
  }
  return out;
}

// /v2/models/{m}[/versions/{v}][/{action}] -> model, version, action. False if not that form.
bool ParseModelPath(const std::vector<std::string>& seg, std::string* model, std::string* version,
                    std::string* action) {
  if (seg.size() < 3 || seg[0] != "v2" || seg[1] != "models") return false;
  *model = seg[2];
  size_t i = 3;
  if (seg.size() >= 5 && seg[3] == "versions") {
    *version = seg[4];
    i = 5;
  }
  if (seg.size() > i + 1) return false;
  *action = seg.size() == i + 1 ? seg[i] : "";
  return true;
}

// GET /debug/flight_recorder[?model=NAME]: the flight recorders (server/flight_service.h).
// Building the JSON of a full default ring takes ~25 ms on a busy 2-core VM (flight_recorder_
// test's RecordCost): acceptable on an I/O thread for an admin route that is rarely called.
StatusOr<json> FlightRecorderJson(const ServerCore& core, std::string_view query) {
  KILN_ASSIGN_OR_RETURN(auto params, finetune::ParseQuery(query));
  std::string model;
  for (auto& [key, value] : params) {
    if (key != "model") {
      return InvalidArgument("unknown query parameter '", key,
                             "' for /debug/flight_recorder; it takes model=NAME");
    }
    model = std::move(value);
  }
  return core.flight->Dump(model, "http");
}

// The `seconds` of GET /debug/trace?seconds=N: (0, 60], default 5.
StatusOr<double> CaptureSeconds(std::string_view query) {
  KILN_ASSIGN_OR_RETURN(auto params, finetune::ParseQuery(query));
  double seconds = 5;
  for (const auto& [key, v] : params) {
    if (key != "seconds") continue;
    char* end = nullptr;
    seconds = std::strtod(v.c_str(), &end);
    if (v.empty() || end != v.c_str() + v.size() || !(seconds > 0 && seconds <= 60)) {
      return WithParam(InvalidArgument("`seconds` is `", v,
                                       "`; give the capture's length in seconds, more than 0 "
                                       "and at most 60 (e.g. /debug/trace?seconds=5)"),
                       "seconds");
    }
  }
  return seconds;
}

class KServeHttpHandler {
 public:
  KServeHttpHandler(ServerCore* core, finetune::FineTuningHttp* fine_tuning)
      : core_(core), openai_(core), fine_tuning_(fine_tuning) {}

  // Handlers answer with Status-based errors; an exception that still escapes one (a bug) is
  // answered here, in the route's error shape, rather than by the HTTP server's bare 500.
  void operator()(http::Request req, Responder r) {
    const std::string method = req.method, path = req.path;
    try {
      Dispatch(std::move(req), r);
    } catch (const std::exception& e) {
      spdlog::error("http: {} {} threw: {}", method, path, e.what());
      SendRouteError(r, path,
                     Internal("internal error while answering ", method, " ", path,
                              "; the server's log has the details"));
    }
  }

 private:
  void Dispatch(http::Request req, const Responder& r) {
    if (!Admit(*core_, RoutePort::kHttp, req, r)) return;
    if (req.path == "/debug/trace") return DebugTrace(req, r);
    if (req.path == "/openapi.json" && req.method == "GET") {
      http::Response doc;
      doc.body = std::string(OpenApiJson());
      return r->Send(std::move(doc));
    }
    if (fine_tuning_->Handle(req, r)) return;  // /v1/files, /v1/fine_tuning (before openai_)
    if (openai_.Handle(req, r)) return;        // /v1/...: the OpenAI-compatible API
    if (FindHttpRoute(RoutePort::kHttp, req.method, req.path) == nullptr) {
      if (std::string allow = AllowedMethods(RoutePort::kHttp, req.path); !allow.empty()) {
        return SendMethodNotAllowed(r, req, allow);
      }
    }
    const auto seg = Segments(req.path);
    const bool get = req.method == "GET" || req.method == "HEAD";
    const bool post = req.method == "POST";
    // Health answers in the status and, as the open inference protocol has it, in a JSON body:
    // KServe's SDK reads `live` / `ready` from it.
    if (seg.size() == 3 && seg[0] == "v2" && seg[1] == "health" && get) {
      if (seg[2] == "live") {
        const bool live = core_->live();
        return SendJson(r, live ? 200 : 503, json{{"live", live}});
      }
      if (seg[2] == "ready") {
        const bool ready = core_->ready();
        return SendJson(r, ready ? 200 : 503, json{{"ready", ready}});
      }
    }
    if (seg.size() == 1 && seg[0] == "v2" && get) return ServerMetadata(r);
    if (seg.size() == 2 && seg[0] == "v2" && seg[1] == "logging") return Logging(req, r);
    if (seg.size() == 2 && seg[0] == "debug" && seg[1] == "flight_recorder" && get) {
      return FlightRecorderDump(req, r);
    }
    if (seg.size() == 3 && seg[0] == "v2" && seg[1] == "models" && seg[2] == "stats" && get) {
      return Statistics(r, "", "");
    }
    if (seg.size() >= 2 && seg[0] == "v2" && seg[1] == "repository") {
      return Repository(seg, req, r);
    }
    // Admit only let through the routes of http_routes.cc, with their methods.
    if (seg.size() >= 2 && seg[0] == "v2" && seg[1] == "systemsharedmemory") {
      return SystemSharedMemory(seg, req, r);
    }
    if (seg.size() >= 2 && seg[0] == "v2" && seg[1] == "cudasharedmemory") {
      if (seg.back() == "unregister") return SendEmpty(r, 200);  // none can be registered
      if (seg.back() == "status") {
        Status s = CudaSharedMemoryStatus(seg.size() == 5 ? seg[3] : "");
        return s.ok() ? SendJson(r, 200, json::array()) : SendError(r, s);
      }
      return SendError(r, CudaSharedMemoryUnsupported());
    }
    std::string model, version, action;
    if (ParseModelPath(seg, &model, &version, &action)) {
      if (action.empty() && get) return ModelMetadata(model, version, r);
      if (action == "ready" && get) return ModelReady(model, version, r);
      if (action == "config" && get) return ModelConfig(model, version, r);
      if (action == "stats" && get) return Statistics(r, model, version);
      if (action == "infer" && post) return Infer(std::move(req), model, version, r);
      if ((action == "generate" || action == "generate_stream") && post) {
        return Generate(req, model, version, r, action == "generate_stream");
      }
      if (action == "infer" || action == "ready" || action == "config" || action == "stats" ||
          action == "generate" || action == "generate_stream" || action.empty()) {
        return SendError(r,
                         InvalidArgument("method ", req.method, " is not allowed on ", req.path));
      }
    }
    SendError(r, NotFound("no route for ", req.method, " ", req.path));
  }

  void FlightRecorderDump(const http::Request& req, const Responder& r) {
    StatusOr<json> doc = FlightRecorderJson(*core_, req.query);
    if (!doc.ok()) return SendError(r, doc.status());
    SendJson(r, 200, *doc);
  }

  // GET /debug/trace?seconds=N: a Chrome trace (Perfetto, chrome://tracing) of every step and
  // request span that ends in the next N seconds. Answered from the sink's timer thread.
  void DebugTrace(const http::Request& req, const Responder& r) {
    if (req.method != "GET") return SendMethodNotAllowed(r, req, "GET");
    StatusOr<double> seconds = CaptureSeconds(req.query);
    if (!seconds.ok()) return SendError(r, seconds.status());
    if (core_->tracer == nullptr || !core_->tracer->enabled()) {
      return SendJson(r, 409,
                      json{{"error",
                            "tracing is off (observability.tracing.enabled is false); "
                            "there is nothing to capture"}});
    }
    Status s = core_->tracer->Capture(absl::Seconds(*seconds), [r](std::string doc) {
      http::Response resp;
      resp.body = std::move(doc);
      resp.headers.emplace_back("Content-Disposition", "attachment; filename=\"kiln-trace.json\"");
      r->Send(std::move(resp));
    });
    if (s.code() == StatusCode::kAlreadyExists) {
      return SendJson(r, 409, json{{"error", std::string(StatusMessage(s))}});
    }
    if (!s.ok()) SendError(r, s);
  }

  void ServerMetadata(const Responder& r) {
    SendJson(r, 200,
             json{{"name", std::string(kServerName)},
                  {"version", std::string(ServerVersion())},
                  {"extensions", ServerExtensions()}});
  }

  // GET /v2/logging, POST /v2/logging {"log_verbose_level": 1, ...}: Triton's logging
  // extension (server/logging.h); both answer the settings now in force.
  void Logging(const http::Request& req, const Responder& r) {
    const std::string& format = core_->config->logging.format;
    if (req.method == "POST") {
      auto body = ParseJsonObject(req.body, "the log settings");
      if (!body.ok()) return SendError(r, body.status());
      for (const auto& [key, v] : body->items()) {
        LogSettingValue value;
        if (v.is_boolean()) {
          value = v.get<bool>();
        } else if (v.is_number_unsigned()) {
          value = v.get<uint64_t>();
        } else if (v.is_string()) {
          value = v.get<std::string>();
        } else {
          return SendError(r, InvalidArgument("log setting '", key, "' is ", v.dump(),
                                              "; expected a boolean, an unsigned integer or a "
                                              "string"));
        }
        if (Status s = ApplyLogSetting(key, value, format); !s.ok()) return SendError(r, s);
      }
    }
    const LogSettings now = CurrentLogSettings(format);
    SendJson(r, 200,
             json{{"log_file", now.log_file},
                  {"log_info", now.log_info},
                  {"log_warning", now.log_warning},
                  {"log_error", now.log_error},
                  {"log_verbose_level", now.log_verbose_level},
                  {"log_format", now.log_format}});
  }

  void ModelMetadata(const std::string& name, const std::string& version, const Responder& r) {
    std::string adapter;
    auto model = core_->repository->GetReady(name, version, &adapter);
    if (!model.ok()) return SendError(r, model.status());
    inference::ModelMetadataResponse md;
    FillModelMetadata(**model, &md);
    if (!adapter.empty()) md.set_name(adapter);  // a LoRA adapter: its base's signature
    SendJson(r, 200, ProtoToJson(md));
  }

  void ModelReady(const std::string& name, const std::string& version, const Responder& r) {
    std::string adapter;
    auto model = core_->repository->GetReady(name, version, &adapter);
    if (!model.ok() && model.status().code() == StatusCode::kNotFound) {
      return SendError(r, model.status());
    }
    const bool ready = core_->model_ready(model.ok());
    SendJson(r, ready ? 200 : 503, json{{"name", name}, {"ready", ready}});
  }

  void ModelConfig(const std::string& name, const std::string& version, const Responder& r) {
    auto model = core_->repository->GetReady(name, version);
    if (!model.ok()) return SendError(r, model.status());
    inference::ModelConfig cfg;
    FillModelConfig(**model, &cfg);
    SendJson(r, 200, ProtoToJson(cfg));
  }

  void Statistics(const Responder& r, const std::string& name, const std::string& version) {
    inference::ModelStatisticsResponse stats;
    if (!name.empty()) {
      auto model = core_->repository->GetReady(name, version);
      if (!model.ok()) return SendError(r, model.status());
      FillModelStatistics(**model, stats.add_model_stats());
    } else {
      for (const auto& m : core_->repository->ReadyModels()) {
        FillModelStatistics(*m, stats.add_model_stats());
      }
    }
    json out = ProtoToJson(stats);
    if (!out.contains("model_stats")) out["model_stats"] = json::array();
    SendJson(r, 200, out);
  }

  // /v2/systemsharedmemory[/region/{name}]/status|register|unregister (Triton's shapes).
  void SystemSharedMemory(const std::vector<std::string>& seg, const http::Request& req,
                          const Responder& r) {
    SharedMemoryManager& shm = *core_->shared_memory;
    const std::string name = seg.size() == 5 ? seg[3] : "";
    const std::string& action = seg.back();
    if (action == "status") {
      auto regions = shm.GetStatus(name);
      if (!regions.ok()) return SendError(r, regions.status());
      json out = json::array();
      for (const auto& region : *regions) {
        out.push_back({{"name", region.name},
                       {"key", region.key},
                       {"offset", region.offset},
                       {"byte_size", region.byte_size}});
      }
      return SendJson(r, 200, out);
    }
    if (action == "unregister") {
      name.empty() ? shm.UnregisterAll() : shm.Unregister(name);
      return SendEmpty(r, 200);
    }
    auto body = ParseJsonObject(req.body, "the register request's body");
    if (!body.ok()) return SendError(r, body.status());
    auto field = [&](const char* key, bool required) -> StatusOr<const json*> {
      auto it = body->find(key);
      if (it == body->end()) {
        if (!required) return nullptr;
        return InvalidArgument("shared memory region '", name, "': the body needs `", key, "`");
      }
      const bool ok = std::string_view(key) == "key" ? it->is_string() : it->is_number_unsigned();
      if (!ok) {
        return InvalidArgument(
            "shared memory region '", name, "': `", key, "` must be ",
            std::string_view(key) == "key" ? "a string" : "a non-negative integer", ", got ",
            it->dump());
      }
      return &*it;
    };
    auto key = field("key", true);
    auto offset = field("offset", false);
    auto byte_size = field("byte_size", true);
    for (const auto* f : {&key, &offset, &byte_size}) {
      if (!f->ok()) return SendError(r, f->status());
    }
    Status s =
        shm.Register(name, (*key)->get<std::string>(), *offset ? (*offset)->get<uint64_t>() : 0,
                     (*byte_size)->get<uint64_t>());
    s.ok() ? SendEmpty(r, 200) : SendError(r, s);
  }

  void Repository(const std::vector<std::string>& seg, const http::Request& req,
                  const Responder& r) {
    if (req.method != "POST") {
      return SendError(r, InvalidArgument("repository routes take POST"));
    }
    json body = json::object();
    if (!req.body.empty()) {
      auto parsed = ParseJsonObject(req.body, "the request body");
      if (!parsed.ok()) return SendError(r, parsed.status());
      body = *std::move(parsed);
    }
    if (seg.size() == 3 && seg[2] == "index") {
      bool ready_only = false;
      if (auto it = body.find("ready"); it != body.end() && !it->is_null()) {
        if (!it->is_boolean()) {
          return SendError(r, InvalidArgument("`ready` must be true or false, got ", it->dump()));
        }
        ready_only = it->get<bool>();
      }
      json out = json::array();
      for (const auto& e : core_->repository->Index(ready_only, /*with_adapters=*/true)) {
        json entry = {{"name", e.name},
                      {"version", e.version},
                      {"state", std::string(ModelStateName(e.state))}};
        if (!e.reason.empty()) entry["reason"] = e.reason;
        out.push_back(std::move(entry));
      }
      return SendJson(r, 200, out);
    }
    if (seg.size() == 5 && seg[2] == "models" && (seg[4] == "load" || seg[4] == "unload")) {
      const std::string name = seg[3];
      if (auto it = body.find("parameters"); it != body.end() && !it->is_object()) {
        return SendError(
            r, WithParam(InvalidArgument("`parameters` must be an object, got ", JsonTypeName(*it)),
                         "parameters"));
      }
      if (seg[4] == "load") {
        std::optional<config::ModelConfig> inline_config;
        if (body.contains("parameters") && body["parameters"].is_object() &&
            body["parameters"].contains("config")) {
          const json& c = body["parameters"]["config"];
          const std::string text = c.is_string() ? c.get<std::string>() : c.dump();
          const auto current = core_->repository->CurrentConfig(name);
          auto parsed = ParseLoadConfig(name, text, current ? &*current : nullptr);
          if (!parsed.ok()) return SendError(r, parsed.status());
          inline_config = std::move(*parsed);
        }
        if (core_->shutting_down) return SendError(r, Unavailable("the server is shutting down"));
        // Loading blocks; answer from a thread of its own.
        std::thread([this, r, name, cfg = std::move(inline_config)]() mutable {
          Status s = core_->repository->Load(name, std::move(cfg));
          s.ok() ? SendEmpty(r, 200) : SendError(r, s);
        }).detach();
        return;
      }
      const auto deadline =
          SteadyClock::now() +
          std::chrono::duration_cast<SteadyClock::duration>(
              std::chrono::duration<double>(core_->config->server.shutdown_grace_seconds));
      std::thread([this, r, name, deadline] {
        Status s = core_->repository->Unload(name, deadline);
        s.ok() ? SendEmpty(r, 200) : SendError(r, s);
      }).detach();
      return;
    }
    SendError(r, NotFound("no route for ", req.method, " ", req.path));
  }

  void Infer(http::Request req, const std::string& name, const std::string& version,
             const Responder& r) {
    const auto received = SteadyClock::now();
    auto ticket = core_->Admit();
    if (!ticket.ok()) return SendError(r, ticket.status());
    std::optional<size_t> header_length;
    if (auto h = req.Header("Inference-Header-Content-Length")) {
      size_t v = 0;
      auto [p, ec] = std::from_chars(h->data(), h->data() + h->size(), v);
      if (ec != std::errc() || p != h->data() + h->size()) {
        return SendError(r, InvalidArgument("Inference-Header-Content-Length `", *h,
                                            "` is not a non-negative integer"));
      }
      header_length = v;
    }
    if (auto enc = req.Header("Content-Encoding"); enc && *enc != "identity") {
      return SendError(r, Unimplemented("Content-Encoding `", *enc,
                                        "` is not supported; send the body uncompressed"));
    }
    auto decoded = DecodeJsonInferRequest(std::move(req.body), header_length, name, version,
                                          core_->shared_memory);
    if (!decoded.ok()) return SendError(r, decoded.status());
    std::string adapter;  // a LoRA adapter's name reaches SubmitText as the model name
    auto model = core_->repository->GetReady(name, version, &adapter);
    if (!model.ok()) return SendError(r, model.status());
    if ((*model)->is_llm()) {
      if (Status s = RefuseShmOutputs(decoded->shm_outputs, name); !s.ok()) return SendError(r, s);
    }
    std::unique_ptr<InferenceRequest> request = std::move(decoded->request);
    auto flag = request->cancel;
    std::weak_ptr<Model> weak = *model;
    r->OnClientGone([flag, weak] {
      flag->Cancel();
      if (auto m = weak.lock()) m->WakeUp();
    });
    if ((*model)->is_llm()) {
      return llm::HandleJsonInfer(*model, std::move(request), std::move(*ticket), r,
                                  std::move(decoded->binary_outputs), decoded->all_binary);
    }
    if ((*model)->signature().decoupled) {
      return SendError(r, InvalidArgument("HTTP end point doesn't support models with decoupled "
                                          "transaction policy: model '",
                                          name,
                                          "' sends zero, one or many responses per request; use "
                                          "gRPC ModelStreamInfer"));
    }
    // Traced from here on (LLMs through KServe JSON are not yet), its admission from arrival.
    std::shared_ptr<RequestTrace> trace = BeginHttpTrace(*core_, req, "", received);
    auto shared_ticket = std::make_shared<InflightLimiter::Ticket>(std::move(*ticket));
    request->trace = trace;
    request->on_complete = [r, name, id = request->id, bin = std::move(decoded->binary_outputs),
                            all = decoded->all_binary, shm = std::move(decoded->shm_outputs),
                            shared_ticket, trace](InferenceResponse&& resp) {
      shared_ticket->Release();
      const auto start = SteadyClock::now();
      Status status = resp.status;
      if (status.ok()) status = WriteShmOutputs(shm, resp.outputs);
      http::Response hr;
      hr.headers = TraceHeaders(trace.get());
      if (status.ok()) {
        JsonInferResponse out = EncodeJsonInferResponse(name, id, std::move(resp), bin, all, &shm);
        hr.body = std::move(out.body);
        if (out.header_length) {
          hr.content_type = "application/octet-stream";
          hr.headers.emplace_back("Inference-Header-Content-Length",
                                  std::to_string(*out.header_length));
        }
      } else {
        hr.status = ToHttpStatus(status);
        hr.body = json{{"error", std::string(StatusMessage(status))}}.dump(
            -1, ' ', false, json::error_handler_t::replace);
      }
      r->Send(std::move(hr));
      if (trace) {
        trace->Span("response", start, SteadyClock::now());
        trace->End(status);
      }
    };
    Status s = (*model)->Infer(request);
    if (trace) {
      trace->Span("admission", trace->start(), SteadyClock::now(), {{"kiln.ok", int64_t{s.ok()}}});
    }
    if (!s.ok()) {
      if (trace) trace->End(s);
      SendError(r, s);
    }
  }

  // Triton's generate extension (LLMs only).
  void Generate(const http::Request& req, const std::string& name, const std::string& version,
                const Responder& r, bool stream) {
    std::string adapter;
    auto model = core_->repository->GetReady(name, version, &adapter);
    if (!model.ok()) return SendError(r, model.status());
    if (!(*model)->is_llm()) {
      return SendError(r, InvalidArgument("model '", name,
                                          "' does not generate text; the generate extension "
                                          "serves LLMs (use /infer)"));
    }
    llm::HandleGenerate(*core_, *model, name, req, r, stream);
  }

  ServerCore* const core_;
  llm::OpenAiApi openai_;
  finetune::FineTuningHttp* fine_tuning_;  // owned by HttpFrontEnds
};

}  // namespace

HttpFrontEnds::HttpFrontEnds(ServerCore* core) : core_(core) {}
HttpFrontEnds::~HttpFrontEnds() { Shutdown(SteadyClock::now()); }

Status HttpFrontEnds::Start(std::shared_ptr<tls::ServerContext> tls) {
  const config::ServerConfig& cfg = core_->config->server;
  if (cfg.http.enabled) {
    http::ServerOptions opts;
    opts.address = cfg.http.address;
    opts.threads = cfg.http.threads;
    opts.max_body_bytes = cfg.http.max_body_bytes;
    opts.idle_timeout_seconds = cfg.http.idle_timeout_seconds;
    opts.name = "http";
    opts.tls = tls;
    fine_tuning_ = std::make_unique<finetune::FineTuningHttp>(core_);
    http_ = std::make_unique<http::Server>(opts, KServeHttpHandler(core_, fine_tuning_.get()));
    KILN_RETURN_IF_ERROR(Annotate(http_->Start(), "server.http.address"));
  }
  if (cfg.metrics.enabled) {
    http::ServerOptions opts;
    opts.address = cfg.metrics.address;
    opts.threads = 1;
    opts.max_body_bytes = 1 << 16;
    opts.name = "metrics";
    if (cfg.tls.metrics) opts.tls = tls;
    const ServerCore* core = core_;
    metrics_ = std::make_unique<http::Server>(opts, [core](http::Request req, Responder r) {
      if (!Admit(*core, RoutePort::kMetrics, req, r)) return;
      if (req.method != "GET" && req.method != "HEAD") {
        return SendMethodNotAllowed(r, req, AllowedMethods(RoutePort::kMetrics, req.path));
      }
      http::Response resp;
      resp.content_type = "text/plain; version=0.0.4; charset=utf-8";
      resp.body = core->registry->Serialize();
      r->Send(std::move(resp));
    });
    KILN_RETURN_IF_ERROR(Annotate(metrics_->Start(), "server.metrics.address"));
  }
  return OkStatus();
}

int HttpFrontEnds::http_port() const { return http_ ? http_->port() : 0; }
int HttpFrontEnds::metrics_port() const { return metrics_ ? metrics_->port() : 0; }

int HttpFrontEnds::Shutdown(SteadyClock::time_point deadline) {
  int cut = 0;
  if (http_) {
    http_->StopAccepting();
    cut += http_->Shutdown(deadline);
    http_.reset();
  }
  fine_tuning_.reset();  // after the server: no handler can post to its workers any more
  if (metrics_) {
    metrics_->StopAccepting();
    cut += metrics_->Shutdown(deadline);
    metrics_.reset();
  }
  return cut;
}

}  // namespace kiln
