// The data plane's rendezvous store (store.h) on etcd (cluster/etcd_client.h): what
// `ranncd --cluster-store etcd://...` gives a job's groups in place of the store its leading
// daemon serves, so that the rendezvous outlives any one daemon. Keys live under `prefix` (a
// job's, e.g. "/rannc/store/<job id>/"); Get and Wait wait through a watch, Add is a
// compare-and-swap on the key's revision.
//
//   std::unique_ptr<comm::Store> store = comm::MakeEtcdStore(etcd, "/rannc/store/job-1/");
//   store->Set("world/addr/0", bytes);
//
// Errors: etcd's, naming the key (UNAVAILABLE when no member answers); a Get or Wait that times
// out returns DEADLINE_EXCEEDED naming the key. Thread-safe; `etcd` must outlive the store.
#ifndef RANNC_DAEMON_COMM_ETCD_STORE_H_
#define RANNC_DAEMON_COMM_ETCD_STORE_H_

#include <memory>
#include <string>

#include "daemon/cluster/etcd_client.h"
#include "daemon/comm/store.h"

namespace rannc {
namespace comm {

// Keys are written under `lease` (0: none), so that they go with the daemon that wrote them.
std::unique_ptr<Store> MakeEtcdStore(cluster::EtcdClient* etcd, std::string prefix,
                                     int64_t lease = 0);

}  // namespace comm
}  // namespace rannc

#endif  // RANNC_DAEMON_COMM_ETCD_STORE_H_
