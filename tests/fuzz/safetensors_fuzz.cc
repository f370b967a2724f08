// libFuzzer target: the safetensors header parser on arbitrary bytes; every file it accepts is
// written again with SafetensorsWriter and must read back with the same tensors and metadata.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "models/safetensors/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln::models;
  auto file = MappedFile::FromBytes(std::string(reinterpret_cast<const char*>(data), size),
                                    "fuzz.safetensors");
  auto st = SafetensorsFile::Parse(file);
  if (!st.ok()) return 0;
  uint64_t sum = 0;
  SafetensorsWriter w;
  for (const auto& [k, v] : (*st)->metadata()) w.SetMetadata(k, v);
  for (const SafetensorsTensor& t : (*st)->tensors()) {
    if (t.name.empty()) return 0;  // the writer refuses an empty name
    if (!w.Add(t.name, t.dtype, t.shape, t.data, t.n_bytes).ok()) std::abort();
    if (t.n_bytes == 0) continue;
    const auto* p = static_cast<const uint8_t*>(t.data);
    sum += p[0] + p[t.n_bytes - 1];  // both ends must be inside the file
  }
  auto again = SafetensorsFile::Parse(MappedFile::FromBytes(w.Serialize(), "rewritten"));
  if (!again.ok() || (*again)->tensors().size() != (*st)->tensors().size() ||
      (*again)->metadata() != (*st)->metadata()) {
    std::abort();
  }
  for (const SafetensorsTensor& t : (*st)->tensors()) {
    const SafetensorsTensor* u = (*again)->Find(t.name);
    if (u == nullptr || u->dtype != t.dtype || u->shape != t.shape || u->n_bytes != t.n_bytes ||
        (t.n_bytes != 0 && std::memcmp(u->data, t.data, t.n_bytes) != 0)) {
      std::abort();
    }
  }
  return static_cast<int>(sum & 0);
}
