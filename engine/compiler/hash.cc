#include "engine/compiler/hash.h"

#include <openssl/evp.h>

#include <cstdint>

#include "engine/base/status.h"

namespace kiln::compiler {
namespace {

std::string ToHex(const unsigned char* d, unsigned n) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (unsigned i = 0; i < n; ++i) {
    s[2 * i] = kHex[d[i] >> 4];
    s[2 * i + 1] = kHex[d[i] & 15];
  }
  return s;
}

}  // namespace

std::string Sha256Hex(std::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  KILN_CHECK(EVP_Digest(data.data(), data.size(), md, &n, EVP_sha256(), nullptr) == 1,
             "EVP_Digest(sha256) failed");
  return ToHex(md, n);
}

Hasher::Hasher() : ctx_(EVP_MD_CTX_new()) {
  KILN_CHECK(ctx_ != nullptr &&
                 EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr) == 1,
             "EVP_DigestInit_ex(sha256) failed");
}

Hasher::~Hasher() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

Hasher& Hasher::Add(std::string_view piece) {
  const uint64_t n = piece.size();
  auto* c = static_cast<EVP_MD_CTX*>(ctx_);
  KILN_CHECK(EVP_DigestUpdate(c, &n, sizeof(n)) == 1 &&
                 EVP_DigestUpdate(c, piece.data(), piece.size()) == 1,
             "EVP_DigestUpdate failed");
  return *this;
}

std::string Hasher::Hex() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  KILN_CHECK(EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), md, &n) == 1,
             "EVP_DigestFinal_ex failed");
  return ToHex(md, n);
}

}  // namespace kiln::compiler
