#include "server/tls/tls.h"

#include <fcntl.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/mman.h>
#include <unistd.h>

#include <boost/asio/buffer.hpp>
#include <boost/asio/ssl/context.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <exception>
#include <vector>

namespace kiln::tls {
namespace {

namespace ssl = boost::asio::ssl;

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;

// Refuses to decrypt: an encrypted key would otherwise make OpenSSL prompt on the terminal.
int NoPassword(char*, int, int, void*) { return 0; }

// The reason of the oldest queued OpenSSL error ("no start line"), and clears the queue.
std::string OpenSslReason() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  const char* reason = e == 0 ? nullptr : ERR_reason_error_string(e);
  return reason ? std::string(reason) : std::string("unknown OpenSSL error");
}

Status ReadFile(const std::string& key, const std::string& path, std::string* out) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return InvalidArgument(key, ": cannot read ", path, ": ", std::strerror(errno));
  out->clear();
  char buf[8192];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out->append(buf, n);
  const bool failed = std::ferror(f);
  const int err = errno;
  std::fclose(f);
  if (failed) return InvalidArgument(key, ": cannot read ", path, ": ", std::strerror(err));
  return OkStatus();
}

// Every certificate in `pem`, in order; empty if none parses (or the text is not PEM).
std::vector<X509Ptr> ParseCertificates(const std::string& pem) {
  std::vector<X509Ptr> certs;
  BioPtr bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, NoPassword, nullptr)) {
    certs.emplace_back(x);
  }
  ERR_clear_error();  // the read that ended the loop queued "no start line"
  return certs;
}

// "2025-01-01 00:00:00 UTC".
std::string FormatTime(const ASN1_TIME* t) {
  std::tm tm{};
  if (ASN1_TIME_to_tm(t, &tm) != 1) return "(unreadable date)";
  char buf[64];
  const size_t n = std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S UTC", &tm);
  return std::string(buf, n);
}

// "subject CN=kilnd, serial 1A2B, valid until 2027-01-01 00:00:00 UTC".
std::string Summary(X509* cert) {
  std::string out = "subject ";
  char name[256];
  X509_NAME_oneline(X509_get_subject_name(cert), name, sizeof(name));
  out += name;
  if (BIGNUM* bn = ASN1_INTEGER_to_BN(X509_get0_serialNumber(cert), nullptr)) {
    if (char* hex = BN_bn2hex(bn)) {
      out += ", serial ";
      out += hex;
      OPENSSL_free(hex);
    }
    BN_free(bn);
  }
  out += ", valid until " + FormatTime(X509_get0_notAfter(cert));
  return out;
}

}  // namespace

StatusOr<Pem> LoadFiles(const Files& files) {
  const std::string cert_key = files.key_prefix + ".cert_file";
  const std::string key_key = files.key_prefix + ".key_file";
  const std::string ca_key = files.key_prefix + ".client_ca_file";
  Pem pem;
  KILN_RETURN_IF_ERROR(ReadFile(cert_key, files.cert_file, &pem.cert_chain));
  KILN_RETURN_IF_ERROR(ReadFile(key_key, files.key_file, &pem.private_key));
  if (!files.client_ca_file.empty()) {
    KILN_RETURN_IF_ERROR(ReadFile(ca_key, files.client_ca_file, &pem.client_ca));
  }

  std::vector<X509Ptr> chain = ParseCertificates(pem.cert_chain);
  if (chain.empty()) {
    return InvalidArgument(cert_key, ": ", files.cert_file,
                           " holds no PEM certificate (expected -----BEGIN CERTIFICATE-----)");
  }
  X509* leaf = chain.front().get();
  if (X509_cmp_current_time(X509_get0_notAfter(leaf)) < 0) {
    return InvalidArgument(cert_key, ": ", files.cert_file, " expired on ",
                           FormatTime(X509_get0_notAfter(leaf)));
  }
  if (X509_cmp_current_time(X509_get0_notBefore(leaf)) > 0) {
    return InvalidArgument(cert_key, ": ", files.cert_file, " is not valid before ",
                           FormatTime(X509_get0_notBefore(leaf)), " (check the clock)");
  }

  BioPtr bio(BIO_new_mem_buf(pem.private_key.data(), static_cast<int>(pem.private_key.size())));
  PkeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassword, nullptr));
  if (!key) {
    const std::string reason = OpenSslReason();
    if (pem.private_key.find("ENCRYPTED") != std::string::npos) {
      return InvalidArgument(key_key, ": ", files.key_file,
                             " is encrypted; kilnd needs an unencrypted key (e.g. `openssl pkey "
                             "-in encrypted.key -out tls.key`, then protect the file)");
    }
    return InvalidArgument(key_key, ": ", files.key_file, " holds no PEM private key (", reason,
                           ")");
  }
  if (X509_check_private_key(leaf, key.get()) != 1) {
    ERR_clear_error();
    return InvalidArgument(key_key, ": ", files.key_file, " does not match the certificate in ",
                           cert_key, " (", files.cert_file, ")");
  }

  if (!files.client_ca_file.empty() && ParseCertificates(pem.client_ca).empty()) {
    return InvalidArgument(ca_key, ": ", files.client_ca_file,
                           " holds no PEM certificate (expected -----BEGIN CERTIFICATE-----)");
  }
  pem.summary = Summary(leaf);
  return pem;
}

