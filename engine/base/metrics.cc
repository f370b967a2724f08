#include "engine/base/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/base/status.h"

namespace kiln::metrics {
namespace {

bool IsNameChar(char c, bool first, bool allow_colon) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_') return true;
  if (allow_colon && c == ':') return true;
  return !first && c >= '0' && c <= '9';
}

bool IsValidName(std::string_view s, bool allow_colon) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    if (!IsNameChar(s[i], i == 0, allow_colon)) return false;
  }
  return true;
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// Shortest round-trip form; integers (and every value with a decimal exponent in [-4, 21))
// print without an exponent, like Go's strconv 'g' -1 that Prometheus itself uses.
void AppendNumber(std::string& out, double v) {
  if (std::isnan(v)) {
    out += "NaN";
    return;
  }
  if (std::isinf(v)) {
    out += v > 0 ? "+Inf" : "-Inf";
    return;
  }
  char buf[64];
  auto sci = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  std::string_view s(buf, sci.ptr - buf);
  int exponent = 0;
  size_t e = s.find('e');
  std::from_chars(s.data() + e + (s[e + 1] == '+' ? 2 : 1), s.data() + s.size(), exponent);
  if (exponent >= -4 && exponent < 21) {
    auto fixed = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::fixed);
    s = std::string_view(buf, fixed.ptr - buf);
  }
  out.append(s);
}

void AppendNumber(std::string& out, uint64_t v) {
  char buf[32];
  auto r = std::to_chars(buf, buf + sizeof(buf), v);
  out.append(buf, r.ptr);
}

void AppendEscaped(std::string& out, std::string_view s, bool escape_quote) {
  for (char c : s) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '"':
        out += escape_quote ? "\\\"" : "\"";
        break;
      default:
        out += c;
    }
  }
}

// Appends `{a="x",b="y"}` (or nothing when there are no labels). `extra_name`/`extra_value`
// is the histogram's `le` label, appended last.
void AppendLabels(std::string& out, const std::vector<std::string>& names,
                  const std::vector<std::string>& values, std::string_view extra_name = {},
                  std::string_view extra_value = {}) {
  if (names.empty() && extra_name.empty()) return;
  out += '{';
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += ',';
    out += names[i];
    out += "=\"";
    AppendEscaped(out, values[i], /*escape_quote=*/true);
    out += '"';
  }
  if (!extra_name.empty()) {
    if (!names.empty()) out += ',';
    out += extra_name;
    out += "=\"";
    out += extra_value;
    out += '"';
  }
  out += '}';
}

template <typename V>
void AppendSample(std::string& out, std::string_view name, std::string_view suffix,
                  const std::vector<std::string>& label_names,
                  const std::vector<std::string>& values, V v, std::string_view extra_name = {},
                  std::string_view extra_value = {}) {
  out += name;
  out += suffix;
  AppendLabels(out, label_names, values, extra_name, extra_value);
  out += ' ';
  AppendNumber(out, v);
  out += '\n';
}

const char* TypeName(MetricType t) {
  switch (t) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

// The sample names a family of this type writes: a histogram `x` also owns `x_bucket`,
// `x_sum` and `x_count`, which no other family may use.
std::vector<std::string> SampleNames(const std::string& name, MetricType type) {
  if (type != MetricType::kHistogram) return {name};
  return {name, name + "_bucket", name + "_sum", name + "_count"};
}

// A trailing +Inf is implicit; accept it when given explicitly. Aborts on NaN or bounds that
// are not strictly increasing (programmer errors).
void NormalizeBuckets(std::vector<double>& bounds) {
  if (!bounds.empty() && std::isinf(bounds.back()) && bounds.back() > 0) bounds.pop_back();
  for (size_t i = 0; i < bounds.size(); ++i) {
    KILN_CHECK(!std::isnan(bounds[i]), "histogram bucket bound is NaN");
    KILN_CHECK(i == 0 || bounds[i - 1] < bounds[i],
               "histogram bucket bounds must be strictly increasing (and below +Inf)");
  }
}

}  // namespace

// ---- Histogram -------------------------------------------------------------------------------

Histogram::Histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)) {
  NormalizeBuckets(bounds_);
  counts_ = std::make_unique<std::atomic<uint64_t>[]>(bounds_.size() + 1);
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double v) {
  // Buckets are `le` (less than or equal): the first bound >= v. NaN lands in +Inf only.
  size_t i = std::isnan(v)
                 ? bounds_.size()
                 : static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) -
                                       bounds_.begin());
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::Snap() const {
  Snapshot s;
  s.upper_bounds = bounds_;
  s.cumulative.resize(bounds_.size() + 1);
  uint64_t running = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    running += counts_[i].load(std::memory_order_relaxed);
    s.cumulative[i] = running;
  }
  s.count = running;
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  KILN_CHECK(start > 0, "ExponentialBuckets: start must be > 0");
  KILN_CHECK(factor > 1, "ExponentialBuckets: factor must be > 1");
  KILN_CHECK(count >= 1, "ExponentialBuckets: count must be >= 1");
  std::vector<double> out;
  out.reserve(count);
  double v = start;
  for (int i = 0; i < count; ++i, v *= factor) out.push_back(v);
  return out;
}

