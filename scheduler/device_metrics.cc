#include "scheduler/device_metrics.h"

#include <string>
#include <vector>

#include "engine/backend/backend.h"

namespace kiln::scheduler {
namespace {

metrics::Family<metrics::Gauge>& Bytes(metrics::Registry& r) {
  return r.AddGauge("kiln_device_memory_bytes",
                    "Device memory: total and free (the device's figure), reserved (held by "
                    "Kiln's allocator), allocated (in live buffers), peak_allocated.",
                    {"device", "kind"});
}
metrics::Family<metrics::Gauge>& Segments(metrics::Registry& r) {
  return r.AddGauge("kiln_device_memory_segments",
                    "Driver allocations Kiln's device allocator holds.", {"device"});
}

}  // namespace

namespace internal {
void CollectDeviceMetrics(metrics::Registry& registry, std::span<backend::Device* const> devices) {
  metrics::Family<metrics::Gauge>& bytes = Bytes(registry);
  metrics::Family<metrics::Gauge>& segments = Segments(registry);
  for (backend::Device* d : devices) {
    const std::string name(d->name());
    // Host devices' figure is the machine's (a /proc read per scrape for nothing): skipped.
    if (d->host_visible()) continue;
    if (StatusOr<backend::DeviceMemoryInfo> m = d->MemoryInfo(); m.ok()) {
      bytes.WithLabels({name, "total"})->Set(static_cast<double>(m->total_bytes));
      bytes.WithLabels({name, "free"})->Set(static_cast<double>(m->free_bytes));
    }
    if (const std::optional<backend::DeviceAllocatorStats> a = d->AllocatorStatistics()) {
      bytes.WithLabels({name, "reserved"})->Set(static_cast<double>(a->reserved_bytes));
      bytes.WithLabels({name, "allocated"})->Set(static_cast<double>(a->allocated_bytes));
      bytes.WithLabels({name, "peak_allocated"})->Set(static_cast<double>(a->peak_allocated_bytes));
      segments.WithLabels({name})->Set(static_cast<double>(a->segments));
    }
  }
}
}  // namespace internal

void RegisterDeviceMetrics(metrics::Registry& registry,
                           std::function<std::vector<backend::Device*>()> devices) {
  Bytes(registry);
  Segments(registry);
  registry.AddCollector([&registry, devices = std::move(devices)] {
    internal::CollectDeviceMetrics(registry, devices());
  });
}

}  // namespace kiln::scheduler
