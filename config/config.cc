#include "config/config.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <set>
#include <span>
#include <string>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "config/yaml_tree.h"

namespace kiln::config {
namespace {

using internal::Entry;
using internal::Mark;
using internal::Problem;
using internal::Value;
using Names = std::span<const std::string_view>;

// ---- The schema's limits and names (config/README.md documents each) ------------------------

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kUint32Max = std::numeric_limits<uint32_t>::max();

// An integer setting's allowed range; `note` explains a limit that is not obvious.
struct IntRange {
  int64_t min;
  int64_t max;
  std::string_view note = {};
};

constexpr IntRange kMaxMessageBytesRange{1, kInt32Max, "gRPC's limit is 2 GiB - 1"};
constexpr IntRange kMaxConcurrentStreamsRange{1, kInt32Max};
constexpr IntRange kMaxBodyBytesRange{1, kInt64Max};
constexpr IntRange kHttpThreadsRange{1, 64};
constexpr IntRange kIdleTimeoutSecondsRange{1, 86400};
constexpr IntRange kMaxInflightRequestsRange{1, kInt32Max};
constexpr double kMaxShutdownGraceSeconds = 3600;
constexpr IntRange kMaxConcurrentJobsRange{1, 64};
constexpr IntRange kCheckpointEveryStepsRange{0, kInt32Max};
constexpr double kMaxCheckpointEverySeconds = 7 * 86400;
constexpr IntRange kKeepCheckpointsRange{1, 1000};
constexpr IntRange kMaxFileBytesRange{1, 1ll << 40};
constexpr IntRange kJobThreadsRange{0, 1024};
constexpr IntRange kInstanceCountRange{1, 64};
constexpr IntRange kMaxBatchSizeRange{0, 1 << 20};
constexpr IntRange kPreferredBatchSizeRange{1, 1 << 20};
// Durations are added to clock readings; 24 h keeps that far from overflow.
constexpr IntRange kMicrosecondsRange{0, 86'400'000'000, "at most 24 hours"};
constexpr IntRange kPriorityLevelsRange{0, 1024};
constexpr IntRange kPriorityLevelRange{0, kPriorityLevelsRange.max};
constexpr IntRange kMaxQueueSizeRange{0, kUint32Max};
// kind llm:
constexpr IntRange kMaxNumSeqsRange{1, 4096};
constexpr IntRange kMaxNumBatchedTokensRange{1, 1 << 20};
constexpr IntRange kMaxPrefillWithDecodesRange{0, 1 << 20};
constexpr IntRange kLlmQueueSizeRange{0, 1 << 20};
constexpr IntRange kBlockSizeRange{1, 1024};
constexpr IntRange kKvCacheBytesRange{1 << 20, int64_t{1} << 40, "1 MiB to 1 TiB, or auto"};
constexpr double kKvMemoryFractionMin = 0.01, kKvMemoryFractionMax = 0.99;
constexpr double kTargetItlMsMax = 60'000;
constexpr IntRange kThreadsRange{0, 1024};
constexpr IntRange kContextLengthRange{0, 1 << 24};
constexpr IntRange kMaxLoadedAdaptersRange{0, 256};
constexpr IntRange kMaxLoraRankRange{1, 1024};
constexpr IntRange kFlightRecorderEntriesRange{16, 1 << 20};
constexpr double kMaxWatchdogSeconds = 86400;
constexpr double kMaxOtlpTimeoutSeconds = 300;
constexpr size_t kMaxApiKeyNameLength = 64;

constexpr std::string_view kLogLevels[] = {"trace", "debug",    "info", "warn",
                                           "error", "critical", "off"};
constexpr std::string_view kLogFormats[] = {"text", "json"};
constexpr std::string_view kTimeoutActions[] = {"REJECT", "DELAY"};

// Backends a model (or fine-tuning) may name: the device families of backends/builtin.h and the
// gpu plugins (cuda, hip). A family this machine lacks is refused when the model loads, naming
// what is registered.
constexpr std::string_view kBackends[] = {"cpu", "cuda", "hip", "xpu", "ref"};

// Model kinds and what each needs. A new kind (e.g. `llm`, weights from `path`) is a row here;
// keys only one kind uses are checked against this table, not against the key list.
struct ModelKind {
  std::string_view name;
  bool uses_builtin;  // `builtin:` picks the model; required
  bool uses_path;     // `path:` names the weights; required
};
constexpr ModelKind kModelKinds[] = {
    {"builtin", /*uses_builtin=*/true, /*uses_path=*/false},
    {"llm", /*uses_builtin=*/false, /*uses_path=*/true},
    {"embedding", /*uses_builtin=*/false, /*uses_path=*/true},
};
// models/tensor's BuiltinModelNames (config/ depends on nothing, so the list is repeated;
// builtin_models_test checks the two agree).
constexpr std::string_view kBuiltinModels[] = {
    "simple",          "identity_fp32",         "sleep_us",     "simple_string",  "simple_int8",
    "simple_identity", "custom_identity_int32", "repeat_int32", "simple_sequence"};
constexpr std::string_view kKvCacheDtypes[] = {"f32", "f16", "bf16"};
constexpr std::string_view kSamplingPlaces[] = {"device", "host"};

constexpr size_t kMaxModelNameLength = 128;
constexpr size_t kMaxConfigFileBytes = 16 << 20;

// The keys allowed in each mapping.
constexpr std::string_view kTopKeys[] = {"server", "logging", "fine_tuning", "observability",
                                         "models"};
constexpr std::string_view kServerKeys[] = {"grpc",
                                            "http",
                                            "metrics",
                                            "auth",
                                            "tls",
                                            "max_inflight_requests",
                                            "shutdown_grace_seconds",
                                            "storage_dir"};
constexpr std::string_view kAuthKeys[] = {"enabled", "api_keys", "open"};
constexpr std::string_view kApiKeyKeys[] = {"name", "key_sha256", "key_file", "scopes"};
constexpr std::string_view kTlsKeys[] = {"cert_file", "key_file", "client_ca_file", "metrics"};
constexpr std::string_view kObservabilityKeys[] = {"flight_recorder", "watchdog_seconds", "tracing",
                                                   "otlp"};
constexpr std::string_view kFlightRecorderKeys[] = {"enabled", "entries"};
constexpr std::string_view kTracingKeys[] = {"enabled"};
constexpr std::string_view kOtlpKeys[] = {"endpoint", "service_name", "timeout_seconds"};
constexpr std::string_view kGrpcKeys[] = {"enabled", "address", "max_message_bytes",
                                          "max_concurrent_streams"};
constexpr std::string_view kHttpKeys[] = {"enabled", "address", "max_body_bytes", "threads",
                                          "idle_timeout_seconds"};
constexpr std::string_view kMetricsKeys[] = {"enabled", "address"};
constexpr std::string_view kLoggingKeys[] = {"level", "format"};
constexpr std::string_view kFineTuningKeys[] = {"enabled",
                                                "max_concurrent_jobs",
                                                "checkpoint_every_steps",
                                                "checkpoint_every_seconds",
                                                "keep_checkpoints",
                                                "yield_to_serving",
                                                "max_yield_seconds",
                                                "max_file_bytes",
                                                "threads",
                                                "backend"};
constexpr std::string_view kModelKeys[] = {
    "name",          "kind",           "builtin",           "path",
    "backend",       "instance_count", "max_batch_size",    "dynamic_batching",
    "load_on_start", "scheduler",      "threads",           "context_length",
    "activations",   "kv_cache_dtype", "sampling",          "max_loaded_adapters",
    "max_lora_rank", "adapters",       "sequence_batching", "attention"};
constexpr std::string_view kAttentionKeys[] = {"mask", "window", "chunk", "score", "softcap"};
constexpr std::string_view kAttentionMasks[] = {"causal", "sliding_window", "chunked"};
constexpr std::string_view kAttentionScores[] = {"none", "softcap", "alibi"};
// Decoded wide; ValidateAttention says what is wrong with a value out of range, once.
constexpr IntRange kAttentionTokensDecode{-(int64_t{1} << 40), int64_t{1} << 40};
constexpr int64_t kAttentionTokensMax = int64_t{1} << 30;
constexpr std::string_view kAdapterKeys[] = {"name", "path"};
constexpr std::string_view kSchedulerKeys[] = {
    "max_num_seqs",    "max_num_batched_tokens",   "max_prefill_tokens_with_decodes",
    "target_itl_ms",   "max_queue_size",           "block_size",
    "kv_cache_bytes",  "kv_cache_memory_fraction", "enable_prefix_caching",
    "priority_levels", "default_priority_level",   "capture_batch_sizes",
    "speculative"};
constexpr std::string_view kSpeculativeKeys[] = {
    "method", "draft_model", "num_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive"};
constexpr std::string_view kSpeculativeMethods[] = {"none", "ngram", "draft"};
constexpr IntRange kSpecTokensRange{1, 16};
constexpr std::string_view kDynamicBatchingKeys[] = {
    "preferred_batch_size", "max_queue_delay_microseconds", "preserve_ordering",
    "priority_levels",      "default_priority_level",       "default_queue_policy",
    "priority_queue_policy"};
constexpr std::string_view kSequenceBatchingKeys[] = {"max_sequence_idle_microseconds", "direct",
                                                      "oldest", "control_input"};
constexpr std::string_view kSequenceDirectKeys[] = {"max_queue_delay_microseconds",
                                                    "minimum_slot_utilization"};
constexpr std::string_view kSequenceOldestKeys[] = {
    "max_candidate_sequences", "preferred_batch_size", "max_queue_delay_microseconds",
    "preserve_ordering"};
constexpr std::string_view kControlInputKeys[] = {"name", "control"};
constexpr std::string_view kControlKeys[] = {"kind", "int32_false_true", "fp32_false_true",
                                             "bool_false_true", "data_type"};
constexpr std::string_view kControlKinds[] = {"CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_READY",
                                              "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_CORRID"};
constexpr std::string_view kCorridTypes[] = {"TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32",
                                             "TYPE_INT32", "TYPE_STRING"};
constexpr IntRange kIdleMicrosecondsRange{0, 86'400'000'000, "at most 24 hours; 0: 1 s"};
constexpr IntRange kMaxCandidateSequencesRange{1, 1 << 16};
constexpr std::string_view kQueuePolicyKeys[] = {"timeout_action", "default_timeout_microseconds",
                                                 "allow_timeout_override", "max_queue_size"};

// ---- Small helpers --------------------------------------------------------------------------

std::string Join(std::string_view parent, std::string_view key) {
  if (parent.empty()) return std::string(key);
  return absl::StrCat(ToAbsl(parent), ".", ToAbsl(key));
}

std::string Index(std::string_view parent, size_t i) {
  return absl::StrCat(ToAbsl(parent), "[", i, "]");
}

// "models[1].name" -> "models[1]" -> "models" -> "".
std::string Parent(std::string_view path) {
  size_t cut = path.find_last_of(".[");
  return std::string(cut == std::string_view::npos ? std::string_view() : path.substr(0, cut));
}

std::string ListNames(Names names) {
  std::string out;
  for (std::string_view n : names) absl::StrAppend(&out, out.empty() ? "" : ", ", ToAbsl(n));
  return out;
}

std::vector<std::string> Prefixed(std::string_view prefix, Names keys) {
  std::vector<std::string> out;
  for (std::string_view k : keys) out.push_back(Join(prefix, k));
  return out;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Optimal string alignment distance (Levenshtein plus transpositions of neighbours).
size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// The candidate `word` most likely meant, or "" when none is close. Case and `-` vs `_` are
// ignored; a candidate that `word` abbreviates (`max_batch` -> `max_batch_size`) counts as
// close, and so does a candidate `word` begins or ends with. `nested` are keys one level down
// ("grpc.address"): suggested only when their last part matches exactly, for a key written one
// level too high.
std::string Suggest(std::string_view word, Names candidates,
                    const std::vector<std::string>& nested = {}) {
  std::string w = Lower(word);
  std::replace(w.begin(), w.end(), '-', '_');
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (std::string_view c : candidates) {
    std::string lc = Lower(c);
    size_t distance = EditDistance(w, lc);
    // `max_batch` for `max_batch_size`, `max_batch_size_x` or `log_level` for `level`.
    bool abbreviation =
        (w.size() >= 3 && lc.compare(0, w.size(), w) == 0) ||
        (lc.size() >= 4 && w.size() > lc.size() &&
         (w.compare(0, lc.size(), lc) == 0 || w.compare(w.size() - lc.size(), lc.size(), lc) == 0));
    bool close = distance <= std::max<size_t>(2, w.size() / 3);
    if ((close || abbreviation) && distance < best_distance) {
      best = std::string(c);
      best_distance = distance;
    }
  }
  if (!best.empty()) return best;
  for (const std::string& n : nested) {
    if (std::string_view(n).substr(n.rfind('.') + 1) == w) return n;
  }
  return "";
}

std::string DidYouMean(const std::string& suggestion) {
  return suggestion.empty() ? "" : absl::StrCat(" (did you mean `", suggestion, "`?)");
}

std::string RangeText(const IntRange& r) {
  std::string out = r.max == kInt64Max ? absl::StrCat(">= ", r.min)
                                       : absl::StrCat("in [", r.min, ", ", r.max, "]");
  if (!r.note.empty()) absl::StrAppend(&out, " (", ToAbsl(r.note), ")");
  return out;
}

std::string IntRangeMessage(const IntRange& r, std::string_view got) {
  return absl::StrCat("expected an integer ", RangeText(r), ", got ", ToAbsl(got));
}

enum class NumberParse { kOk, kNotANumber, kOutOfRange };

NumberParse ParseInt64(std::string_view text, int64_t* out) {
  std::string_view t = text;
  if (!t.empty() && t[0] == '+') t.remove_prefix(1);
  if (t.empty() || t[0] == '+') return NumberParse::kNotANumber;
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), *out);
  if (end != t.data() + t.size()) return NumberParse::kNotANumber;
  if (ec == std::errc::result_out_of_range) return NumberParse::kOutOfRange;
  return ec == std::errc() ? NumberParse::kOk : NumberParse::kNotANumber;
}

bool ParseFiniteDouble(std::string_view text, double* out) {
  std::string_view t = text;
  if (!t.empty() && t[0] == '+') t.remove_prefix(1);
  if (t.empty() || t[0] == '+') return false;
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), *out);
  return ec == std::errc() && end == t.data() + t.size() && std::isfinite(*out);
}

bool IsValidModelName(std::string_view name) {
  if (name.empty() || name.size() > kMaxModelNameLength) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-';
  });
}

