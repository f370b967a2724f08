// The set of models a server knows (from its configuration, or loaded over the API), their
// states, and access to the ready ones. Front ends reach models only through here.
//
// States follow Triton's repository API: READY, UNAVAILABLE (not loaded, unloaded, or failed
// to load, with a reason), LOADING, UNLOADING. Every model is served as version "1".
//
// Thread-safety: every method is thread-safe. Load and Unload block while the model loads or
// drains; call them off I/O threads. Loads and unloads of one model are serialized: each waits
// for the one under way (as in Triton), so a load returns once the model is READY or failed.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "config/config.h"
#include "scheduler/model.h"

namespace kiln {

enum class ModelState { kUnavailable, kLoading, kReady, kUnloading };
std::string_view ModelStateName(ModelState state);  // "READY", ...

// A LoRA adapter served on top of an LLM (multi-LoRA): requests name it as their model.
struct LoraAdapterInfo {
  std::string name;
  std::string base_model;
  std::string path;  // its PEFT folder
};

struct ModelIndexEntry {
  std::string name;
  std::string version;
  ModelState state = ModelState::kUnavailable;
  std::string reason;  // why it is not READY
};

class ModelRepository {
 public:
  // Nothing is loaded yet; `deps` is what loading needs (see model.h).
  ModelRepository(std::vector<config::ModelConfig> models, ModelDeps deps);
  // Drains every model with an immediate deadline.
  ~ModelRepository();

  // Loads every configured model with load_on_start, one after the other; each is READY (and
  // served) as soon as it is loaded. All are attempted; returns an error listing every model
  // that failed (they stay UNAVAILABLE with the reason).
  Status LoadStartupModels();

  // Loads a configured model by name, or (re)loads it with `inline_config` replacing its
  // configuration — which may also add a model not in the configuration file. A READY model
  // is reloaded: the new one serves new requests, the old one drains in the background; if
  // the reload fails, the old one keeps serving with its configuration (CurrentConfig).
  // Returns once the model is READY (OK) or failed to load (the reason).
  // While a load of the same model is under way (start-up's, or another client's), a load
  // without `inline_config` waits for it and returns its outcome instead of loading again;
  // one with `inline_config`, like one that finds the model unloading, waits for it and then
  // loads. NotFound for an unknown name without inline config.
  Status Load(std::string_view name, std::optional<config::ModelConfig> inline_config = {});

  // Stops serving a model: new requests fail at once, queued and executing ones finish until
  // `deadline`, then the model is released. A load or unload under way is waited for first.
  // NotFound for an unknown name.
  Status Unload(std::string_view name, SteadyClock::time_point deadline);

  // The ready model, or NotFound (unknown name or version) / Unavailable (known, not ready).
  // `version` may be "" (latest) or "1".
  StatusOr<std::shared_ptr<Model>> GetReady(std::string_view name,
                                            std::string_view version = "") const;

  // The same where a name may also be a LoRA adapter (the KServe routes): for an adapter, its
  // base model, with `*adapter` set to the adapter's name (else cleared). REQUIRES: adapter.
  StatusOr<std::shared_ptr<Model>> GetReady(std::string_view name, std::string_view version,
                                            std::string* adapter) const;
  // The configuration a load of `name` would use now (what a partial configuration in a load
  // request is merged into), or nullopt for an unknown name.
  std::optional<config::ModelConfig> CurrentConfig(std::string_view name) const;

  // The models by name; `with_adapters` (KServe's repository index) appends the LoRA adapters
  // by name, each in its base model's state.
  std::vector<ModelIndexEntry> Index(bool ready_only = false, bool with_adapters = false) const;

  // ---- LoRA adapters (multi-LoRA serving; see ContinuousBatcher) ----
  // Reads the PEFT folder `path` on the caller's thread and serves it as `name` on the READY
  // LLM `base_model`. The adapter is remembered with the model's entry: a reload of the model
  // adds it again (configured `adapters:` are added the same way when the model loads).
  // Errors: AlreadyExists (`name` names a model or an adapter); NotFound (unknown base model,
  // or a folder without adapter_config.json / adapter_model.safetensors, naming the path);
  // Unavailable (base not READY); InvalidArgument (not an LLM, a bad name, an adapter whose
  // rank or shapes do not fit the base, naming the path and the limit); FailedPrecondition
  // (the base has max_loaded_adapters 0).
  Status AddLoraAdapter(const std::string& name, const std::string& base_model,
                        const std::string& path);
  // Stops serving adapter `name` (requests already queued or running keep it until they
  // end) and forgets it (a reload does not add it again). NotFound for an unknown name.
  Status RemoveLoraAdapter(std::string_view name);
  // Every adapter of every model (also of models not loaded), sorted by name.
  std::vector<LoraAdapterInfo> LoraAdapters() const;
  // The adapter `name`, if there is one.
  std::optional<LoraAdapterInfo> FindLoraAdapter(std::string_view name) const;
  std::vector<std::shared_ptr<Model>> ReadyModels() const;

  // Requests queued or executing across all models.
  size_t pending() const;

  // Shutdown: drains every model until `deadline`; returns requests cut off.
  int DrainAll(SteadyClock::time_point deadline);

  // Called after every state change (readiness for gRPC health, for example). Called with no
  // repository lock held, possibly from several threads.
  void SetStateListener(std::function<void(const std::string& name, ModelState state)> listener);

 private:
  // What is being done to a model; one thing at a time.
  enum class Operation { kNone, kLoad, kUnload };
  struct Entry {
    config::ModelConfig config;
    ModelState state = ModelState::kUnavailable;
    std::string reason;
    std::shared_ptr<Model> model;  // set when READY
    Operation operation = Operation::kNone;
    // Loads that join the one under way wait for `loads_finished` to pass it, then return
    // `last_load`, the outcome of the latest.
    uint64_t loads_finished = 0;
    Status last_load;
  };
  void Notify(const std::string& name, ModelState state);
  // Waits until no load or unload of `e` (named `name`) is under way; `what` ("a load
  // request") says in the log what waits.
  void AwaitIdleLocked(std::string_view name, const Entry& e, std::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The entry whose config lists adapter `name`, with the adapter's index; null if none.
  std::pair<const Entry*, size_t> FindAdapterLocked(std::string_view name) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ModelDeps deps_;
  absl::Mutex adapters_mu_;  // serializes AddLoraAdapter / RemoveLoraAdapter (taken before mu_)
  mutable absl::Mutex mu_;
  std::map<std::string, Entry, std::less<>> entries_ ABSL_GUARDED_BY(mu_);
  absl::Mutex listener_mu_;
  std::function<void(const std::string&, ModelState)> listener_ ABSL_GUARDED_BY(listener_mu_);
};

}  // namespace kiln
