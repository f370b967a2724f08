// Test helpers: EC keys and X.509 certificates made in memory (PEM), for the TLS unit tests.
#pragma once

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <cstdio>
#include <fstream>
#include <string>

namespace kiln::tls::testing {

struct KeyPair {
  EVP_PKEY* key = nullptr;
  std::string pem;  // the private key, PEM (PKCS#8)
};

inline std::string BioText(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  std::string out(data, static_cast<size_t>(n));
  BIO_free(bio);
  return out;
}

// A new P-256 key (leaked: tests only).
inline KeyPair NewKey() {
  KeyPair k;
  k.key = EVP_EC_gen("P-256");
  BIO* bio = BIO_new(BIO_s_mem());
  PEM_write_bio_PrivateKey(bio, k.key, nullptr, nullptr, 0, nullptr, nullptr);
  k.pem = BioText(bio);
  return k;
}

// `key` encrypted with a passphrase (PEM "ENCRYPTED PRIVATE KEY").
inline std::string EncryptedPem(const KeyPair& k) {
  BIO* bio = BIO_new(BIO_s_mem());
  static char pass[] = "secret";
  PEM_write_bio_PKCS8PrivateKey(bio, k.key, EVP_aes_128_cbc(), pass, 6, nullptr, nullptr);
  return BioText(bio);
}

// A certificate for `subject_key` named `cn`, signed by `issuer_key` (itself when the same),
// valid from now + `not_before_s` to now + `not_after_s` seconds. `ca` adds basicConstraints
// CA:TRUE. Returns PEM.
inline std::string MakeCert(const KeyPair& subject_key, const std::string& cn,
                            const KeyPair& issuer_key, const std::string& issuer_cn, long serial,
                            long not_before_s = -60, long not_after_s = 86400, bool ca = false) {
  X509* x = X509_new();
  X509_set_version(x, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x), serial);
  X509_gmtime_adj(X509_getm_notBefore(x), not_before_s);
  X509_gmtime_adj(X509_getm_notAfter(x), not_after_s);
  X509_set_pubkey(x, subject_key.key);
  X509_NAME_add_entry_by_txt(X509_get_subject_name(x), "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0);
  X509_NAME_add_entry_by_txt(X509_get_issuer_name(x), "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(issuer_cn.c_str()), -1, -1, 0);
  if (ca) {
    X509_EXTENSION* ext =
        X509V3_EXT_conf_nid(nullptr, nullptr, NID_basic_constraints, "critical,CA:TRUE");
    X509_add_ext(x, ext, -1);
    X509_EXTENSION_free(ext);
  }
  X509_sign(x, issuer_key.key, EVP_sha256());
  BIO* bio = BIO_new(BIO_s_mem());
  PEM_write_bio_X509(bio, x);
  X509_free(x);
  return BioText(bio);
}

inline void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

}  // namespace kiln::tls::testing
