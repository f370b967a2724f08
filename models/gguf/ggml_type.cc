#include "models/gguf/ggml_type.h"

#include <string>

namespace kiln::models {
namespace {

struct Entry {
  uint32_t id;
  GgmlTypeTraits traits;
};

// Block layouts from ggml (ggml-common.h). `supported` marks what Kiln loads today; the others
// are listed so that errors can name them.
constexpr Entry kTypes[] = {
    {0, {"F32", 1, 4, true}},          {1, {"F16", 1, 2, true}},
    {2, {"Q4_0", 32, 18, true}},       {3, {"Q4_1", 32, 20, true}},
    {6, {"Q5_0", 32, 22, true}},       {7, {"Q5_1", 32, 24, true}},
    {8, {"Q8_0", 32, 34, true}},       {9, {"Q8_1", 32, 36, false}},
    {10, {"Q2_K", 256, 84, false}},    {11, {"Q3_K", 256, 110, false}},
    {12, {"Q4_K", 256, 144, true}},    {13, {"Q5_K", 256, 176, true}},
    {14, {"Q6_K", 256, 210, true}},    {15, {"Q8_K", 256, 292, false}},
    {16, {"IQ2_XXS", 256, 66, false}}, {17, {"IQ2_XS", 256, 74, false}},
    {18, {"IQ3_XXS", 256, 98, false}}, {19, {"IQ1_S", 256, 50, false}},
    {20, {"IQ4_NL", 32, 18, false}},   {21, {"IQ3_S", 256, 110, false}},
    {22, {"IQ2_S", 256, 82, false}},   {23, {"IQ4_XS", 256, 136, false}},
    {24, {"I8", 1, 1, true}},          {25, {"I16", 1, 2, true}},
    {26, {"I32", 1, 4, true}},         {27, {"I64", 1, 8, true}},
    {28, {"F64", 1, 8, true}},         {29, {"IQ1_M", 256, 56, false}},
    {30, {"BF16", 1, 2, true}},        {34, {"TQ1_0", 256, 54, false}},
    {35, {"TQ2_0", 256, 66, false}},   {39, {"MXFP4", 32, 17, true}},
};

}  // namespace

std::optional<GgmlTypeTraits> GetGgmlTypeTraits(uint32_t type_id) {
  for (const Entry& e : kTypes) {
    if (e.id == type_id) return e.traits;
  }
  return std::nullopt;
}

std::string GgmlTypeName(uint32_t type_id) {
  auto t = GetGgmlTypeTraits(type_id);
  if (t) return std::string(t->name);
  return "type#" + std::to_string(type_id);
}

std::string_view SupportedGgmlTypeList() {
  return "F32, F16, BF16, F64, I8, I16, I32, I64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, "
         "MXFP4";
}

}  // namespace kiln::models
