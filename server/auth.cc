#include "server/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "engine/base/ascii.h"
#include "spdlog/spdlog.h"

namespace kiln {
namespace {

constexpr uint32_t Bit(RouteClass c) { return 1u << static_cast<int>(c); }

// The scope a class needs, or nullopt when any valid key will do (health, metrics, openapi).
std::optional<RouteClass> ScopeOf(RouteClass c) {
  if (c == RouteClass::kInference || c == RouteClass::kFineTuning || c == RouteClass::kAdmin) {
    return c;
  }
  return std::nullopt;
}

std::string_view ProtocolName(AuthProtocol p) { return p == AuthProtocol::kHttp ? "http" : "grpc"; }

// A key as a client can send it: printable ASCII, no spaces (RFC 6750's b64token is a subset).
bool ValidKeyChars(std::string_view key) {
  for (unsigned char c : key) {
    if (c <= 0x20 || c >= 0x7f) return false;
  }
  return true;
}

// "config.yaml:12:7: server.auth.api_keys `ci-bot`", the prefix of a key's start-up errors.
std::string Where(const config::ApiKeyConfig& k) {
  return StrCat(k.location.ToString(), ": server.auth.api_keys `", k.name, "`");
}

// The key in `k.key_file`: its content less trailing newlines. Errors name the entry and the
// path, never the content.
StatusOr<std::string> ReadKeyFile(const config::ApiKeyConfig& k) {
  std::ifstream in(k.key_file, std::ios::binary);
  if (!in) {
    const int err = errno;
    return FailedPrecondition(Where(k), ": cannot read key_file `", k.key_file,
                              "`: ", err != 0 ? std::strerror(err) : "cannot open it");
  }
  std::ostringstream content;
  content << in.rdbuf();
  if (in.bad()) {
    return FailedPrecondition(Where(k), ": cannot read key_file `", k.key_file, "`");
  }
  std::string key = std::move(content).str();
  while (!key.empty() && (key.back() == '\n' || key.back() == '\r')) key.pop_back();
  if (key.empty()) {
    return FailedPrecondition(Where(k), ": key_file `", k.key_file,
                              "` is empty; it should hold the key (one line)");
  }
  if (!ValidKeyChars(key)) {
    return FailedPrecondition(Where(k), ": key_file `", k.key_file,
                              "` holds spaces or non-printable characters; a key is printable "
                              "ASCII without spaces (only a trailing newline is ignored)");
  }
  return key;
}

std::array<uint8_t, 32> Sha256(std::string_view data) {
  std::array<uint8_t, 32> out{};
  unsigned int len = 0;
  const int ok = EVP_Digest(data.data(), data.size(), out.data(), &len, EVP_sha256(), nullptr);
  KILN_CHECK(ok == 1 && len == out.size(), "EVP_Digest(SHA-256) failed");
  return out;
}

std::array<uint8_t, 32> FromHex(std::string_view hex) {  // REQUIRES: 64 hex digits (config)
  std::array<uint8_t, 32> out{};
  auto nibble = [](char c) { return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10; };
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<uint8_t>(nibble(hex[2 * i]) << 4 | nibble(hex[2 * i + 1]));
  }
  return out;
}

}  // namespace

// One counter per (key, protocol, result) that can happen, looked up once at start.
struct Authenticator::Counters {
  static constexpr int kProtocols = 2;
  std::vector<std::array<metrics::Counter*, kProtocols>> ok, denied;  // per key, in config order
  std::array<metrics::Counter*, kProtocols> unauthenticated{};        // key ""
};

Authenticator::Authenticator(const config::AuthConfig& config)
    : config_(config), enabled_(config.enabled) {
  for (const std::string& name : config.open) {
    for (RouteClass c : {RouteClass::kHealth, RouteClass::kMetrics, RouteClass::kOpenApi,
                         RouteClass::kInference, RouteClass::kFineTuning, RouteClass::kAdmin}) {
      if (RouteClassName(c) == name) open_ |= Bit(c);
    }
  }
}

Authenticator::~Authenticator() = default;

StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(const config::AuthConfig& config,
                                                               metrics::Registry* registry) {
  std::unique_ptr<Authenticator> auth(new Authenticator(config));
  if (auth->enabled_) {
    KILN_ASSIGN_OR_RETURN(std::shared_ptr<const KeySet> keys, auth->LoadKeys());
    absl::MutexLock lock(&auth->mu_);
    auth->keys_ = std::move(keys);
  }
  if (registry != nullptr && auth->enabled_) {
    auto& family = registry->AddCounter(
        "kiln_auth_requests_total",
        "Requests checked for an API key, by key name (\"\" when none or an unknown one was "
        "sent), protocol (http, grpc) and result (ok, unauthenticated, permission_denied).",
        {"key", "protocol", "result"});
    auto counters = std::make_unique<Counters>();
    for (int p = 0; p < Counters::kProtocols; ++p) {
      const std::string_view protocol = ProtocolName(static_cast<AuthProtocol>(p));
      counters->unauthenticated[p] = family.WithLabels({"", protocol, "unauthenticated"});
    }
    for (const config::ApiKeyConfig& k : config.api_keys) {
      auto& ok = counters->ok.emplace_back();
      auto& denied = counters->denied.emplace_back();
      for (int p = 0; p < Counters::kProtocols; ++p) {
        const std::string_view protocol = ProtocolName(static_cast<AuthProtocol>(p));
        ok[p] = family.WithLabels({k.name, protocol, "ok"});
        denied[p] = family.WithLabels({k.name, protocol, "permission_denied"});
      }
    }
    auth->counters_ = std::move(counters);
  }
  return auth;
}

