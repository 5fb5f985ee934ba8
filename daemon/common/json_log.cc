#include "daemon/common/json_log.h"

#include <cctype>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>

#include <spdlog/formatter.h>
#include <spdlog/pattern_formatter.h>

namespace rannc {
namespace {

std::mutex names_mu;
std::map<std::string, std::string>& Names() {
  static auto* names = new std::map<std::string, std::string>();
  return *names;
}

void AppendJsonString(std::string_view s, std::string* out) {
  out->push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (c < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
          out->append(escaped);
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

void AppendField(const char* key, std::string_view value, std::string* out) {
  if (out->size() > 1) out->push_back(',');
  AppendJsonString(key, out);
  out->push_back(':');
  AppendJsonString(value, out);
}

// The first job id ("job-" then letters, digits and '-') in `message`, or "".
std::string JobIdIn(std::string_view message) {
  for (size_t at = message.find("job-"); at != std::string_view::npos;
       at = message.find("job-", at + 1)) {
    if (at > 0 && (std::isalnum(static_cast<unsigned char>(message[at - 1])) ||
                   message[at - 1] == '-' || message[at - 1] == '_')) {
      continue;  // inside another word
    }
    size_t end = at + 4;
    while (end < message.size() &&
           (std::isalnum(static_cast<unsigned char>(message[end])) || message[end] == '-')) {
      ++end;
    }
    if (end > at + 4) return std::string(message.substr(at, end - at));
  }
  return "";
}

class JsonFormatter : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto since_epoch = msg.time.time_since_epoch();
    const std::time_t seconds =
        std::chrono::duration_cast<std::chrono::seconds>(since_epoch).count();
    const int millis = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(since_epoch).count() % 1000);
    std::tm utc{};
    gmtime_r(&seconds, &utc);
    char time[80];
    std::snprintf(time, sizeof(time), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", utc.tm_year + 1900,
                  utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, millis);
    const spdlog::string_view_t level = spdlog::level::to_string_view(msg.level);
    const std::string line = JsonLogLine(
        time, std::string(level.data(), level.size()),
        std::string(msg.logger_name.data(), msg.logger_name.size()),
        std::string(msg.payload.data(), msg.payload.size()));
    dest.append(line.data(), line.data() + line.size());
    dest.push_back('\n');
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

}  // namespace

std::string JsonLogLine(const std::string& time, const std::string& level,
                        const std::string& logger, const std::string& message) {
  std::string out = "{";
  AppendField("time", time, &out);
  AppendField("level", level, &out);
  AppendField("logger", logger, &out);
  const std::string id = JobIdIn(message);
  if (!id.empty()) {
    std::string name;
    {
      std::lock_guard<std::mutex> lock(names_mu);
      auto it = Names().find(id);
      if (it != Names().end()) name = it->second;
    }
    if (!name.empty()) AppendField("job", name, &out);
    AppendField("job_id", id, &out);
  }
  AppendField("message", message, &out);
  out.push_back('}');
  return out;
}

void UseJsonLogs(spdlog::logger& logger) {
  logger.set_formatter(std::make_unique<JsonFormatter>());
}

void NameJob(const std::string& id, const std::string& name) {
  std::lock_guard<std::mutex> lock(names_mu);
  Names()[id] = name;
}

void ForgetJob(const std::string& id) {
  std::lock_guard<std::mutex> lock(names_mu);
  Names().erase(id);
}

}  // namespace rannc