bool IsValidAdapterName(std::string_view name) {
  if (name.empty() || name.size() > kMaxModelNameLength) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-' ||
           c == ':';
  });
}

bool IsIPv4(std::string_view host) {
  int parts = 0;
  size_t i = 0;
  while (true) {
    size_t start = i;
    while (i < host.size() && host[i] >= '0' && host[i] <= '9') ++i;
    if (i == start || i - start > 3) return false;
    if (std::stoi(std::string(host.substr(start, i - start))) > 255) return false;
    ++parts;
    if (i == host.size()) return parts == 4;
    if (host[i] != '.' || parts == 4) return false;
    ++i;
  }
}

// RFC 1123: dot-separated labels of letters, digits and inner hyphens, 1-63 long, 253 in all.
bool IsHostName(std::string_view host) {
  if (host.empty() || host.size() > 253) return false;
  size_t start = 0;
  while (true) {
    size_t end = host.find('.', start);
    std::string_view label =
        host.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start);
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') {
      return false;
    }
    for (char c : label) {
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-') return false;
    }
    if (end == std::string_view::npos) return true;
    start = end + 1;
  }
}

// ---- Diagnostics: every problem found, with where it is -------------------------------------

class Diagnostics {
 public:
  // `file` names origin 0 in messages; `root` says where a path-less key sits ("at the top
  // level"); `overrides` are the --set texts, quoted in messages about them.
  Diagnostics(std::string file, std::string root, const std::vector<std::string>* overrides)
      : file_(std::move(file)), root_(std::move(root)), overrides_(overrides) {}

  const std::string& root() const { return root_; }

  void Add(const Mark& mark, std::string message) {
    errors_.push_back(Error{mark, std::move(message)});
  }

  // Remembers where the value at `path` was written, for messages found later. The first
  // record wins: a priority level's policy is recorded at its key, before the policy's
  // mapping would record its own position.
  void Record(const std::string& path, const Mark& mark) { marks_.emplace(path, mark); }

  // The recorded mark of `path`, else of its nearest recorded ancestor.
  Mark Find(const std::string& path) const {
    std::string p = path;
    while (true) {
      auto it = marks_.find(p);
      if (it != marks_.end()) return it->second;
      if (p.empty()) return Mark{};
      p = Parent(p);
    }
  }

  // "`path`: message" at the value's location. At most one error per path: once a value is
  // wrong, checks that depend on it (or on its parent) would only repeat the news.
  void AtPath(const std::string& path, std::string_view message) {
    if (Failed(path)) return;
    failed_.insert(path);
    Add(Find(path),
        path.empty() ? std::string(message) : absl::StrCat("`", path, "`: ", ToAbsl(message)));
  }

  bool Failed(const std::string& path) const {
    std::string p = path;
    while (true) {
      if (failed_.count(p) != 0) return true;
      if (p.empty()) return false;
      p = Parent(p);
    }
  }

  std::string Where(const Mark& mark) const {
    if (mark.origin > 0) return absl::StrCat("<set>:", mark.line, ":", mark.column);
    if (mark.line == 0) return file_;
    return absl::StrCat(file_, ":", mark.line, ":", mark.column);
  }

  SourceLocation Location(const Mark& mark) const {
    return SourceLocation{mark.origin > 0 ? "<set>" : file_, mark.line, mark.column};
  }

  bool ok() const { return errors_.empty(); }

  Status ToStatus() const {
    if (errors_.empty()) return OkStatus();
    std::vector<Error> sorted = errors_;
    std::stable_sort(sorted.begin(), sorted.end(), [](const Error& a, const Error& b) {
      return std::tie(a.mark.origin, a.mark.line, a.mark.column) <
             std::tie(b.mark.origin, b.mark.line, b.mark.column);
    });
    std::string text;
    for (const Error& e : sorted) {
      if (!text.empty()) text += "\n";
      absl::StrAppend(&text, Where(e.mark), ": ", e.message);
      if (e.mark.origin > 0 && overrides_ != nullptr &&
          static_cast<size_t>(e.mark.origin) <= overrides_->size()) {
        absl::StrAppend(&text, " (in --set `", (*overrides_)[e.mark.origin - 1], "`)");
      }
    }
    return InvalidArgument(text);
  }

 private:
  struct Error {
    Mark mark;
    std::string message;
  };
  std::string file_;
  std::string root_;
  const std::vector<std::string>* overrides_;
  std::vector<Error> errors_;
  std::map<std::string, Mark> marks_;
  std::set<std::string> failed_;
};

// ---- Decoding: the YAML tree into the structs ------------------------------------------------

// The known keys of one mapping, once Decoder::Mapping has reported the others.
class Fields {
 public:
  // The value written for `key` (possibly null), or nullptr when the key is absent.
  const Value* Get(std::string_view key) const {
    for (const auto& f : fields_) {
      if (f.key == key) return f.value;
    }
    return nullptr;
  }
  const Value* KeyOf(std::string_view key) const {
    for (const auto& f : fields_) {
      if (f.key == key) return f.key_value;
    }
    return nullptr;
  }
  void Add(std::string_view key, const Value* key_value, const Value* value) {
    fields_.push_back(Field{key, key_value, value});
  }

 private:
  struct Field {
    std::string_view key;
    const Value* key_value;
    const Value* value;
  };
  std::vector<Field> fields_;
};

// Reads values, reporting type and range errors at the value. A null value means "not
// written": the field keeps its default.
class Decoder {
 public:
  explicit Decoder(Diagnostics* d) : d_(*d) {}

  Diagnostics& diagnostics() { return d_; }

  // Reports unless `v` is a mapping (absent or null counts as empty); reports unknown and
  // duplicate keys; records where each known key's value is. `nested` feeds the did-you-mean
  // of unknown keys (see Suggest); keys starting with `ignored_prefix` are skipped.
  Fields Mapping(const Value* v, const std::string& path, Names keys,
                 const std::vector<std::string>& nested = {},
                 std::string_view ignored_prefix = {}) {
    Fields fields;
    if (v == nullptr || v->is_null()) return fields;
    d_.Record(path, v->mark);
    if (!v->is_mapping()) {
      d_.AtPath(path, absl::StrCat("expected a mapping", path.empty() ? " " + d_.root() : "",
                                   " (keys: ", ListNames(keys), "), got ", v->Describe()));
      return fields;
    }
    for (const Entry& e : v->entries) {
      const std::string& key = e.key.scalar;
      if (!ignored_prefix.empty() && key.rfind(ignored_prefix, 0) == 0) continue;
      auto known = std::find(keys.begin(), keys.end(), key);
      std::string where = path.empty() ? d_.root() : absl::StrCat("in `", path, "`");
      if (known == keys.end()) {
        std::string suggestion = Suggest(key, keys, nested);
        d_.Add(e.key.mark,
               absl::StrCat("unknown key ", internal::Quote(key), " ", where,
                            suggestion.empty() ? absl::StrCat(" (allowed: ", ListNames(keys), ")")
                                               : DidYouMean(suggestion)));
        continue;
      }
      if (const Value* first = fields.KeyOf(key)) {
        d_.Add(e.key.mark, absl::StrCat("duplicate key ", internal::Quote(key), " ", where,
                                        " (first at ", d_.Where(first->mark), ")"));
        continue;
      }
      fields.Add(*known, &e.key, &e.value);
      d_.Record(Join(path, key), e.value.mark);
    }
    return fields;
  }

  void Bool(const Fields& f, std::string_view key, const std::string& parent, bool* out) {
    const Value* v = f.Get(key);
    if (v == nullptr || v->is_null()) return;
    std::string lower = v->is_scalar() ? Lower(v->scalar) : "";
    if (lower == "true" || lower == "false") {
      *out = lower == "true";
    } else {
      d_.AtPath(Join(parent, key), "expected true or false, got " + v->Describe());
    }
  }

  template <typename T>
  void Int(const Fields& f, std::string_view key, const std::string& parent, const IntRange& r,
           T* out) {
    const Value* v = f.Get(key);
    if (v != nullptr && !v->is_null()) IntValue(*v, Join(parent, key), r, out);
  }

  template <typename T>
  bool IntValue(const Value& v, const std::string& path, const IntRange& r, T* out) {
    KILN_CHECK(
        r.min >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
            static_cast<uint64_t>(r.max) <= static_cast<uint64_t>(std::numeric_limits<T>::max()),
        "an IntRange does not fit the field's type");
    int64_t n = 0;
    if (!v.is_scalar() || ParseInt64(v.scalar, &n) != NumberParse::kOk || n < r.min || n > r.max) {
      d_.AtPath(path, IntRangeMessage(r, v.Describe()));
      return false;
    }
    *out = static_cast<T>(n);
    return true;
  }

  void Double(const Fields& f, std::string_view key, const std::string& parent, double min,
              double max, double* out) {
    const Value* v = f.Get(key);
    if (v == nullptr || v->is_null()) return;
    double x = 0;
    if (!v->is_scalar() || !ParseFiniteDouble(v->scalar, &x) || x < min || x > max) {
      d_.AtPath(Join(parent, key),
                fmt::format("expected a number in [{}, {}], got {}", min, max, v->Describe()));
      return;
    }
    *out = x;
  }

  // Any scalar is a string (`name: 123` is the name "123").
  bool String(const Fields& f, std::string_view key, const std::string& parent, std::string* out) {
    const Value* v = f.Get(key);
    if (v == nullptr || v->is_null()) return false;
    if (!v->is_scalar()) {
      d_.AtPath(Join(parent, key), "expected a string, got " + v->Describe());
      return false;
    }
    *out = v->scalar;
    return true;
  }

  // Stores the allowed spelling; `ignore_case` accepts `INFO` for `info`.
  void Enum(const Fields& f, std::string_view key, const std::string& parent, Names allowed,
            bool ignore_case, std::string* out) {
    const Value* v = f.Get(key);
    if (v == nullptr || v->is_null()) return;
    if (v->is_scalar()) {
      for (std::string_view a : allowed) {
        if (v->scalar == a || (ignore_case && Lower(v->scalar) == Lower(a))) {
          *out = std::string(a);
          return;
        }
      }
    }
    d_.AtPath(Join(parent, key),
              absl::StrCat("expected one of ", ListNames(allowed), "; got ", v->Describe(),
                           v->is_scalar() ? DidYouMean(Suggest(v->scalar, allowed)) : ""));
  }

  void Address(const Fields& f, std::string_view key, const std::string& parent, std::string* out) {
    std::string address;
    if (!String(f, key, parent, &address)) return;
    StatusOr<HostPort> parsed = ParseHostPort(address);
    if (!parsed.ok()) {
      d_.AtPath(Join(parent, key), StatusMessage(parsed.status()));
      return;
    }
    *out = address;
  }

  // A list of distinct values of `allowed` (`[a, b]`); an absent or null key keeps `out`.
  void EnumList(const Fields& f, std::string_view key, const std::string& parent, Names allowed,
                std::vector<std::string>* out) {
    const Value* v = f.Get(key);
    if (v == nullptr || v->is_null()) return;
    const std::string path = Join(parent, key);
    if (!v->is_sequence()) {
      d_.AtPath(path,
                absl::StrCat("expected a list of ", ListNames(allowed), ", got ", v->Describe()));
      return;
    }
    out->clear();
    for (size_t i = 0; i < v->items.size(); ++i) {
      const Value& item = v->items[i];
      const std::string item_path = Index(path, i);
      d_.Record(item_path, item.mark);
      auto known =
          item.is_scalar() ? std::find(allowed.begin(), allowed.end(), item.scalar) : allowed.end();
      if (known == allowed.end()) {
        d_.AtPath(item_path,
                  absl::StrCat("expected one of ", ListNames(allowed), "; got ", item.Describe(),
                               item.is_scalar() ? DidYouMean(Suggest(item.scalar, allowed)) : ""));
      } else if (std::find(out->begin(), out->end(), *known) != out->end()) {
        d_.AtPath(item_path, absl::StrCat("`", ToAbsl(*known), "` is listed twice"));
      } else {
        out->emplace_back(*known);
      }
    }
  }

 private:
  Diagnostics& d_;
};

void DecodeQueuePolicy(Decoder& dec, const Value* v, const std::string& path, QueuePolicy* q) {
  Fields f = dec.Mapping(v, path, kQueuePolicyKeys);
  std::string action;
  dec.Enum(f, "timeout_action", path, kTimeoutActions, /*ignore_case=*/true, &action);
  if (!action.empty()) {
    q->timeout_action = action == "DELAY" ? QueuePolicy::TimeoutAction::kDelay
                                          : QueuePolicy::TimeoutAction::kReject;
  }
  dec.Int(f, "default_timeout_microseconds", path, kMicrosecondsRange,
          &q->default_timeout_microseconds);
  dec.Bool(f, "allow_timeout_override", path, &q->allow_timeout_override);
  dec.Int(f, "max_queue_size", path, kMaxQueueSizeRange, &q->max_queue_size);
}