StatusOr<std::shared_ptr<const Authenticator::KeySet>> Authenticator::LoadKeys() const {
  auto keys = std::make_shared<KeySet>();
  for (const config::ApiKeyConfig& k : config_.api_keys) {
    Key& key = keys->emplace_back();
    key.name = k.name;
    if (!k.key_file.empty()) {
      KILN_ASSIGN_OR_RETURN(std::string value, ReadKeyFile(k));
      key.digest = Sha256(value);
      OPENSSL_cleanse(value.data(), value.size());
    } else {
      key.digest = FromHex(k.key_sha256);
    }
    for (const std::string& s : k.scopes) {
      for (RouteClass c : {RouteClass::kInference, RouteClass::kFineTuning, RouteClass::kAdmin}) {
        if (RouteClassName(c) == s) key.scopes |= Bit(c);
      }
    }
  }
  // Two names for one key would make the name a request is counted under a matter of order.
  for (size_t i = 0; i < keys->size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if ((*keys)[i].digest == (*keys)[j].digest) {
        return FailedPrecondition(
            Where(config_.api_keys[i]), " holds the same key as `", config_.api_keys[j].name, "` (",
            config_.api_keys[j].location.ToString(), "); give each client its own key");
      }
    }
  }
  return std::shared_ptr<const KeySet>(std::move(keys));
}

std::shared_ptr<const Authenticator::KeySet> Authenticator::keys() const {
  absl::MutexLock lock(&mu_);
  return keys_;
}

bool Authenticator::IsOpen(RouteClass c) const { return !enabled_ || (open_ & Bit(c)) != 0; }

Authenticator::Decision Authenticator::Decide(std::optional<std::string_view> authorization,
                                              RouteClass c) const {
  if (!authorization) {
    return {Unauthenticated(
        "this route needs an API key: send `Authorization: Bearer <key>` (gRPC: metadata "
        "`authorization: Bearer <key>`)")};
  }
  // Strictly `Bearer` (any case), one space, the key; nothing trimmed.
  constexpr std::string_view kScheme = "Bearer";
  const std::string_view v = *authorization;
  const bool bearer = v.size() > kScheme.size() + 1 &&
                      EqualsIgnoreCase(v.substr(0, kScheme.size()), kScheme) &&
                      v[kScheme.size()] == ' ';
  const std::string_view presented = bearer ? v.substr(kScheme.size() + 1) : std::string_view();
  if (!bearer || !ValidKeyChars(presented)) {
    return {Unauthenticated(
        "the authorization value is not `Bearer <key>` (the word Bearer, one space, then the "
        "key, with no other whitespace)")};
  }
  const Digest digest = Sha256(presented);
  const std::shared_ptr<const KeySet> keys = this->keys();
  // Every digest is compared, whatever matched before, so the time taken does not depend on
  // which key (if any) matches.
  int match = -1;
  for (size_t i = 0; i < keys->size(); ++i) {
    const bool equal = CRYPTO_memcmp(digest.data(), (*keys)[i].digest.data(), digest.size()) == 0;
    match = equal ? static_cast<int>(i) : match;
  }
  if (match < 0) {
    return {
        Unauthenticated("the API key is not valid: no configured key matches it (check for a stray "
                        "character)")};
  }
  const Key& key = (*keys)[match];
  if (const std::optional<RouteClass> scope = ScopeOf(c); scope && !(key.scopes & Bit(*scope))) {
    return {PermissionDenied("key `", key.name, "` lacks the `", RouteClassName(*scope),
                             "` scope this route needs"),
            match};
  }
  return {OkStatus(), match};
}

StatusOr<std::string> Authenticator::Authorize(std::optional<std::string_view> authorization,
                                               RouteClass c) const {
  if (IsOpen(c)) return std::string();
  Decision d = Decide(authorization, c);
  if (!d.status.ok()) return d.status;
  return config_.api_keys[d.key].name;
}

StatusOr<std::string> Authenticator::Check(AuthProtocol protocol,
                                           std::optional<std::string_view> authorization,
                                           RouteClass c, std::string_view remote,
                                           std::string_view route) const {
  if (IsOpen(c)) return std::string();
  Decision d = Decide(authorization, c);
  const int p = static_cast<int>(protocol);
  if (counters_) {
    metrics::Counter* counter = d.status.ok() ? counters_->ok[d.key][p]
                                : d.key >= 0  ? counters_->denied[d.key][p]
                                              : counters_->unauthenticated[p];
    counter->Increment();
  }
  if (d.status.ok()) return config_.api_keys[d.key].name;
  spdlog::debug("auth: {} {} from {} refused ({} class): {}", ProtocolName(protocol), route, remote,
                RouteClassName(c), StatusMessage(d.status));
  return d.status;
}

Status Authenticator::ReloadKeyFiles() {
  if (!enabled_) return OkStatus();
  absl::MutexLock reload(&reload_mu_);
  KILN_ASSIGN_OR_RETURN(std::shared_ptr<const KeySet> keys, LoadKeys());
  {
    absl::MutexLock lock(&mu_);
    keys_ = std::move(keys);
  }
  int files = 0;
  for (const config::ApiKeyConfig& k : config_.api_keys) files += k.key_file.empty() ? 0 : 1;
  spdlog::info("auth: reloaded {} key file(s); {} key(s) in force", files, config_.api_keys.size());
  return OkStatus();
}

}  // namespace kiln
