#include "server/finetune/finetune_http.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "boost/asio/post.hpp"
#include "boost/asio/thread_pool.hpp"
#include "engine/base/json_parse.h"
#include "nlohmann/json.hpp"
#include "scheduler/finetune/job_service.h"
#include "server/finetune/forms.h"
#include "server/llm/openai_http.h"
#include "server/status_mapping.h"

namespace kiln::finetune {
namespace {

using nlohmann::json;
using Responder = std::shared_ptr<http::Responder>;

void SendJson(const Responder& r, int status, const json& body, http::Headers headers = {}) {
  http::Response resp;
  resp.status = status;
  resp.body = body.dump(-1, ' ', false, json::error_handler_t::replace);
  resp.headers = std::move(headers);
  r->Send(std::move(resp));
}

void SendError(const Responder& r, const Status& status) {
  SendJson(r, ToHttpStatus(status), llm::OpenAiError(status));
}

void SendMethodNotAllowed(const Responder& r, const http::Request& req, std::string_view allow) {
  SendJson(r, 405,
           llm::OpenAiError(InvalidArgument("method ", req.method, " is not allowed on ", req.path,
                                            "; use ", allow)),
           {{"Allow", std::string(allow)}});
}

Status Disabled() {
  return NotFound("fine-tuning is disabled in this server's configuration (fine_tuning.enabled)");
}

// OpenAI's list object. Files also carry first_id and last_id.
template <typename T, typename Render>
json ListJson(const Page<T>& page, Render render, bool with_ids) {
  json data = json::array();
  for (const T& item : page.data) data.push_back(render(item));
  json out = {{"object", "list"}, {"data", std::move(data)}, {"has_more", page.has_more}};
  if (with_ids) {
    out["first_id"] = page.data.empty() ? json(nullptr) : json(page.data.front().id);
    out["last_id"] = page.data.empty() ? json(nullptr) : json(page.data.back().id);
  }
  return out;
}

// The name a file is stored under: the uploader's last path component, without control
// characters (some clients send a full path).
std::string CleanFilename(std::string_view name) {
  const size_t slash = name.find_last_of("/\\");
  if (slash != std::string_view::npos) name.remove_prefix(slash + 1);
  std::string out;
  for (char c : name) {
    if (static_cast<unsigned char>(c) >= 0x20 && c != 0x7f) out.push_back(c);
  }
  return out;
}

// POST /v1/files.
void Upload(FineTuningService* ft, const http::Request& req, const Responder& r) {
  const std::optional<std::string> content_type = req.Header("Content-Type");
  StatusOr<std::string> boundary = MultipartBoundary(content_type.value_or(""));
  if (!boundary.ok()) return SendError(r, boundary.status());
  StatusOr<std::vector<MultipartPart>> parts = ParseMultipart(req.body, *boundary);
  if (!parts.ok()) return SendError(r, parts.status());
  const MultipartPart* purpose = nullptr;
  const MultipartPart* file = nullptr;
  for (const MultipartPart& p : *parts) {
    const MultipartPart** slot = nullptr;
    if (p.name == "purpose") {
      slot = &purpose;
    } else if (p.name == "file") {
      slot = &file;
    } else if (p.name.rfind("expires_after", 0) == 0) {
      return SendError(r, WithParam(InvalidArgument("`expires_after` is not supported by this "
                                                    "server: files are kept until deleted"),
                                    "expires_after"));
    } else {
      return SendError(
          r, WithParam(InvalidArgument("unknown form field `", p.name, "`; allowed: purpose, file"),
                       p.name));
    }
    if (*slot != nullptr) {
      return SendError(r,
                       WithParam(InvalidArgument("form field `", p.name, "` is repeated"), p.name));
    }
    *slot = &p;
  }
  if (purpose == nullptr) {
    return SendError(r, WithParam(InvalidArgument("form field `purpose` is missing; send "
                                                  "purpose=fine-tune"),
                                  "purpose"));
  }
  if (file == nullptr) {
    return SendError(
        r, WithParam(InvalidArgument("form field `file` is missing; send the file's contents"),
                     "file"));
  }
  StatusOr<FileRecord> f =
      ft->UploadFile(CleanFilename(file->filename.value_or("")), purpose->body, file->body);
  if (!f.ok() && f.status().code() == StatusCode::kResourceExhausted &&
      ParamOf(f.status()) == "file") {
    // The file is over fine_tuning.max_file_bytes: payload too large, not "slow down" (429).
    // (A full disk is ResourceExhausted too, without the param, and keeps the usual mapping.)
    json err = llm::OpenAiError(f.status());
    err["error"]["type"] = "invalid_request_error";
    err["error"]["code"] = "file_too_large";
    return SendJson(r, 413, err);
  }
  if (!f.ok()) return SendError(r, f.status());
  SendJson(r, 200, FineTuningService::FileJson(*f));
}

int PageSize(int limit) { return std::min(limit, kMaxPageSize); }

// /v1/files[/{id}[/content]]. `seg` has "v1", "files", ...
void Files(FineTuningService* ft, const std::vector<std::string>& seg, const http::Request& req,
           const Responder& r) {
  const bool get = req.method == "GET";
  if (seg.size() == 2) {
    if (req.method == "POST") return Upload(ft, req, r);
    if (!get) return SendMethodNotAllowed(r, req, "GET, POST");
    StatusOr<ListQuery> q = ParseListQuery(
        req.query, {.default_limit = 10000, .max_limit = 10000, .purpose = true, .order = true});
    if (!q.ok()) return SendError(r, q.status());
    StatusOr<Page<FileRecord>> page = ft->ListFiles(q->purpose, q->after, PageSize(q->limit));
    if (!page.ok()) return SendError(r, page.status());
    return SendJson(r, 200, ListJson(*page, FineTuningService::FileJson, true));
  }
  const std::string& id = seg[2];
  if (seg.size() == 3) {
    if (get) {
      StatusOr<FileRecord> f = ft->GetFile(id);
      return f.ok() ? SendJson(r, 200, FineTuningService::FileJson(*f)) : SendError(r, f.status());
    }
    if (req.method != "DELETE") return SendMethodNotAllowed(r, req, "GET, DELETE");
    Status s = ft->DeleteFile(id);
    if (!s.ok()) return SendError(r, s);
    return SendJson(r, 200, {{"id", id}, {"object", "file"}, {"deleted", true}});
  }
  if (seg.size() == 4 && seg[3] == "content") {
    if (!get) return SendMethodNotAllowed(r, req, "GET");
    StatusOr<std::string> content = ft->FileContent(id);
    if (!content.ok()) return SendError(r, content.status());
    http::Response resp;
    resp.content_type = "application/octet-stream";
    resp.body = *std::move(content);
    return r->Send(std::move(resp));
  }
  SendError(r, NotFound("no route for ", req.method, " ", req.path,
                        "; the file routes are /v1/files, /v1/files/{id} and "
                        "/v1/files/{id}/content"));
}

// /v1/fine_tuning/jobs[/{id}[/{action}]]. `seg` has "v1", "fine_tuning", "jobs", ...
void Jobs(FineTuningService* ft, const std::vector<std::string>& seg, const http::Request& req,
          const Responder& r) {
  const bool get = req.method == "GET";
  const bool post = req.method == "POST";
  auto send_job = [&](const StatusOr<JobRecord>& job) {
    job.ok() ? SendJson(r, 200, FineTuningService::JobJson(*job)) : SendError(r, job.status());
  };
  if (seg.size() == 3) {
    if (post) {
      StatusOr<json> body = ParseJsonObject(req.body, "the request body");
      if (!body.ok()) return SendError(r, body.status());
      return send_job(ft->CreateJob(*body));
    }
    if (!get) return SendMethodNotAllowed(r, req, "GET, POST");
    StatusOr<ListQuery> q = ParseListQuery(req.query, {.metadata = true});
    if (!q.ok()) return SendError(r, q.status());
    StatusOr<Page<JobRecord>> page = ft->ListJobs(q->after, PageSize(q->limit), q->metadata);
    if (!page.ok()) return SendError(r, page.status());
    return SendJson(r, 200, ListJson(*page, FineTuningService::JobJson, false));
  }
  const std::string& id = seg[3];
  if (seg.size() == 4) {
    if (!get) return SendMethodNotAllowed(r, req, "GET");
    return send_job(ft->GetJob(id));
  }
  if (seg.size() == 5) {
    const std::string& action = seg[4];
    if (action == "cancel" || action == "pause" || action == "resume") {
      if (!post) return SendMethodNotAllowed(r, req, "POST");
      if (action == "cancel") return send_job(ft->CancelJob(id));
      if (action == "pause") return send_job(ft->PauseJob(id));
      return send_job(ft->ResumeJob(id));
    }
    if (action == "events" || action == "checkpoints") {
      if (!get) return SendMethodNotAllowed(r, req, "GET");
      StatusOr<ListQuery> q = ParseListQuery(req.query, {});
      if (!q.ok()) return SendError(r, q.status());
      if (action == "events") {
        StatusOr<Page<EventRecord>> page = ft->ListEvents(id, q->after, PageSize(q->limit));
        if (!page.ok()) return SendError(r, page.status());
        return SendJson(r, 200, ListJson(*page, FineTuningService::EventJson, false));
      }
      StatusOr<Page<CheckpointRecord>> page = ft->ListCheckpoints(id, q->after, PageSize(q->limit));
      if (!page.ok()) return SendError(r, page.status());
      return SendJson(r, 200, ListJson(*page, FineTuningService::CheckpointJson, false));
    }
  }
  SendError(r, NotFound("no route for ", req.method, " ", req.path,
                        "; the fine-tuning routes are /v1/fine_tuning/jobs, "
                        "/v1/fine_tuning/jobs/{id} and /v1/fine_tuning/jobs/{id}/"
                        "{cancel,pause,resume,events,checkpoints}"));
}

}  // namespace

struct FineTuningHttp::Workers {
  explicit Workers(int threads) : pool(static_cast<size_t>(std::max(1, threads))) {}
  boost::asio::thread_pool pool;
};

FineTuningHttp::FineTuningHttp(ServerCore* core, int threads)
    : core_(core), workers_(std::make_unique<Workers>(threads)) {}

FineTuningHttp::~FineTuningHttp() { workers_->pool.join(); }

bool FineTuningHttp::Handle(http::Request& request, const std::shared_ptr<http::Responder>& r) {
  std::vector<std::string> seg;
  for (absl::string_view s : absl::StrSplit(ToAbsl(request.path), '/', absl::SkipEmpty())) {
    seg.emplace_back(s);
  }
  const bool files = seg.size() >= 2 && seg[0] == "v1" && seg[1] == "files";
  const bool fine_tuning = seg.size() >= 2 && seg[0] == "v1" && seg[1] == "fine_tuning";
  if (!files && !fine_tuning) return false;
  FineTuningService* ft = core_->fine_tuning;
  if (ft == nullptr) return SendError(r, Disabled()), true;
  if (fine_tuning && (seg.size() < 3 || seg[2] != "jobs")) {
    return SendError(r, NotFound("no route for ", request.method, " ", request.path,
                                 "; the fine-tuning routes are under /v1/fine_tuning/jobs")),
           true;
  }
  // The service writes SQLite with fsync: off the I/O thread.
  boost::asio::post(workers_->pool,
                    [ft, files, seg = std::move(seg), req = std::move(request), r]() {
                      files ? Files(ft, seg, req, r) : Jobs(ft, seg, req, r);
                    });
  return true;
}

}  // namespace kiln::finetune
