// kilnd: the Kiln inference server daemon.
//
//   kilnd [--config FILE] [--set KEY=VALUE]... [--log-level L] [--log-format text|json]
//   kilnd --check-config [--config FILE]     validate, exit 0 (valid) or 1
//   kilnd --print-default-config             print the embedded default configuration
//
// Signals: SIGTERM/SIGINT shut down (server/server.h); SIGHUP re-reads the secrets kept in
// files (TLS certificates, API key files) without dropping connections, and logs the outcome;
// SIGUSR1 dumps the flight recorder to <storage_dir>/flight/ (server/flight_service.h).
//
// Exit codes: 0 clean shutdown; 1 invalid configuration, start-up failure (port in use,
// model failed to load) or in-flight work cut off at shutdown; 2 bad command line.
#include <signal.h>
#include <sys/resource.h>

#include <cstdio>
#include <filesystem>
#include <iostream>

#include "CLI/CLI.hpp"
#include "config/config.h"
#include "engine/compiler/kernel_cache.h"
#include "server/logging.h"
#include "server/server.h"
#include "spdlog/spdlog.h"

namespace {

// Blocks SIGTERM/SIGINT (shutdown), SIGHUP (reload secrets) and SIGUSR1 (flight recorder
// dump) in every thread (call before creating any) so that only the main thread's sigwait
// receives them.
sigset_t BlockSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  sigaddset(&set, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

// Raises the soft limit on open descriptors to the hard one (what systemd's LimitNOFILE or a
// container runtime allows): every connection holds one, and Debian's gRPC 1.51 stops
// accepting for good after a single EMFILE (tests/system/test_connection_storm.py).
void RaiseDescriptorLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) return;
  const rlim_t soft = limit.rlim_cur;
  limit.rlim_cur = limit.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &limit) == 0) {
    spdlog::debug("open descriptor limit raised from {} to {}", soft, limit.rlim_max);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const sigset_t signals = BlockSignals();
  signal(SIGPIPE, SIG_IGN);

  CLI::App app{"kilnd: serves transformer and tensor models over gRPC (KServe v2) and HTTP"};
  std::string config_path;
  std::vector<std::string> overrides;
  std::string log_level, log_format;
  bool check_config = false, print_default = false, version = false;
  app.add_option("-c,--config", config_path, "YAML configuration file (default: embedded)")
      ->check(CLI::ExistingFile);
  app.add_option("--set", overrides,
                 "Override a configuration key, e.g. --set server.grpc.address=127.0.0.1:9001");
  app.add_flag("--check-config", check_config, "Validate the configuration and exit 0/1");
  app.add_flag("--print-default-config", print_default,
               "Print the embedded default configuration (documented YAML) and exit");
  app.add_option("--log-level", log_level,
                 "trace|debug|info|warn|error|critical|off (overrides logging.level)");
  app.add_option("--log-format", log_format, "text|json (overrides logging.format)")
      ->check(CLI::IsMember({"text", "json"}));
  app.add_flag("--version", version, "Print the version and exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (version) {
    std::printf("kilnd %s\n", std::string(kiln::ServerVersion()).c_str());
    return 0;
  }
  if (print_default) {
    std::cout << kiln::config::DefaultConfigYaml();
    return 0;
  }

  auto config = config_path.empty() ? kiln::config::ParseConfig(kiln::config::DefaultConfigYaml(),
                                                                "<default>", overrides)
                                    : kiln::config::LoadConfigFile(config_path, overrides);
  if (!config.ok()) {
    std::fprintf(stderr, "kilnd: invalid configuration:\n%s\n",
                 std::string(kiln::StatusMessage(config.status())).c_str());
    return 1;
  }
  if (check_config) {
    std::printf("%s: valid (%zu model(s))\n", config->source.c_str(), config->models.size());
    return 0;
  }
  if (!log_level.empty()) config->logging.level = log_level;
  if (!log_format.empty()) config->logging.format = log_format;
  if (auto s = kiln::SetUpLogging(config->logging.level, config->logging.format); !s.ok()) {
    std::fprintf(stderr, "kilnd: %s\n", std::string(kiln::StatusMessage(s)).c_str());
    return 2;
  }
  spdlog::info("kilnd {} starting with configuration {}", kiln::ServerVersion(), config->source);
  // Kernels compiled at run time (and autotuning choices) are cached in <storage_dir>/cache, on
  // the volume an operator keeps across restarts (config/README.md); KILN_CACHE_DIR still wins.
  std::error_code ec;
  const std::filesystem::path storage = std::filesystem::absolute(config->server.storage_dir, ec);
  kiln::compiler::SetCacheDir(
      ((ec ? std::filesystem::path(config->server.storage_dir) : storage) / "cache").string());
  spdlog::info("kernel cache: {}", kiln::compiler::CacheDir());
  RaiseDescriptorLimit();

  kiln::Server server(std::move(*config));
  if (auto s = server.Start(); !s.ok()) {
    spdlog::critical("start-up failed: {}", kiln::StatusMessage(s));
    server.Shutdown();
    return 1;
  }

  int sig = 0;
  for (;;) {
    sigwait(&signals, &sig);
    if (sig == SIGUSR1) {
      server.DumpFlightRecorder("sigusr1");  // returns at once; a storm coalesces
      continue;
    }
    if (sig != SIGHUP) break;
    spdlog::info("received SIGHUP: reloading secrets");
    if (auto s = server.ReloadSecrets(); !s.ok()) {
      spdlog::error("reload failed; still using the previous secrets: {}", kiln::StatusMessage(s));
    }
  }
  spdlog::info("received {}", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  const bool clean = server.Shutdown();
  spdlog::default_logger()->flush();
  // Work cut off at the deadline may still be running on model threads; don't wait for it.
  std::fflush(nullptr);
  std::_Exit(clean ? 0 : 1);
}
