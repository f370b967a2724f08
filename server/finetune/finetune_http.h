// OpenAI's files and fine-tuning routes over FineTuningService (scheduler/finetune/
// job_service.h), served on server.http next to the rest of the OpenAI-compatible API:
//
//   POST   /v1/files                              multipart/form-data: purpose, file
//   GET    /v1/files                              ?purpose=&after=&limit=&order=desc
//   GET    /v1/files/{id}
//   GET    /v1/files/{id}/content                 the raw bytes (application/octet-stream)
//   DELETE /v1/files/{id}                         {"id", "object": "file", "deleted": true}
//   POST   /v1/fine_tuning/jobs                   JSON body, passed to CreateJob as is
//   GET    /v1/fine_tuning/jobs                   ?after=&limit=&metadata[k]=v
//   GET    /v1/fine_tuning/jobs/{id}
//   POST   /v1/fine_tuning/jobs/{id}/cancel | pause | resume
//   GET    /v1/fine_tuning/jobs/{id}/events       ?after=&limit=
//   GET    /v1/fine_tuning/jobs/{id}/checkpoints  ?after=&limit=
//
// Lists are OpenAI's `{"object": "list", "data": [...], "has_more": bool}` (files add
// first_id and last_id), newest first; `limit` defaults to 20 (10000 for files) and a page
// holds at most 100 items — has_more tells the client (the openai SDK's auto-pagination
// does) to ask for the next page with `after`.
//
// Errors are OpenAI's shape (llm::OpenAiError) with the status of server/status_mapping.h:
// 400 for bad input, for an operation the job's status does not allow (FailedPrecondition:
// cancelling a finished job, deleting a file a job still needs) and for a taken suffix
// (AlreadyExists; OpenAI answers conflicts with 400 too, and the openai SDK would retry a 409),
// 404 for an unknown id, model or route, 413 for a file over fine_tuning.max_file_bytes (the
// HTTP server answers 413 itself past server.http.max_body_bytes), 405 for a wrong method.
// Without the service (fine_tuning.enabled false) every route answers 404 saying so.
//
// Threading: the service writes SQLite with fsync, so no route runs it on the HTTP I/O
// thread: Handle parses what it can cheaply, then hands the call to this front end's worker
// threads, which answer through the Responder.
#pragma once

#include <memory>

#include "server/core.h"
#include "server/http/http_server.h"

namespace kiln::finetune {

class FineTuningHttp {
 public:
  // `core` (and core->fine_tuning, which may be null) must outlive this object.
  explicit FineTuningHttp(ServerCore* core, int threads = 2);
  // Waits for the calls already handed to the workers (each returns promptly).
  ~FineTuningHttp();
  FineTuningHttp(const FineTuningHttp&) = delete;
  FineTuningHttp& operator=(const FineTuningHttp&) = delete;

  // Answers `request` if its path is /v1/files or /v1/fine_tuning or below them, and returns
  // true (it may move from `request`); returns false, touching nothing, for every
  // other path. Never blocks. Thread-safe.
  bool Handle(http::Request& request, const std::shared_ptr<http::Responder>& responder);

 private:
  struct Workers;
  ServerCore* core_;
  std::unique_ptr<Workers> workers_;
};

}  // namespace kiln::finetune
