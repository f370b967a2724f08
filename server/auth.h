// API keys (config server.auth): who may call which route.
//
// Every front end asks the one Authenticator before doing any work for a request:
//   HTTP   `Authorization: Bearer <key>`                 (server/http_frontend.cc)
//   gRPC   metadata `authorization: Bearer <key>`        (server/grpc_auth.h, in every handler)
// A route's class (server/http_routes.h; gRPC methods map onto the same classes) names the
// scope a key needs: kInference -> `inference`, kFineTuning -> `fine_tuning`, kAdmin ->
// `admin`. kHealth, kMetrics and kOpenApi need no scope: while they are not open, any valid
// key passes. A class listed in server.auth.open needs no key at all.
//
// Keys are held as SHA-256 digests only. A presented key is hashed and compared against every
// configured digest with CRYPTO_memcmp, without stopping at the first match, so neither the
// comparison nor which key matched shows in the timing. Messages, logs and metrics name a
// key by its configured `name`, never by its value or digest.
//
// The value is parsed strictly: the scheme `Bearer` (any case), exactly one space, then the
// key, which is printable ASCII without spaces. Nothing is trimmed: `Bearer KEY ` carries the
// key `KEY ` (which is not `KEY`). HTTP/1.1 itself drops whitespace around a header value
// (RFC 9110 OWS) before the server sees it; gRPC metadata arrives byte for byte.
//
// Thread-safety: every method is thread-safe. ReloadKeyFiles swaps the key set atomically;
// a request sees either the old set or the new one.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "config/config.h"
#include "engine/base/metrics.h"
#include "engine/base/status.h"
#include "server/http_routes.h"

namespace kiln {

// The front end a request came through (the `protocol` label of kiln_auth_requests_total).
enum class AuthProtocol { kHttp, kGrpc };

class Authenticator {
 public:
  // Reads every key_file (a missing, unreadable or empty file, or one whose key holds
  // whitespace, is an error naming the entry's config file:line and the path, never the
  // content) and registers kiln_auth_requests_total{key, protocol, result} on `registry`
  // (may be null: no metrics). Two entries holding the same key are an error too.
  static StatusOr<std::unique_ptr<Authenticator>> Create(const config::AuthConfig& config,
                                                         metrics::Registry* registry);

  bool enabled() const { return enabled_; }
  // Whether `c` is listed in server.auth.open (or auth is off): no key needed.
  bool IsOpen(RouteClass c) const;

  // Decides one request. `authorization` is the Authorization header (HTTP) or the
  // `authorization` metadata value (gRPC); nullopt when absent. Returns the name of the key
  // that passed, or "" for an open class (or auth off); else Unauthenticated (no value, not
  // `Bearer <key>`, unknown key) or PermissionDenied (the key lacks the class's scope). The
  // messages say what is expected and never echo the value sent.
  StatusOr<std::string> Authorize(std::optional<std::string_view> authorization,
                                  RouteClass c) const;

  // Authorize, plus what every front end does with the result: counts it in
  // kiln_auth_requests_total (open classes are not counted) and logs a refusal at debug level
  // with `remote`, `route` and the reason (never the key).
  StatusOr<std::string> Check(AuthProtocol protocol, std::optional<std::string_view> authorization,
                              RouteClass c, std::string_view remote, std::string_view route) const;

  // Re-reads every key_file (SIGHUP). On success the new keys take effect at once for new
  // requests; on any error the old set stays in force and the error is returned.
  Status ReloadKeyFiles();

  ~Authenticator();

 private:
  using Digest = std::array<uint8_t, 32>;
  struct Key {
    std::string name;
    Digest digest{};
    uint32_t scopes = 0;  // bit (1 << RouteClass) for kInference, kFineTuning, kAdmin
  };
  using KeySet = std::vector<Key>;
  struct Counters;

  // The outcome of one request: the status, and the index of the key that was sent (in
  // config order; -1 when none matched).
  struct Decision {
    Status status;
    int key = -1;
  };

  explicit Authenticator(const config::AuthConfig& config);
  // REQUIRES: the class is not open.
  Decision Decide(std::optional<std::string_view> authorization, RouteClass c) const;
  // The key set the configuration describes now (key files read again).
  StatusOr<std::shared_ptr<const KeySet>> LoadKeys() const;
  std::shared_ptr<const KeySet> keys() const;

  const config::AuthConfig config_;
  const bool enabled_;
  uint32_t open_ = 0;      // bit (1 << RouteClass) per open class
  absl::Mutex reload_mu_;  // one ReloadKeyFiles at a time
  mutable absl::Mutex mu_;
  std::shared_ptr<const KeySet> keys_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Counters> counters_;  // null without a registry
};

}  // namespace kiln