std::vector<double> LinearBuckets(double start, double width, int count) {
  KILN_CHECK(width > 0, "LinearBuckets: width must be > 0");
  KILN_CHECK(count >= 1, "LinearBuckets: count must be >= 1");
  std::vector<double> out;
  out.reserve(count);
  // start + i*width rather than repeated addition, so bounds do not drift (0.1+0.1+0.1).
  for (int i = 0; i < count; ++i) out.push_back(start + i * width);
  return out;
}

// ---- Family ----------------------------------------------------------------------------------

template <typename M>
Family<M>::Family(std::string name, std::string help, std::vector<std::string> label_names,
                  std::vector<double> buckets)
    : name_(std::move(name)),
      help_(std::move(help)),
      label_names_(std::move(label_names)),
      buckets_(std::move(buckets)) {
  // A label-less family always exposes its single child, even before the first update.
  if (label_names_.empty()) GetOrCreate({});
}

template <typename M>
M* Family<M>::WithLabels(std::initializer_list<std::string_view> values) {
  std::vector<std::string> v;
  v.reserve(values.size());
  for (std::string_view s : values) v.emplace_back(s);
  return GetOrCreate(std::move(v));
}

template <typename M>
M* Family<M>::WithLabels(const std::vector<std::string>& values) {
  return GetOrCreate(values);
}

template <typename M>
void Family<M>::Remove(const std::vector<std::string>& values) {
  std::lock_guard<std::mutex> lock(mu_);
  children_.erase(values);
}

template <typename M>
void Family<M>::ForEach(
    const std::function<void(const std::vector<std::string>&, const M&)>& fn) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [values, child] : children_) fn(values, *child);
}

template <typename M>
M* Family<M>::GetOrCreate(std::vector<std::string> values) {
  KILN_CHECK(values.size() == label_names_.size(),
             absl::StrCat("metric ", name_, ": got ", values.size(),
                          " label values but the family has labels {",
                          absl::StrJoin(label_names_, ","), "}")
                 .c_str());
  std::lock_guard<std::mutex> lock(mu_);
  auto it = children_.find(values);
  if (it != children_.end()) return it->second.get();
  std::unique_ptr<M> child;
  if constexpr (std::is_same_v<M, Histogram>) {
    child = std::make_unique<Histogram>(buckets_);
  } else {
    child = std::make_unique<M>();
  }
  M* raw = child.get();
  children_.emplace(std::move(values), std::move(child));
  return raw;
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

// ---- Registry --------------------------------------------------------------------------------

struct Registry::Entry {
  MetricType type;
  std::unique_ptr<Family<Counter>> counter;
  std::unique_ptr<Family<Gauge>> gauge;
  std::unique_ptr<Family<Histogram>> histogram;

  const std::string& name() const {
    switch (type) {
      case MetricType::kCounter:
        return counter->name();
      case MetricType::kGauge:
        return gauge->name();
      case MetricType::kHistogram:
        break;
    }
    return histogram->name();
  }
  const std::vector<std::string>& label_names() const {
    switch (type) {
      case MetricType::kCounter:
        return counter->label_names();
      case MetricType::kGauge:
        return gauge->label_names();
      case MetricType::kHistogram:
        break;
    }
    return histogram->label_names();
  }
};

Registry::Registry() = default;
Registry::~Registry() = default;

namespace {

// Validates a registration; aborts on a programmer error (bad name, label, or buckets).
void ValidateRegistration(const std::string& name, MetricType type,
                          const std::vector<std::string>& label_names) {
  KILN_CHECK(IsValidName(name, /*allow_colon=*/true),
             absl::StrCat("metric name `", name, "` must match [a-zA-Z_:][a-zA-Z0-9_:]*").c_str());
  KILN_CHECK(type != MetricType::kCounter || EndsWith(name, "_total"),
             absl::StrCat("counter `", name, "` must end in `_total`").c_str());
  for (size_t i = 0; i < label_names.size(); ++i) {
    const std::string& l = label_names[i];
    KILN_CHECK(IsValidName(l, /*allow_colon=*/false) && l.rfind("__", 0) != 0,
               absl::StrCat("metric ", name, ": label name `", l,
                            "` must match [a-zA-Z_][a-zA-Z0-9_]* and not start with `__`")
                   .c_str());
    KILN_CHECK(type != MetricType::kHistogram || l != "le",
               absl::StrCat("histogram ", name, ": label name `le` is reserved").c_str());
    for (size_t j = 0; j < i; ++j) {
      KILN_CHECK(label_names[j] != l,
                 absl::StrCat("metric ", name, ": duplicate label name `", l, "`").c_str());
    }
  }
}

}  // namespace

Family<Counter>& Registry::AddCounter(std::string name, std::string help,
                                      std::vector<std::string> label_names) {
  return *Add<Counter>(MetricType::kCounter, std::move(name), std::move(help),
                       std::move(label_names), {});
}

Family<Gauge>& Registry::AddGauge(std::string name, std::string help,
                                  std::vector<std::string> label_names) {
  return *Add<Gauge>(MetricType::kGauge, std::move(name), std::move(help), std::move(label_names),
                     {});
}

Family<Histogram>& Registry::AddHistogram(std::string name, std::string help,
                                          std::vector<std::string> label_names,
                                          std::vector<double> buckets) {
  NormalizeBuckets(buckets);
  return *Add<Histogram>(MetricType::kHistogram, std::move(name), std::move(help),
                         std::move(label_names), std::move(buckets));
}

template <typename M>
Family<M>* Registry::Add(MetricType type, std::string name, std::string help,
                         std::vector<std::string> label_names, std::vector<double> buckets) {
  ValidateRegistration(name, type, label_names);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& e : entries_) {
    if (e->name() == name) {
      KILN_CHECK(e->type == type && e->label_names() == label_names,
                 absl::StrCat("metric ", name, " registered twice with a different type or labels")
                     .c_str());
      if constexpr (std::is_same_v<M, Counter>) {
        return e->counter.get();
      } else if constexpr (std::is_same_v<M, Gauge>) {
        return e->gauge.get();
      } else {
        KILN_CHECK(
            e->histogram->buckets_ == buckets,
            absl::StrCat("histogram ", name, " registered twice with different buckets").c_str());
        return e->histogram.get();
      }
    }
    // Distinct families must not write the same sample name (`x_count` vs histogram `x`).
    for (const std::string& mine : SampleNames(name, type)) {
      for (const std::string& theirs : SampleNames(e->name(), e->type)) {
        KILN_CHECK(mine != theirs, absl::StrCat("metric ", name, " collides with metric ",
                                                e->name(), " on the sample name ", mine)
                                       .c_str());
      }
    }
  }
  auto entry = std::make_unique<Entry>();
  entry->type = type;
  auto* family =
      new Family<M>(std::move(name), std::move(help), std::move(label_names), std::move(buckets));
  if constexpr (std::is_same_v<M, Counter>) {
    entry->counter.reset(family);
  } else if constexpr (std::is_same_v<M, Gauge>) {
    entry->gauge.reset(family);
  } else {
    entry->histogram.reset(family);
  }
  entries_.push_back(std::move(entry));
  return family;
}

