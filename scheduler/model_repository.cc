#include "scheduler/model_repository.h"

#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"

namespace kiln {

std::string_view ModelStateName(ModelState state) {
  switch (state) {
    case ModelState::kReady:
      return "READY";
    case ModelState::kLoading:
      return "LOADING";
    case ModelState::kUnloading:
      return "UNLOADING";
    case ModelState::kUnavailable:
      return "UNAVAILABLE";
  }
  return "UNAVAILABLE";
}

ModelRepository::ModelRepository(std::vector<config::ModelConfig> models, ModelDeps deps)
    : deps_(std::move(deps)) {
  absl::MutexLock lock(&mu_);
  for (auto& m : models) {
    Entry e;
    e.config = std::move(m);
    e.reason = "not loaded";
    std::string name = e.config.name;
    entries_.emplace(std::move(name), std::move(e));
  }
}

ModelRepository::~ModelRepository() { DrainAll(SteadyClock::now()); }

void ModelRepository::SetStateListener(
    std::function<void(const std::string&, ModelState)> listener) {
  absl::MutexLock lock(&listener_mu_);
  listener_ = std::move(listener);
}

void ModelRepository::Notify(const std::string& name, ModelState state) {
  absl::MutexLock lock(&listener_mu_);
  if (listener_) listener_(name, state);
}

Status ModelRepository::LoadStartupModels() {
  std::vector<std::string> names;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, e] : entries_) {
      if (e.config.load_on_start) names.push_back(name);
    }
  }
  std::vector<std::string> failures;
  for (const auto& name : names) {
    Status s = Load(name);
    if (!s.ok()) failures.push_back(std::string(StatusMessage(s)));
  }
  if (!failures.empty()) {
    return FailedPrecondition(failures.size(), " model(s) failed to load:\n",
                              absl::StrJoin(failures, "\n"));
  }
  return OkStatus();
}

Status ModelRepository::Load(std::string_view name,
                             std::optional<config::ModelConfig> inline_config) {
  config::ModelConfig cfg;
  std::shared_ptr<Model> old;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(name);
    if (it == entries_.end() && !inline_config) {
      return NotFound("no model named '", ToAbsl(name), "' in the configuration");
    }
    if (it == entries_.end()) {
      it = entries_.emplace(std::string(name), Entry{}).first;
    }
    Entry& e = it->second;
    if (e.state == ModelState::kLoading || e.state == ModelState::kUnloading) {
      return FailedPrecondition("model '", ToAbsl(name), "' is ", ModelStateName(e.state),
                                "; try again when it is done");
    }
    if (inline_config) {
      e.config = std::move(*inline_config);
      e.config.name = std::string(name);
    }
    cfg = e.config;
    old = e.model;  // a reload keeps serving the old one until the new one is ready
    if (!old) e.state = ModelState::kLoading;
  }
  if (!old) Notify(std::string(name), ModelState::kLoading);

  const auto start = SteadyClock::now();
  auto loaded = Model::Load(cfg, deps_);
  const double ms = std::chrono::duration<double, std::milli>(SteadyClock::now() - start).count();
  {
    absl::MutexLock lock(&mu_);
    Entry& e = entries_.find(name)->second;
    if (!loaded.ok()) {
      if (!old) {
        e.state = ModelState::kUnavailable;
        e.reason = std::string(StatusMessage(loaded.status()));
      }
    } else {
      e.model = *loaded;
      e.state = ModelState::kReady;
      e.reason.clear();
    }
  }
  if (!loaded.ok()) {
    spdlog::error("model '{}' failed to load: {}", name, StatusMessage(loaded.status()));
    if (!old) Notify(std::string(name), ModelState::kUnavailable);
    return loaded.status();
  }
  spdlog::info("model '{}' loaded in {:.1f} ms ({}, {} instance(s), max_batch_size {})", name, ms,
               cfg.builtin.empty() ? cfg.kind : cfg.builtin, cfg.instance_count,
               cfg.max_batch_size);
  Notify(std::string(name), ModelState::kReady);
  if (old) {
    // The replaced model finishes what it queued; requests hold their own reference.
    old->Drain(SteadyClock::now() + std::chrono::seconds(30));
  }
  return OkStatus();
}

Status ModelRepository::Unload(std::string_view name, SteadyClock::time_point deadline) {
  std::shared_ptr<Model> model;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(name);
    if (it == entries_.end()) {
      return NotFound("no model named '", ToAbsl(name), "'");
    }
    Entry& e = it->second;
    if (e.state == ModelState::kLoading || e.state == ModelState::kUnloading) {
      return FailedPrecondition("model '", ToAbsl(name), "' is ", ModelStateName(e.state),
                                "; try again when it is done");
    }
    if (!e.model) {
      return OkStatus();  // already unloaded: unloading is idempotent, as in Triton
    }
    model = std::move(e.model);
    e.state = ModelState::kUnloading;
  }
  Notify(std::string(name), ModelState::kUnloading);
  const int cut = model->Drain(deadline);
  {
    absl::MutexLock lock(&mu_);
    Entry& e = entries_.find(name)->second;
    e.state = ModelState::kUnavailable;
    e.reason = "unloaded";
  }
  spdlog::info("model '{}' unloaded{}", name,
               cut > 0 ? fmt::format(" ({} request(s) cut off)", cut) : std::string());
  Notify(std::string(name), ModelState::kUnavailable);
  return OkStatus();
}

StatusOr<std::shared_ptr<Model>> ModelRepository::GetReady(std::string_view name,
                                                           std::string_view version) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return NotFound("unknown model '", ToAbsl(name), "'");
  }
  if (!version.empty() && version != kModelVersion) {
    return NotFound("model '", ToAbsl(name), "' has no version '", ToAbsl(version),
                    "'; available versions: ", kModelVersion);
  }
  const Entry& e = it->second;
  if (e.state != ModelState::kReady || !e.model) {
    return Unavailable("model '", ToAbsl(name), "' is not ready (", ModelStateName(e.state),
                       e.reason.empty() ? "" : ": ", e.reason, ")");
  }
  return e.model;
}

std::vector<ModelIndexEntry> ModelRepository::Index(bool ready_only) const {
  absl::MutexLock lock(&mu_);
  std::vector<ModelIndexEntry> out;
  for (const auto& [name, e] : entries_) {
    if (ready_only && e.state != ModelState::kReady) continue;
    out.push_back({name, std::string(kModelVersion), e.state, e.reason});
  }
  return out;
}

std::vector<std::shared_ptr<Model>> ModelRepository::ReadyModels() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Model>> out;
  for (const auto& [name, e] : entries_) {
    if (e.state == ModelState::kReady && e.model) out.push_back(e.model);
  }
  return out;
}

size_t ModelRepository::pending() const {
  size_t n = 0;
  for (const auto& m : ReadyModels()) n += m->pending();
  return n;
}

int ModelRepository::DrainAll(SteadyClock::time_point deadline) {
  std::vector<std::shared_ptr<Model>> models;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [name, e] : entries_) {
      if (e.model) models.push_back(e.model);
    }
  }
  int cut = 0;
  for (auto& m : models) cut += m->Drain(deadline);
  return cut;
}

}  // namespace kiln
