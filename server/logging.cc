#include "server/logging.h"

#include <chrono>
#include <memory>

#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace kiln {
namespace {

void AppendJsonString(std::string_view s, spdlog::memory_buf_t& out) {
  out.push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out.append(std::string_view("\\\""));
        break;
      case '\\':
        out.append(std::string_view("\\\\"));
        break;
      case '\n':
        out.append(std::string_view("\\n"));
        break;
      case '\r':
        out.append(std::string_view("\\r"));
        break;
      case '\t':
        out.append(std::string_view("\\t"));
        break;
      default:
        if (c < 0x20) {
          fmt::format_to(std::back_inserter(out), "\\u{:04x}", c);
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  out.push_back('"');
}

// One JSON object per line, with the message properly escaped (spdlog patterns cannot).
class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    using namespace std::chrono;
    const auto t = msg.time;
    const auto secs = time_point_cast<seconds>(t);
    const auto micros = duration_cast<microseconds>(t - secs).count();
    std::time_t tt = system_clock::to_time_t(secs);
    std::tm tm{};
    gmtime_r(&tt, &tm);
    fmt::format_to(
        std::back_inserter(dest),
        "{{\"ts\":\"{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z\",\"level\":", tm.tm_year + 1900,
        tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, micros);
    const auto level = spdlog::level::to_string_view(msg.level);
    AppendJsonString(std::string_view(level.data(), level.size()), dest);
    dest.append(std::string_view(",\"msg\":"));
    AppendJsonString(std::string_view(msg.payload.data(), msg.payload.size()), dest);
    fmt::format_to(std::back_inserter(dest), ",\"thread\":{}}}\n", msg.thread_id);
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

}  // namespace

Status SetUpLogging(std::string_view level, std::string_view format) {
  auto lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") {
    return InvalidArgument("unknown log level `", ToAbsl(level),
                           "`; expected trace, debug, info, warn, error, critical or off");
  }
  if (format != "text" && format != "json") {
    return InvalidArgument("unknown log format `", ToAbsl(format), "`; expected text or json");
  }
  // Logs go to stderr (containers collect it); stdout stays free for --print-default-config.
  auto logger =
      std::make_shared<spdlog::logger>("kilnd", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  if (format == "json") {
    logger->set_formatter(std::make_unique<JsonFormatter>());
  } else {
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%-5l%$ %v");
  }
  logger->set_level(lvl);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(std::move(logger));
  return OkStatus();
}

LogSettings CurrentLogSettings(std::string_view format) {
  const auto level = spdlog::get_level();
  LogSettings out;
  out.log_info = level <= spdlog::level::info;
  out.log_warning = level <= spdlog::level::warn;
  out.log_error = level <= spdlog::level::err;
  out.log_verbose_level = level <= spdlog::level::trace ? 2 : level <= spdlog::level::debug ? 1 : 0;
  out.log_format = std::string(format);
  return out;
}

Status ApplyLogSetting(std::string_view key, const LogSettingValue& value,
                       std::string_view format) {
  if (key == "log_verbose_level") {
    const auto* v = std::get_if<uint64_t>(&value);
    if (v == nullptr) {
      return InvalidArgument("log setting 'log_verbose_level' must be an unsigned integer");
    }
    spdlog::set_level(*v >= 2   ? spdlog::level::trace
                      : *v == 1 ? spdlog::level::debug
                                : spdlog::level::info);
    return OkStatus();
  }
  if (key == "log_info" || key == "log_warning" || key == "log_error") {
    const auto* on = std::get_if<bool>(&value);
    if (on == nullptr) return InvalidArgument("log setting '", key, "' must be a boolean");
    const auto level = key == "log_info"      ? spdlog::level::info
                       : key == "log_warning" ? spdlog::level::warn
                                              : spdlog::level::err;
    if (*on) {
      if (spdlog::get_level() > level) spdlog::set_level(level);
    } else if (spdlog::get_level() <= level) {
      spdlog::set_level(static_cast<spdlog::level::level_enum>(level + 1));
    }
    return OkStatus();
  }
  if (key == "log_format" || key == "log_file") {
    const auto* s = std::get_if<std::string>(&value);
    const std::string_view current = key == "log_format" ? format : "";
    if (s != nullptr && *s == current) return OkStatus();
    return InvalidArgument("log setting '", key, "' cannot be changed while kilnd runs (it is \"",
                           current, "\"", key == "log_format" ? "; set logging.format" : "", ")");
  }
  return InvalidArgument("unknown log setting '", key,
                         "'; known: log_info, log_warning, log_error, log_verbose_level, "
                         "log_format, log_file");
}

}  // namespace kiln