void DecodeDynamicBatching(Decoder& dec, const Value* v, const std::string& path,
                           DynamicBatchingConfig* db) {
  Diagnostics& d = dec.diagnostics();
  Fields f = dec.Mapping(v, path, kDynamicBatchingKeys,
                         Prefixed("default_queue_policy", kQueuePolicyKeys));
  if (const Value* sizes = f.Get("preferred_batch_size"); sizes != nullptr && !sizes->is_null()) {
    std::string sizes_path = Join(path, "preferred_batch_size");
    if (!sizes->is_sequence()) {
      d.AtPath(sizes_path,
               "expected a list of batch sizes such as [4, 8], got " + sizes->Describe());
    } else {
      for (size_t i = 0; i < sizes->items.size(); ++i) {
        std::string item_path = Index(sizes_path, i);
        d.Record(item_path, sizes->items[i].mark);
        // A bad entry keeps its place (as 0, its error already given), so that the indices
        // checked later are the ones written.
        int size = 0;
        dec.IntValue(sizes->items[i], item_path, kPreferredBatchSizeRange, &size);
        db->preferred_batch_size.push_back(size);
      }
    }
  }
  dec.Int(f, "max_queue_delay_microseconds", path, kMicrosecondsRange,
          &db->max_queue_delay_microseconds);
  dec.Bool(f, "preserve_ordering", path, &db->preserve_ordering);
  dec.Int(f, "priority_levels", path, kPriorityLevelsRange, &db->priority_levels);
  dec.Int(f, "default_priority_level", path, kPriorityLevelRange, &db->default_priority_level);
  DecodeQueuePolicy(dec, f.Get("default_queue_policy"), Join(path, "default_queue_policy"),
                    &db->default_queue_policy);

  // A mapping from priority level to policy: its keys are integers, not names.
  const Value* policies = f.Get("priority_queue_policy");
  std::string policies_path = Join(path, "priority_queue_policy");
  if (policies == nullptr || policies->is_null()) return;
  if (!policies->is_mapping()) {
    d.AtPath(policies_path,
             "expected a mapping from priority level to queue policy, such as "
             "{1: {max_queue_size: 16}}, got " +
                 policies->Describe());
    return;
  }
  std::map<uint32_t, const Value*> seen;
  for (const Entry& e : policies->entries) {
    int64_t level = 0;
    if (ParseInt64(e.key.scalar, &level) != NumberParse::kOk || level < 1 ||
        level > kPriorityLevelsRange.max) {
      d.Add(e.key.mark,
            absl::StrCat("`", policies_path, "`: expected a priority level (an integer in [1, ",
                         kPriorityLevelsRange.max, "]) as key, got ", e.key.Describe()));
      continue;
    }
    auto [it, inserted] = seen.emplace(static_cast<uint32_t>(level), &e.key);
    if (!inserted) {
      d.Add(e.key.mark, absl::StrCat("duplicate priority level ", level, " in `", policies_path,
                                     "` (first at ", d.Where(it->second->mark), ")"));
      continue;
    }
    std::string level_path = Join(policies_path, std::to_string(level));
    d.Record(level_path, e.key.mark);  // errors about the level point at the key
    DecodeQueuePolicy(dec, &e.value, level_path,
                      &db->priority_queue_policy[static_cast<uint32_t>(level)]);
  }
}

// One `control` entry of a control input: its kind and its values.
void DecodeControl(Decoder& dec, const Value& v, const std::string& path,
                   SequenceControlConfig* c) {
  Diagnostics& d = dec.diagnostics();
  Fields f = dec.Mapping(&v, path, kControlKeys);
  std::string kind;
  dec.Enum(f, "kind", path, kControlKinds, /*ignore_case=*/false, &kind);
  if (kind.empty() && f.Get("kind") == nullptr) {
    d.AtPath(path, absl::StrCat("missing `kind` (one of ", ListNames(kControlKinds), ")"));
  }
  for (size_t i = 0; i < std::size(kControlKinds); ++i) {
    if (kind == kControlKinds[i]) c->kind = static_cast<SequenceControlConfig::Kind>(i);
  }
  dec.Enum(f, "data_type", path, kCorridTypes, /*ignore_case=*/false, &c->data_type);
  // The three value lists; each element is checked on its own.
  auto list = [&](std::string_view key, auto parse) {
    const Value* l = f.Get(key);
    if (l == nullptr || l->is_null()) return;
    const std::string list_path = Join(path, key);
    if (!l->is_sequence()) {
      d.AtPath(list_path, "expected a list of two values [false, true], got " + l->Describe());
      return;
    }
    for (size_t i = 0; i < l->items.size(); ++i) {
      d.Record(Index(list_path, i), l->items[i].mark);
      parse(l->items[i], Index(list_path, i));
    }
  };
  list("int32_false_true", [&](const Value& item, const std::string& item_path) {
    int32_t x = 0;
    dec.IntValue(item, item_path, IntRange{-kInt32Max - 1, kInt32Max}, &x);
    c->int32_false_true.push_back(x);
  });
  list("fp32_false_true", [&](const Value& item, const std::string& item_path) {
    double x = 0;
    if (!item.is_scalar() || !ParseFiniteDouble(item.scalar, &x)) {
      d.AtPath(item_path, "expected a number, got " + item.Describe());
    }
    c->fp32_false_true.push_back(static_cast<float>(x));
  });
  list("bool_false_true", [&](const Value& item, const std::string& item_path) {
    const std::string lower = item.is_scalar() ? Lower(item.scalar) : "";
    if (lower != "true" && lower != "false") {
      d.AtPath(item_path, "expected true or false, got " + item.Describe());
    }
    c->bool_false_true.push_back(lower == "true");
  });
}

void DecodeSequenceBatching(Decoder& dec, const Value* v, const std::string& path,
                            SequenceBatchingConfig* sb) {
  Diagnostics& d = dec.diagnostics();
  std::vector<std::string> nested = Prefixed("direct", kSequenceDirectKeys);
  for (std::string& n : Prefixed("oldest", kSequenceOldestKeys)) nested.push_back(std::move(n));
  Fields f = dec.Mapping(v, path, kSequenceBatchingKeys, nested);
  dec.Int(f, "max_sequence_idle_microseconds", path, kIdleMicrosecondsRange,
          &sb->max_sequence_idle_microseconds);
  if (sb->max_sequence_idle_microseconds == 0) sb->max_sequence_idle_microseconds = 1'000'000;
  const Value* direct = f.Get("direct");
  const Value* oldest = f.Get("oldest");
  if (direct != nullptr && oldest != nullptr && !direct->is_null() && !oldest->is_null()) {
    d.AtPath(Join(path, "oldest"), "`direct` and `oldest` exclude each other: pick one strategy");
  }
  if (direct != nullptr && !direct->is_null()) {
    const std::string p = Join(path, "direct");
    Fields df = dec.Mapping(direct, p, kSequenceDirectKeys);
    sb->strategy = SequenceBatchingConfig::Strategy::kDirect;
    dec.Int(df, "max_queue_delay_microseconds", p, kMicrosecondsRange,
            &sb->direct_max_queue_delay_microseconds);
    dec.Double(df, "minimum_slot_utilization", p, 0, 1, &sb->direct_minimum_slot_utilization);
  } else if (oldest != nullptr && !oldest->is_null()) {
    const std::string p = Join(path, "oldest");
    Fields of = dec.Mapping(oldest, p, kSequenceOldestKeys);
    sb->strategy = SequenceBatchingConfig::Strategy::kOldest;
    dec.Int(of, "max_candidate_sequences", p, kMaxCandidateSequencesRange,
            &sb->oldest_max_candidate_sequences);
    if (const Value* sizes = of.Get("preferred_batch_size");
        sizes != nullptr && !sizes->is_null()) {
      const std::string sizes_path = Join(p, "preferred_batch_size");
      if (!sizes->is_sequence()) {
        d.AtPath(sizes_path,
                 "expected a list of batch sizes such as [4, 8], got " + sizes->Describe());
      } else {
        for (size_t i = 0; i < sizes->items.size(); ++i) {
          d.Record(Index(sizes_path, i), sizes->items[i].mark);
          int size = 0;
          dec.IntValue(sizes->items[i], Index(sizes_path, i), kPreferredBatchSizeRange, &size);
          sb->oldest_preferred_batch_size.push_back(size);
        }
      }
    }
    dec.Int(of, "max_queue_delay_microseconds", p, kMicrosecondsRange,
            &sb->oldest_max_queue_delay_microseconds);
    dec.Bool(of, "preserve_ordering", p, &sb->oldest_preserve_ordering);
  }
  const Value* inputs = f.Get("control_input");
  if (inputs == nullptr || inputs->is_null()) return;
  const std::string inputs_path = Join(path, "control_input");
  if (!inputs->is_sequence()) {
    d.AtPath(inputs_path, "expected a list of {name, control} entries, got " + inputs->Describe());
    return;
  }
  for (size_t i = 0; i < inputs->items.size(); ++i) {
    const std::string item_path = Index(inputs_path, i);
    Fields cf = dec.Mapping(&inputs->items[i], item_path, kControlInputKeys,
                            Prefixed("control", kControlKeys));
    SequenceControlInput& in = sb->control_input.emplace_back();
    dec.String(cf, "name", item_path, &in.name);
    const Value* controls = cf.Get("control");
    const std::string controls_path = Join(item_path, "control");
    if (controls == nullptr || controls->is_null()) continue;  // reported by validation
    if (!controls->is_sequence()) {
      d.AtPath(controls_path,
               "expected a list with one {kind, ...} entry, got " + controls->Describe());
      continue;
    }
    for (size_t j = 0; j < controls->items.size(); ++j) {
      d.Record(Index(controls_path, j), controls->items[j].mark);
      DecodeControl(dec, controls->items[j], Index(controls_path, j), &in.control.emplace_back());
    }
  }
}

void DecodeScheduler(Decoder& dec, const Value* v, const std::string& path, LlmSchedulerConfig* s) {
  Diagnostics& d = dec.diagnostics();
  Fields f = dec.Mapping(v, path, kSchedulerKeys);
  dec.Int(f, "max_num_seqs", path, kMaxNumSeqsRange, &s->max_num_seqs);
  dec.Int(f, "max_num_batched_tokens", path, kMaxNumBatchedTokensRange, &s->max_num_batched_tokens);
  dec.Int(f, "max_prefill_tokens_with_decodes", path, kMaxPrefillWithDecodesRange,
          &s->max_prefill_tokens_with_decodes);
  dec.Double(f, "target_itl_ms", path, 0, kTargetItlMsMax, &s->target_itl_ms);
  dec.Int(f, "max_queue_size", path, kLlmQueueSizeRange, &s->max_queue_size);
  dec.Int(f, "block_size", path, kBlockSizeRange, &s->block_size);
  if (const Value* kv = f.Get("kv_cache_bytes");
      kv != nullptr && kv->is_scalar() && Lower(kv->scalar) == "auto") {
    s->kv_cache_bytes = kKvCacheAuto;
  } else {
    dec.Int(f, "kv_cache_bytes", path, kKvCacheBytesRange, &s->kv_cache_bytes);
  }
  dec.Double(f, "kv_cache_memory_fraction", path, kKvMemoryFractionMin, kKvMemoryFractionMax,
             &s->kv_cache_memory_fraction);
  dec.Bool(f, "enable_prefix_caching", path, &s->enable_prefix_caching);
  dec.Int(f, "priority_levels", path, kPriorityLevelsRange, &s->priority_levels);
  dec.Int(f, "default_priority_level", path, kPriorityLevelRange, &s->default_priority_level);
  if (const Value* sizes = f.Get("capture_batch_sizes"); sizes != nullptr && !sizes->is_null()) {
    std::string sizes_path = Join(path, "capture_batch_sizes");
    if (!sizes->is_sequence()) {
      d.AtPath(sizes_path,
               "expected a list of batch sizes such as [1, 2, 4, 8], got " + sizes->Describe());
    } else {
      s->capture_batch_sizes.clear();
      for (size_t i = 0; i < sizes->items.size(); ++i) {
        std::string item_path = Index(sizes_path, i);
        d.Record(item_path, sizes->items[i].mark);
        int size = 0;
        dec.IntValue(sizes->items[i], item_path, kMaxNumSeqsRange, &size);
        s->capture_batch_sizes.push_back(size);
      }
    }
  } else {
    // The default sizes stop at max_num_seqs (a larger batch cannot happen).
    std::erase_if(s->capture_batch_sizes, [&](int n) { return n > s->max_num_seqs; });
  }
  if (const Value* spec = f.Get("speculative"); spec != nullptr && !spec->is_null()) {
    const std::string spec_path = Join(path, "speculative");
    SpeculativeConfig& c = s->speculative;
    Fields sf = dec.Mapping(spec, spec_path, kSpeculativeKeys);
    dec.Enum(sf, "method", spec_path, kSpeculativeMethods, /*ignore_case=*/false, &c.method);
    dec.String(sf, "draft_model", spec_path, &c.draft_model);
    if (c.method == "draft" && c.draft_model.empty()) {
      d.AtPath(Join(spec_path, "draft_model"),
               "method `draft` needs a draft model: the path of a smaller model with the same "
               "vocabulary");
    }
    dec.Int(sf, "num_tokens", spec_path, kSpecTokensRange, &c.num_tokens);
    dec.Int(sf, "prompt_lookup_min", spec_path, kSpecTokensRange, &c.prompt_lookup_min);
    dec.Int(sf, "prompt_lookup_max", spec_path, kSpecTokensRange, &c.prompt_lookup_max);
    dec.Bool(sf, "adaptive", spec_path, &c.adaptive);
    if (c.prompt_lookup_min > c.prompt_lookup_max) {
      d.AtPath(Join(spec_path, "prompt_lookup_min"),
               absl::StrCat("expected at most prompt_lookup_max (", c.prompt_lookup_max, "), got `",
                            c.prompt_lookup_min, "`"));
    }
  }
}

