// Test helper: builds GGUF bytes in memory (valid by default, easy to corrupt).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "models/gguf/gguf.h"

namespace kiln::models::testing {

class GgufBuilder {
 public:
  explicit GgufBuilder(uint32_t version = 3) : version_(version) {}

  GgufBuilder& U32(std::string_view key, uint32_t v) { return Scalar(key, 4, &v, 4); }
  GgufBuilder& I32(std::string_view key, int32_t v) { return Scalar(key, 5, &v, 4); }
  GgufBuilder& F32(std::string_view key, float v) { return Scalar(key, 6, &v, 4); }
  GgufBuilder& U64(std::string_view key, uint64_t v) { return Scalar(key, 10, &v, 8); }
  GgufBuilder& Bool(std::string_view key, bool v) {
    uint8_t b = v;
    return Scalar(key, 7, &b, 1);
  }
  GgufBuilder& Str(std::string_view key, std::string_view v) {
    Key(key, 8);
    PutStr(&kv_, v);
    ++n_kv_;
    return *this;
  }
  GgufBuilder& StrArray(std::string_view key, const std::vector<std::string>& v) {
    Key(key, 9);
    Put<uint32_t>(&kv_, 8);
    Put<uint64_t>(&kv_, v.size());
    for (const auto& s : v) PutStr(&kv_, s);
    ++n_kv_;
    return *this;
  }
  GgufBuilder& F32Array(std::string_view key, const std::vector<float>& v) {
    Key(key, 9);
    Put<uint32_t>(&kv_, 6);
    Put<uint64_t>(&kv_, v.size());
    for (float x : v) Put<float>(&kv_, x);
    ++n_kv_;
    return *this;
  }
  GgufBuilder& I32Array(std::string_view key, const std::vector<int32_t>& v) {
    Key(key, 9);
    Put<uint32_t>(&kv_, 5);
    Put<uint64_t>(&kv_, v.size());
    for (int32_t x : v) Put<int32_t>(&kv_, x);
    ++n_kv_;
    return *this;
  }
  // Raw kv bytes (for corrupt values).
  GgufBuilder& RawKv(std::string_view key, uint32_t type, const std::string& payload) {
    Key(key, type);
    kv_ += payload;
    ++n_kv_;
    return *this;
  }

  // Adds a tensor whose data is `data` (padded to the alignment). `offset_override` forces
  // the recorded offset.
  GgufBuilder& Tensor(std::string_view name, uint32_t type, std::vector<uint64_t> dims,
                      const std::string& data, int64_t offset_override = -1) {
    while (data_.size() % alignment_) data_.push_back('\0');
    uint64_t off = offset_override >= 0 ? static_cast<uint64_t>(offset_override) : data_.size();
    PutStr(&ti_, name);
    Put<uint32_t>(&ti_, static_cast<uint32_t>(dims.size()));
    for (uint64_t d : dims) Put<uint64_t>(&ti_, d);
    Put<uint32_t>(&ti_, type);
    Put<uint64_t>(&ti_, off);
    data_ += data;
    ++n_tensors_;
    return *this;
  }
  GgufBuilder& Alignment(uint32_t a) {
    alignment_ = a;
    return U32("general.alignment", a);
  }

  std::string Build() const {
    std::string out = "GGUF";
    Put<uint32_t>(&out, version_);
    Put<uint64_t>(&out, n_tensors_);
    Put<uint64_t>(&out, n_kv_);
    out += kv_;
    out += ti_;
    while (out.size() % alignment_) out.push_back('\0');
    out += data_;
    return out;
  }

 private:
  template <typename T>
  static void Put(std::string* s, T v) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    s->append(b, sizeof(T));
  }
  static void PutStr(std::string* s, std::string_view v) {
    Put<uint64_t>(s, v.size());
    s->append(v.data(), v.size());
  }
  void Key(std::string_view key, uint32_t type) {
    PutStr(&kv_, key);
    Put<uint32_t>(&kv_, type);
  }
  GgufBuilder& Scalar(std::string_view key, uint32_t type, const void* v, size_t n) {
    Key(key, type);
    kv_.append(static_cast<const char*>(v), n);
    ++n_kv_;
    return *this;
  }

  uint32_t version_;
  uint32_t alignment_ = 32;
  uint64_t n_kv_ = 0;
  uint64_t n_tensors_ = 0;
  std::string kv_, ti_, data_;
};

}  // namespace kiln::models::testing