// ---- ServerContext ------------------------------------------------------------------------

namespace {

StatusOr<std::shared_ptr<ssl::context>> MakeContext(const Pem& pem) {
  try {
    auto ctx = std::make_shared<ssl::context>(ssl::context::tls_server);
    ctx->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                     ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1 |
                     ssl::context::single_dh_use);
    SSL_CTX* native = ctx->native_handle();
    SSL_CTX_set_min_proto_version(native, TLS1_2_VERSION);
    // Resumed sessions with client certificates need a session id context.
    static constexpr unsigned char kSessionContext[] = "kilnd";
    SSL_CTX_set_session_id_context(native, kSessionContext, sizeof(kSessionContext) - 1);
    boost::system::error_code ec;
    ctx->use_certificate_chain(boost::asio::buffer(pem.cert_chain), ec);
    if (ec) return InvalidArgument("TLS certificate chain refused: ", ec.message());
    ctx->use_private_key(boost::asio::buffer(pem.private_key), ssl::context::pem, ec);
    if (ec) return InvalidArgument("TLS private key refused: ", ec.message());
    if (!pem.client_ca.empty()) {
      ctx->add_certificate_authority(boost::asio::buffer(pem.client_ca), ec);
      if (ec) return InvalidArgument("TLS client CA refused: ", ec.message());
      ctx->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert);
    } else {
      ctx->set_verify_mode(ssl::verify_none);
    }
    return ctx;
  } catch (const std::exception& e) {
    return Internal("cannot create a TLS context: ", e.what());
  }
}

}  // namespace

StatusOr<std::shared_ptr<ServerContext>> ServerContext::Create(const Pem& pem) {
  KILN_ASSIGN_OR_RETURN(auto ctx, MakeContext(pem));
  std::shared_ptr<ServerContext> out(new ServerContext());
  out->current_ = std::move(ctx);
  return out;
}

Status ServerContext::Update(const Pem& pem) {
  KILN_ASSIGN_OR_RETURN(auto ctx, MakeContext(pem));
  std::lock_guard<std::mutex> lock(mu_);
  current_ = std::move(ctx);
  return OkStatus();
}

std::shared_ptr<ssl::context> ServerContext::Current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return current_;
}

// ---- MemoryFiles --------------------------------------------------------------------------

namespace {

// A new close-on-exec memfd holding `text`; -1 and `error` on failure.
int NewMemFd(const char* name, const std::string& text, std::string* error) {
  const int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) {
    *error = std::string("memfd_create: ") + std::strerror(errno);
    return -1;
  }
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      *error = std::string("writing a memfd: ") + std::strerror(errno);
      close(fd);
      return -1;
    }
    done += static_cast<size_t>(n);
  }
  return fd;
}

}  // namespace

StatusOr<std::unique_ptr<MemoryFiles>> MemoryFiles::Create(const Pem& pem) {
  std::unique_ptr<MemoryFiles> files(new MemoryFiles());
  std::string error;
  files->cert_fd_ = NewMemFd("kiln-tls-cert", pem.cert_chain, &error);
  if (files->cert_fd_ >= 0) files->key_fd_ = NewMemFd("kiln-tls-key", pem.private_key, &error);
  if (files->key_fd_ >= 0 && !pem.client_ca.empty()) {
    files->ca_fd_ = NewMemFd("kiln-tls-ca", pem.client_ca, &error);
  }
  if (!error.empty()) return Internal("TLS: ", error);  // the destructor closes what opened
  // The readers open the files by path: check that /proc lets this process do that.
  std::string text;
  if (Status s = ReadFile("TLS", files->cert_path(), &text); !s.ok() || text != pem.cert_chain) {
    return Internal("TLS: cannot read back ", files->cert_path(),
                    " (gRPC reads the certificates there; is /proc mounted?)");
  }
  return files;
}

MemoryFiles::~MemoryFiles() {
  for (int fd : {cert_fd_, key_fd_, ca_fd_}) {
    if (fd >= 0) close(fd);
  }
}

Status MemoryFiles::Update(const Pem& pem) {
  std::lock_guard<std::mutex> lock(mu_);
  struct Swap {
    int target;
    const std::string* text;
    const char* name;
  };
  std::vector<Swap> swaps = {{key_fd_, &pem.private_key, "kiln-tls-key"},
                             {cert_fd_, &pem.cert_chain, "kiln-tls-cert"}};
  if (ca_fd_ >= 0) swaps.push_back({ca_fd_, &pem.client_ca, "kiln-tls-ca"});
  // Write every new file first, so that a failure changes nothing.
  std::vector<int> fresh;
  std::string error;
  for (const Swap& s : swaps) {
    const int fd = NewMemFd(s.name, *s.text, &error);
    if (fd < 0) {
      for (int f : fresh) close(f);
      return Internal("TLS: ", error);
    }
    fresh.push_back(fd);
  }
  for (size_t i = 0; i < swaps.size(); ++i) {
    // dup3 replaces the file behind the number in one step (and keeps it close-on-exec).
    if (dup3(fresh[i], swaps[i].target, O_CLOEXEC) < 0) error = std::strerror(errno);
    close(fresh[i]);
  }
  if (!error.empty()) return Internal("TLS: dup3: ", error);
  return OkStatus();
}

}  // namespace kiln::tls
