// libFuzzer target: the GGUF parser must reject or accept any bytes without crashing, and
// everything it accepts must be safe to read (tensor data in range, arrays decodable).
#include <cstddef>
#include <cstdint>
#include <string>

#include "models/gguf/dequant.h"
#include "models/gguf/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln::models;
  auto file =
      MappedFile::FromBytes(std::string(reinterpret_cast<const char*>(data), size), "fuzz.gguf");
  auto gguf = GgufFile::Parse(file);
  if (!gguf.ok()) return 0;
  const GgufFile& g = **gguf;
  for (std::string_view key : g.keys()) {
    const GgufValue* v = g.Find(key);
    (void)v->DebugString();
    if (v->is_array()) {
      (void)g.GetStringArray(key);
      (void)g.GetF32Array(key);
      (void)g.GetI32Array(key);
    }
    (void)g.GetU32(key);
    (void)g.GetString(key);
  }
  std::vector<float> out;
  for (const GgufTensor& t : g.tensors()) {
    auto traits = GetGgmlTypeTraits(t.type);
    uint64_t n = std::min<uint64_t>(t.n_elements, 4096);
    n -= n % traits->block_size;
    out.resize(n);
    (void)Dequantize(t.type, t.data, n, out.data());
    if (t.n_bytes > 0) {
      // Touch the last byte: must be inside the file.
      volatile uint8_t last = static_cast<const uint8_t*>(t.data)[t.n_bytes - 1];
      (void)last;
    }
  }
  return 0;
}