void DecodeModel(Decoder& dec, const Value& v, const std::string& path, ModelConfig* m) {
  m->location = dec.diagnostics().Location(v.mark);
  std::vector<std::string> nested = Prefixed("dynamic_batching", kDynamicBatchingKeys);
  for (std::string& n : Prefixed("scheduler", kSchedulerKeys)) nested.push_back(std::move(n));
  for (std::string& n : Prefixed("attention", kAttentionKeys)) nested.push_back(std::move(n));
  for (std::string& n : Prefixed("sequence_batching", kSequenceBatchingKeys)) {
    nested.push_back(std::move(n));
  }
  Fields f = dec.Mapping(&v, path, kModelKeys, nested);
  dec.String(f, "name", path, &m->name);
  dec.String(f, "kind", path, &m->kind);
  dec.String(f, "builtin", path, &m->builtin);
  dec.String(f, "path", path, &m->path);
  dec.String(f, "backend", path, &m->backend);
  dec.Int(f, "instance_count", path, kInstanceCountRange, &m->instance_count);
  dec.Int(f, "max_batch_size", path, kMaxBatchSizeRange, &m->max_batch_size);
  // Writing the section turns dynamic batching on, even with nothing under it (Triton's
  // `dynamic_batching {}`).
  if (const Value* db = f.Get("dynamic_batching")) {
    DecodeDynamicBatching(dec, db, Join(path, "dynamic_batching"), &m->dynamic_batching.emplace());
  }
  if (const Value* sb = f.Get("sequence_batching"); sb != nullptr && !sb->is_null()) {
    DecodeSequenceBatching(dec, sb, Join(path, "sequence_batching"),
                           &m->sequence_batching.emplace());
  }
  dec.Bool(f, "load_on_start", path, &m->load_on_start);
  if (const Value* sched = f.Get("scheduler")) {
    if (m->kind != "llm" && !m->kind.empty()) {
      dec.diagnostics().AtPath(Join(path, "scheduler"),
                               absl::StrCat("not used by kind `", m->kind,
                                            "` (the continuous batcher is for kind `llm`; "
                                            "tensor models use `dynamic_batching`)"));
    } else {
      DecodeScheduler(dec, sched, Join(path, "scheduler"), &m->scheduler);
    }
  }
  dec.Int(f, "threads", path, kThreadsRange, &m->threads);
  dec.Int(f, "context_length", path, kContextLengthRange, &m->context_length);
  dec.String(f, "activations", path, &m->activations);
  dec.String(f, "kv_cache_dtype", path, &m->kv_cache_dtype);
  dec.String(f, "sampling", path, &m->sampling);
  dec.Int(f, "max_loaded_adapters", path, kMaxLoadedAdaptersRange, &m->max_loaded_adapters);
  dec.Int(f, "max_lora_rank", path, kMaxLoraRankRange, &m->max_lora_rank);
  if (const Value* att = f.Get("attention"); att != nullptr && !att->is_null()) {
    const std::string att_path = Join(path, "attention");
    Fields af = dec.Mapping(att, att_path, kAttentionKeys);
    dec.String(af, "mask", att_path, &m->attention.mask);
    dec.Int(af, "window", att_path, kAttentionTokensDecode, &m->attention.window);
    dec.Int(af, "chunk", att_path, kAttentionTokensDecode, &m->attention.chunk);
    dec.String(af, "score", att_path, &m->attention.score);
    dec.Double(af, "softcap", att_path, -1e300, 1e300, &m->attention.softcap);
  }
  if (const Value* list = f.Get("adapters"); list != nullptr && !list->is_null()) {
    Diagnostics& d = dec.diagnostics();
    const std::string list_path = Join(path, "adapters");
    if (!list->is_sequence()) {
      d.AtPath(list_path,
               "expected a list of adapters (`- {name: ..., path: ...}`), got " + list->Describe());
    } else {
      for (size_t i = 0; i < list->items.size(); ++i) {
        const Value& item = list->items[i];
        const std::string item_path = Index(list_path, i);
        d.Record(item_path, item.mark);
        if (!item.is_mapping()) {
          d.AtPath(item_path, "expected an adapter (a mapping with `name` and `path`), got " +
                                  item.Describe());
          continue;
        }
        LoraAdapterConfig& a = m->adapters.emplace_back();
        a.location = d.Location(item.mark);
        Fields af = dec.Mapping(&item, item_path, kAdapterKeys);
        dec.String(af, "name", item_path, &a.name);
        dec.String(af, "path", item_path, &a.path);
      }
    }
  }
}

// ---- Validation of a model's settings together (also for models built in code) -------------

template <typename T>
void CheckInt(Diagnostics& d, const std::string& path, const IntRange& r, T value) {
  bool in_range;
  if constexpr (std::is_unsigned_v<T>) {
    in_range = static_cast<uint64_t>(value) <= static_cast<uint64_t>(r.max) &&
               (r.min <= 0 || static_cast<uint64_t>(value) >= static_cast<uint64_t>(r.min));
  } else {
    in_range = static_cast<int64_t>(value) >= r.min && static_cast<int64_t>(value) <= r.max;
  }
  if (!in_range) d.AtPath(path, IntRangeMessage(r, internal::Quote(std::to_string(value))));
}

void CheckName(Diagnostics& d, const std::string& path, std::string_view kind_of_value,
               std::string_view value, Names allowed) {
  if (value.empty()) {
    d.AtPath(path, absl::StrCat("missing; expected one of ", ListNames(allowed)));
  } else if (std::find(allowed.begin(), allowed.end(), value) == allowed.end()) {
    d.AtPath(path, absl::StrCat("unknown ", ToAbsl(kind_of_value), " `", ToAbsl(value),
                                "`; expected one of ", ListNames(allowed),
                                DidYouMean(Suggest(value, allowed))));
  }
}

void ValidateQueuePolicy(Diagnostics& d, const QueuePolicy& q, const std::string& path) {
  CheckInt(d, Join(path, "default_timeout_microseconds"), kMicrosecondsRange,
           q.default_timeout_microseconds);
}

void ValidateDynamicBatching(Diagnostics& d, const DynamicBatchingConfig& db, const ModelConfig& m,
                             const std::string& model_path) {
  std::string path = Join(model_path, "dynamic_batching");
  std::string sizes_path = Join(path, "preferred_batch_size");
  for (size_t i = 0; i < db.preferred_batch_size.size(); ++i) {
    CheckInt(d, Index(sizes_path, i), kPreferredBatchSizeRange, db.preferred_batch_size[i]);
  }
  if (!db.preferred_batch_size.empty() && !d.Failed(Join(model_path, "max_batch_size"))) {
    if (m.max_batch_size == 0) {
      d.AtPath(sizes_path,
               "needs max_batch_size > 0, but max_batch_size is 0 (the model does not batch)");
    } else {
      int previous = 0;  // the last good size; bad ones are reported once, on their own
      for (size_t i = 0; i < db.preferred_batch_size.size(); ++i) {
        int size = db.preferred_batch_size[i];
        std::string item_path = Index(sizes_path, i);
        if (d.Failed(item_path)) continue;
        if (size > m.max_batch_size) {
          d.AtPath(item_path, absl::StrCat("expected a batch size in [1, ", m.max_batch_size,
                                           "] (max_batch_size), got `", size, "`"));
        } else if (size <= previous) {
          d.AtPath(item_path,
                   absl::StrCat("expected sizes in ascending order without repeats, got `", size,
                                "` after `", previous, "`"));
        } else {
          previous = size;
        }
      }
    }
  }
  CheckInt(d, Join(path, "max_queue_delay_microseconds"), kMicrosecondsRange,
           db.max_queue_delay_microseconds);
  std::string levels_path = Join(path, "priority_levels");
  std::string default_level_path = Join(path, "default_priority_level");
  std::string policies_path = Join(path, "priority_queue_policy");
  CheckInt(d, levels_path, kPriorityLevelsRange, db.priority_levels);
  if (!d.Failed(levels_path)) {
    uint32_t levels = db.priority_levels;
    uint32_t level = db.default_priority_level;
    if (levels == 0) {
      if (level != 0) {
        d.AtPath(default_level_path,
                 absl::StrCat("must be 0 or absent when priority_levels is 0 (a single level), "
                              "got `",
                              level, "`"));
      }
      if (!db.priority_queue_policy.empty()) {
        d.AtPath(policies_path, "needs priority_levels > 0, but priority_levels is 0");
      }
    } else {
      if (level == 0) {
        d.AtPath(default_level_path, absl::StrCat("missing; required in [1, ", levels,
                                                  "] when priority_levels is ", levels));
      } else if (level > levels) {
        d.AtPath(default_level_path, absl::StrCat("expected a level in [1, ", levels,
                                                  "] (priority_levels), got `", level, "`"));
      }
      for (const auto& [key, policy] : db.priority_queue_policy) {
        if (key < 1 || key > levels) {
          d.AtPath(Join(policies_path, std::to_string(key)),
                   absl::StrCat("priority level ", key, " is not in [1, ", levels,
                                "] (priority_levels)"));
        }
      }
    }
  }
  ValidateQueuePolicy(d, db.default_queue_policy, Join(path, "default_queue_policy"));
  for (const auto& [key, policy] : db.priority_queue_policy) {
    ValidateQueuePolicy(d, policy, Join(policies_path, std::to_string(key)));
  }
}

void ValidateSequenceBatching(Diagnostics& d, const SequenceBatchingConfig& sb,
                              const ModelConfig& m, const std::string& model_path) {
  const std::string path = Join(model_path, "sequence_batching");
  if (m.dynamic_batching.has_value()) {
    d.AtPath(path,
             "excludes `dynamic_batching` (a model has one scheduler, as in Triton): "
             "remove one of them");
  }
  if (sb.strategy == SequenceBatchingConfig::Strategy::kOldest) {
    const std::string sizes_path = Join(Join(path, "oldest"), "preferred_batch_size");
    int previous = 0;
    for (size_t i = 0; i < sb.oldest_preferred_batch_size.size(); ++i) {
      const int size = sb.oldest_preferred_batch_size[i];
      const std::string item_path = Index(sizes_path, i);
      if (d.Failed(item_path)) continue;
      if (m.max_batch_size == 0) {
        d.AtPath(sizes_path,
                 "needs max_batch_size > 0, but max_batch_size is 0 (the model does not batch)");
        break;
      }
      if (size < 1 || size > m.max_batch_size) {
        d.AtPath(item_path, absl::StrCat("expected a batch size in [1, ", m.max_batch_size,
                                         "] (max_batch_size), got `", size, "`"));
      } else if (size <= previous) {
        d.AtPath(item_path, absl::StrCat("expected sizes in ascending order without repeats, "
                                         "got `",
                                         size, "` after `", previous, "`"));
      } else {
        previous = size;
      }
    }
  }
  const std::string inputs_path = Join(path, "control_input");
  std::map<std::string, size_t> names;
  std::map<SequenceControlConfig::Kind, size_t> kinds;
  for (size_t i = 0; i < sb.control_input.size(); ++i) {
    const SequenceControlInput& in = sb.control_input[i];
    const std::string item_path = Index(inputs_path, i);
    if (in.name.empty()) {
      d.AtPath(Join(item_path, "name"), "missing: the model input that receives the control");
    } else if (auto [it, fresh] = names.emplace(in.name, i); !fresh) {
      d.AtPath(Join(item_path, "name"),
               absl::StrCat("input `", in.name, "` is already a control input (control_input[",
                            it->second, "])"));
    }
    const std::string controls_path = Join(item_path, "control");
    if (in.control.size() != 1) {
      if (!d.Failed(controls_path)) {
        d.AtPath(controls_path,
                 absl::StrCat("expected exactly one control, got ", in.control.size()));
      }
      continue;
    }
    const SequenceControlConfig& c = in.control[0];
    const std::string c_path = Index(controls_path, 0);
    if (d.Failed(c_path) || d.Failed(Join(c_path, "kind"))) continue;
    const std::string_view kind = SequenceControlKindName(c.kind);
    if (auto [it, fresh] = kinds.emplace(c.kind, i); !fresh) {
      d.AtPath(Join(c_path, "kind"), absl::StrCat("`", ToAbsl(kind),
                                                  "` is already given by "
                                                  "control_input[",
                                                  it->second, "]"));
    }
    const int lists = int{!c.int32_false_true.empty()} + int{!c.fp32_false_true.empty()} +
                      int{!c.bool_false_true.empty()};
    if (c.kind == SequenceControlConfig::Kind::kCorrid) {
      if (c.data_type.empty()) {
        d.AtPath(Join(c_path, "data_type"),
                 absl::StrCat("missing; CONTROL_SEQUENCE_CORRID needs the input's type, one of ",
                              ListNames(kCorridTypes)));
      }
      if (lists != 0) {
        d.AtPath(c_path, "CONTROL_SEQUENCE_CORRID takes `data_type`, not *_false_true values");
      }
      continue;
    }
    if (!c.data_type.empty()) {
      d.AtPath(Join(c_path, "data_type"),
               absl::StrCat("only used by CONTROL_SEQUENCE_CORRID, not `", ToAbsl(kind), "`"));
    }
    if (lists != 1) {
      d.AtPath(c_path, absl::StrCat("`", ToAbsl(kind),
                                    "` needs exactly one of "
                                    "int32_false_true, fp32_false_true, bool_false_true"));
      continue;
    }
    const size_t n =
        c.int32_false_true.size() + c.fp32_false_true.size() + c.bool_false_true.size();
    if (n != 2) {
      const std::string_view key = !c.int32_false_true.empty()  ? "int32_false_true"
                                   : !c.fp32_false_true.empty() ? "fp32_false_true"
                                                                : "bool_false_true";
      d.AtPath(Join(c_path, key), absl::StrCat("expected two values [false, true], got ", n));
    }
  }
}

