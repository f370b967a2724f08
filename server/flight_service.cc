#include "server/flight_service.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <fstream>

#include "spdlog/spdlog.h"

namespace kiln {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// A reason as it may appear in a file name: [A-Za-z0-9_-], at most 40 characters.
std::string FileSafe(std::string_view reason) {
  std::string out;
  for (char c : reason.substr(0, 40)) {
    out += std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' ? c : '_';
  }
  return out.empty() ? "dump" : out;
}

// "20261126T021503.123456Z": sorts as time does.
std::string FileTime(int64_t unix_ns) {
  std::string iso = FlightIsoTime(unix_ns);  // 2026-11-26T02:15:03.123456Z
  std::erase(iso, '-');
  std::erase(iso, ':');
  return iso;
}

json StuckJson(const std::vector<FlightStuckWork>& stuck) {
  json out = json::array();
  for (const FlightStuckWork& s : stuck) {
    out.push_back({{"model", s.model},
                   {"kind", s.kind},
                   {"id", s.id},
                   {"seconds", s.seconds},
                   {"requests", s.requests}});
  }
  return out;
}

}  // namespace

FlightService::FlightService(const config::Config& config, ModelRepository* repository,
                             metrics::Registry* registry)
    : config_(config),
      repository_(repository),
      dir_(fs::path(config.server.storage_dir) / "flight"),
      recording_(config.observability.flight_recorder.enabled) {
  fires_ = &registry->AddCounter("kiln_watchdog_fires_total",
                                 "Steps or batches in progress, or running LLM requests left out "
                                 "of steps, for longer than observability.watchdog_seconds.",
                                 {"model"});
  dumps_ = registry
               ->AddCounter("kiln_flight_dumps_total",
                            "Flight recorder dumps written to <storage_dir>/flight/.")
               .WithLabels({});
}

FlightService::~FlightService() { Stop(); }

void FlightService::Start() {
  absl::MutexLock lock(&mu_);
  if (started_) return;
  started_ = true;
  if (config_.observability.watchdog_seconds > 0 && !recording_) {
    spdlog::warn(
        "observability.watchdog_seconds is {} but the flight recorder is off: the watchdog "
        "needs it and is off too",
        config_.observability.watchdog_seconds);
  }
  thread_ = std::thread([this] { Loop(); });
}

void FlightService::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

StatusOr<json> FlightService::Dump(std::string_view model, std::string_view reason) const {
  if (!recording_) {
    return NotFound(
        "the flight recorder is off (observability.flight_recorder.enabled: false); turn it on "
        "in the configuration to record steps, batches and request state changes");
  }
  const int64_t now = FlightWallNs();
  json doc{{"reason", reason},
           {"time", FlightIsoTime(now)},
           {"unix_ns", now},
           {"entries", config_.observability.flight_recorder.entries},
           {"watchdog_seconds", config_.observability.watchdog_seconds},
           {"stuck", json::array()}};
  json& models = doc["models"] = json::array();
  for (const std::shared_ptr<Model>& m : repository_->ReadyModels()) {
    if (!model.empty() && m->name() != model) continue;
    if (const FlightRecorder* rec = m->flight_recorder()) models.push_back(rec->ToJson());
  }
  if (!model.empty() && models.empty()) {
    return NotFound("no ready model '", model, "' to show the flight recorder of");
  }
  return doc;
}

void FlightService::RequestDump(std::string_view reason) {
  absl::MutexLock lock(&mu_);
  // Coalesce: a reason already pending is not added again.
  if (std::find(pending_.begin(), pending_.end(), reason) == pending_.end()) {
    pending_.emplace_back(reason);
  }
}

