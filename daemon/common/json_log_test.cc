#include "daemon/common/json_log.h"

#include <memory>
#include <sstream>

#include <catch2/catch.hpp>
#include <spdlog/sinks/ostream_sink.h>

namespace rannc {
namespace {

TEST_CASE("JsonLogLine: fields, the job's name and id, escaping", "[log]") {
  NameJob("job-1a2b3c4d-7", "gpt \"small\"");
  CHECK(JsonLogLine("T", "info", "ranncd", "job job-1a2b3c4d-7: step 3") ==
        "{\"time\":\"T\",\"level\":\"info\",\"logger\":\"ranncd\",\"job\":\"gpt \\\"small\\\"\","
        "\"job_id\":\"job-1a2b3c4d-7\",\"message\":\"job job-1a2b3c4d-7: step 3\"}");
  // An id no job registered: the id alone. No id: neither field.
  CHECK(JsonLogLine("T", "warn", "r", "deleting job job-ffffffff-1 now") ==
        "{\"time\":\"T\",\"level\":\"warn\",\"logger\":\"r\",\"job_id\":\"job-ffffffff-1\","
        "\"message\":\"deleting job job-ffffffff-1 now\"}");
  CHECK(JsonLogLine("T", "info", "r", "a\\b\nc\td\x01 my-job-x") ==
        "{\"time\":\"T\",\"level\":\"info\",\"logger\":\"r\","
        "\"message\":\"a\\\\b\\nc\\td\\u0001 my-job-x\"}");
  ForgetJob("job-1a2b3c4d-7");
  CHECK(JsonLogLine("T", "info", "r", "job job-1a2b3c4d-7: gone").find("\"job\":") ==
        std::string::npos);
}

TEST_CASE("UseJsonLogs: a logger writes one JSON object per line", "[log]") {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  spdlog::logger logger("test", sink);
  UseJsonLogs(logger);
  NameJob("job-00000001-1", "mnist");
  logger.info("job {}: created", "job-00000001-1");
  logger.error("plain");
  ForgetJob("job-00000001-1");
  std::istringstream lines(out.str());
  std::string first, second, rest;
  REQUIRE(std::getline(lines, first));
  REQUIRE(std::getline(lines, second));
  CHECK_FALSE(std::getline(lines, rest));
  CHECK(first.rfind("{\"time\":\"", 0) == 0);
  CHECK(first.find("Z\",\"level\":\"info\",\"logger\":\"test\",\"job\":\"mnist\",\"job_id\":"
                   "\"job-00000001-1\",\"message\":\"job job-00000001-1: created\"}") !=
        std::string::npos);
  CHECK(second.find("\"level\":\"error\"") != std::string::npos);
  CHECK(second.back() == '}');
}

}  // namespace
}  // namespace rannc
