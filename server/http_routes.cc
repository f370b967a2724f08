#include "server/http_routes.h"

namespace kiln {
namespace {

using C = RouteClass;

// Keep in step with docs/openapi.json (http_routes_test checks both ways).
constexpr HttpRoute kRoutes[] = {
    // KServe v2 REST (server/http_frontend.cc).
    {"GET", "/v2/health/live", C::kHealth},
    {"GET", "/v2/health/ready", C::kHealth},
    {"GET", "/v2", C::kInference},
    {"GET", "/v2/models/stats", C::kInference},
    {"GET", "/v2/models/{model}", C::kInference},
    {"GET", "/v2/models/{model}/versions/{version}", C::kInference},
    {"GET", "/v2/models/{model}/ready", C::kHealth},
    {"GET", "/v2/models/{model}/versions/{version}/ready", C::kHealth},
    {"GET", "/v2/models/{model}/config", C::kInference},
    {"GET", "/v2/models/{model}/versions/{version}/config", C::kInference},
    {"GET", "/v2/models/{model}/stats", C::kInference},
    {"GET", "/v2/models/{model}/versions/{version}/stats", C::kInference},
    {"POST", "/v2/models/{model}/infer", C::kInference},
    {"POST", "/v2/models/{model}/versions/{version}/infer", C::kInference},
    {"POST", "/v2/models/{model}/generate", C::kInference},
    {"POST", "/v2/models/{model}/versions/{version}/generate", C::kInference},
    {"POST", "/v2/models/{model}/generate_stream", C::kInference},
    {"POST", "/v2/models/{model}/versions/{version}/generate_stream", C::kInference},
    {"GET", "/v2/logging", C::kInference},
    {"POST", "/v2/logging", C::kAdmin},
    {"GET", "/v2/systemsharedmemory/status", C::kInference},
    {"GET", "/v2/systemsharedmemory/region/{region}/status", C::kInference},
    {"POST", "/v2/systemsharedmemory/region/{region}/register", C::kAdmin},
    {"POST", "/v2/systemsharedmemory/region/{region}/unregister", C::kAdmin},
    {"POST", "/v2/systemsharedmemory/unregister", C::kAdmin},
    {"GET", "/v2/cudasharedmemory/status", C::kInference},
    {"GET", "/v2/cudasharedmemory/region/{region}/status", C::kInference},
    {"POST", "/v2/cudasharedmemory/region/{region}/register", C::kAdmin},
    {"POST", "/v2/cudasharedmemory/region/{region}/unregister", C::kAdmin},
    {"POST", "/v2/cudasharedmemory/unregister", C::kAdmin},
    {"POST", "/v2/repository/index", C::kInference},
    {"POST", "/v2/repository/models/{model}/load", C::kAdmin},
    {"POST", "/v2/repository/models/{model}/unload", C::kAdmin},
    // OpenAI-compatible (server/llm/openai_http.cc).
    {"GET", "/v1/models", C::kInference},
    {"GET", "/v1/models/{model}", C::kInference},
    {"POST", "/v1/completions", C::kInference},
    {"POST", "/v1/chat/completions", C::kInference},
    {"POST", "/v1/embeddings", C::kInference},
    {"POST", "/v1/load_lora_adapter", C::kAdmin},
    {"POST", "/v1/unload_lora_adapter", C::kAdmin},
    // Files and fine-tuning jobs (server/finetune/finetune_http.cc).
    {"POST", "/v1/files", C::kFineTuning},
    {"GET", "/v1/files", C::kFineTuning},
    {"GET", "/v1/files/{file_id}", C::kFineTuning},
    {"DELETE", "/v1/files/{file_id}", C::kFineTuning},
    {"GET", "/v1/files/{file_id}/content", C::kFineTuning},
    {"POST", "/v1/fine_tuning/jobs", C::kFineTuning},
    {"GET", "/v1/fine_tuning/jobs", C::kFineTuning},
    {"GET", "/v1/fine_tuning/jobs/{fine_tuning_job_id}", C::kFineTuning},
    {"POST", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/cancel", C::kFineTuning},
    {"POST", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/pause", C::kFineTuning},
    {"POST", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/resume", C::kFineTuning},
    {"GET", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/events", C::kFineTuning},
    {"GET", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/checkpoints", C::kFineTuning},
    // The document of all of the above.
    {"GET", "/openapi.json", C::kOpenApi},
    // Operations (admin).
    {"GET", "/debug/flight_recorder", C::kAdmin},
    {"GET", "/debug/trace", C::kAdmin},
    // The metrics listener.
    {"GET", "/metrics", C::kMetrics, RoutePort::kMetrics},
};

// The next segment of `s` after `pos` (which points at a '/'), advancing `pos`.
std::string_view NextSegment(std::string_view s, size_t* pos) {
  size_t start = *pos + 1;
  size_t end = s.find('/', start);
  if (end == std::string_view::npos) end = s.size();
  *pos = end;
  return s.substr(start, end - start);
}

}  // namespace

std::string_view RouteClassName(RouteClass c) {
  switch (c) {
    case C::kHealth:
      return "health";
    case C::kMetrics:
      return "metrics";
    case C::kOpenApi:
      return "openapi";
    case C::kInference:
      return "inference";
    case C::kFineTuning:
      return "fine_tuning";
    case C::kAdmin:
      return "admin";
  }
  return "admin";
}

std::span<const HttpRoute> HttpRoutes() { return kRoutes; }

bool MatchRoutePath(std::string_view templ, std::string_view path) {
  // A trailing slash is not a route of its own ("/v1/models/" is not "/v1/models").
  if (path.empty() || path[0] != '/' || templ.empty()) return false;
  size_t t = 0, p = 0;
  while (t < templ.size() && p < path.size()) {
    std::string_view ts = NextSegment(templ, &t);
    std::string_view ps = NextSegment(path, &p);
    const bool param = ts.size() >= 2 && ts.front() == '{' && ts.back() == '}';
    if (param ? ps.empty() : ts != ps) return false;
  }
  return t == templ.size() && p == path.size();
}

const HttpRoute* FindHttpRoute(RoutePort port, std::string_view method, std::string_view path) {
  if (method == "HEAD") method = "GET";
  for (const HttpRoute& r : kRoutes) {
    if (r.port == port && r.method == method && MatchRoutePath(r.path, path)) return &r;
  }
  return nullptr;
}

std::string AllowedMethods(RoutePort port, std::string_view path) {
  std::string allow;
  bool get = false;
  for (const HttpRoute& r : kRoutes) {
    if (r.port != port || !MatchRoutePath(r.path, path)) continue;
    if (allow.find(r.method) != std::string::npos) continue;  // {model} and a literal alike
    if (!allow.empty()) allow += ", ";
    allow += r.method;
    get = get || r.method == "GET";
  }
  if (get) allow += ", HEAD";
  return allow;
}

const HttpRoute* FindHttpRoutePath(RoutePort port, std::string_view path) {
  for (const HttpRoute& r : kRoutes) {
    if (r.port == port && MatchRoutePath(r.path, path)) return &r;
  }
  return nullptr;
}

}  // namespace kiln
