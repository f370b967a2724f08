// Device memory as Prometheus metrics, refreshed at every scrape:
//   kiln_device_memory_bytes{device, kind}: kind `total` and `free` (the device's MemoryInfo:
//     the driver's figure, Kiln's cached blocks counted free), `reserved` (taken from the
//     driver by Kiln's allocator: live buffers + cache), `allocated` (live buffers) and
//     `peak_allocated`;
//   kiln_device_memory_segments{device}: driver allocations the allocator holds.
// For every device `devices` lists that reports them (GPUs: `cuda:0`, OpenCL devices); host
// devices (cpu, ref) report none and are left out. kilnd passes every registered backend's
// devices (models::RegisteredDevices); the scheduler itself does not depend on the backends.
//
// Thread-safety: the collector is thread-safe (the backends' figures are).
#pragma once

#include <functional>
#include <span>
#include <vector>

#include "engine/base/metrics.h"

namespace kiln::backend {
class Device;
}

namespace kiln::scheduler {

// Registers the families and a collector over the devices `devices` returns at each scrape.
void RegisterDeviceMetrics(metrics::Registry& registry,
                           std::function<std::vector<backend::Device*>()> devices);

namespace internal {
// One scrape's refresh over `devices` (the collector's body; for tests).
void CollectDeviceMetrics(metrics::Registry& registry, std::span<backend::Device* const> devices);
}  // namespace internal

}  // namespace kiln::scheduler
