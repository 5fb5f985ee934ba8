// The list of host-reading ops (host_reads.h).
#include "daemon/graph/host_reads.h"

#include <set>

#include <torch/csrc/jit/ir/ir.h>

namespace rannc {

const std::vector<c10::Symbol>& HostReadKinds() {
  static const std::vector<c10::Symbol> kinds = [] {
    std::vector<c10::Symbol> out;
    for (const char* name :
         {"aten::item", "aten::_local_scalar_dense", "aten::Int", "aten::Float", "aten::Bool",
          "aten::IntImplicit", "aten::FloatImplicit", "aten::ComplexImplicit",
          "aten::ScalarImplicit", "aten::tolist", "prim::tolist"}) {
      out.push_back(c10::Symbol::fromQualString(name));
    }
    return out;
  }();
  return kinds;
}

bool IsHostRead(const torch::jit::Node* n) {
  static const std::set<c10::Symbol> kinds(HostReadKinds().begin(), HostReadKinds().end());
  return kinds.count(n->kind()) > 0;
}

}  // namespace rannc
