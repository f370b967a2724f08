// kilnd's configuration: the YAML schema as C++ structs, loading, validation and defaults.
//
// The YAML file has three top-level sections, `server`, `logging` and `models`; every key
// and its default is documented in config/README.md and printed, with comments, by
// `kilnd --print-default-config` (which is the embedded default configuration itself).
//
// Errors name the place and say what is allowed:
//   config.yaml:14:5: unknown key `max_batch` in `models[0]` (did you mean `max_batch_size`?)
//   config.yaml:3:14: `server.grpc.address`: expected HOST:PORT, got `8001`
// Unknown keys are errors. Every error found is reported (one per line), not just the first.
//
// Thread-safety: the structs are plain values; the functions are pure and thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/status.h"

namespace kiln::config {

// Where a value came from, for error messages given after parsing (e.g. at model load).
struct SourceLocation {
  std::string file;  // "<default>" for the embedded default, "<set>" for --set overrides
  int line = 0;      // 1-based; 0 when unknown
  int column = 0;    // 1-based; 0 when unknown
  std::string ToString() const;  // "file:line:col" (or just "file" when line is 0)
  bool operator==(const SourceLocation&) const = default;
};

// ---- server ---------------------------------------------------------------------------------

struct GrpcConfig {
  bool enabled = true;
  std::string address = "0.0.0.0:8001";    // HOST:PORT; port 0 picks a free port
  int64_t max_message_bytes = 64ll << 20;  // largest request or response message
  int max_concurrent_streams = 1024;       // HTTP/2 streams per connection
  bool operator==(const GrpcConfig&) const = default;
};

struct HttpConfig {
  bool enabled = true;
  std::string address = "0.0.0.0:8000";
  int64_t max_body_bytes = 64ll << 20;  // larger request bodies get 413
  int threads = 2;                      // I/O threads for HTTP and metrics
  int idle_timeout_seconds = 60;        // keep-alive connections idle this long are closed
  bool operator==(const HttpConfig&) const = default;
};

struct MetricsConfig {
  bool enabled = true;
  std::string address = "0.0.0.0:8002";  // serves GET /metrics
  bool operator==(const MetricsConfig&) const = default;
};

// ---- server.auth: API keys ---------------------------------------------------------------
//
// With auth on, every request carries `Authorization: Bearer <key>` (HTTP) or `authorization:
// Bearer <key>` (gRPC metadata, as tritonclient and the openai SDK send it). A route's class
// (server/http_routes.h; gRPC methods map the same way) says which scope it needs; classes
// named in `open` need no key.

// The scopes a key may hold, and the route classes that may be left open.
inline constexpr std::string_view kAuthScopes[] = {"inference", "fine_tuning", "admin"};
inline constexpr std::string_view kAuthOpenClasses[] = {"health", "metrics", "openapi",
                                                        "inference"};

struct ApiKeyConfig {
  std::string name;                 // [A-Za-z0-9_.-]{1,64}, unique: what metrics and logs show
  std::string key_sha256;           // 64 hex digits: SHA-256 of the key; or
  std::string key_file;             // a file whose content (trailing newline stripped) is the key
  std::vector<std::string> scopes;  // of kAuthScopes, at least one, no repeats
  SourceLocation location;          // where the entry was written (for start-up errors)
  bool operator==(const ApiKeyConfig& o) const {
    return name == o.name && key_sha256 == o.key_sha256 && key_file == o.key_file &&
           scopes == o.scopes;
  }
};

struct AuthConfig {
  // On when `api_keys` is written (then `enabled: false` turns it off); `enabled: true` with
  // no keys is refused at start-up, naming the line.
  bool enabled = false;
  std::vector<ApiKeyConfig> api_keys;
  std::vector<std::string> open = {"health", "metrics"};  // of kAuthOpenClasses
  bool operator==(const AuthConfig&) const = default;
};

// ---- server.tls ----------------------------------------------------------------------------

// TLS on the gRPC and HTTP ports (and the metrics port if `metrics`). Off while cert_file is
// empty. Files are PEM; they are read at start-up (an unreadable, mismatched or expired
// certificate is a start-up error) and again on SIGHUP.
struct TlsConfig {
  std::string cert_file;       // the server's certificate chain
  std::string key_file;        // its private key; required with cert_file
  std::string client_ca_file;  // optional: require client certificates signed by this CA
  bool metrics = false;        // also serve /metrics over TLS
  bool enabled() const { return !cert_file.empty(); }
  bool operator==(const TlsConfig&) const = default;
};

struct ServerConfig {
  GrpcConfig grpc;
  HttpConfig http;
  MetricsConfig metrics;
  AuthConfig auth;
  TlsConfig tls;
  // Requests admitted at once across all front ends (queued + executing). Past it, new
  // requests are refused at once with RESOURCE_EXHAUSTED / HTTP 429.
  int max_inflight_requests = 4096;
  // On SIGTERM/SIGINT: time for in-flight work to finish before it is cancelled.
  double shutdown_grace_seconds = 30.0;
  // Jobs, checkpoints, adapters, kernel cache. Relative paths resolve against the working
  // directory at start-up.
  std::string storage_dir = ".kiln";
  bool operator==(const ServerConfig&) const = default;
};

// ---- logging --------------------------------------------------------------------------------

struct LoggingConfig {
  std::string level = "info";   // trace, debug, info, warn, error, critical, off
  std::string format = "text";  // text | json
  bool operator==(const LoggingConfig&) const = default;
};

// ---- fine_tuning ----------------------------------------------------------------------------

// The daemon's fine-tuning jobs (scheduler/finetune/job_service.h, docs/fine-tuning.md).
struct FineTuningConfig {
  bool enabled = true;          // serve the files and fine_tuning.jobs APIs and run jobs
  int max_concurrent_jobs = 1;  // jobs training at once; more wait queued, [1, 64]
  // A checkpoint (what a crash resumes from) every this many optimizer steps, and at least
  // every checkpoint_every_seconds of training; 0 turns either off (then only epoch ends).
  int64_t checkpoint_every_steps = 50;
  double checkpoint_every_seconds = 600;
  int keep_checkpoints = 3;  // newest checkpoints kept per job (served as ...:ckpt-step-N)
  // Between steps, a job waits while its base model has generation requests queued or running.
  bool yield_to_serving = true;
  // The longest a job waits between two steps, so it progresses under steady load.
  double max_yield_seconds = 10;
  int64_t max_file_bytes = 512ll << 20;  // largest uploaded file; more gets 413
  int threads = 0;  // CPU threads per job; 0: the CPUs the process may use (affinity, cgroup quota)
  std::string backend = "cpu";  // where jobs train
  bool operator==(const FineTuningConfig&) const = default;
};

// ---- models ---------------------------------------------------------------------------------

// Triton's ModelQueuePolicy.
struct QueuePolicy {
  enum class TimeoutAction { kReject, kDelay };
  TimeoutAction timeout_action = TimeoutAction::kReject;
  uint64_t default_timeout_microseconds = 0;  // 0: requests never time out in the queue
  bool allow_timeout_override = false;        // may a request's `timeout` parameter override?
  uint32_t max_queue_size = 0;                // 0: unbounded (still limited by max_inflight)
  bool operator==(const QueuePolicy&) const = default;
};

// "REJECT" or "DELAY", as written in the YAML.
std::string_view TimeoutActionName(QueuePolicy::TimeoutAction action);

// Triton's ModelDynamicBatching (same names and meaning).
struct DynamicBatchingConfig {
  std::vector<int> preferred_batch_size;      // each in [1, max_batch_size]
  uint64_t max_queue_delay_microseconds = 0;  // wait at most this for a fuller batch
  bool preserve_ordering = false;
  uint32_t priority_levels = 0;         // 0: a single level; else levels 1..N, 1 is highest
  uint32_t default_priority_level = 0;  // in [1, priority_levels] when priority_levels > 0
  QueuePolicy default_queue_policy;
  std::map<uint32_t, QueuePolicy> priority_queue_policy;  // keys in [1, priority_levels]
  bool operator==(const DynamicBatchingConfig&) const = default;
};

// Triton's ModelSequenceBatching (same names and meaning): stateful models whose requests
// carry a sequence id. Requests of one sequence run in order, one at a time, on the instance
// (and, with `direct`, the batch slot) the sequence was given at its START; the batcher adds
// the control inputs below to every request it runs.
struct SequenceControlConfig {
  // Triton's ModelSequenceBatching.Control.Kind.
  enum class Kind { kStart, kReady, kEnd, kCorrid };
  Kind kind = Kind::kStart;
  // START, READY, END: the input's [false, true] values; exactly one list, of two values.
  std::vector<int32_t> int32_false_true;
  std::vector<float> fp32_false_true;
  std::vector<bool> bool_false_true;
  // CORRID: the input's type: "TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32" or
  // "TYPE_STRING" (string ids need TYPE_STRING; integer ids fit any integer type in range).
  std::string data_type;
  bool operator==(const SequenceControlConfig&) const = default;
};

// "CONTROL_SEQUENCE_START", ... as written in the config.
std::string_view SequenceControlKindName(SequenceControlConfig::Kind kind);

struct SequenceControlInput {
  std::string name;                            // one of the model's inputs; clients do not send it
  std::vector<SequenceControlConfig> control;  // exactly one
  bool operator==(const SequenceControlInput&) const = default;
};

struct SequenceBatchingConfig {
  enum class Strategy { kDirect, kOldest };
  // direct: every sequence holds a batch slot (max_batch_size slots per instance, 1 without
  // batching) from START to END; sequences beyond the slots wait for one. oldest: each
  // instance keeps max_candidate_sequences sequences and batches the oldest requests among
  // them like the dynamic batcher (at most one request per sequence in a batch).
  Strategy strategy = Strategy::kDirect;
  // A sequence with no request for this long is released (0: Triton's default, 1 s); a later
  // request for it without START is refused.
  uint64_t max_sequence_idle_microseconds = 1'000'000;
  std::vector<SequenceControlInput> control_input;
  // direct: wait up to max_queue_delay_microseconds for at least minimum_slot_utilization of
  // an instance's slots to have a request ready.
  uint64_t direct_max_queue_delay_microseconds = 0;
  double direct_minimum_slot_utilization = 0;
  // oldest:
  int oldest_max_candidate_sequences = 1;        // >= 1
  std::vector<int> oldest_preferred_batch_size;  // each in [1, max_batch_size]
  uint64_t oldest_max_queue_delay_microseconds = 0;
  bool oldest_preserve_ordering = false;
  bool operator==(const SequenceBatchingConfig&) const = default;
};

// kv_cache_bytes: auto.
inline constexpr int64_t kKvCacheAuto = -1;

// Speculative decoding (scheduler.speculative): each decode step also verifies up to
// num_tokens drafted tokens, accepting those the model would have produced itself. A
// request's own `speculative` field overrides it.
struct SpeculativeConfig {
  // "none", "ngram" (prompt lookup: drafts copied from the sequence's own earlier tokens) or
  // "draft" (drafts generated greedily by draft_model).
  std::string method = "none";
  // A smaller model with the same vocabulary that proposes drafts: the name of another kind llm
  // entry (loaded with its settings) or a path (GGUF file or Hugging Face folder, loaded with
  // this model's); needed by method "draft", and when set requests may ask for "draft" whatever
  // the default method. Empty: none.
  std::string draft_model;
  int num_tokens = 8;         // drafted tokens per step (at most, when adaptive), [1, 16]
  int prompt_lookup_min = 2;  // ngram: shortest suffix looked up, [1, prompt_lookup_max]
  int prompt_lookup_max = 4;  // ngram: longest suffix looked up, [1, 16]
  // Each sequence drafts what pays on this device (its acceptance rate against the measured
  // cost of a step's rows), up to num_tokens; false: always num_tokens.
  bool adaptive = true;
  bool operator==(const SpeculativeConfig&) const = default;
};

// With scheduler.target_itl_ms, the fewest prompt tokens a step that decodes still carries
// (where a step's decodes leave room for fewer: a prompt always advances). Small, so that the
// target holds where decodes are slow (docs/performance.md: 16 tokens cost 37 ms beside four
// decodes on a 2-core Zen 3, above a 55 ms target's room); the step cost model measures
// mixed steps from 4 prompt tokens on (StepCostModel::kMinPromptTokens).
inline constexpr int kTargetItlMinPromptTokens = 4;

// The continuous batcher of a generative model (kind llm): the model's `scheduler:` section.
struct LlmSchedulerConfig {
  int max_num_seqs = 64;             // sequences in one step, [1, 4096]
  int max_num_batched_tokens = 128;  // tokens in one step (decode + prefill chunks), >= 1
  // Prompt tokens at most in a step that also decodes running streams (they wait for the whole
  // step); 0: up to max_num_batched_tokens. Steps with nothing to decode use the full budget.
  int max_prefill_tokens_with_decodes = 64;
  // A target for the running streams' inter-token latency, in ms; 0: none. When set, a step
  // that decodes carries as many prompt tokens as the measured step costs say fit in it (at
  // least kTargetItlMinPromptTokens, so prompts always advance) instead of
  // max_prefill_tokens_with_decodes, which still applies until those costs are measured.
  // Prompt tokens always get at least half the decodes' time (StepCostModel::kPromptShare), so
  // where the decodes alone take most of the target or more, a step takes up to 1.5x them; a
  // number of streams never decoded alone first gets one decode-only step, which measures it.
  double target_itl_ms = 0;
  int max_queue_size = 1024;             // waiting requests; more get RESOURCE_EXHAUSTED; 0 = none
  int block_size = 16;                   // tokens per KV-cache block, [1, 1024]
  int64_t kv_cache_bytes = 256ll << 20;  // memory for the KV cache (all layers); kKvCacheAuto:
  // kv_cache_memory_fraction of the device's free memory when the model loads (after its
  // weights), on devices that report their memory (cuda, xpu); 256 MiB on the others
  double kv_cache_memory_fraction = 0.9;  // for kv_cache_bytes: auto, in [0.01, 0.99]
  bool enable_prefix_caching = true;      // share KV blocks of identical prompt prefixes
  uint32_t priority_levels = 0;           // 0: a single level; else levels 1..N, 1 is highest
  uint32_t default_priority_level = 0;    // in [1, priority_levels] when priority_levels > 0
  // Decode-step batch sizes to capture and replay (padded up to the next one); empty: none.
  // Left out, the defaults above max_num_seqs are dropped.
  std::vector<int> capture_batch_sizes = {1, 2, 4, 8, 16, 32, 64};
  SpeculativeConfig speculative;  // method none: off
  bool operator==(const LlmSchedulerConfig&) const = default;
};

// A LoRA adapter served from the start (models[].adapters).
struct LoraAdapterConfig {
  std::string name;         // [A-Za-z0-9_.:-]{1,128}, unique among adapters and models
  std::string path;         // a PEFT folder: adapter_config.json + adapter_model.safetensors
  SourceLocation location;  // of the list entry
  // Added while serving (ModelRepository::AddLoraAdapter), not by the file: a reload that
  // cannot read it again (its folder was removed) drops it with a warning instead of failing
  // the model. Not part of the value (not written by ToYaml).
  bool runtime = false;
  bool operator==(const LoraAdapterConfig& o) const { return name == o.name && path == o.path; }
};

// A model's attention modifiers (models[].attention), replacing what its files say on every
// layer: masks and score modifiers of the engine's attn:: library (engine/expr.h) by name.
// Empty fields keep the model's own (e.g. Gemma 2's alternating windows and soft-cap).
struct AttentionConfig {
  std::string mask;    // "" (the model's), "causal", "sliding_window" or "chunked"
  int64_t window = 0;  // mask sliding_window: a query sees this many positions back (>= 1)
  int64_t chunk = 0;   // mask chunked: causal within chunks of this many positions (>= 1)
  std::string score;   // "" (the model's), "none", "softcap" or "alibi"
  double softcap = 0;  // score softcap: cap * tanh(score / cap), cap > 0
  bool empty() const { return mask.empty() && score.empty(); }
  bool operator==(const AttentionConfig&) const = default;
};

// The values of ModelConfig::activations.
inline constexpr std::string_view kActivationNames[] = {"f32", "q8", "bf16"};

struct ModelConfig {
  std::string name;  // [A-Za-z0-9_.-]{1,128}, unique
  // "builtin" (tensor smoke-test models), "llm" (path: GGUF or HF folder) or "embedding"
  // (path: a sentence-transformers / Hugging Face BERT folder; a tensor model)
  std::string kind;
  std::string builtin;  // kind builtin: "simple", "identity_fp32" or "sleep_us"
  std::string path;     // weights (file or folder), for kinds that load weights
  std::string backend = "cpu";
  int instance_count = 1;  // model instances executing batches in parallel, >= 1
  int max_batch_size = 0;  // 0: the model does not batch (inputs have no batch dimension)
  std::optional<DynamicBatchingConfig> dynamic_batching;  // absent: no dynamic batching
  // Absent: not a sequence model. Excludes dynamic_batching (Triton's scheduling_choice).
  std::optional<SequenceBatchingConfig> sequence_batching;
  bool load_on_start = true;  // false: listed in the repository index, loaded on request
  // kind llm only:
  LlmSchedulerConfig scheduler;
  // kinds llm and embedding:
  int threads = 0;         // CPU threads for the model's kernels; 0: the CPUs the process may use
                           // (affinity, cgroup quota)
  int context_length = 0;  // cap on the model's context (llm: KV per sequence; embedding: tokens
                           // per text); 0: the model's own
  // kind llm only:
  // Numerics, one of kActivationNames. "f32": activations stay f32 (exact against f32
  // references). "q8": activations are quantized to 8-bit blocks before multiplying
  // q4_0/q4_1/q8_0/mxfp4 weights, as llama.cpp does (faster one-stream decode on cpu; logits
  // move by up to ~1). "bf16": rounded to bf16 before bf16 weights, as llama.cpp does (cpu
  // with AVX-512 BF16 dot products that outrun its FMAs; exact elsewhere).
  std::string activations = "f32";
  std::string kv_cache_dtype = "f32";  // "f32", "f16" or "bf16" (half the memory per token)
  // Where tokens are sampled: "device" (the step program ends in a sampling stage where the
  // backend has the kernel, so only token ids cross to the host; else the host) or "host".
  std::string sampling = "device";
  // Multi-LoRA: adapter slots in the step program (adapters resident at once; more are
  // swapped in LRU order) and the largest rank they take. 0 slots: no LoRA in the graph.
  int max_loaded_adapters = 4;
  int max_lora_rank = 16;
  std::vector<LoraAdapterConfig> adapters;  // served from the start
  AttentionConfig attention;                // empty: the model's own attention
  SourceLocation location;                  // of the list entry