void ValidateScheduler(Diagnostics& d, const LlmSchedulerConfig& s, const std::string& path) {
  CheckInt(d, Join(path, "max_num_seqs"), kMaxNumSeqsRange, s.max_num_seqs);
  CheckInt(d, Join(path, "max_num_batched_tokens"), kMaxNumBatchedTokensRange,
           s.max_num_batched_tokens);
  CheckInt(d, Join(path, "max_prefill_tokens_with_decodes"), kMaxPrefillWithDecodesRange,
           s.max_prefill_tokens_with_decodes);
  if (!(s.target_itl_ms >= 0 && s.target_itl_ms <= kTargetItlMsMax)) {
    d.AtPath(Join(path, "target_itl_ms"),
             fmt::format("expected a number in [0, {}] (0: no target), got {}", kTargetItlMsMax,
                         s.target_itl_ms));
  }
  CheckInt(d, Join(path, "max_queue_size"), kLlmQueueSizeRange, s.max_queue_size);
  CheckInt(d, Join(path, "block_size"), kBlockSizeRange, s.block_size);
  if (s.kv_cache_bytes != kKvCacheAuto) {
    CheckInt(d, Join(path, "kv_cache_bytes"), kKvCacheBytesRange, s.kv_cache_bytes);
  }
  if (!(s.kv_cache_memory_fraction >= kKvMemoryFractionMin &&
        s.kv_cache_memory_fraction <= kKvMemoryFractionMax)) {
    d.AtPath(Join(path, "kv_cache_memory_fraction"),
             fmt::format("expected a number in [{}, {}], got {}", kKvMemoryFractionMin,
                         kKvMemoryFractionMax, s.kv_cache_memory_fraction));
  }
  const std::string levels_path = Join(path, "priority_levels");
  const std::string level_path = Join(path, "default_priority_level");
  CheckInt(d, levels_path, kPriorityLevelsRange, s.priority_levels);
  if (!d.Failed(levels_path)) {
    if (s.priority_levels == 0 && s.default_priority_level != 0) {
      d.AtPath(level_path, absl::StrCat("must be 0 or absent when priority_levels is 0 (a "
                                        "single level), got `",
                                        s.default_priority_level, "`"));
    } else if (s.priority_levels > 0 &&
               (s.default_priority_level < 1 || s.default_priority_level > s.priority_levels)) {
      d.AtPath(level_path, absl::StrCat("expected a level in [1, ", s.priority_levels,
                                        "] when priority_levels is ", s.priority_levels, ", got `",
                                        s.default_priority_level, "`"));
    }
  }
  const std::string sizes_path = Join(path, "capture_batch_sizes");
  int previous = 0;
  for (size_t i = 0; i < s.capture_batch_sizes.size(); ++i) {
    const std::string item_path = Index(sizes_path, i);
    if (d.Failed(item_path)) continue;
    const int size = s.capture_batch_sizes[i];
    if (size < 1 || size > s.max_num_seqs) {
      d.AtPath(item_path, absl::StrCat("expected a batch size in [1, ", s.max_num_seqs,
                                       "] (max_num_seqs), got `", size, "`"));
    } else if (size <= previous) {
      d.AtPath(item_path, absl::StrCat("expected sizes in ascending order without repeats, got `",
                                       size, "` after `", previous, "`"));
    } else {
      previous = size;
    }
  }
}

// models[].attention: known names, and each number present exactly where its modifier uses it.
void ValidateAttention(Diagnostics& d, const AttentionConfig& a, const std::string& path) {
  if (!a.mask.empty()) CheckName(d, Join(path, "mask"), "attention mask", a.mask, kAttentionMasks);
  if (!a.score.empty()) {
    CheckName(d, Join(path, "score"), "attention score modifier", a.score, kAttentionScores);
  }
  // `key` (value `v`) is used by `owner: name` only and must then be in [1, max].
  auto tokens = [&](std::string_view key, int64_t v, bool used, std::string_view owner_line) {
    if (!used) {
      if (v != 0) d.AtPath(Join(path, key), absl::StrCat("only used with ", ToAbsl(owner_line)));
    } else if (v < 1 || v > kAttentionTokensMax) {
      d.AtPath(Join(path, key),
               absl::StrCat(v == 0 ? "missing" : absl::StrCat("is ", v), ": `", ToAbsl(owner_line),
                            "` needs a number of tokens in [1, ", kAttentionTokensMax, "]"));
    }
  };
  tokens("window", a.window, a.mask == "sliding_window", "mask: sliding_window");
  tokens("chunk", a.chunk, a.mask == "chunked", "mask: chunked");
  if (a.score != "softcap") {
    if (a.softcap != 0) d.AtPath(Join(path, "softcap"), "only used with `score: softcap`");
  } else if (!(a.softcap > 0)) {
    d.AtPath(Join(path, "softcap"),
             a.softcap == 0 ? std::string("missing: `score: softcap` needs the cap, a positive "
                                          "number (scores become cap * tanh(score / cap))")
                            : absl::StrCat("is ", a.softcap, "; the cap must be positive"));
  }
}

void ValidateModelInto(Diagnostics& d, const ModelConfig& m, const std::string& path) {
  std::string name_path = Join(path, "name");
  if (m.name.empty()) {
    d.AtPath(name_path,
             "missing; every model needs a name of 1 to 128 characters from "
             "[A-Za-z0-9_.-]");
  } else if (!IsValidModelName(m.name)) {
    d.AtPath(name_path, absl::StrCat("expected 1 to 128 characters from [A-Za-z0-9_.-], got ",
                                     internal::Quote(m.name)));
  }

  std::vector<std::string_view> kinds;
  const ModelKind* kind = nullptr;
  for (const ModelKind& k : kModelKinds) {
    kinds.push_back(k.name);
    if (k.name == m.kind) kind = &k;
  }
  CheckName(d, Join(path, "kind"), "model kind", m.kind, kinds);
  if (kind != nullptr) {
    std::string builtin_path = Join(path, "builtin");
    if (kind->uses_builtin) {
      CheckName(d, builtin_path, "built-in model", m.builtin, kBuiltinModels);
    } else if (!m.builtin.empty()) {
      d.AtPath(builtin_path, absl::StrCat("not used by kind `", ToAbsl(kind->name), "`"));
    }
    std::string weights_path = Join(path, "path");
    if (kind->uses_path) {
      if (m.path.empty()) {
        d.AtPath(weights_path, absl::StrCat("missing; kind `", ToAbsl(kind->name),
                                            "` loads its weights from `path`"));
      }
    } else if (!m.path.empty()) {
      d.AtPath(weights_path,
               absl::StrCat("not used by kind `", ToAbsl(kind->name), "` (it loads no weights)"));
    }
  }
  CheckName(d, Join(path, "backend"), "backend", m.backend, kBackends);
  CheckInt(d, Join(path, "instance_count"), kInstanceCountRange, m.instance_count);
  CheckInt(d, Join(path, "max_batch_size"), kMaxBatchSizeRange, m.max_batch_size);
  CheckInt(d, Join(path, "threads"), kThreadsRange, m.threads);
  CheckInt(d, Join(path, "context_length"), kContextLengthRange, m.context_length);
  if (m.kind == "llm") {
    // An LLM batches with its continuous batcher, configured under `scheduler`.
    if (m.max_batch_size != 0) {
      d.AtPath(Join(path, "max_batch_size"),
               "not used by kind `llm` (set scheduler.max_num_seqs instead)");
    }
    if (m.dynamic_batching.has_value()) {
      d.AtPath(Join(path, "dynamic_batching"),
               "not used by kind `llm` (the continuous batcher is configured under `scheduler`)");
    }
    if (m.sequence_batching.has_value()) {
      d.AtPath(Join(path, "sequence_batching"), "not used by kind `llm` (tensor models only)");
    }
    if (m.instance_count != 1) {
      d.AtPath(Join(path, "instance_count"),
               "must be 1 for kind `llm` (scale LLMs out with replicas)");
    }
    ValidateScheduler(d, m.scheduler, Join(path, "scheduler"));
    ValidateAttention(d, m.attention, Join(path, "attention"));
    CheckName(d, Join(path, "activations"), "activation type", m.activations, kActivationNames);
    CheckName(d, Join(path, "kv_cache_dtype"), "KV cache dtype", m.kv_cache_dtype, kKvCacheDtypes);
    CheckName(d, Join(path, "sampling"), "sampling place", m.sampling, kSamplingPlaces);
    CheckInt(d, Join(path, "max_loaded_adapters"), kMaxLoadedAdaptersRange, m.max_loaded_adapters);
    CheckInt(d, Join(path, "max_lora_rank"), kMaxLoraRankRange, m.max_lora_rank);
    if (!m.adapters.empty() && m.max_loaded_adapters == 0) {
      d.AtPath(Join(path, "adapters"),
               "model has adapters but max_loaded_adapters is 0 (no adapter slots)");
    }
    for (size_t i = 0; i < m.adapters.size(); ++i) {
      const LoraAdapterConfig& a = m.adapters[i];
      const std::string item_path = Index(Join(path, "adapters"), i);
      if (!IsValidAdapterName(a.name)) {
        d.AtPath(Join(item_path, "name"),
                 absl::StrCat("adapter name `", a.name,
                              "` is not valid: use 1 to 128 of A-Z a-z 0-9 _ . : -"));
      }
      if (a.path.empty()) d.AtPath(Join(item_path, "path"), "missing: the adapter's PEFT folder");
    }
  } else {
    const bool embedding = m.kind == "embedding";
    if (embedding) {
      // The encoder runs batches of texts; it needs a batch dimension.
      if (m.max_batch_size == 0) {
        d.AtPath(Join(path, "max_batch_size"),
                 "must be at least 1 for kind `embedding` (texts per step, e.g. 32)");
      }
      if (m.sequence_batching.has_value()) {
        d.AtPath(Join(path, "sequence_batching"), "not used by kind `embedding`");
      }
    }
    if (m.threads != 0 && !embedding) {
      d.AtPath(Join(path, "threads"), "only used by kinds `llm` and `embedding`");
    }
    if (m.activations != "f32") d.AtPath(Join(path, "activations"), "only used by kind `llm`");
    if (m.kv_cache_dtype != "f32") {
      d.AtPath(Join(path, "kv_cache_dtype"), "only used by kind `llm`");
    }
    if (m.context_length != 0 && !embedding) {
      d.AtPath(Join(path, "context_length"), "only used by kinds `llm` and `embedding`");
    }
    if (m.attention != AttentionConfig{}) {
      d.AtPath(Join(path, "attention"), "only used by kind `llm`");
    }
    if (m.sampling != "device") d.AtPath(Join(path, "sampling"), "only used by kind `llm`");
    if (!m.adapters.empty()) d.AtPath(Join(path, "adapters"), "only used by kind `llm`");
    if (m.dynamic_batching.has_value()) ValidateDynamicBatching(d, *m.dynamic_batching, m, path);
    if (m.sequence_batching.has_value()) {
      ValidateSequenceBatching(d, *m.sequence_batching, m, path);
    }
  }
}

// ---- The whole file -------------------------------------------------------------------------

// Key names follow the model-name rule (they become metric labels), shorter.
bool IsValidKeyName(std::string_view name) {
  return name.size() <= kMaxApiKeyNameLength && IsValidModelName(name);
}