void FlightService::Loop() {
  const double limit = recording_ ? config_.observability.watchdog_seconds : 0;
  const absl::Duration tick =
      limit > 0 ? std::clamp(absl::Seconds(limit / 4), absl::Milliseconds(10), absl::Seconds(1))
                : absl::InfiniteDuration();
  absl::MutexLock lock(&mu_);
  for (;;) {
    auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !pending_.empty(); };
    mu_.AwaitWithTimeout(absl::Condition(&woken), tick);
    if (stop_) return;
    std::vector<std::string> reasons = std::move(pending_);
    pending_.clear();
    mu_.Unlock();
    if (limit > 0) Watch();
    if (!reasons.empty()) {
      std::string reason;
      for (const std::string& r : reasons) reason += (reason.empty() ? "" : "+") + r;
      StatusOr<json> doc = Dump("", reason);
      if (doc.ok()) {
        WriteFile(*doc, reason);
      } else {
        spdlog::warn("flight recorder dump ({}) not written: {}", reason,
                     StatusMessage(doc.status()));
      }
    }
    mu_.Lock();
  }
}

void FlightService::Watch() {
  const auto limit = std::chrono::duration_cast<SteadyClock::duration>(
      std::chrono::duration<double>(config_.observability.watchdog_seconds));
  std::vector<FlightStuckWork> stuck;
  for (const std::shared_ptr<Model>& m : repository_->ReadyModels()) {
    FlightRecorder* rec = m->flight_recorder();
    if (rec == nullptr) continue;
    for (FlightStuckWork& s : rec->FindStuck(SteadyClock::now(), limit)) {
      std::string requests;
      for (const std::string& r : s.requests) requests += (requests.empty() ? "" : ", ") + r;
      if (s.kind == "request") {
        spdlog::error(
            "watchdog: model '{}': running request {} was left out of every step for {:.1f} s "
            "(watchdog_seconds {})",
            s.model, requests, s.seconds, config_.observability.watchdog_seconds);
      } else {
        spdlog::error(
            "watchdog: model '{}': {} {} has been in progress for {:.1f} s (watchdog_seconds {}) "
            "with {} request(s): {}",
            s.model, s.kind, s.id, s.seconds, config_.observability.watchdog_seconds,
            s.requests.size(), requests.empty() ? "(none)" : requests);
      }
      fires_->WithLabels({s.model})->Increment();
      stuck.push_back(std::move(s));
    }
  }
  if (stuck.empty()) return;
  StatusOr<json> doc = Dump("", "watchdog");
  if (!doc.ok()) return;
  (*doc)["stuck"] = StuckJson(stuck);
  WriteFile(*doc, "watchdog");
}

void FlightService::WriteFile(const json& doc, std::string_view reason) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) {
    spdlog::error("flight recorder dump not written: cannot create {}: {}", dir_.string(),
                  ec.message());
    return;
  }
  const std::string stem = "flight-" + FileTime(FlightWallNs()) + "-" + FileSafe(reason);
  fs::path path = dir_ / (stem + ".json");
  for (int i = 1; fs::exists(path); ++i) path = dir_ / (stem + "-" + std::to_string(i) + ".json");
  const fs::path tmp = dir_ / (".tmp-" + path.filename().string());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << doc.dump(1, ' ', false, json::error_handler_t::replace) << '\n';
    out.close();
    if (!out) {
      spdlog::error("flight recorder dump not written: writing {} failed", tmp.string());
      fs::remove(tmp, ec);
      return;
    }
  }
  fs::rename(tmp, path, ec);
  if (ec) {
    spdlog::error("flight recorder dump not written: renaming {} failed: {}", tmp.string(),
                  ec.message());
    fs::remove(tmp, ec);
    return;
  }
  dumps_->Increment();
  spdlog::info("flight recorder dump ({}) written to {}", reason, path.string());
  // Keep the newest kKeepFiles (names sort by time).
  std::vector<fs::path> files;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_, ec)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("flight-") && name.ends_with(".json")) files.push_back(e.path());
  }
  if (files.size() <= static_cast<size_t>(kKeepFiles)) return;
  std::sort(files.begin(), files.end());
  for (size_t i = 0; i + kKeepFiles < files.size(); ++i) fs::remove(files[i], ec);
}

}  // namespace kiln
