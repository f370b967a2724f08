#include "backends/rocm/hipcc.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_split.h"
#include "backends/host/command.h"

namespace kiln::rocm {

using host::ReadFileOrEmpty;
using host::RunCommand;
using host::TempDir;

StatusOr<std::string> FindHipcc(std::string* version) {
  const char* env = std::getenv("KILN_HIPCC");
  const std::string hipcc = env != nullptr && *env != '\0' ? env : "hipcc";
  TempDir tmp("kiln-hipcc-");
  if (tmp.path().empty()) return Internal("cannot create a temporary directory");
  const std::string log = tmp.path() + "/version.txt";
  StatusOr<int> rc = RunCommand({hipcc, "--version"}, log);
  if (!rc.ok() || *rc != 0) {
    return Unavailable("hipcc not found (", hipcc, "); apt install hipcc or set KILN_HIPCC");
  }
  if (version != nullptr) {
    *version = "hipcc";
    for (absl::string_view line : absl::StrSplit(ReadFileOrEmpty(log), '\n')) {
      if (line.find("HIP version") != absl::string_view::npos) *version = std::string(line);
    }
  }
  return hipcc;
}

StatusOr<std::string> CompileCodeObject(const std::string& source,
                                        const std::vector<std::string>& archs) {
  KILN_ASSIGN_OR_RETURN(std::string hipcc, FindHipcc());
  TempDir tmp("kiln-hipcc-");
  if (tmp.path().empty()) return Internal("cannot create a temporary directory");
  const std::string src = tmp.path() + "/kernels.hip", out = tmp.path() + "/kernels.co";
  std::ofstream(src) << source;
  std::vector<std::string> argv = {hipcc, "--genco", "-O3"};
  for (const std::string& a : archs) argv.push_back("--offload-arch=" + a);
  argv.insert(argv.end(), {"-o", out, src});
  const std::string log = tmp.path() + "/log.txt";
  KILN_ASSIGN_OR_RETURN(int rc, RunCommand(argv, log));
  if (rc != 0 || !std::filesystem::exists(out)) {
    std::string text = ReadFileOrEmpty(log);
    if (text.size() > 20000) text = text.substr(0, 20000) + "\n...";
    return InvalidArgument("hipcc failed (exit ", rc, "):\n", text);
  }
  return ReadFileOrEmpty(out);
}

}  // namespace kiln::rocm
