// A small Prometheus metrics registry: counters, gauges and histograms with labels, exposed
// in the Prometheus text format 0.0.4.
//
// Why here and not in server/: every layer records metrics (the engine counts compiled and
// reused kernels, the scheduler observes queue time), and dependencies point toward engine/.
// server/ owns the metric *names* of the front ends and the /metrics endpoint.
//
// Usage (hot path is one atomic add; look the labelled child up once and keep the pointer):
//   metrics::Registry registry;
//   auto& requests = registry.AddCounter("kiln_requests_total", "Requests handled.",
//                                        {"model", "outcome"});
//   metrics::Counter* ok = requests.WithLabels({"simple", "success"});
//   ok->Increment();
//
// Ownership and lifetime: the Registry owns every family and child; pointers returned stay
// valid until the Registry is destroyed. No process-global registry exists: each server
// instance (and each test) makes its own and passes it down.
//
// Thread-safety: every method of every class here is thread-safe. Increment/Set/Observe are
// lock-free; WithLabels takes a per-family mutex (cache its result); Serialize takes the
// registration mutex and each family's mutex briefly.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::metrics {

// A monotonically increasing value. REQUIRES: Increment's argument >= 0.
class Counter {
 public:
  void Increment(double v = 1.0) { value_.fetch_add(v, std::memory_order_relaxed); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down.
class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Increment(double v = 1.0) { value_.fetch_add(v, std::memory_order_relaxed); }
  void Decrement(double v = 1.0) { value_.fetch_sub(v, std::memory_order_relaxed); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Cumulative-bucket histogram. Buckets are upper bounds, strictly increasing; +Inf is
// implicit (a trailing +Inf given explicitly is dropped). A value v falls in the first bucket
// with v <= bound (Prometheus `le`); NaN counts only in +Inf. REQUIRES: bounds are not NaN and
// strictly increasing (checked).
// Snap() reads the buckets and the sum without a lock: under concurrent Observe calls, `sum`
// may lag or lead the counts by the observations in flight (as in other Prometheus clients).
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double v);

  struct Snapshot {
    std::vector<double> upper_bounds;  // without +Inf
    std::vector<uint64_t> cumulative;  // one per bound, then one for +Inf (== count)
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot Snap() const;

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // per bucket (not cumulative), +Inf last
  std::atomic<double> sum_{0.0};
};

// Bucket helpers: {start, start*factor, ...} (count bounds) and {start, start+width, ...}.
std::vector<double> ExponentialBuckets(double start, double factor, int count);
std::vector<double> LinearBuckets(double start, double width, int count);

enum class MetricType { kCounter, kGauge, kHistogram };

// All children of one metric name, one per distinct label-value tuple.
template <typename M>
class Family {
 public:
  // Returns the child for these label values (in the order of the family's label names),
  // creating it on first use. REQUIRES: values.size() == label_names().size() (checked).
  M* WithLabels(std::initializer_list<std::string_view> values);
  M* WithLabels(const std::vector<std::string>& values);
  // Removes a child (e.g. a model was unloaded). Pointers to it become dangling. Removing the
  // only child of a label-less family is allowed but leaves it printing HELP/TYPE only.
  void Remove(const std::vector<std::string>& values);

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

  // For the serializer: calls fn(label_values, child) for each child, in label order.
  void ForEach(const std::function<void(const std::vector<std::string>&, const M&)>& fn) const;

 private:
  friend class Registry;
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         std::vector<double> buckets);
  M* GetOrCreate(std::vector<std::string> values);

  std::string name_, help_;
  std::vector<std::string> label_names_;
  std::vector<double> buckets_;  // histograms only
  mutable std::mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<M>> children_;  // guarded by mu_
};

class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Registers a metric family. Names must match [a-zA-Z_:][a-zA-Z0-9_:]*, label names
  // [a-zA-Z_][a-zA-Z0-9_]* and not start with "__", without duplicates; counters must end in
  // `_total` (promtool's lint; checked); a histogram may not use the label `le`, and its
  // `_bucket`/`_sum`/`_count` sample names may not collide with another family.
  // Registering the same name twice with the same type and labels (and buckets) returns the
  // existing family (the first help text stays); with a different type, labels or buckets it
  // is a programmer error (KILN_CHECK). A label-less family has its single child at once.
  Family<Counter>& AddCounter(std::string name, std::string help,
                              std::vector<std::string> label_names = {});
  Family<Gauge>& AddGauge(std::string name, std::string help,
                          std::vector<std::string> label_names = {});
  Family<Histogram>& AddHistogram(std::string name, std::string help,
                                  std::vector<std::string> label_names,
                                  std::vector<double> buckets);

  // Runs before every Serialize (e.g. to refresh process CPU/RSS gauges). Collectors run
  // outside the registry mutex, so they may look families up (or register them); two scrapes
  // at once run a collector concurrently, so it must be thread-safe.
  void AddCollector(std::function<void()> collector);

  // Prometheus text exposition format 0.0.4 (# HELP, # TYPE, samples; label values escaped;
  // histograms as _bucket{le=...}, _sum, _count). Families in registration order, children
  // in label-value order; a family without children prints only HELP and TYPE. Numbers are
  // the shortest round-trip form, without exponent for decimal exponents in [-4, 21)
  // (so integers print as integers); +Inf, -Inf, NaN. Serve it as
  // `text/plain; version=0.0.4; charset=utf-8`.
  std::string Serialize() const;

 private:
  struct Entry;
  // Registers (or finds) a family of type M; validates names, labels and collisions.
  template <typename M>
  Family<M>* Add(MetricType type, std::string name, std::string help,
                 std::vector<std::string> label_names, std::vector<double> buckets);

  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Entry>> entries_;    // guarded by mu_
  std::vector<std::function<void()>> collectors_;  // guarded by mu_
};

// Registers process metrics on `registry`, refreshed at every scrape from /proc/self (call
// once per registry; values stay 0 where /proc is unavailable, with one warning logged):
//   process_cpu_seconds_total, process_resident_memory_bytes, process_virtual_memory_bytes,
//   process_open_fds, process_max_fds, process_start_time_seconds, process_threads.
void RegisterProcessMetrics(Registry& registry);

}  // namespace kiln::metrics
