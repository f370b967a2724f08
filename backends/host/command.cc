#include "backends/host/command.h"

#include <fcntl.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_join.h"

extern char** environ;

namespace kiln::host {

StatusOr<int> RunCommand(const std::vector<std::string>& argv, const std::string& log_path) {
  if (argv.empty()) return InvalidArgument("RunCommand: empty argv");
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  pid_t pid = 0;
  const int err = posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (err != 0) return Unavailable("cannot run `", argv[0], "`: ", std::strerror(err));
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return Internal("waitpid: ", std::strerror(errno));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

StatusOr<std::string> CommandOutput(const std::vector<std::string>& argv) {
  TempDir tmp("kiln-probe-");
  if (tmp.path().empty()) return Internal("cannot create a temporary directory");
  const std::string log = tmp.path() + "/out.txt";
  KILN_ASSIGN_OR_RETURN(int rc, RunCommand(argv, log));
  if (rc != 0) return Unavailable("`", absl::StrJoin(argv, " "), "` exited with ", rc);
  return ReadFileOrEmpty(log);
}

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TempDir::TempDir(std::string_view prefix) {
  std::error_code ec;
  std::string t = std::filesystem::temp_directory_path(ec).string();
  if (ec) t = "/tmp";
  t.append("/").append(prefix).append("XXXXXX");
  if (mkdtemp(t.data()) != nullptr) path_ = t;
}

TempDir::~TempDir() {
  if (path_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace kiln::host
