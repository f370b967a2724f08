// Test-only: where fixture-driven tests find tests/fixtures/ and the default model.
#pragma once

#include <cstdlib>
#include <string>

#include "engine/testing/source_dir.h"

namespace kiln::models::testing {

inline std::string SourceDir() { return ::kiln::TestSourceDir(); }

inline std::string FixturePath(const std::string& relative) {
  return SourceDir() + "/tests/fixtures/" + relative;
}

// ${KILN_MODELS_DIR:-.kiln/models}; a relative directory is taken from the repository root, as
// scripts/fetch-default-model.sh does.
inline std::string DefaultModelsDir() {
  const char* env = std::getenv("KILN_MODELS_DIR");
  std::string dir = env != nullptr && *env != '\0' ? env : ".kiln/models";
  if (dir[0] != '/') dir = SourceDir() + "/" + dir;
  return dir;
}

inline std::string DefaultModelPath() {
  return DefaultModelsDir() + "/SmolLM2-135M-Instruct.Q4_1.gguf";
}

// The default embedding model's sentence-transformers folder (all-MiniLM-L6-v2), fetched by
// the same script.
inline std::string DefaultEmbeddingModelPath() { return DefaultModelsDir() + "/all-MiniLM-L6-v2"; }

}  // namespace kiln::models::testing
