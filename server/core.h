// What the front ends share: the model repository, admission control, metrics, and the
// server's readiness. Front ends are adapters over this and scheduler/'s public headers.
#pragma once

#include <atomic>

#include "config/config.h"
#include "engine/base/metrics.h"
#include "scheduler/inflight.h"
#include "scheduler/model_repository.h"
#include "scheduler/trace.h"

namespace kiln {
class Authenticator;
namespace finetune {
class FineTuningService;
}
class FlightService;
class SharedMemoryManager;

struct ServerCore {
  const config::Config* config = nullptr;
  ModelRepository* repository = nullptr;
  InflightLimiter* limiter = nullptr;
  metrics::Registry* registry = nullptr;
  finetune::FineTuningService* fine_tuning = nullptr;  // null: fine_tuning.enabled is false
  // API keys (server/auth.h); every front end asks it before any work. Null: no checks (unit
  // tests that build a core by hand).
  const Authenticator* auth = nullptr;
  FlightService* flight = nullptr;  // flight recorder dumps (server/flight_service.h)
  TraceSink* tracer = nullptr;      // per-request traces (scheduler/trace.h); null: none
  // Registered system shared memory regions (server/shared_memory.h). Null: none can be
  // registered (unit tests that build a core by hand).
  SharedMemoryManager* shared_memory = nullptr;

  std::atomic<bool> started{false};        // start-up finished (models loaded)
  std::atomic<bool> shutting_down{false};  // SIGTERM received: not ready, refuse new work

  bool live() const { return true; }
  bool ready() const { return started.load() && !shutting_down.load(); }
  // Whether a model the repository has READY answers ready (ModelReady, GET .../ready): yes
  // until shutdown. Not tied to ready(): a model serves as soon as it is loaded, while
  // start-up may still be loading others.
  bool model_ready(bool repository_ready) const {
    return repository_ready && !shutting_down.load();
  }

  // Admits a new inference request: Unavailable while shutting down, ResourceExhausted past
  // server.max_inflight_requests.
  StatusOr<InflightLimiter::Ticket> Admit() const {
    if (shutting_down.load()) return Unavailable("the server is shutting down");
    return limiter->Acquire();
  }
};

// Name, version and protocol extensions reported by ServerMetadata.
inline constexpr std::string_view kServerName = "kiln";
std::string_view ServerVersion();
const std::vector<std::string>& ServerExtensions();

}  // namespace kiln
