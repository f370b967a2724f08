#include "scheduler/model_repository.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "models/llm/llm_model.h"
#include "scheduler/llm/continuous_batcher.h"
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
    : deps_([&] {
        // A draft model may name another entry (called by Model::Load, outside mu_).
        deps.find_model = [this](const std::string& name) -> std::optional<config::ModelConfig> {
          absl::MutexLock lock(&mu_);
          auto it = entries_.find(name);
          if (it == entries_.end()) return std::nullopt;
          return it->second.config;
        };
        return std::move(deps);
      }()) {
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

void ModelRepository::AwaitIdleLocked(std::string_view name, const Entry& e,
                                      std::string_view what) {
  if (e.operation == Operation::kNone) return;
  spdlog::info("model '{}': {} waits for the {} under way", name, what,
               e.operation == Operation::kLoad ? "load" : "unload");
  auto idle = [&e] { return e.operation == Operation::kNone; };
  mu_.Await(absl::Condition(&idle));
}

Status ModelRepository::Load(std::string_view name,
                             std::optional<config::ModelConfig> inline_config) {
  config::ModelConfig cfg, previous;
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
    Entry& e = it->second;  // entries are never erased: the reference outlives the waits
    if (e.operation == Operation::kLoad && !inline_config) {
      // The same load is already under way (start-up's, or another client's): it loads the
      // configuration this one would, so its outcome is this one's.
      spdlog::info("model '{}': a load request joins the load under way", name);
      const uint64_t joined = e.loads_finished + 1;
      auto finished = [&e, joined] { return e.loads_finished >= joined; };
      mu_.Await(absl::Condition(&finished));
      return e.last_load;
    }
    AwaitIdleLocked(name, e, "a load request");
    e.operation = Operation::kLoad;
    previous = e.config;
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
      } else {
        e.config = std::move(previous);  // the entry describes the model still served
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
  } else {
    spdlog::info("model '{}' loaded in {:.1f} ms ({}, {} instance(s), max_batch_size {})", name, ms,
                 cfg.builtin.empty() ? cfg.kind : cfg.builtin, cfg.instance_count,
                 cfg.max_batch_size);
    Notify(std::string(name), ModelState::kReady);
  }
  {
    // Only now (the listener told: gRPC health agrees) are the loads that joined this one
    // answered, and the loads and unloads waiting for it let in.
    absl::MutexLock lock(&mu_);
    Entry& e = entries_.find(name)->second;
    e.last_load = loaded.status();
    ++e.loads_finished;
    e.operation = Operation::kNone;
  }
  if (!loaded.ok()) return loaded.status();
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
    AwaitIdleLocked(name, e, "an unload request");
    if (!e.model) {
      return OkStatus();  // already unloaded: unloading is idempotent, as in Triton
    }
    model = std::move(e.model);
    e.state = ModelState::kUnloading;
    e.operation = Operation::kUnload;
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
  {
    // After the listener: a load waiting for this unload tells it READY only later.
    absl::MutexLock lock(&mu_);
    entries_.find(name)->second.operation = Operation::kNone;
  }
  return OkStatus();
}

StatusOr<std::shared_ptr<Model>> ModelRepository::GetReady(std::string_view name,
                                                           std::string_view version) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    // Triton's wording: tritonclient's examples (simple_http_infer_client.py, the aio and
    // health/metadata ones) check that the message starts with "Request for unknown model".
    return NotFound("Request for unknown model: '", ToAbsl(name), "' is not found");
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

StatusOr<std::shared_ptr<Model>> ModelRepository::GetReady(std::string_view name,
                                                           std::string_view version,
                                                           std::string* adapter) const {
  adapter->clear();
  StatusOr<std::shared_ptr<Model>> model = GetReady(name, version);
  if (model.ok() || model.status().code() != absl::StatusCode::kNotFound) return model;
  std::optional<LoraAdapterInfo> a = FindLoraAdapter(name);
  if (!a) return model;
  StatusOr<std::shared_ptr<Model>> base = GetReady(a->base_model, version);
  if (base.ok()) *adapter = a->name;
  return base;
}

std::optional<config::ModelConfig> ModelRepository::CurrentConfig(std::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(name);
  if (it == entries_.end()) return std::nullopt;
  return it->second.config;
}

