// The ops that read a tensor's contents into host values: int(t), float(t), bool(t), t.item(),
// t.tolist(), and the implicit conversions TorchScript inserts where a tensor stands for a
// number. The one list of them; every pass that must know such reads asks here:
//  - ShapesFollowFromShapes (ir.h): a host read turns contents into a number, so shapes may
//    depend on contents;
//  - subgraph.cc: a host integer constant whose uses end in host reads stays on the host;
//  - the batch analysis (batch_flow.h): a read of batch values into a host number keeps the
//    batch whole.
//
//   if (IsHostRead(node)) ...;
//
// Pure functions over immutable tables; safe from any thread.
#ifndef RANNC_DAEMON_GRAPH_HOST_READS_H_
#define RANNC_DAEMON_GRAPH_HOST_READS_H_

#include <vector>

#include <ATen/core/symbol.h>

namespace torch {
namespace jit {
struct Node;
}  // namespace jit
}  // namespace torch

namespace rannc {

// Every host-reading op kind ("aten::item", ...), in a fixed order (for tests).
const std::vector<c10::Symbol>& HostReadKinds();

// Whether `n` is one of HostReadKinds().
bool IsHostRead(const torch::jit::Node* n);

}  // namespace rannc

#endif  // RANNC_DAEMON_GRAPH_HOST_READS_H_
