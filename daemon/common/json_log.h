// ranncd's logs as JSON lines (--log-format json), for log collectors: each line one object,
//
//   {"time":"2026-12-04T16:51:20.991Z","level":"info","logger":"ranncd",
//    "job":"gpt-small","job_id":"job-1a2b3c4d-7","message":"job job-1a2b3c4d-7: step 10 ..."}
//
// "job" and "job_id" are there when the message names a job id (the daemon's lines about a job
// start "job <id>: "): the id is the first "job-..." word, and its name is the one the job was
// registered with (NameJob, by the Job itself while it exists). Strings are escaped as JSON
// requires (quotes, backslashes, control characters); time is UTC with milliseconds.
//
//   UseJsonLogs(*spdlog::default_logger());
//   NameJob("job-1a2b3c4d-7", "gpt-small");  ...  ForgetJob("job-1a2b3c4d-7");
//
// Thread-safe.
#ifndef RANNC_DAEMON_COMMON_JSON_LOG_H_
#define RANNC_DAEMON_COMMON_JSON_LOG_H_

#include <string>

#include <spdlog/logger.h>

namespace rannc {

// Gives `logger` (every sink of it) the JSON formatter.
void UseJsonLogs(spdlog::logger& logger);

// The job names that JSON lines carry, by job id.
void NameJob(const std::string& id, const std::string& name);
void ForgetJob(const std::string& id);

// One JSON line (without the newline) for a message: exposed for tests.
std::string JsonLogLine(const std::string& time, const std::string& level,
                        const std::string& logger, const std::string& message);

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_JSON_LOG_H_
