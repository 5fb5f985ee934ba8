#include "daemon/config/options.h"

#include <stdlib.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

namespace rannc {
namespace {

// Shows the error when a load that should succeed does not.
#define REQUIRE_OK(result)              \
  do {                                  \
    INFO((result).status().ToString()); \
    REQUIRE((result).ok());             \
  } while (false)

namespace fs = std::filesystem;
using Env = std::map<std::string, std::string>;

// A fresh directory per call, under Bazel's TEST_TMPDIR when there is one.
fs::path MakeTempDir() {
  const char* root = getenv("TEST_TMPDIR");
  std::string pattern =
      (fs::path(root != nullptr ? root : fs::temp_directory_path().c_str()) / "optionsXXXXXX")
          .string();
  REQUIRE(mkdtemp(pattern.data()) != nullptr);
  return pattern;
}

fs::path WriteFile(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text;
  return path;
}

absl::StatusOr<DaemonOptions> Load(std::vector<std::string> args, const Env& env) {
  args.insert(args.begin(), "ranncd");
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  return LoadDaemonOptions(static_cast<int>(args.size()), argv.data(), env, "1.2.3");
}

// The message if `result` failed with `code`; otherwise a string no check will match.
template <typename T>
std::string ErrorIf(const absl::StatusOr<T>& result, absl::StatusCode code) {
  if (result.ok()) return "<unexpectedly ok>";
  if (result.status().code() != code) return "<wrong code: " + result.status().ToString() + ">";
  return std::string(result.status().message());
}
constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;

TEST_CASE("LoadDaemonOptions: defaults without file, environment or flags", "[config]") {
  auto options = Load({}, {});
  REQUIRE_OK(options);
  CHECK(options->listen == "127.0.0.1:7411");
  CHECK(options->devices == "");
  CHECK(options->device_memory == 0);
  CHECK(options->log_level == "info");
  CHECK(options->max_message_size == 64u << 20);
  CHECK(options->shm_dir == "/dev/shm");
  CHECK(options->links == "");
  CHECK(options->profile_cache == "");
  CHECK(options->peers == "");
  CHECK(options->advertise == "");
  CHECK(options->cluster_size == 0);
  CHECK(options->heartbeat_interval == std::chrono::seconds(1));
  CHECK(options->peer_timeout == std::chrono::seconds(10));
  CHECK(options->upload_ttl == std::chrono::hours(1));
  CHECK(options->queue_aging == std::chrono::hours(1));
  CHECK(options->stop_timeout == std::chrono::minutes(10));
  CHECK(options->config_file == "");
}

TEST_CASE("LoadDaemonOptions: the bound on a stop", "[config]") {
  auto flags = Load({"--stop-timeout=110s"}, {});
  REQUIRE_OK(flags);
  CHECK(flags->stop_timeout == std::chrono::seconds(110));
  auto env = Load({}, {{"RANNC_STOP_TIMEOUT", "2500ms"}});
  REQUIRE_OK(env);
  CHECK(env->stop_timeout == std::chrono::milliseconds(2500));
  CHECK_THAT(ErrorIf(Load({"--stop-timeout", "never"}, {}), kInvalid),
             Catch::Contains("stop_timeout") || Catch::Contains("stop-timeout"));
}

TEST_CASE("LoadDaemonOptions: how long an unclaimed upload stays", "[config]") {
  auto flags = Load({"--upload-ttl", "90s"}, {});
  REQUIRE_OK(flags);
  CHECK(flags->upload_ttl == std::chrono::seconds(90));
  auto env = Load({}, {{"RANNC_UPLOAD_TTL", "2h"}});
  REQUIRE_OK(env);
  CHECK(env->upload_ttl == std::chrono::hours(2));
  CHECK_THAT(ErrorIf(Load({"--upload-ttl", "soon"}, {}), kInvalid),
             Catch::Contains("upload_ttl") || Catch::Contains("upload-ttl"));
}

TEST_CASE("LoadDaemonOptions: the queue's aging", "[config]") {
  auto flags = Load({"--queue-aging", "10m"}, {});
  REQUIRE_OK(flags);
  CHECK(flags->queue_aging == std::chrono::minutes(10));
  auto env = Load({}, {{"RANNC_QUEUE_AGING", "30s"}});
  REQUIRE_OK(env);
  CHECK(env->queue_aging == std::chrono::seconds(30));
  CHECK_THAT(ErrorIf(Load({"--queue-aging", "0s"}, {}), kInvalid),
             Catch::Contains("queue_aging") || Catch::Contains("queue-aging"));
}

TEST_CASE("LoadDaemonOptions: the cluster's keys", "[config]") {
  auto flags = Load({"--peers", "h2:7411, h1:7411", "--advertise", "h1:7411", "--cluster-size",
                     "2", "--heartbeat-interval", "250ms", "--peer-timeout", "1.5s"},
                    {});
  REQUIRE_OK(flags);
  CHECK(flags->peers == "h2:7411,h1:7411");
  CHECK(flags->advertise == "h1:7411");
  CHECK(flags->cluster_size == 2);
  CHECK(flags->heartbeat_interval == std::chrono::milliseconds(250));
  CHECK(flags->peer_timeout == std::chrono::milliseconds(1500));
  auto env = Load({}, {{"RANNC_PEERS", "svc:7411"}, {"RANNC_CLUSTER_SIZE", "4"},
                       {"RANNC_PEER_TIMEOUT", "1m"}});
  REQUIRE_OK(env);
  CHECK(env->peers == "svc:7411");
  CHECK(env->cluster_size == 4);
  CHECK(env->peer_timeout == std::chrono::minutes(1));

  CHECK_THAT(ErrorIf(Load({"--peers", "a:1,a:1"}, {}), kInvalid),
             Catch::Contains("--peers") && Catch::Contains("given twice"));
  CHECK_THAT(ErrorIf(Load({"--peers", "a"}, {}), kInvalid),
             Catch::Contains("--peers") && Catch::Contains("host:port"));
  CHECK_THAT(ErrorIf(Load({"--advertise", "a:x"}, {}), kInvalid), Catch::Contains("--advertise"));
  CHECK_THAT(ErrorIf(Load({"--cluster-size", "two"}, {}), kInvalid),
             Catch::Contains("--cluster-size") && Catch::Contains("whole number"));
  CHECK_THAT(ErrorIf(Load({}, {{"RANNC_HEARTBEAT_INTERVAL", "5"}}), kInvalid),
             Catch::Contains("RANNC_HEARTBEAT_INTERVAL") && Catch::Contains("unit"));
  CHECK_THAT(ErrorIf(Load({"--peer-timeout", "0.1ms"}, {}), kInvalid),
             Catch::Contains("at least 1ms"));
  CHECK_THAT(ErrorIf(Load({"--peer-timeout", "-2s"}, {}), kInvalid),
             Catch::Contains("at least 1ms"));
}

TEST_CASE("LoadDaemonOptions: the planner's links and profile cache", "[config]") {
  auto flags = Load({"--links", "p2p=5GB/s", "--profile-cache", "none"}, {});
  REQUIRE_OK(flags);
  CHECK(flags->links == "p2p=5GB/s");
  CHECK(flags->profile_cache == "none");
  auto env = Load({}, {{"RANNC_LINKS", "allreduce=2:1GB/s"}, {"RANNC_PROFILE_CACHE", "/tmp/p.tsv"}});
  REQUIRE_OK(env);
  CHECK(env->links == "allreduce=2:1GB/s");
  CHECK(env->profile_cache == "/tmp/p.tsv");
}

const char kFullToml[] = R"(
listen = "0.0.0.0:9000"
devices = "cpu:4"
device_memory = "2GiB"
log_level = "debug"
max_message_size = 1048576
shm_dir = "/tmp/shm"
)";

TEST_CASE("LoadDaemonOptions: the TOML file layer", "[config]") {
  const fs::path dir = MakeTempDir();

  SECTION("$RANNC_CONF_DIR/rannc.toml sets every key") {
    const fs::path file = WriteFile(dir / "rannc.toml", kFullToml);
    auto options = Load({}, {{"RANNC_CONF_DIR", dir.string()}});
    REQUIRE_OK(options);
    CHECK(options->listen == "0.0.0.0:9000");
    CHECK(options->devices == "cpu:4");
    CHECK(options->device_memory == 2ull << 30);
    CHECK(options->log_level == "debug");
    CHECK(options->max_message_size == 1048576);
    CHECK(options->shm_dir == "/tmp/shm");
    CHECK(options->config_file == file.string());
  }
  SECTION("~/.rannc/rannc.toml when RANNC_CONF_DIR is unset") {
    const fs::path file = WriteFile(dir / ".rannc" / "rannc.toml", "device_memory = 1000\n");
    auto options = Load({}, {{"HOME", dir.string()}});
    REQUIRE_OK(options);
    CHECK(options->device_memory == 1000);
    CHECK(options->config_file == file.string());
  }
  SECTION("RANNC_CONF_DIR wins over HOME") {
    WriteFile(dir / ".rannc" / "rannc.toml", "log_level = \"warn\"\n");
    const fs::path conf = dir / "conf";
    WriteFile(conf / "rannc.toml", "log_level = \"error\"\n");
    auto options = Load({}, {{"HOME", dir.string()}, {"RANNC_CONF_DIR", conf.string()}});
    REQUIRE_OK(options);
    CHECK(options->log_level == "error");
  }
  SECTION("--config wins over RANNC_CONF_DIR") {
    WriteFile(dir / "rannc.toml", "log_level = \"warn\"\n");
    const fs::path other = WriteFile(dir / "other.toml", "log_level = \"trace\"\n");
    auto options = Load({"--config", other.string()}, {{"RANNC_CONF_DIR", dir.string()}});
    REQUIRE_OK(options);
    CHECK(options->log_level == "trace");
    CHECK(options->config_file == other.string());
  }
  SECTION("a missing default file is fine") {
    auto options = Load({}, {{"HOME", dir.string()}, {"RANNC_CONF_DIR", dir.string()}});
    REQUIRE_OK(options);
    CHECK(options->config_file == "");
  }
  SECTION("the client's job-level keys are accepted and ignored") {
    WriteFile(dir / "rannc.toml", "partition_num = 2\nmem_margin = 0.2\nlisten = \"h:1\"\n");
    auto options = Load({}, {{"RANNC_CONF_DIR", dir.string()}});
    REQUIRE_OK(options);
    CHECK(options->listen == "h:1");
  }
}

TEST_CASE("LoadDaemonOptions: TOML file errors", "[config]") {
  const fs::path dir = MakeTempDir();
  const fs::path file = dir / "rannc.toml";
  const Env env = {{"RANNC_CONF_DIR", dir.string()}};

  SECTION("missing --config file") {
    CHECK_THAT(
        ErrorIf(Load({"--config", (dir / "nope.toml").string()}, env), absl::StatusCode::kNotFound),
        Catch::Contains("--config") && Catch::Contains("nope.toml"));
  }
  SECTION("RANNC_CONF_DIR that is not a directory") {
    CHECK_THAT(ErrorIf(Load({}, {{"RANNC_CONF_DIR", (dir / "absent").string()}}), kInvalid),
               Catch::Contains("RANNC_CONF_DIR") && Catch::Contains("absent"));
  }
  SECTION("parse error names the file and line") {
    WriteFile(file, "listen = \"a:1\"\nlisten = = 3\n");
    CHECK_THAT(ErrorIf(Load({}, env), kInvalid), Catch::Contains(file.string() + ":2:"));
  }
  SECTION("unknown key names the key and the file") {
    WriteFile(file, "listen = \"a:1\"\nlisten_port = 7411\n");
    CHECK_THAT(ErrorIf(Load({}, env), kInvalid), Catch::Contains("unknown key 'listen_port'") &&
                                                     Catch::Contains(file.string()) &&
                                                     Catch::Contains("line 2"));
  }
  SECTION("a section is refused") {
    WriteFile(file, "[daemon]\nlisten = \"a:1\"\n");
    CHECK_THAT(ErrorIf(Load({}, env), kInvalid),
               Catch::Contains("'daemon'") && Catch::Contains("is a section"));
  }
  SECTION("a job's and a client's keys are theirs; a misspelt key names the nearest") {
    // What a RaNNC user keeps in rannc.toml beside the daemon's keys.
    WriteFile(file, "amp_level = \"O2\"\njob_lease = 30\npartition_num = 2\n"
                    "dump_graph = true\ndevices = \"cpu:2\"\n");
    auto options = Load({}, env);
    REQUIRE_OK(options);
    CHECK(options->devices == "cpu:2");
    WriteFile(file, "devices = \"cpu:2\"\namp_levle = \"O2\"\n");
    CHECK_THAT(ErrorIf(Load({}, env), kInvalid),
               Catch::Contains("unknown key 'amp_levle'") && Catch::Contains("line 2") &&
                   Catch::Contains("did you mean 'amp_level'"));
  }
  SECTION("peers as an array, and what may not be in it") {
    WriteFile(file, "peers = [\"b:1\", \" a:2\"]\npeer_timeout = \"3s\"\ncluster_size = 2\n");
    auto options = Load({}, env);
    REQUIRE_OK(options);
    CHECK(options->peers == "b:1,a:2");
    CHECK(options->peer_timeout == std::chrono::seconds(3));
    CHECK(options->cluster_size == 2);
    WriteFile(file, "peers = [\"a:1\", 7]\n");
    CHECK_THAT(ErrorIf(Load({}, env), kInvalid),
               Catch::Contains("'peers'") && Catch::Contains("array of \"host:port\" strings"));
    WriteFile(file, "heartbeat_interval = 1\n");
    CHECK_THAT(ErrorIf(Load({}, env), kInvalid),
               Catch::Contains("'heartbeat_interval'") && Catch::Contains("duration string"));
  }
  SECTION("wrong value types") {
    WriteFile(file, "listen = 7411\n");
    CHECK_THAT(ErrorIf(Load({}, env), kInvalid), Catch::Contains("'listen'") &&
                                                     Catch::Contains("expected a string") &&
                                                     Catch::Contains("got an integer"));
    WriteFile(file, "device_memory = 1.5\n");
    CHECK_THAT(ErrorIf(Load({}, env), kInvalid),
               Catch::Contains("'device_memory'") && Catch::Contains("floating-point"));
    WriteFile(file, "device_memory = -1\n");
    CHECK_THAT(ErrorIf(Load({}, env), kInvalid),
               Catch::Contains("'device_memory'") && Catch::Contains("negative"));
  }
  SECTION("bad values name the key and file") {
    WriteFile(file, "device_memory = \"2 GiBs\"\n");
    CHECK_THAT(
        ErrorIf(Load({}, env), kInvalid),
        Catch::Contains("'device_memory' in " + file.string()) && Catch::Contains("unknown unit"));
    WriteFile(file, "max_message_size = 4294967296\n");
    CHECK_THAT(ErrorIf(Load({}, env), kInvalid),
               Catch::Contains("'max_message_size'") && Catch::Contains("2147483647"));
  }
}

TEST_CASE("LoadDaemonOptions: precedence file < environment < flags", "[config]") {
  const fs::path dir = MakeTempDir();
  WriteFile(dir / "rannc.toml", kFullToml);
  Env env = {{"RANNC_CONF_DIR", dir.string()}};

  SECTION("the environment overrides the file, key by key") {
    env["RANNC_LISTEN"] = "env:1";
    env["RANNC_DEVICES"] = "cuda:1";
    env["RANNC_DEVICE_MEMORY"] = "1.5GB";
    env["RANNC_LOG_LEVEL"] = "WARN";
    env["RANNC_MAX_MESSAGE_SIZE"] = "2MiB";
    env["RANNC_SHM_DIR"] = "";
    env["RANNC_PARTITION_NUM"] = "4";  // the client's: ignored
    auto options = Load({}, env);
    REQUIRE_OK(options);
    CHECK(options->listen == "env:1");
    CHECK(options->devices == "cuda:1");
    CHECK(options->device_memory == 1500000000);
    CHECK(options->log_level == "warn");
    CHECK(options->max_message_size == 2u << 20);
    CHECK(options->shm_dir == "");
  }
  SECTION("flags override the environment and the file") {
    env["RANNC_LISTEN"] = "env:1";
    env["RANNC_DEVICE_MEMORY"] = "1GB";
    env["RANNC_SHM_DIR"] = "/env/shm";
    auto options = Load({"--listen", "flag:2", "--devices=cpu:2", "--device-memory", "512MiB",
                         "--log-level", "trace", "--max-message-size=1000", "--shm-dir="},
                        env);
    REQUIRE_OK(options);
    CHECK(options->listen == "flag:2");
    CHECK(options->devices == "cpu:2");
    CHECK(options->device_memory == 512ull << 20);
    CHECK(options->log_level == "trace");
    CHECK(options->max_message_size == 1000);
    CHECK(options->shm_dir == "");
  }
  SECTION("a layer that does not set a key leaves the lower layer's value") {
    env["RANNC_LISTEN"] = "env:1";
    auto options = Load({"--log-level", "error"}, env);
    REQUIRE_OK(options);
    CHECK(options->listen == "env:1");     // environment
    CHECK(options->devices == "cpu:4");    // file
    CHECK(options->log_level == "error");  // flag
  }
  SECTION("an empty flag value counts") {
    auto options = Load({"--shm-dir", "", "--devices="}, env);
    REQUIRE_OK(options);
    CHECK(options->shm_dir == "");
    CHECK(options->devices == "");
  }
  SECTION("a flag given twice takes the last value") {
    auto options = Load({"--listen", "a:1", "--listen", "b:2"}, env);
    REQUIRE_OK(options);
    CHECK(options->listen == "b:2");
  }
}

TEST_CASE("LoadDaemonOptions: flag and environment errors", "[config]") {
  CHECK_THAT(ErrorIf(Load({"--bogus", "1"}, {}), kInvalid), Catch::Contains("--bogus"));
  CHECK_THAT(ErrorIf(Load({"stray"}, {}), kInvalid), Catch::Contains("stray"));
  CHECK_THAT(ErrorIf(Load({"--listen"}, {}), kInvalid), Catch::Contains("--listen"));
  CHECK_THAT(ErrorIf(Load({"--devices", "tpu:2"}, {}), kInvalid),
             Catch::Contains("--devices") && Catch::Contains("unknown device type 'tpu'") &&
                 Catch::Contains("expected cpu:N, cuda or cuda:I,J"));
  CHECK_THAT(ErrorIf(Load({"--log-level", "verbose"}, {}), kInvalid),
             Catch::Contains("--log-level") && Catch::Contains("verbose"));
  CHECK_THAT(ErrorIf(Load({"--listen", "localhost"}, {}), kInvalid),
             Catch::Contains("--listen") && Catch::Contains("localhost"));
  CHECK_THAT(ErrorIf(Load({"--listen", "h:99999"}, {}), kInvalid),
             Catch::Contains("invalid port '99999'"));
  CHECK_THAT(ErrorIf(Load({"--max-message-size", "0"}, {}), kInvalid),
             Catch::Contains("--max-message-size"));
  CHECK_THAT(ErrorIf(Load({"--shm-dir", "shm"}, {}), kInvalid),
             Catch::Contains("--shm-dir") && Catch::Contains("absolute"));
  CHECK_THAT(ErrorIf(Load({}, {{"RANNC_DEVICE_MEMORY", "lots"}}), kInvalid),
             Catch::Contains("RANNC_DEVICE_MEMORY") && Catch::Contains("'lots'"));
  CHECK_THAT(ErrorIf(Load({}, {{"RANNC_DEVICES", "cuda:x"}}), kInvalid),
             Catch::Contains("RANNC_DEVICES") && Catch::Contains("'x'"));
  // A bad value in a lower layer is reported even when a higher layer would override it: the
  // user should hear about a broken setting rather than have it hide until the flag goes away.
  CHECK_THAT(
      ErrorIf(Load({"--device-memory", "1GiB"}, {{"RANNC_DEVICE_MEMORY", "lots"}}), kInvalid),
      Catch::Contains("RANNC_DEVICE_MEMORY"));
  CHECK_FALSE(IsHelpOrVersion(Load({"--bogus"}, {}).status()));
  CHECK_FALSE(IsHelpOrVersion(absl::CancelledError("--help")));
}

TEST_CASE("LoadDaemonOptions: --help and --version", "[config]") {
  auto help = Load({"--help"}, {});
  REQUIRE(IsHelpOrVersion(help.status()));
  for (const char* flag : {"--listen", "--devices", "--device-memory", "--log-level",
                           "--max-message-size", "--shm-dir", "--config", "--version", "RANNC_"}) {
    CHECK_THAT(std::string(help.status().message()), Catch::Contains(flag));
  }
  auto version = Load({"--version"}, {});
  REQUIRE(IsHelpOrVersion(version.status()));
  CHECK(version.status().message() == "ranncd 1.2.3\n");
}

TEST_CASE("ParseByteSize", "[config]") {
  const std::vector<std::pair<std::string, uint64_t>> good = {
      {"0", 0},
      {"1024", 1024},
      {" 1024 ", 1024},
      {"10B", 10},
      {"1KB", 1000},
      {"1kib", 1024},
      {"512MiB", 512ull << 20},
      {"512 MiB", 512ull << 20},
      {"2GiB", 2ull << 30},
      {"1.5GB", 1500000000},
      {"1.5GiB", 1610612736},
      {".5KiB", 512},
      {"3.", 3},
      {"0.3GiB", 322122547},  // 322122547.2 rounded down
      {"1TB", 1000000000000},
      {"16TiB", 16ull << 40},
      {"18446744073709551615", UINT64_MAX},
  };
  for (const auto& [text, bytes] : good) {
    INFO(text);
    auto parsed = ParseByteSize(text);
    REQUIRE(parsed.ok());
    CHECK(*parsed == bytes);
  }
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "empty"},
      {"  ", "empty"},
      {"-1", "negative"},
      {"GiB", "no number"},
      {".", "no number"},
      {"2XB", "unknown unit 'XB'"},
      {"2 G", "unknown unit 'G'"},
      {"1.2.3", "unknown unit '.3'"},
      {"18446744073709551616", "larger than"},
      {"20000000TiB", "larger than"},
  };
  for (const auto& [text, why] : bad) {
    INFO(text);
    CHECK_THAT(ErrorIf(ParseByteSize(text), kInvalid), Catch::Contains(why) &&
                                                           Catch::Contains("'" + text + "'") &&
                                                           Catch::Contains("512MiB"));
  }
}

