#include "server/llm/http_stream.h"

namespace kiln::llm {

void HttpStreamGate::Start(int status, std::string content_type, http::Headers headers,
                           std::string first) {
  absl::MutexLock lock(&mu_);
  r_->StartStream(status, std::move(content_type), std::move(headers));
  started_ = true;
  if (!first.empty()) r_->Write(std::move(first));
  for (auto& chunk : held_) r_->Write(std::move(chunk));
  held_.clear();
  if (finished_) r_->Finish();
}

void HttpStreamGate::Write(std::string chunk) {
  absl::MutexLock lock(&mu_);
  if (finished_) return;
  if (started_) {
    r_->Write(std::move(chunk));
  } else {
    held_.push_back(std::move(chunk));
  }
}

void HttpStreamGate::Finish() {
  absl::MutexLock lock(&mu_);
  if (finished_) return;
  finished_ = true;
  if (started_) r_->Finish();
}

}  // namespace kiln::llm