void Registry::AddCollector(std::function<void()> collector) {
  std::lock_guard<std::mutex> lock(mu_);
  collectors_.push_back(std::move(collector));
}

std::string Registry::Serialize() const {
  // Collectors run outside mu_ so that they may look up or even register families.
  std::vector<std::function<void()>> collectors;
  {
    std::lock_guard<std::mutex> lock(mu_);
    collectors = collectors_;
  }
  for (const auto& c : collectors) c();

  std::string out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& e : entries_) {
    const std::string& name = e->name();
    const std::vector<std::string>& labels = e->label_names();
    const std::string& help = e->type == MetricType::kCounter ? e->counter->help()
                              : e->type == MetricType::kGauge ? e->gauge->help()
                                                              : e->histogram->help();
    out += "# HELP ";
    out += name;
    out += ' ';
    AppendEscaped(out, help, /*escape_quote=*/false);
    out += "\n# TYPE ";
    out += name;
    out += ' ';
    out += TypeName(e->type);
    out += '\n';
    switch (e->type) {
      case MetricType::kCounter:
        e->counter->ForEach([&](const std::vector<std::string>& values, const Counter& c) {
          AppendSample(out, name, "", labels, values, c.Value());
        });
        break;
      case MetricType::kGauge:
        e->gauge->ForEach([&](const std::vector<std::string>& values, const Gauge& g) {
          AppendSample(out, name, "", labels, values, g.Value());
        });
        break;
      case MetricType::kHistogram:
        e->histogram->ForEach([&](const std::vector<std::string>& values, const Histogram& h) {
          Histogram::Snapshot s = h.Snap();
          std::string le;
          for (size_t i = 0; i < s.upper_bounds.size(); ++i) {
            le.clear();
            AppendNumber(le, s.upper_bounds[i]);
            AppendSample(out, name, "_bucket", labels, values, s.cumulative[i], "le", le);
          }
          AppendSample(out, name, "_bucket", labels, values, s.count, "le", "+Inf");
          AppendSample(out, name, "_sum", labels, values, s.sum);
          AppendSample(out, name, "_count", labels, values, s.count);
        });
        break;
    }
  }
  return out;
}

}  // namespace kiln::metrics
