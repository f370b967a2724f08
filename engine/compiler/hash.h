// Stable content hashes for cache keys (SHA-256, via OpenSSL). Unlike absl::Hash, the
// values are the same in every process and on every machine, so they can name files.
//
// Thread-safety: pure functions; thread-safe.
#pragma once

#include <string>
#include <string_view>

namespace kiln::compiler {

// Lower-case hex SHA-256 of `data` (64 characters).
std::string Sha256Hex(std::string_view data);

// Incremental form: Add() pieces, then Hex(). Pieces are length-prefixed, so ("ab", "c") and
// ("a", "bc") hash differently.
class Hasher {
 public:
  Hasher();
  ~Hasher();
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  Hasher& Add(std::string_view piece);
  std::string Hex();  // finishes; the Hasher must not be used afterwards

 private:
  void* ctx_;  // EVP_MD_CTX
};

}  // namespace kiln::compiler