void DecodeAuth(Decoder& dec, const Value* v, AuthConfig* a) {
  Diagnostics& d = dec.diagnostics();
  const std::string path = "server.auth";
  Fields f = dec.Mapping(v, path, kAuthKeys, Prefixed("api_keys", kApiKeyKeys));
  const Value* list = f.Get("api_keys");
  const bool keys_written = list != nullptr && !list->is_null();
  a->enabled = keys_written;  // keys turn auth on unless `enabled` says otherwise
  dec.Bool(f, "enabled", path, &a->enabled);
  dec.EnumList(f, "open", path, kAuthOpenClasses, &a->open);
  const std::string list_path = Join(path, "api_keys");
  if (keys_written && !list->is_sequence()) {
    d.AtPath(list_path,
             "expected a list of keys (`- {name: ..., key_sha256: ..., scopes: "
             "[inference]}`), got " +
                 list->Describe());
    return;
  }
  std::map<std::string, std::string> first_path;
  for (size_t i = 0; keys_written && i < list->items.size(); ++i) {
    const Value& item = list->items[i];
    const std::string item_path = Index(list_path, i);
    d.Record(item_path, item.mark);
    if (!item.is_mapping()) {
      d.AtPath(item_path,
               "expected a key (a mapping with `name`, `key_sha256` or `key_file`, "
               "and `scopes`), got " +
                   item.Describe());
      continue;
    }
    ApiKeyConfig& k = a->api_keys.emplace_back();
    k.location = d.Location(item.mark);
    Fields kf = dec.Mapping(&item, item_path, kApiKeyKeys);
    k.scopes.clear();
    if (!dec.String(kf, "name", item_path, &k.name)) {
      d.AtPath(item_path, "a key needs a `name` (shown in metrics and logs, never the key)");
    } else if (!IsValidKeyName(k.name)) {
      d.AtPath(Join(item_path, "name"),
               absl::StrCat("expected 1 to ", kMaxApiKeyNameLength, " of A-Z a-z 0-9 _ . -, got ",
                            internal::Quote(k.name)));
    } else if (auto [it, inserted] = first_path.emplace(k.name, item_path); !inserted) {
      d.AtPath(Join(item_path, "name"), absl::StrCat("duplicate key name `", k.name, "` (first at ",
                                                     d.Where(d.Find(it->second)), ")"));
    }
    const bool has_hash = dec.String(kf, "key_sha256", item_path, &k.key_sha256);
    const bool has_file = dec.String(kf, "key_file", item_path, &k.key_file);
    if (has_hash == has_file) {
      d.AtPath(item_path, has_hash ? "give either `key_sha256` or `key_file`, not both"
                                   : "a key needs `key_sha256` (hex SHA-256 of the key, e.g. "
                                     "from `printf %s KEY | sha256sum`) or `key_file`");
    }
    if (has_hash) {
      k.key_sha256 = Lower(k.key_sha256);
      if (k.key_sha256.size() != 64 ||
          k.key_sha256.find_first_not_of("0123456789abcdef") != std::string::npos) {
        d.AtPath(Join(item_path, "key_sha256"),
                 "expected 64 hex digits (the SHA-256 of the key, not the key itself)");
      }
    }
    if (has_file && k.key_file.empty()) {
      d.AtPath(Join(item_path, "key_file"), "expected a file path, got an empty string");
    }
    dec.EnumList(kf, "scopes", item_path, kAuthScopes, &k.scopes);
    const Value* scopes = kf.Get("scopes");
    if (scopes == nullptr || scopes->is_null() ||
        (scopes->is_sequence() && scopes->items.empty())) {
      d.AtPath(item_path,
               absl::StrCat("a key needs `scopes`, a non-empty list of ", ListNames(kAuthScopes)));
    }
  }
  if (a->enabled && a->api_keys.empty() && !d.Failed(list_path)) {
    d.AtPath(keys_written ? list_path : Join(path, "enabled"),
             "auth is on but `server.auth.api_keys` lists no key: every request would be "
             "refused (add a key, or set `server.auth.enabled: false`)");
  }
}

void DecodeTls(Decoder& dec, const Value* v, TlsConfig* t) {
  Diagnostics& d = dec.diagnostics();
  const std::string path = "server.tls";
  Fields f = dec.Mapping(v, path, kTlsKeys);
  dec.String(f, "cert_file", path, &t->cert_file);
  dec.String(f, "key_file", path, &t->key_file);
  dec.String(f, "client_ca_file", path, &t->client_ca_file);
  dec.Bool(f, "metrics", path, &t->metrics);
  if (t->cert_file.empty() && !t->key_file.empty()) {
    d.AtPath(Join(path, "key_file"), "`key_file` is set but `cert_file` is not; TLS needs both");
  } else if (!t->cert_file.empty() && t->key_file.empty()) {
    d.AtPath(Join(path, "cert_file"), "`cert_file` is set but `key_file` is not; TLS needs both");
  }
  if (t->cert_file.empty() && !t->client_ca_file.empty()) {
    d.AtPath(Join(path, "client_ca_file"),
             "client certificates (mTLS) need TLS on: set `cert_file` and `key_file`");
  }
  if (t->cert_file.empty() && t->metrics) {
    d.AtPath(Join(path, "metrics"), "TLS on the metrics port needs `cert_file` and `key_file`");
  }
}

void DecodeObservability(Decoder& dec, const Value* v, ObservabilityConfig* o) {
  Diagnostics& d = dec.diagnostics();
  const std::string path = "observability";
  std::vector<std::string> nested = Prefixed("flight_recorder", kFlightRecorderKeys);
  for (std::string& n : Prefixed("tracing", kTracingKeys)) nested.push_back(std::move(n));
  for (std::string& n : Prefixed("otlp", kOtlpKeys)) nested.push_back(std::move(n));
  Fields f = dec.Mapping(v, path, kObservabilityKeys, nested);
  Fields fr =
      dec.Mapping(f.Get("flight_recorder"), "observability.flight_recorder", kFlightRecorderKeys);
  dec.Bool(fr, "enabled", "observability.flight_recorder", &o->flight_recorder.enabled);
  dec.Int(fr, "entries", "observability.flight_recorder", kFlightRecorderEntriesRange,
          &o->flight_recorder.entries);
  dec.Double(f, "watchdog_seconds", path, 0, kMaxWatchdogSeconds, &o->watchdog_seconds);
  Fields tr = dec.Mapping(f.Get("tracing"), "observability.tracing", kTracingKeys);
  dec.Bool(tr, "enabled", "observability.tracing", &o->tracing.enabled);
  Fields otlp = dec.Mapping(f.Get("otlp"), "observability.otlp", kOtlpKeys);
  if (dec.String(otlp, "endpoint", "observability.otlp", &o->otlp.endpoint) &&
      !o->otlp.endpoint.empty() && o->otlp.endpoint.rfind("http://", 0) != 0 &&
      o->otlp.endpoint.rfind("https://", 0) != 0) {
    d.AtPath("observability.otlp.endpoint",
             absl::StrCat("expected an http:// or https:// URL such as "
                          "http://otel-collector:4318/v1/traces, got ",
                          internal::Quote(o->otlp.endpoint)));
  }
  if (dec.String(otlp, "service_name", "observability.otlp", &o->otlp.service_name) &&
      o->otlp.service_name.empty()) {
    d.AtPath("observability.otlp.service_name", "expected a name, got an empty string");
    o->otlp.service_name = ObservabilityConfig::Otlp().service_name;
  }
  dec.Double(otlp, "timeout_seconds", "observability.otlp", 0.001, kMaxOtlpTimeoutSeconds,
             &o->otlp.timeout_seconds);
}

void DecodeServer(Decoder& dec, const Value* v, ServerConfig* s) {
  Diagnostics& d = dec.diagnostics();
  std::vector<std::string> nested = Prefixed("grpc", kGrpcKeys);
  for (std::string& n : Prefixed("http", kHttpKeys)) nested.push_back(std::move(n));
  for (std::string& n : Prefixed("metrics", kMetricsKeys)) nested.push_back(std::move(n));
  for (std::string& n : Prefixed("auth", kAuthKeys)) nested.push_back(std::move(n));
  for (std::string& n : Prefixed("tls", kTlsKeys)) nested.push_back(std::move(n));
  Fields f = dec.Mapping(v, "server", kServerKeys, nested);

  Fields grpc = dec.Mapping(f.Get("grpc"), "server.grpc", kGrpcKeys);
  dec.Bool(grpc, "enabled", "server.grpc", &s->grpc.enabled);
  dec.Address(grpc, "address", "server.grpc", &s->grpc.address);
  dec.Int(grpc, "max_message_bytes", "server.grpc", kMaxMessageBytesRange,
          &s->grpc.max_message_bytes);
  dec.Int(grpc, "max_concurrent_streams", "server.grpc", kMaxConcurrentStreamsRange,
          &s->grpc.max_concurrent_streams);

  Fields http = dec.Mapping(f.Get("http"), "server.http", kHttpKeys);
  dec.Bool(http, "enabled", "server.http", &s->http.enabled);
  dec.Address(http, "address", "server.http", &s->http.address);
  dec.Int(http, "max_body_bytes", "server.http", kMaxBodyBytesRange, &s->http.max_body_bytes);
  dec.Int(http, "threads", "server.http", kHttpThreadsRange, &s->http.threads);
  dec.Int(http, "idle_timeout_seconds", "server.http", kIdleTimeoutSecondsRange,
          &s->http.idle_timeout_seconds);

  Fields metrics = dec.Mapping(f.Get("metrics"), "server.metrics", kMetricsKeys);
  dec.Bool(metrics, "enabled", "server.metrics", &s->metrics.enabled);
  dec.Address(metrics, "address", "server.metrics", &s->metrics.address);

  DecodeAuth(dec, f.Get("auth"), &s->auth);
  DecodeTls(dec, f.Get("tls"), &s->tls);

  dec.Int(f, "max_inflight_requests", "server", kMaxInflightRequestsRange,
          &s->max_inflight_requests);
  dec.Double(f, "shutdown_grace_seconds", "server", 0, kMaxShutdownGraceSeconds,
             &s->shutdown_grace_seconds);
  if (dec.String(f, "storage_dir", "server", &s->storage_dir) && s->storage_dir.empty()) {
    d.AtPath("server.storage_dir", "expected a directory path, got an empty string");
    s->storage_dir = ServerConfig().storage_dir;
  }

  // Two enabled listeners on one port fail at bind time; say so now, with both places.
  struct Listener {
    std::string path;
    const std::string* address;
    HostPort parsed;
  };
  std::vector<Listener> listeners;
  auto add = [&](bool enabled, std::string path, const std::string& address) {
    if (!enabled || d.Failed(path)) return;
    StatusOr<HostPort> parsed = ParseHostPort(address);
    if (parsed.ok()) listeners.push_back(Listener{std::move(path), &address, *parsed});
  };
  add(s->grpc.enabled, "server.grpc.address", s->grpc.address);
  add(s->http.enabled, "server.http.address", s->http.address);
  add(s->metrics.enabled, "server.metrics.address", s->metrics.address);
  auto wildcard = [](const HostPort& hp) { return hp.host == "0.0.0.0" || hp.host == "::"; };
  for (size_t j = 0; j < listeners.size(); ++j) {
    for (size_t i = 0; i < j; ++i) {
      const HostPort& a = listeners[i].parsed;
      const HostPort& b = listeners[j].parsed;
      if (a.port != 0 && a.port == b.port && (a.host == b.host || wildcard(a) || wildcard(b))) {
        d.AtPath(listeners[j].path, absl::StrCat("port ", b.port, " is also used by `",
                                                 listeners[i].path, "` (", *listeners[i].address,
                                                 ", at ", d.Where(d.Find(listeners[i].path)), ")"));
        break;
      }
    }
  }
}

void DecodeConfig(const Value& root, Diagnostics& d, Config* config) {
  Decoder dec(&d);
  std::vector<std::string> nested = Prefixed("server", kServerKeys);
  for (std::string& n : Prefixed("logging", kLoggingKeys)) nested.push_back(std::move(n));
  for (std::string& n : Prefixed("fine_tuning", kFineTuningKeys)) nested.push_back(std::move(n));
  for (std::string& n : Prefixed("observability", kObservabilityKeys)) {
    nested.push_back(std::move(n));
  }
  // `x-` keys are the user's (e.g. for YAML anchors), as in Docker Compose.
  Fields top = dec.Mapping(&root, "", kTopKeys, nested, /*ignored_prefix=*/"x-");
  if (d.Failed("")) return;

  DecodeServer(dec, top.Get("server"), &config->server);

  Fields logging = dec.Mapping(top.Get("logging"), "logging", kLoggingKeys);
  dec.Enum(logging, "level", "logging", kLogLevels, /*ignore_case=*/true, &config->logging.level);
  dec.Enum(logging, "format", "logging", kLogFormats, /*ignore_case=*/true,
           &config->logging.format);

  Fields ft = dec.Mapping(top.Get("fine_tuning"), "fine_tuning", kFineTuningKeys);
  FineTuningConfig& t = config->fine_tuning;
  dec.Bool(ft, "enabled", "fine_tuning", &t.enabled);
  dec.Int(ft, "max_concurrent_jobs", "fine_tuning", kMaxConcurrentJobsRange,
          &t.max_concurrent_jobs);
  dec.Int(ft, "checkpoint_every_steps", "fine_tuning", kCheckpointEveryStepsRange,
          &t.checkpoint_every_steps);
  dec.Double(ft, "checkpoint_every_seconds", "fine_tuning", 0, kMaxCheckpointEverySeconds,
             &t.checkpoint_every_seconds);
  dec.Int(ft, "keep_checkpoints", "fine_tuning", kKeepCheckpointsRange, &t.keep_checkpoints);
  dec.Bool(ft, "yield_to_serving", "fine_tuning", &t.yield_to_serving);
  dec.Double(ft, "max_yield_seconds", "fine_tuning", 0, kMaxCheckpointEverySeconds,
             &t.max_yield_seconds);
  dec.Int(ft, "max_file_bytes", "fine_tuning", kMaxFileBytesRange, &t.max_file_bytes);
  dec.Int(ft, "threads", "fine_tuning", kJobThreadsRange, &t.threads);
  dec.Enum(ft, "backend", "fine_tuning", kBackends, /*ignore_case=*/false, &t.backend);

  DecodeObservability(dec, top.Get("observability"), &config->observability);

  const Value* models = top.Get("models");
  if (models == nullptr || models->is_null()) return;  // no models
  if (!models->is_sequence()) {
    d.AtPath("models",
             "expected a list of model entries (`- name: ...`), got " + models->Describe());
    return;
  }
  for (size_t i = 0; i < models->items.size(); ++i) {
    const Value& item = models->items[i];
    std::string path = Index("models", i);
    d.Record(path, item.mark);
    if (!item.is_mapping()) {
      d.AtPath(path, "expected a model entry (a mapping with `name`, `kind`, ...), got " +
                         item.Describe());
      continue;
    }
    ModelConfig& model = config->models.emplace_back();
    DecodeModel(dec, item, path, &model);
    ValidateModelInto(d, model, path);
  }

  // Names are unique. (Entries that were not mappings were skipped: index by path.)
  std::map<std::string, std::string> first_path;
  for (size_t i = 0, m = 0; i < models->items.size(); ++i) {
    if (!models->items[i].is_mapping()) continue;
    const ModelConfig& model = config->models[m++];
    std::string path = Join(Index("models", i), "name");
    if (!IsValidModelName(model.name)) continue;
    auto [it, inserted] = first_path.emplace(model.name, path);
    if (!inserted) {
      d.AtPath(path, absl::StrCat("duplicate model name `", model.name, "` (first at ",
                                  d.Where(d.Find(it->second)), ", `", it->second, "`)"));
    }
  }
  // Adapter names are unique too, and name no model (a request's `model` may name either).
  std::map<std::string, std::string> adapter_path;
  for (size_t i = 0, m = 0; i < models->items.size(); ++i) {
    if (!models->items[i].is_mapping()) continue;
    const ModelConfig& model = config->models[m++];
    for (size_t j = 0; j < model.adapters.size(); ++j) {
      const std::string& name = model.adapters[j].name;
      std::string path = Join(Index(Join(Index("models", i), "adapters"), j), "name");
      if (!IsValidAdapterName(name)) continue;
      if (auto it = first_path.find(name); it != first_path.end()) {
        d.AtPath(path, absl::StrCat("adapter name `", name, "` is the name of a model (at ",
                                    d.Where(d.Find(it->second)), ", `", it->second, "`)"));
        continue;
      }
      auto [it, inserted] = adapter_path.emplace(name, path);
      if (!inserted) {
        d.AtPath(path, absl::StrCat("duplicate adapter name `", name, "` (first at ",
                                    d.Where(d.Find(it->second)), ", `", it->second, "`)"));
      }
    }
  }
}

