#include "daemon/config/keys.h"

#include <catch2/catch.hpp>
#include <set>
#include <string>

#include "daemon/config/options.h"

namespace rannc {
namespace {

TEST_CASE("ConfigKeys lists each key once, lower-case, documented", "[config]") {
  std::set<std::string> names;
  for (const ConfigKey& k : ConfigKeys()) {
    INFO(k.name);
    CHECK(names.insert(k.name).second);
    for (const char* c = k.name; *c != '\0'; ++c) {
      CHECK(((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '_'));
    }
    CHECK(std::string(k.doc).size() > 3);
    CHECK(FindConfigKey(k.name) == &k);
  }
  CHECK(FindConfigKey("no_such_key") == nullptr);
}

TEST_CASE("The registry's daemon keys are exactly what ranncd reads", "[config]") {
  std::set<std::string> daemon;
  for (const ConfigKey& k : ConfigKeys()) {
    if (k.scope == KeyScope::kDaemon) daemon.insert(k.name);
  }
  const std::vector<std::string> read = DaemonOptionKeys();
  CHECK(daemon == std::set<std::string>(read.begin(), read.end()));
}

TEST_CASE("DidYouMean names the nearest key for a slip, nothing for another word",
          "[config]") {
  CHECK(DidYouMean("pipline_num") == " (did you mean 'pipeline_num'?)");
  CHECK(DidYouMean("amp_levle") == " (did you mean 'amp_level'?)");
  CHECK(DidYouMean("device_memroy") == " (did you mean 'device_memory'?)");
  CHECK(DidYouMean("completely_unrelated_thing") == "");
  CHECK(DidYouMean("pipeline_num") == "");  // a key is not a slip of itself
}

TEST_CASE("CheckJobKey takes a job's and RaNNC's keys and says where the others belong",
          "[config]") {
  CHECK(CheckJobKey("pipeline_num").ok());
  CHECK(CheckJobKey("amp_level").ok());
  CHECK(CheckJobKey("dump_graph").ok());  // RaNNC's, ignored
  absl::Status daemon = CheckJobKey("devices");
  CHECK(daemon.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(daemon.message()),
             Catch::Contains("daemon setting") && Catch::Contains("where ranncd starts"));
  absl::Status client = CheckJobKey("trace_batch");
  CHECK_THAT(std::string(client.message()), Catch::Contains("client setting"));
  absl::Status unknown = CheckJobKey("replicas_num");
  CHECK(unknown.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(unknown.message()),
             Catch::Contains("unknown key 'replicas_num'") &&
                 Catch::Contains("did you mean 'replica_num'"));
}

TEST_CASE("The generated views hold every key", "[config]") {
  const std::string markdown = ConfigKeysMarkdown();
  const std::string python = ConfigKeysPython();
  for (const ConfigKey& k : ConfigKeys()) {
    INFO(k.name);
    CHECK(markdown.find(std::string("`") + k.name + "`") != std::string::npos);
    CHECK(python.find(std::string("\"") + k.name + "\": (") != std::string::npos);
  }
}

}  // namespace
}  // namespace rannc
