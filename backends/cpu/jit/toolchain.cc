#include "backends/cpu/jit/toolchain.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "engine/compiler/hash.h"

extern char** environ;

namespace kiln::cpu::jit {
namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

StatusOr<std::string> CommandOutput(const std::vector<std::string>& argv) {
  char tmpl[] = "/tmp/kiln-cxx-probe-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) return Internal("mkstemp: ", std::strerror(errno));
  close(fd);
  StatusOr<int> rc = RunCommand(argv, tmpl);
  std::string out = ReadAll(tmpl);
  unlink(tmpl);
  KILN_RETURN_IF_ERROR(rc.status());
  if (*rc != 0) return Unavailable("`", absl::StrJoin(argv, " "), "` exited with ", *rc);
  return out;
}

}  // namespace

StatusOr<int> RunCommand(const std::vector<std::string>& argv, const std::string& log_path) {
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

std::string CpuFeatureLevel() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool v2 = __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("popcnt") &&
                  __builtin_cpu_supports("ssse3");
  const bool v3 = v2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi") &&
                  __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("movbe");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (v4) return "x86-64-v4";
  if (v3) return "x86-64-v3";
  if (v2) return "x86-64-v2";
  return "x86-64";
#else
  return "baseline";
#endif
}

StatusOr<Toolchain> DetectToolchain() {
  static std::once_flag once;
  static StatusOr<Toolchain>* result = nullptr;
  std::call_once(once, [] {
    Toolchain tc;
    const char* env = std::getenv("KILN_CXX");
    tc.compiler = env != nullptr && *env != '\0' ? env : "c++";
    StatusOr<std::string> version = CommandOutput({tc.compiler, "--version"});
    StatusOr<std::string> machine = CommandOutput({tc.compiler, "-dumpmachine"});
    if (!version.ok() || !machine.ok()) {
      result = new StatusOr<Toolchain>(
          Unavailable("no usable C++ compiler for generated kernels (", tc.compiler,
                      "): ", StatusMessage(version.ok() ? machine.status() : version.status()),
                      "; set KILN_CXX or install g++"));
      return;
    }
    const std::string first = std::string(absl::StripAsciiWhitespace(
        std::vector<std::string>(absl::StrSplit(*version, '\n')).front()));
    tc.identity = StrCat(first, " ", absl::StripAsciiWhitespace(*machine));
    tc.feature_level = CpuFeatureLevel();
    tc.flags = {"-std=c++17",
                "-O3",
                "-fPIC",
                "-shared",
                "-fno-math-errno",
                "-fno-trapping-math",
                "-fopenmp-simd",
                "-fno-semantic-interposition",
                "-fvisibility=hidden",
                "-w"};
    if (tc.feature_level != "baseline") tc.flags.push_back("-march=" + tc.feature_level);
    if (const char* extra = std::getenv("KILN_CXX_FLAGS"); extra != nullptr) {
      for (absl::string_view f : absl::StrSplit(extra, ' ', absl::SkipEmpty())) {
        tc.flags.emplace_back(f);
      }
    }
    compiler::Hasher h;
    h.Add(tc.identity);
    for (const std::string& f : tc.flags) h.Add(f);
    tc.cache_namespace = StrCat("cpu-", h.Hex().substr(0, 16));
    result = new StatusOr<Toolchain>(std::move(tc));
  });
  return *result;
}

Status CompileSharedObject(const Toolchain& tc, const std::string& source_path,
                           const std::string& so_path) {
  std::vector<std::string> argv = {tc.compiler};
  argv.insert(argv.end(), tc.flags.begin(), tc.flags.end());
  argv.insert(argv.end(), {"-o", so_path, source_path, "-lmvec", "-lm"});
  const std::string log = so_path + ".log";
  KILN_ASSIGN_OR_RETURN(int rc, RunCommand(argv, log));
  if (rc != 0) {
    std::string out = ReadAll(log);
    if (out.size() > 4000) out = out.substr(0, 4000) + "\n...";
    return Internal("the kernel compiler failed (exit ", rc, "): `", absl::StrJoin(argv, " "),
                    "`\n", out);
  }
  unlink(log.c_str());
  return OkStatus();
}

}  // namespace kiln::cpu::jit
