#include "engine/dump.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "absl/strings/str_split.h"
#include "engine/base/status.h"
#include "engine/graph.h"

namespace kiln {

bool DumpConfig::Enabled(std::string_view pass) const {
  if (passes.empty()) return false;
  for (absl::string_view p : absl::StrSplit(ToAbsl(passes), ',')) {
    if (p == "all" || ToStd(p) == pass) return true;
  }
  return false;
}

void DumpConfig::Write(std::string_view pass, std::string_view text) const {
  std::string all = "=== kiln dump after '" + std::string(pass) + "' ===\n" + std::string(text);
  if (out != nullptr) {
    *out << all;
    out->flush();
    return;
  }
  const char* file = std::getenv("KILN_DUMP_FILE");
  if (file != nullptr && *file) {
    if (FILE* f = std::fopen(file, "a")) {
      std::fwrite(all.data(), 1, all.size(), f);
      std::fclose(f);
      return;
    }
  }
  std::fwrite(all.data(), 1, all.size(), stderr);
}

DumpConfig DumpConfigFromEnv() {
  DumpConfig c;
  if (const char* v = std::getenv("KILN_DUMP")) c.passes = v;
  return c;
}

void DumpGraph(const DumpConfig& config, std::string_view pass, const Graph& g,
               const std::vector<std::string>* marks) {
  if (!config.Enabled(pass)) return;
  std::ostringstream os;
  g.Print(os, marks);
  config.Write(pass, os.str());
}

}  // namespace kiln