// ---- ToYaml ---------------------------------------------------------------------------------

// A string as a YAML scalar: plain when that reads back as the same string, else
// double-quoted with escapes.
std::string YamlString(std::string_view s) {
  bool plain =
      !s.empty() && s != "null" && s != "Null" && s != "NULL" && s.back() != ':' &&
      (std::isalnum(static_cast<unsigned char>(s[0])) || s[0] == '_' || s[0] == '.' || s[0] == '/');
  for (char c : s) {
    plain = plain && (std::isalnum(static_cast<unsigned char>(c)) ||
                      std::string_view("_./:@+-").find(c) != std::string_view::npos);
  }
  if (plain) return std::string(s);
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
          out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

class YamlWriter {
 public:
  void Line(int indent, std::string_view key, std::string_view value = {}) {
    out_.append(static_cast<size_t>(indent), ' ');
    absl::StrAppend(&out_, ToAbsl(key), ":", value.empty() ? "" : " ", ToAbsl(value), "\n");
  }
  // The first key of a list entry: "  - key: value".
  void ItemLine(int indent, std::string_view key, std::string_view value) {
    out_.append(static_cast<size_t>(indent), ' ');
    absl::StrAppend(&out_, "- ", ToAbsl(key), ": ", ToAbsl(value), "\n");
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

std::string YamlBool(bool b) { return b ? "true" : "false"; }

std::string YamlList(const std::vector<std::string>& items) {
  std::vector<std::string> quoted;
  for (const std::string& item : items) quoted.push_back(YamlString(item));
  return absl::StrCat("[", absl::StrJoin(quoted, ", "), "]");
}

template <typename T>
std::string YamlNumbers(const std::vector<T>& values) {
  std::vector<std::string> items;
  for (const T& v : values) {
    if constexpr (std::is_same_v<T, bool>) {
      items.push_back(YamlBool(v));
    } else {
      items.push_back(fmt::format("{}", v));
    }
  }
  return absl::StrCat("[", absl::StrJoin(items, ", "), "]");
}

void WriteSequenceBatching(YamlWriter& w, const SequenceBatchingConfig& sb) {
  w.Line(4, "sequence_batching");
  w.Line(6, "max_sequence_idle_microseconds", std::to_string(sb.max_sequence_idle_microseconds));
  if (sb.strategy == SequenceBatchingConfig::Strategy::kDirect) {
    w.Line(6, "direct");
    w.Line(8, "max_queue_delay_microseconds",
           std::to_string(sb.direct_max_queue_delay_microseconds));
    w.Line(8, "minimum_slot_utilization", fmt::format("{}", sb.direct_minimum_slot_utilization));
  } else {
    w.Line(6, "oldest");
    w.Line(8, "max_candidate_sequences", std::to_string(sb.oldest_max_candidate_sequences));
    w.Line(8, "preferred_batch_size", YamlNumbers(sb.oldest_preferred_batch_size));
    w.Line(8, "max_queue_delay_microseconds",
           std::to_string(sb.oldest_max_queue_delay_microseconds));
    w.Line(8, "preserve_ordering", YamlBool(sb.oldest_preserve_ordering));
  }
  if (sb.control_input.empty()) {
    w.Line(6, "control_input", "[]");
    return;
  }
  w.Line(6, "control_input");
  for (const SequenceControlInput& in : sb.control_input) {
    w.ItemLine(8, "name", YamlString(in.name));
    w.Line(10, "control");
    for (const SequenceControlConfig& c : in.control) {
      w.ItemLine(12, "kind", SequenceControlKindName(c.kind));
      if (!c.int32_false_true.empty()) {
        w.Line(14, "int32_false_true", YamlNumbers(c.int32_false_true));
      }
      if (!c.fp32_false_true.empty()) w.Line(14, "fp32_false_true", YamlNumbers(c.fp32_false_true));
      if (!c.bool_false_true.empty()) w.Line(14, "bool_false_true", YamlNumbers(c.bool_false_true));
      if (!c.data_type.empty()) w.Line(14, "data_type", c.data_type);
    }
  }
}

void WriteQueuePolicy(YamlWriter& w, int indent, const QueuePolicy& q) {
  w.Line(indent, "timeout_action", TimeoutActionName(q.timeout_action));
  w.Line(indent, "default_timeout_microseconds", std::to_string(q.default_timeout_microseconds));
  w.Line(indent, "allow_timeout_override", YamlBool(q.allow_timeout_override));
  w.Line(indent, "max_queue_size", std::to_string(q.max_queue_size));
}

void WriteModel(YamlWriter& w, const ModelConfig& m) {
  w.ItemLine(2, "name", YamlString(m.name));
  w.Line(4, "kind", YamlString(m.kind));
  if (!m.builtin.empty()) w.Line(4, "builtin", YamlString(m.builtin));
  if (!m.path.empty()) w.Line(4, "path", YamlString(m.path));
  w.Line(4, "backend", YamlString(m.backend));
  w.Line(4, "instance_count", std::to_string(m.instance_count));
  w.Line(4, "max_batch_size", std::to_string(m.max_batch_size));
  w.Line(4, "load_on_start", YamlBool(m.load_on_start));
  if (m.kind == "llm") {
    const LlmSchedulerConfig& s = m.scheduler;
    w.Line(4, "threads", std::to_string(m.threads));
    w.Line(4, "context_length", std::to_string(m.context_length));
    w.Line(4, "activations", YamlString(m.activations));
    w.Line(4, "kv_cache_dtype", YamlString(m.kv_cache_dtype));
    w.Line(4, "sampling", YamlString(m.sampling));
    w.Line(4, "max_loaded_adapters", std::to_string(m.max_loaded_adapters));
    w.Line(4, "max_lora_rank", std::to_string(m.max_lora_rank));
    const AttentionConfig& a = m.attention;
    if (a != AttentionConfig{}) {
      w.Line(4, "attention");
      if (!a.mask.empty()) w.Line(6, "mask", YamlString(a.mask));
      if (a.window != 0) w.Line(6, "window", std::to_string(a.window));
      if (a.chunk != 0) w.Line(6, "chunk", std::to_string(a.chunk));
      if (!a.score.empty()) w.Line(6, "score", YamlString(a.score));
      if (a.softcap != 0) w.Line(6, "softcap", fmt::format("{}", a.softcap));
    }
    if (!m.adapters.empty()) {
      w.Line(4, "adapters");
      for (const LoraAdapterConfig& a : m.adapters) {
        w.ItemLine(6, "name", YamlString(a.name));
        w.Line(8, "path", YamlString(a.path));
      }
    }
    w.Line(4, "scheduler");
    w.Line(6, "max_num_seqs", std::to_string(s.max_num_seqs));
    w.Line(6, "max_num_batched_tokens", std::to_string(s.max_num_batched_tokens));
    w.Line(6, "max_prefill_tokens_with_decodes", std::to_string(s.max_prefill_tokens_with_decodes));
    w.Line(6, "target_itl_ms", fmt::format("{}", s.target_itl_ms));
    w.Line(6, "max_queue_size", std::to_string(s.max_queue_size));
    w.Line(6, "block_size", std::to_string(s.block_size));
    w.Line(6, "kv_cache_bytes",
           s.kv_cache_bytes == kKvCacheAuto ? "auto" : std::to_string(s.kv_cache_bytes));
    w.Line(6, "kv_cache_memory_fraction", fmt::format("{}", s.kv_cache_memory_fraction));
    w.Line(6, "enable_prefix_caching", YamlBool(s.enable_prefix_caching));
    w.Line(6, "priority_levels", std::to_string(s.priority_levels));
    w.Line(6, "default_priority_level", std::to_string(s.default_priority_level));
    std::vector<std::string> sizes;
    for (int n : s.capture_batch_sizes) sizes.push_back(std::to_string(n));
    w.Line(6, "capture_batch_sizes", absl::StrCat("[", absl::StrJoin(sizes, ", "), "]"));
    w.Line(6, "speculative");
    w.Line(8, "method", s.speculative.method);
    if (!s.speculative.draft_model.empty()) {
      w.Line(8, "draft_model", YamlString(s.speculative.draft_model));
    }
    w.Line(8, "num_tokens", std::to_string(s.speculative.num_tokens));
    w.Line(8, "prompt_lookup_min", std::to_string(s.speculative.prompt_lookup_min));
    w.Line(8, "prompt_lookup_max", std::to_string(s.speculative.prompt_lookup_max));
    w.Line(8, "adaptive", YamlBool(s.speculative.adaptive));
  }
  if (m.dynamic_batching.has_value()) {
    const DynamicBatchingConfig& db = *m.dynamic_batching;
    w.Line(4, "dynamic_batching");
    std::vector<std::string> sizes;
    for (int s : db.preferred_batch_size) sizes.push_back(std::to_string(s));
    w.Line(6, "preferred_batch_size", absl::StrCat("[", absl::StrJoin(sizes, ", "), "]"));
    w.Line(6, "max_queue_delay_microseconds", std::to_string(db.max_queue_delay_microseconds));
    w.Line(6, "preserve_ordering", YamlBool(db.preserve_ordering));
    w.Line(6, "priority_levels", std::to_string(db.priority_levels));
    w.Line(6, "default_priority_level", std::to_string(db.default_priority_level));
    w.Line(6, "default_queue_policy");
    WriteQueuePolicy(w, 8, db.default_queue_policy);
    if (db.priority_queue_policy.empty()) {
      w.Line(6, "priority_queue_policy", "{}");
    } else {
      w.Line(6, "priority_queue_policy");
      for (const auto& [level, policy] : db.priority_queue_policy) {
        w.Line(8, std::to_string(level));
        WriteQueuePolicy(w, 10, policy);
      }
    }
  }
  if (m.sequence_batching.has_value()) WriteSequenceBatching(w, *m.sequence_batching);
}

}  // namespace

// ---- Public API -----------------------------------------------------------------------------

std::string SourceLocation::ToString() const {
  if (line == 0) return file;
  return absl::StrCat(file, ":", line, ":", column);
}

std::string_view SequenceControlKindName(SequenceControlConfig::Kind kind) {
  return kControlKinds[static_cast<size_t>(kind)];
}

std::string_view TimeoutActionName(QueuePolicy::TimeoutAction action) {
  return action == QueuePolicy::TimeoutAction::kDelay ? "DELAY" : "REJECT";
}

bool ModelConfig::operator==(const ModelConfig& o) const {
  // Every field but `location`; keep in step with the struct.
  return name == o.name && kind == o.kind && builtin == o.builtin && path == o.path &&
         backend == o.backend && instance_count == o.instance_count &&
         max_batch_size == o.max_batch_size && dynamic_batching == o.dynamic_batching &&
         sequence_batching == o.sequence_batching && load_on_start == o.load_on_start &&
         scheduler == o.scheduler && threads == o.threads && context_length == o.context_length &&
         activations == o.activations && kv_cache_dtype == o.kv_cache_dtype &&
         sampling == o.sampling && max_loaded_adapters == o.max_loaded_adapters &&
         max_lora_rank == o.max_lora_rank && adapters == o.adapters && attention == o.attention;
}

bool Config::operator==(const Config& o) const {
  return server == o.server && logging == o.logging && fine_tuning == o.fine_tuning &&
         observability == o.observability && models == o.models;
}

const ModelConfig* Config::FindModel(std::string_view name) const {
  for (const ModelConfig& m : models) {
    if (m.name == name) return &m;
  }
  return nullptr;
}

const Config& DefaultConfig() {
  static const Config* const config = [] {
    StatusOr<Config> parsed = ParseConfig(DefaultConfigYaml(), "<default>");
    KILN_CHECK(parsed.ok(),
               "the embedded default configuration (config/examples/default.yaml) "
               "does not parse");
    return new Config(*std::move(parsed));
  }();
  return *config;
}

StatusOr<Config> ParseConfig(std::string_view yaml_text, std::string_view filename,
                             const std::vector<std::string>& overrides) {
  Diagnostics d(std::string(filename), "at the top level", &overrides);
  Value root;
  Problem problem;
  if (!internal::ParseYaml(yaml_text, 0, &root, &problem)) {
    d.Add(problem.mark, problem.message);
    return d.ToStatus();
  }
  std::vector<Problem> problems;
  for (size_t i = 0; i < overrides.size(); ++i) {
    internal::ApplyOverride(overrides[i], static_cast<int>(i) + 1, &root, &problems);
  }
  for (Problem& p : problems) d.Add(p.mark, std::move(p.message));

  Config config;
  config.source = std::string(filename);
  DecodeConfig(root, d, &config);
  if (!d.ok()) return d.ToStatus();
  return config;
}

StatusOr<Config> LoadConfigFile(const std::string& path,
                                const std::vector<std::string>& overrides) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    int error = errno;
    std::string reason = std::error_code(error, std::generic_category()).message();
    if (error == ENOENT || error == ENOTDIR) {
      return NotFound("config file `", path, "` not found: ", reason);
    }
    if (error == EACCES || error == EPERM) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot read config file `", path, "`: ", reason));
    }
    return InvalidArgument("cannot open config file `", path, "`: ", reason);
  }
  std::string text;
  char buffer[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), file)) > 0 &&
         text.size() <= kMaxConfigFileBytes) {
    text.append(buffer, n);
  }
  int error = std::ferror(file) ? errno : 0;
  std::fclose(file);
  if (error == EISDIR) return InvalidArgument("config file `", path, "` is a directory");
  if (error != 0) {
    return InvalidArgument("cannot read config file `", path,
                           "`: ", std::error_code(error, std::generic_category()).message());
  }
  if (text.size() > kMaxConfigFileBytes) {
    return InvalidArgument("config file `", path, "` is larger than ", kMaxConfigFileBytes >> 20,
                           " MiB");
  }
  return ParseConfig(text, path, overrides);
}