  // Compares the settings; `location` (where they were written) is not part of the value.
  bool operator==(const ModelConfig& other) const;
};

// ---- observability --------------------------------------------------------------------------

struct ObservabilityConfig {
  // A ring of recent events per model (steps, batches, request state changes), dumped as
  // JSON on SIGUSR1, at GET /debug/flight_recorder and by the watchdog.
  struct FlightRecorder {
    bool enabled = true;
    int entries = 4096;  // events kept per model, [16, 1048576]
    bool operator==(const FlightRecorder&) const = default;
  } flight_recorder;
  // A step, batch or request that makes no progress this long dumps the flight recorder and
  // names what is stuck; 0 turns the watchdog off. [0, 86400].
  double watchdog_seconds = 60;
  // Per-request spans: W3C traceparent in and out, GET /debug/trace, OTLP export.
  struct Tracing {
    bool enabled = true;
    bool operator==(const Tracing&) const = default;
  } tracing;
  // Export spans to an OpenTelemetry collector over OTLP/HTTP JSON; off while endpoint is
  // empty. endpoint: http://HOST:PORT/v1/traces.
  struct Otlp {
    std::string endpoint;
    std::string service_name = "kilnd";
    double timeout_seconds = 5;  // per export request, (0, 300]
    bool operator==(const Otlp&) const = default;
  } otlp;
  bool operator==(const ObservabilityConfig&) const = default;
};

// ---- the whole file -------------------------------------------------------------------------

struct Config {
  ServerConfig server;
  LoggingConfig logging;
  FineTuningConfig fine_tuning;
  ObservabilityConfig observability;
  std::vector<ModelConfig> models;
  std::string source;  // the file it came from, or "<default>"

