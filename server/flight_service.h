// The flight recorder's dumps and the watchdog (docs/operations.md, "Flight recorder and
// watchdog"). Each model records into its own ring (scheduler/flight_recorder.h); this
// gathers the rings of every ready model into one JSON document, writes dumps to
// <server.storage_dir>/flight/, and runs the watchdog.
//
// Dumps to files: RequestDump returns at once; one thread writes. Requests made while a dump
// is pending coalesce into it (a SIGUSR1 storm writes a handful of files, not one per
// signal), and only the newest kKeepFiles dumps are kept. A file appears whole: written to a
// temporary name, then renamed to flight-<UTC time>-<reason>.json.
//
// The watchdog (observability.watchdog_seconds > 0, needs the flight recorder): the same
// thread looks, every min(watchdog_seconds / 4, 1 s), for a step (LLM) or batch (tensor
// model) in progress for longer than watchdog_seconds, and for the requests the LLM loops
// reported (FlightRecorder::ReportStuckRequest). A request makes no progress when
//   - the step or batch it is in does not complete (it is named with that work), or
//   - LLM: it is running (admitted, holding KV blocks) but no step has included it for
//     watchdog_seconds while steps go on — the token budget went to sequences ahead of it
//     (e.g. a higher-priority prompt's prefill). The loop checks this at each step.
// Queued requests are not watched: waiting behind a busy, healthy model is not a hang (queue
// timeouts and deadlines bound it), and when the model is stuck its stuck step is reported,
// with the queued requests' events in the dump. A fire logs an error naming the model, the
// step or batch and its requests (or the request), increments
// kiln_watchdog_fires_total{model} and writes a dump (reason "watchdog") whose "stuck" array
// names them; once per stuck step, batch or request.
//
// Thread-safety: every method is thread-safe.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "config/config.h"
#include "engine/base/metrics.h"
#include "nlohmann/json.hpp"
#include "scheduler/model_repository.h"

namespace kiln {

class FlightService {
 public:
  static constexpr int kKeepFiles = 20;  // dumps kept in <storage_dir>/flight/

  // `config`, `repository` and `registry` must outlive this. Registers
  // kiln_watchdog_fires_total and kiln_flight_dumps_total.
  FlightService(const config::Config& config, ModelRepository* repository,
                metrics::Registry* registry);
  // Stops the thread (see Stop).
  ~FlightService();

  // Starts the writer and watchdog thread.
  void Start();
  // Stops it promptly: a dump being written is finished, pending ones are dropped.
  void Stop();

  // The recorders of the ready models (or only `model` when not empty) as one document:
  //   {"reason", "time", "unix_ns", "watchdog_seconds", "stuck": [...], "models": [<ring>]}
  // NotFound: the flight recorder is off, or no such ready model.
  StatusOr<nlohmann::json> Dump(std::string_view model, std::string_view reason) const;

  // Asks the thread to write a dump to a file (see the file comment); returns at once.
  void RequestDump(std::string_view reason);

  // The directory dumps are written to.
  const std::filesystem::path& dir() const { return dir_; }

 private:
  void Loop();
  // Writes `doc` to a new file; prunes the oldest beyond kKeepFiles.
  void WriteFile(const nlohmann::json& doc, std::string_view reason);
  void Watch();

  const config::Config& config_;
  ModelRepository* const repository_;
  const std::filesystem::path dir_;
  const bool recording_;
  metrics::Family<metrics::Counter>* fires_;
  metrics::Counter* dumps_;

  mutable absl::Mutex mu_;
  std::vector<std::string> pending_ ABSL_GUARDED_BY(mu_);  // reasons of requested dumps
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kiln
