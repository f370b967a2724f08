// TLS material for kilnd's front ends: reading and checking the PEM files of `server.tls`
// (one check for every front end, run before anything binds and again on SIGHUP), the
// OpenSSL context the HTTP servers hand to new connections, and in-memory copies of the
// files for gRPC's certificate watcher.
//
// Usage:
//   kiln::tls::Files files{cfg.cert_file, cfg.key_file, cfg.client_ca_file};
//   KILN_ASSIGN_OR_RETURN(kiln::tls::Pem pem, kiln::tls::LoadFiles(files));
//   KILN_ASSIGN_OR_RETURN(auto context, kiln::tls::ServerContext::Create(pem));
//   http_options.tls = context;  // every new connection takes context->Current()
//   ...on SIGHUP: LoadFiles again; if that succeeds, context->Update(pem).
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "engine/base/status.h"

namespace boost::asio::ssl {
class context;
}

namespace kiln::tls {

// Where the files are, and the configuration key they came from (named in every error).
struct Files {
  std::string cert_file;       // PEM certificate chain, the server's own certificate first
  std::string key_file;        // PEM private key of that certificate (not encrypted)
  std::string client_ca_file;  // optional: PEM CA certificate(s) client certificates must chain to
  std::string key_prefix = "server.tls";  // errors read "server.tls.cert_file: <path> ..."
};

// The checked contents of the files.
struct Pem {
  std::string cert_chain;
  std::string private_key;
  std::string client_ca;  // empty: client certificates are not requested
  std::string summary;    // for logs: "CN=..., serial 0A1B..., valid until 2027-01-01 ..."
};

// Reads `files` and checks them: each readable; the certificate chain and the client CA parse;
// the key parses (an encrypted key is refused, never prompted for) and matches the first
// certificate; that certificate is valid now (notBefore passed, notAfter not). Errors are
// InvalidArgument naming the key and the file, e.g.
//   "server.tls.cert_file: /etc/kiln/tls.crt expired on 2025-01-01 00:00:00 UTC".
StatusOr<Pem> LoadFiles(const Files& files);

// The OpenSSL server context for new connections: TLS 1.2 or newer, the certificate chain and
// key of a Pem, and, when it has a client CA, client certificates required and verified
// against it (mTLS). Update() swaps in a new context; connections keep the one they started
// with (they hold it by shared_ptr), so a reload drops none of them. Thread-safe.
class ServerContext {
 public:
  // InvalidArgument if OpenSSL refuses the material (LoadFiles has checked it already).
  static StatusOr<std::shared_ptr<ServerContext>> Create(const Pem& pem);

  // Replaces the context given to new connections. On error the old one stays.
  Status Update(const Pem& pem);

  // The context for a connection starting now. Never null.
  std::shared_ptr<boost::asio::ssl::context> Current() const;

 private:
  ServerContext() = default;
  mutable std::mutex mu_;
  std::shared_ptr<boost::asio::ssl::context> current_;  // guarded by mu_
};

// The three PEM texts as anonymous in-memory files (memfd), readable by this process at
// fixed paths (/proc/self/fd/N) for the life of the object. Update() replaces each file's
// contents atomically (a new memfd moved onto the same descriptor number), so a reader sees
// the old or the new file, never half of one. This is how gRPC's FileWatcherCertificateProvider
// gets certificates that kilnd has checked, without copies of the key on disk.
// Thread-safe; the paths are valid until destruction.
class MemoryFiles {
 public:
  static StatusOr<std::unique_ptr<MemoryFiles>> Create(const Pem& pem);
  ~MemoryFiles();
  MemoryFiles(const MemoryFiles&) = delete;
  MemoryFiles& operator=(const MemoryFiles&) = delete;

  Status Update(const Pem& pem);

  std::string cert_path() const { return Path(cert_fd_); }
  std::string key_path() const { return Path(key_fd_); }
  // Empty when the Pem given to Create had no client CA (then Update keeps none either).
  std::string client_ca_path() const { return ca_fd_ < 0 ? std::string() : Path(ca_fd_); }

 private:
  MemoryFiles() = default;
  static std::string Path(int fd) { return "/proc/self/fd/" + std::to_string(fd); }
  std::mutex mu_;  // serializes Update
  int cert_fd_ = -1, key_fd_ = -1, ca_fd_ = -1;
};

}  // namespace kiln::tls
