// PartChannels to other "daemons" in this process, for tests: each member address has its own
// JobManager, where CreatePart makes the part as JobPartService would (CreatePartJob), and each
// call goes straight to the part's Job. The parts' engines meet the leader's through one
// in-memory store. Tests cut a member off (every call UNAVAILABLE, as an unreachable daemon's)
// or make its next call fail, to drive the Coordinator's abort and loss paths without
// processes, sockets or sleeps.
//
//   comm::Store* store = ...;                      // the leader's JobSettings::engine_store
//   FakePartChannels channels(store);
//   channels.AddDaemon("b:1", facts);
//   Job::Create(id, settings, bytes, inputs, {}, &channels);   // settings.members = {"b:1"}
//   channels.Cut("b:1");
//
// Thread-safe.
#ifndef RANNC_DAEMON_SERVER_FAKE_PART_CHANNEL_H_
#define RANNC_DAEMON_SERVER_FAKE_PART_CHANNEL_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "daemon/comm/store.h"
#include "daemon/server/job_manager.h"
#include "daemon/server/job_settings.h"
#include "daemon/server/part_channel.h"

namespace rannc {

class FakePartChannels final : public PartChannels {
 public:
  explicit FakePartChannels(comm::Store* store) : store_(store) {}

  // A daemon at `address` with `facts` (its devices).
  void AddDaemon(const std::string& address, DaemonFacts facts);
  // The jobs of the daemon at `address` (its parts); null for an unknown address.
  JobManager* jobs(const std::string& address);
  // Every later call to `address` fails UNAVAILABLE, as a daemon gone or cut off; the other
  // daemons' parts hear of it as their clusters would tell them (Coordinator::MemberLost).
  void Cut(const std::string& address);
  // The next Forward, Backward or Run on `address` fails with `status` without reaching the part.
  void FailNext(const std::string& address, absl::Status status);

  absl::StatusOr<std::unique_ptr<PartChannel>> CreatePart(
      const std::string& address, const v1::JobSpec& spec, const v1::PartSpec& part,
      const std::string& model_bytes) override;

  // For the channels: OK, or why a call to `address` fails now (consuming a FailNext).
  absl::Status Reach(const std::string& address, bool consume_failure);

 private:
  struct Daemon {
    DaemonFacts facts;
    std::unique_ptr<JobManager> jobs;
    bool cut = false;
    absl::Status fail_next;
  };

  comm::Store* const store_;
  std::mutex mu_;
  std::map<std::string, Daemon> daemons_;
};

}  // namespace rannc

#endif  // RANNC_DAEMON_SERVER_FAKE_PART_CHANNEL_H_
