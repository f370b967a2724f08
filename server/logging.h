// Process-wide logging setup for kilnd (spdlog's default logger).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>

#include "engine/base/status.h"

namespace kiln {

// level: trace, debug, info, warn, error, critical, off. format: "text" (human-readable,
// with timestamps) or "json" (one JSON object per line: ts, level, msg, thread, logger).
// InvalidArgument for unknown values.
Status SetUpLogging(std::string_view level, std::string_view format);

// Triton's logging extension (gRPC LogSettings, HTTP GET/POST /v2/logging) over spdlog's
// process-wide level. log_info / log_warning / log_error say whether that severity is logged;
// log_verbose_level is 1 at debug, 2 at trace, else 0; log_format is the configured format
// (read-only); log_file is always "" (kilnd logs to stdout).
struct LogSettings {
  bool log_info = true;
  bool log_warning = true;
  bool log_error = true;
  uint32_t log_verbose_level = 0;
  std::string log_format;
  std::string log_file;
};
LogSettings CurrentLogSettings(std::string_view format);

// A setting's value as either wire format carries it.
using LogSettingValue = std::variant<bool, uint64_t, std::string>;

// Changes the level for one setting: log_verbose_level (an unsigned integer: 0 info, 1 debug,
// 2+ trace), log_info / log_warning / log_error (booleans: turning one off raises the level
// past it, turning it on lowers the level to it). log_format and log_file may be sent only
// with their current values (clients echo back what they read). InvalidArgument naming the
// key otherwise. `format` is the configured log format.
Status ApplyLogSetting(std::string_view key, const LogSettingValue& value, std::string_view format);

}  // namespace kiln
