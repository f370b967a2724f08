// Process-wide logging setup for kilnd (spdlog's default logger).
#pragma once

#include <string_view>

#include "engine/base/status.h"

namespace kiln {

// level: trace, debug, info, warn, error, critical, off. format: "text" (human-readable,
// with timestamps) or "json" (one JSON object per line: ts, level, msg, thread, logger).
// InvalidArgument for unknown values.
Status SetUpLogging(std::string_view level, std::string_view format);

}  // namespace kiln