  const ModelConfig* FindModel(std::string_view name) const;  // nullptr if absent

  // Compares the settings; `source` (where they came from) is not part of the value.
  bool operator==(const Config& other) const;
};

// The embedded default configuration, as YAML with a comment on every key. It is what
// `kilnd` runs without --config and what --print-default-config prints; parsing it gives
// DefaultConfig().
std::string_view DefaultConfigYaml();
const Config& DefaultConfig();

// Parses and validates YAML text. `filename` is used in error messages only.
// `overrides` are `dotted.path=value` strings (from `kilnd --set`), applied on top of the
// file before validation: `server.grpc.address=127.0.0.1:0`, `models[1].max_batch_size=4`,
// `logging.level=debug`. Values are parsed as YAML scalars or flow collections.
// Returns InvalidArgument whose message lists every problem, one per line, each starting with
// `file:line:col: `.
StatusOr<Config> ParseConfig(std::string_view yaml_text, std::string_view filename,
                             const std::vector<std::string>& overrides = {});

// Reads `path` and calls ParseConfig. NotFound / PermissionDenied name the path.
StatusOr<Config> LoadConfigFile(const std::string& path,
                                const std::vector<std::string>& overrides = {});

// Validates one model entry on its own (used when a model is loaded over the API with an
// inline configuration). Error messages are prefixed by `where`.
Status ValidateModel(const ModelConfig& model, std::string_view where);

// Parses a single model entry from JSON or YAML text (RepositoryModelLoad's `config`
// parameter) with the same schema and errors as an entry of `models:`.
StatusOr<ModelConfig> ParseModelConfig(std::string_view text, std::string_view where);

// Parses `text` (JSON or YAML, a mapping) as changes to the entry `base`, as JSON Merge Patch
// (RFC 7386) has it: a key given replaces base's value, a mapping given (`scheduler`,
// `dynamic_batching`, ...) merges key by key, a list replaces the list, and a key set to null
// goes back to its default (`"dynamic_batching": null` turns dynamic batching off); every
// other key keeps base's value. The result is validated as a whole, with the errors of an
// entry of `models:`: a problem in `text` gives its line and column, one in a value kept from
// `base` its key path alone (e.g. a new `max_batch_size` below base's preferred batch sizes).
// `{"max_batch_size": 16}` changes only that.
StatusOr<ModelConfig> MergeModelConfig(const ModelConfig& base, std::string_view text,
                                       std::string_view where);

// Serializes a config back to YAML (no comments), e.g. for logging the effective config.
// Every key is written, defaults included. For a valid config, ParseConfig(ToYaml(c)) == c.
std::string ToYaml(const Config& config);

// A listen address split into its parts, as accepted by the config: HOST:PORT where HOST is an
// IPv4 address, a bracketed IPv6 address or a host name (RFC 1123), and PORT is 0..65535.
struct HostPort {
  std::string host;  // without the brackets of an IPv6 address: "::1" for "[::1]:8001"
  int port = 0;      // 0: the OS picks a free port
  bool ipv6 = false;
  bool operator==(const HostPort&) const = default;
};

// Parses and checks an address such as `server.grpc.address`. InvalidArgument says what is
// wrong with it ("expected HOST:PORT ..., got `8001`"), without a location.
StatusOr<HostPort> ParseHostPort(std::string_view address);

}  // namespace kiln::config