std::vector<ModelIndexEntry> ModelRepository::Index(bool ready_only, bool with_adapters) const {
  absl::MutexLock lock(&mu_);
  std::vector<ModelIndexEntry> out, adapters;
  for (const auto& [name, e] : entries_) {
    if (ready_only && e.state != ModelState::kReady) continue;
    out.push_back({name, std::string(kModelVersion), e.state, e.reason});
    if (!with_adapters) continue;
    for (const config::LoraAdapterConfig& a : e.config.adapters) {
      adapters.push_back({a.name, std::string(kModelVersion), e.state,
                          e.state == ModelState::kReady
                              ? std::string()
                              : absl::StrCat("its base model '", name, "' is not ready")});
    }
  }
  std::sort(adapters.begin(), adapters.end(),
            [](const ModelIndexEntry& a, const ModelIndexEntry& b) { return a.name < b.name; });
  out.insert(out.end(), std::make_move_iterator(adapters.begin()),
             std::make_move_iterator(adapters.end()));
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

std::pair<const ModelRepository::Entry*, size_t> ModelRepository::FindAdapterLocked(
    std::string_view name) const {
  for (const auto& [model, e] : entries_) {
    for (size_t i = 0; i < e.config.adapters.size(); ++i) {
      if (e.config.adapters[i].name == name) return {&e, i};
    }
  }
  return {nullptr, 0};
}

Status ModelRepository::AddLoraAdapter(const std::string& name, const std::string& base_model,
                                       const std::string& path) {
  absl::MutexLock adding(&adapters_mu_);
  std::shared_ptr<Model> model;
  {
    absl::MutexLock lock(&mu_);
    if (entries_.count(name)) {
      return AlreadyExists("'", name, "' is the name of a model; pick another adapter name");
    }
    if (const auto [e, i] = FindAdapterLocked(name); e != nullptr) {
      return AlreadyExists("adapter '", name, "' already exists (on model '", e->config.name,
                           "', from ", e->config.adapters[i].path, ")");
    }
  }
  const bool valid_name =
      !name.empty() && name.size() <= 128 && std::all_of(name.begin(), name.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) ||
               std::string_view("_.:-").find(c) != std::string_view::npos;
      });
  if (!valid_name) {
    return InvalidArgument("adapter name '", name,
                           "' is not valid: use 1 to 128 of A-Z a-z 0-9 _ . : -");
  }
  KILN_ASSIGN_OR_RETURN(model, GetReady(base_model));
  if (!model->is_llm()) {
    return InvalidArgument("model '", base_model,
                           "' is a tensor model; LoRA adapters are for LLMs (kind llm)");
  }
  if (model->llm()->model().max_adapters() == 0) {
    return FailedPrecondition("model '", base_model,
                              "' serves no LoRA adapters (its max_loaded_adapters is 0)");
  }
  KILN_ASSIGN_OR_RETURN(auto adapter, model->llm()->model().ReadAdapter(path));
  KILN_RETURN_IF_ERROR(model->llm()->AddAdapter(name, std::move(adapter)));
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(base_model);
    if (it != entries_.end()) {
      config::LoraAdapterConfig a;
      a.name = name;
      a.path = path;
      a.runtime = true;
      it->second.config.adapters.push_back(std::move(a));
    }
  }
  spdlog::info("model '{}': serving LoRA adapter '{}' from {}", base_model, name, path);
  return OkStatus();
}

Status ModelRepository::RemoveLoraAdapter(std::string_view name) {
  absl::MutexLock adding(&adapters_mu_);
  std::shared_ptr<Model> model;
  {
    absl::MutexLock lock(&mu_);
    const auto [found, i] = FindAdapterLocked(name);
    if (found == nullptr) return NotFound("no LoRA adapter named '", ToAbsl(name), "'");
    Entry& e = entries_.find(found->config.name)->second;
    e.config.adapters.erase(e.config.adapters.begin() + static_cast<std::ptrdiff_t>(i));
    if (e.state == ModelState::kReady) model = e.model;
  }
  if (model && model->is_llm()) (void)model->llm()->RemoveAdapter(name);  // absent: fine
  spdlog::info("LoRA adapter '{}' removed", name);
  return OkStatus();
}

std::vector<LoraAdapterInfo> ModelRepository::LoraAdapters() const {
  absl::MutexLock lock(&mu_);
  std::vector<LoraAdapterInfo> out;
  for (const auto& [model, e] : entries_) {
    for (const config::LoraAdapterConfig& a : e.config.adapters) {
      out.push_back({a.name, model, a.path});
    }
  }
  std::sort(out.begin(), out.end(),
            [](const LoraAdapterInfo& a, const LoraAdapterInfo& b) { return a.name < b.name; });
  return out;
}

std::optional<LoraAdapterInfo> ModelRepository::FindLoraAdapter(std::string_view name) const {
  absl::MutexLock lock(&mu_);
  const auto [e, i] = FindAdapterLocked(name);
  if (e == nullptr) return std::nullopt;
  return LoraAdapterInfo{e->config.adapters[i].name, e->config.name, e->config.adapters[i].path};
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
