// libFuzzer target: the safetensors header parser on arbitrary bytes.
#include <cstddef>
#include <cstdint>
#include <string>

#include "models/safetensors/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln::models;
  auto file = MappedFile::FromBytes(std::string(reinterpret_cast<const char*>(data), size),
                                    "fuzz.safetensors");
  auto st = SafetensorsFile::Parse(file);
  if (!st.ok()) return 0;
  uint64_t sum = 0;
  for (const SafetensorsTensor& t : (*st)->tensors()) {
    if (t.n_bytes == 0) continue;
    const auto* p = static_cast<const uint8_t*>(t.data);
    sum += p[0] + p[t.n_bytes - 1];  // both ends must be inside the file
  }
  return static_cast<int>(sum & 0);
}
