// Host plumbing every backend's kernel compiler uses: running a tool (the system C++
// compiler, hipcc, ...), capturing what it printed, and a scratch directory that cleans up
// after itself. Nothing here is specific to one backend.
//
// Thread-safety: every function is reentrant; a TempDir is owned by one thread.
#pragma once

#include <string>
#include <vector>

#include "engine/base/status.h"

namespace kiln::host {

// Runs argv (PATH lookup) with stdin from /dev/null and stdout+stderr to `log_path`; returns
// the exit status (128 + signal when killed), or Unavailable if it could not start.
StatusOr<int> RunCommand(const std::vector<std::string>& argv, const std::string& log_path);

// Runs argv and returns what it printed (stdout+stderr). Unavailable when it cannot start or
// exits non-zero (the message names the command and the exit status).
StatusOr<std::string> CommandOutput(const std::vector<std::string>& argv);

// The whole file (binary-safe); empty when it cannot be read.
std::string ReadFileOrEmpty(const std::string& path);

// A fresh directory under the system's temporary directory ("<tmp>/<prefix>XXXXXX"), removed
// with everything in it when the object dies. path() is empty if it could not be created.
class TempDir {
 public:
  explicit TempDir(std::string_view prefix = "kiln-");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace kiln::host