std::vector<std::string> Names(const absl::StatusOr<std::vector<DeviceSpec>>& devices) {
  std::vector<std::string> names;
  if (!devices.ok()) return {devices.status().ToString()};
  for (const DeviceSpec& device : *devices) names.push_back(DeviceName(device));
  return names;
}

TEST_CASE("ParseDevices", "[config]") {
  using V = std::vector<std::string>;
  CHECK(Names(ParseDevices("", 0)) == V{"cpu:0"});
  CHECK(Names(ParseDevices("", 2)) == V{"cuda:0", "cuda:1"});
  CHECK(Names(ParseDevices("cpu:4", 2)) == V{"cpu:0", "cpu:1", "cpu:2", "cpu:3"});
  CHECK(Names(ParseDevices("cpu", 0)) == V{"cpu:0"});
  CHECK(Names(ParseDevices("cuda", 3)) == V{"cuda:0", "cuda:1", "cuda:2"});
  CHECK(Names(ParseDevices("cuda:2,0", 3)) == V{"cuda:2", "cuda:0"});
  CHECK(Names(ParseDevices(" CUDA: 1 , 2 ", 3)) == V{"cuda:1", "cuda:2"});
  CHECK(ParseDevices("cpu:2", 0)->at(1) == DeviceSpec{"cpu", 1});
  // A shared GPU: one device per share, each knowing how many share it.
  CHECK(Names(ParseDevices("cuda:0/3", 1)) == V{"cuda:0", "cuda:0", "cuda:0"});
  CHECK(*ParseDevices("cuda:1/2, 0", 2) ==
        std::vector<DeviceSpec>{{"cuda", 1, 2}, {"cuda", 1, 2}, {"cuda", 0, 1}});
  CHECK(ParseDevices("cuda:0/1", 1)->at(0) == DeviceSpec{"cuda", 0});

  CHECK(ErrorIf(ParseDevices("tpu:2", 0), kInvalid) ==
        "unknown device type 'tpu' in devices 'tpu:2'; expected cpu:N, cuda or cuda:I,J (I/N: "
        "GPU I as N devices)");
  CHECK_THAT(ErrorIf(ParseDevices("cuda:0/0", 1), kInvalid), Catch::Contains("count '0'"));
  CHECK_THAT(ErrorIf(ParseDevices("cuda:0/x", 1), kInvalid), Catch::Contains("count 'x'"));
  CHECK_THAT(ErrorIf(ParseDevices("cuda:0/65", 1), kInvalid), Catch::Contains("1 to 64"));
  CHECK_THAT(ErrorIf(ParseDevices("cuda:0/2,0", 1), kInvalid), Catch::Contains("given twice"));
  CHECK_THAT(ErrorIf(ParseDevices("cuda:3/2", 1), kInvalid), Catch::Contains("not present"));
  CHECK_THAT(ErrorIf(ParseDevices("cuda", 0), kInvalid),
             Catch::Contains("no CUDA devices") && Catch::Contains("'cuda'"));
  CHECK_THAT(ErrorIf(ParseDevices("cuda:0,2", 2), kInvalid),
             Catch::Contains("CUDA device 2 is not present (2 found)"));
  CHECK_THAT(ErrorIf(ParseDevices("cuda:1,1", 2), kInvalid), Catch::Contains("given twice"));
  CHECK_THAT(ErrorIf(ParseDevices("cuda:", 2), kInvalid), Catch::Contains("index ''"));
  CHECK_THAT(ErrorIf(ParseDevices("cuda:-1", 2), kInvalid), Catch::Contains("index '-1'"));
  CHECK_THAT(ErrorIf(ParseDevices("cpu:0", 0), kInvalid), Catch::Contains("count '0'"));
  CHECK_THAT(ErrorIf(ParseDevices("cpu:two", 0), kInvalid), Catch::Contains("count 'two'"));
  CHECK_THAT(ErrorIf(ParseDevices("cpu:5000", 0), kInvalid), Catch::Contains("1024"));
  CHECK_THAT(ErrorIf(ParseDevices("cpu:2,cuda:0", 1), kInvalid), Catch::Contains("count"));
}

TEST_CASE("ProcessEnvironment reads this process's environment", "[config]") {
  REQUIRE(setenv("RANNC_OPTIONS_TEST_VAR", "a=b", 1) == 0);
  const Env env = ProcessEnvironment();
  REQUIRE(env.count("RANNC_OPTIONS_TEST_VAR"));
  CHECK(env.at("RANNC_OPTIONS_TEST_VAR") == "a=b");
}

}  // namespace
}  // namespace rannc