Status ValidateModel(const ModelConfig& model, std::string_view where) {
  Diagnostics d(std::string(where), "in the model entry", nullptr);
  ValidateModelInto(d, model, "");
  return d.ToStatus();
}

namespace {

// Reads one model entry's text (JSON or YAML) into `*root`, a mapping; false (the problem
// added to `d`) if it is not one. `empty` says what an empty text should have held.
bool ParseModelEntryText(std::string_view text, std::string_view empty, Diagnostics& d,
                         Value* root) {
  Problem problem;
  if (!internal::ParseYaml(text, 0, root, &problem)) {
    // JSON that yaml-cpp cannot read (surrogate pairs) still is JSON; and for text that is
    // meant as JSON, nlohmann's message is the relevant one.
    size_t first = text.find_first_not_of(" \t\r\n");
    if (first == std::string_view::npos || text[first] != '{') {
      d.Add(problem.mark, problem.message);
      return false;
    }
    if (!internal::ParseJson(text, root, &problem)) {
      d.Add(problem.mark, problem.message);
      return false;
    }
  }
  if (root->is_null()) {
    d.Add(root->mark,
          absl::StrCat("empty model configuration; expected a mapping with ", ToAbsl(empty)));
    return false;
  }
  d.Record("", root->mark);
  if (!root->is_mapping()) {
    d.AtPath(
        "", "expected a model entry (a mapping with `name`, `kind`, ...), got " + root->Describe());
    return false;
  }
  return true;
}

// Decodes and validates a model entry's tree.
StatusOr<ModelConfig> DecodeModelEntry(const Value& root, Diagnostics& d) {
  Decoder dec(&d);
  ModelConfig model;
  DecodeModel(dec, root, "", &model);
  ValidateModelInto(d, model, "");
  if (!d.ok()) return d.ToStatus();
  return model;
}

void ForgetMarks(Value* v) {
  v->mark = Mark{};
  for (Value& item : v->items) ForgetMarks(&item);
  for (internal::Entry& e : v->entries) {
    ForgetMarks(&e.key);
    ForgetMarks(&e.value);
  }
}

// `model` as the tree an entry of `models:` that sets every key would give, without positions
// (an error about a value that came from here is named by its path alone).
Value ModelTree(const ModelConfig& model) {
  YamlWriter w;
  w.Line(0, "models");
  WriteModel(w, model);
  Value root;
  Problem problem;
  KILN_CHECK(internal::ParseYaml(w.Take(), 0, &root, &problem),
             "WriteModel wrote YAML that does not parse back");
  Value entry = std::move(root.entries.at(0).value.items.at(0));
  ForgetMarks(&entry);
  // Capture sizes left at their default follow max_num_seqs (DecodeScheduler trims them), so
  // that a change of max_num_seqs alone keeps the entry valid.
  LlmSchedulerConfig defaults;
  std::erase_if(defaults.capture_batch_sizes,
                [&](int n) { return n > model.scheduler.max_num_seqs; });
  if (model.scheduler.capture_batch_sizes == defaults.capture_batch_sizes) {
    for (internal::Entry& e : entry.entries) {
      if (e.key.scalar != "scheduler") continue;
      std::erase_if(e.value.entries,
                    [](const internal::Entry& s) { return s.key.scalar == "capture_batch_sizes"; });
    }
  }
  return entry;
}

// JSON Merge Patch (RFC 7386) on the tree: a mapping in `patch` merges into a mapping in
// `*target` key by key; null removes the key; anything else replaces. A key written twice in
// one mapping of the patch is kept twice, so that decoding reports it as in a file.
void MergePatch(const Value& patch, Value* target) {
  if (!patch.is_mapping() || !target->is_mapping()) {
    *target = patch;
    if (target->is_mapping()) {  // into nothing: nulls (removals) have nothing to remove
      std::erase_if(target->entries, [](const internal::Entry& e) { return e.value.is_null(); });
    }
    return;
  }
  target->mark = patch.mark;
  std::set<std::string> seen;
  for (const internal::Entry& p : patch.entries) {
    const std::string& key = p.key.scalar;
    auto it = std::find_if(target->entries.begin(), target->entries.end(),
                           [&](const internal::Entry& e) { return e.key.scalar == key; });
    if (!seen.insert(key).second) {
      target->entries.push_back(p);  // a duplicate: decoding says so
    } else if (p.value.is_null()) {
      if (it != target->entries.end()) target->entries.erase(it);
    } else if (it == target->entries.end()) {
      internal::Entry& added = target->entries.emplace_back();
      added.key = p.key;
      MergePatch(p.value, &added.value);
    } else {
      it->key = p.key;  // where the key was written, for messages about it
      MergePatch(p.value, &it->value);
    }
  }
}

}  // namespace

StatusOr<ModelConfig> ParseModelConfig(std::string_view text, std::string_view where) {
  Diagnostics d(std::string(where), "in the model entry", nullptr);
  Value root;
  if (!ParseModelEntryText(text, "at least `name` and `kind`", d, &root)) return d.ToStatus();
  return DecodeModelEntry(root, d);
}

StatusOr<ModelConfig> MergeModelConfig(const ModelConfig& base, std::string_view text,
                                       std::string_view where) {
  Diagnostics d(std::string(where), "in the model entry", nullptr);
  Value patch;
  if (!ParseModelEntryText(text, "the keys to change (`{}` for none)", d, &patch)) {
    return d.ToStatus();
  }
  Value merged = ModelTree(base);
  MergePatch(patch, &merged);
  d.Record("", merged.mark);
  StatusOr<ModelConfig> model = DecodeModelEntry(merged, d);
  if (!model.ok()) return model;
  // Adapters added while serving stay so (a reload that cannot read one drops it).
  for (LoraAdapterConfig& a : model->adapters) {
    for (const LoraAdapterConfig& b : base.adapters) {
      if (a == b) a.runtime = b.runtime;
    }
  }
  return model;
}

std::string ToYaml(const Config& c) {
  YamlWriter w;
  const ServerConfig& s = c.server;
  w.Line(0, "server");
  w.Line(2, "grpc");
  w.Line(4, "enabled", YamlBool(s.grpc.enabled));
  w.Line(4, "address", YamlString(s.grpc.address));
  w.Line(4, "max_message_bytes", std::to_string(s.grpc.max_message_bytes));
  w.Line(4, "max_concurrent_streams", std::to_string(s.grpc.max_concurrent_streams));
  w.Line(2, "http");
  w.Line(4, "enabled", YamlBool(s.http.enabled));
  w.Line(4, "address", YamlString(s.http.address));
  w.Line(4, "max_body_bytes", std::to_string(s.http.max_body_bytes));
  w.Line(4, "threads", std::to_string(s.http.threads));
  w.Line(4, "idle_timeout_seconds", std::to_string(s.http.idle_timeout_seconds));
  w.Line(2, "metrics");
  w.Line(4, "enabled", YamlBool(s.metrics.enabled));
  w.Line(4, "address", YamlString(s.metrics.address));
  w.Line(2, "auth");
  w.Line(4, "enabled", YamlBool(s.auth.enabled));
  if (s.auth.api_keys.empty()) {
    w.Line(4, "api_keys", "[]");
  } else {
    w.Line(4, "api_keys");
    for (const ApiKeyConfig& k : s.auth.api_keys) {
      w.ItemLine(6, "name", YamlString(k.name));
      if (!k.key_sha256.empty()) w.Line(8, "key_sha256", YamlString(k.key_sha256));
      if (!k.key_file.empty()) w.Line(8, "key_file", YamlString(k.key_file));
      w.Line(8, "scopes", YamlList(k.scopes));
    }
  }
  w.Line(4, "open", YamlList(s.auth.open));
  w.Line(2, "tls");
  w.Line(4, "cert_file", YamlString(s.tls.cert_file));
  w.Line(4, "key_file", YamlString(s.tls.key_file));
  w.Line(4, "client_ca_file", YamlString(s.tls.client_ca_file));
  w.Line(4, "metrics", YamlBool(s.tls.metrics));
  w.Line(2, "max_inflight_requests", std::to_string(s.max_inflight_requests));
  // Shortest text that reads back as the same double.
  w.Line(2, "shutdown_grace_seconds", fmt::format("{}", s.shutdown_grace_seconds));
  w.Line(2, "storage_dir", YamlString(s.storage_dir));
  w.Line(0, "logging");
  w.Line(2, "level", YamlString(c.logging.level));
  w.Line(2, "format", YamlString(c.logging.format));
  const FineTuningConfig& t = c.fine_tuning;
  w.Line(0, "fine_tuning");
  w.Line(2, "enabled", YamlBool(t.enabled));
  w.Line(2, "max_concurrent_jobs", std::to_string(t.max_concurrent_jobs));
  w.Line(2, "checkpoint_every_steps", std::to_string(t.checkpoint_every_steps));
  w.Line(2, "checkpoint_every_seconds", fmt::format("{}", t.checkpoint_every_seconds));
  w.Line(2, "keep_checkpoints", std::to_string(t.keep_checkpoints));
  w.Line(2, "yield_to_serving", YamlBool(t.yield_to_serving));
  w.Line(2, "max_yield_seconds", fmt::format("{}", t.max_yield_seconds));
  w.Line(2, "max_file_bytes", std::to_string(t.max_file_bytes));
  w.Line(2, "threads", std::to_string(t.threads));
  w.Line(2, "backend", YamlString(t.backend));
  const ObservabilityConfig& o = c.observability;
  w.Line(0, "observability");
  w.Line(2, "flight_recorder");
  w.Line(4, "enabled", YamlBool(o.flight_recorder.enabled));
  w.Line(4, "entries", std::to_string(o.flight_recorder.entries));
  w.Line(2, "watchdog_seconds", fmt::format("{}", o.watchdog_seconds));
  w.Line(2, "tracing");
  w.Line(4, "enabled", YamlBool(o.tracing.enabled));
  w.Line(2, "otlp");
  w.Line(4, "endpoint", YamlString(o.otlp.endpoint));
  w.Line(4, "service_name", YamlString(o.otlp.service_name));
  w.Line(4, "timeout_seconds", fmt::format("{}", o.otlp.timeout_seconds));
  if (c.models.empty()) {
    w.Line(0, "models", "[]");
  } else {
    w.Line(0, "models");
    for (const ModelConfig& m : c.models) WriteModel(w, m);
  }
  return w.Take();
}

StatusOr<HostPort> ParseHostPort(std::string_view address) {
  auto bad = [&](std::string_view what) {
    return InvalidArgument("expected HOST:PORT", ToAbsl(what), ", got `", ToAbsl(address), "`");
  };
  HostPort result;
  std::string_view host;
  std::string_view port;
  if (!address.empty() && address[0] == '[') {
    size_t close = address.find(']');
    if (close == std::string_view::npos || close + 1 >= address.size() ||
        address[close + 1] != ':') {
      return bad(" with an IPv6 HOST in brackets, e.g. [::1]:8001");
    }
    host = address.substr(1, close - 1);
    port = address.substr(close + 2);
    in6_addr unused;
    if (inet_pton(AF_INET6, std::string(host).c_str(), &unused) != 1) {
      return bad(" where [HOST] is an IPv6 address");
    }
    result.ipv6 = true;
  } else {
    size_t colon = address.rfind(':');
    if (colon == std::string_view::npos) return bad("");
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
    if (host.find(':') != std::string_view::npos) {
      return bad(" with an IPv6 HOST in brackets, e.g. [::1]:8001");
    }
    if (host.empty()) return bad(" with a HOST (0.0.0.0 listens on every interface)");
    bool numeric = host.find_first_not_of("0123456789.") == std::string_view::npos;
    if (numeric ? !IsIPv4(host) : !IsHostName(host)) {
      return bad(" where HOST is an IPv4 address, [IPv6 address] or host name");
    }
  }
  int64_t port_number = -1;
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string_view::npos ||
      ParseInt64(port, &port_number) != NumberParse::kOk || port_number > 65535) {
    return bad(" with PORT in [0, 65535]");
  }
  result.host = std::string(host);
  result.port = static_cast<int>(port_number);
  return result;
}

}  // namespace kiln::config
