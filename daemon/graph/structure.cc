#include "daemon/graph/structure.h"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/ir.h>

namespace rannc {
namespace {

using torch::jit::AttributeKind;
using torch::jit::Block;
using torch::jit::Node;
using torch::jit::Value;

// FNV-1a over a tensor's bytes: constants with the same shape but other values differ.
std::string ContentHash(const at::Tensor& t) {
  uint64_t h = 1469598103934665603ull;
  if (t.defined() && t.numel() > 0) {
    at::Tensor c = t.to(at::kCPU).contiguous();
    const unsigned char* p = static_cast<const unsigned char*>(c.data_ptr());
    const size_t n = c.numel() * c.element_size();
    for (size_t i = 0; i < n; ++i) {
      h ^= p[i];
      h *= 1099511628211ull;
    }
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

void WriteTensor(const at::Tensor& t, std::ostream& out) {
  if (!t.defined()) {
    out << "T<undefined>";
    return;
  }
  out << "T<" << c10::toString(t.scalar_type()) << t.sizes() << '#' << ContentHash(t) << '>';
}

void WriteIValue(const c10::IValue& v, std::ostream& out) {
  if (v.isTensor()) {
    WriteTensor(v.toTensor(), out);
  } else if (v.isList()) {
    out << "L[";
    for (const c10::IValue& e : v.toListRef()) {
      WriteIValue(e, out);
      out << ',';
    }
    out << ']';
  } else if (v.isTuple()) {
    out << "U(";
    for (const c10::IValue& e : v.toTupleRef().elements()) {
      WriteIValue(e, out);
      out << ',';
    }
    out << ')';
  } else if (v.isDouble()) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.17g", v.toDouble());
    out << "D" << buf;
  } else if (v.isString()) {
    const std::string& s = v.toStringRef();
    out << "S" << s.size() << ':' << s;
  } else {
    out << v.tagKind() << ':' << v;
  }
}

class Writer {
 public:
  explicit Writer(std::ostream& out) : out_(out) {}

  void WriteGraph(const torch::jit::Graph& graph) {
    out_ << "graph(";
    for (const Value* in : graph.inputs()) Define(in);
    out_ << ")\n";
    WriteNodes(graph.block());
    out_ << "return(";
    for (const Value* o : graph.outputs()) Use(o);
    out_ << ")\n";
  }

 private:
  void Define(const Value* v) {
    const int id = next_++;
    ids_[v] = id;
    out_ << '%' << id << ':' << v->type()->str() << ',';
  }

  void Use(const Value* v) {
    auto it = ids_.find(v);
    // A value from outside the graph cannot occur in a well-formed graph; name it by address
    // so that such a graph never matches another.
    if (it == ids_.end()) {
      out_ << "%ext" << static_cast<const void*>(v) << ',';
    } else {
      out_ << '%' << it->second << ',';
    }
  }

  void WriteNodes(const Block* block) {
    for (const Node* n : block->nodes()) WriteNode(n);
  }

  void WriteNode(const Node* n) {
    for (const Value* o : n->outputs()) Define(o);
    out_ << "= " << n->kind().toQualString() << '[';
    std::vector<c10::Symbol> names = n->attributeNames();
    std::sort(names.begin(), names.end(), [](c10::Symbol a, c10::Symbol b) {
      return std::string(a.toQualString()) < std::string(b.toQualString());
    });
    for (c10::Symbol name : names) {
      out_ << name.toUnqualString() << '=';
      WriteAttribute(n, name);
      out_ << ';';
    }
    out_ << "](";
    for (const Value* in : n->inputs()) Use(in);
    out_ << ')';
    for (const Block* b : n->blocks()) {
      out_ << "{block(";
      for (const Value* in : b->inputs()) Define(in);
      out_ << ")\n";
      WriteNodes(b);
      out_ << "->(";
      for (const Value* o : b->outputs()) Use(o);
      out_ << ")}";
    }
    out_ << '\n';
  }

  void WriteAttribute(const Node* n, c10::Symbol name) {
    char buf[64];
    switch (n->kindOf(name)) {
      case AttributeKind::f:
        std::snprintf(buf, sizeof(buf), "%.17g", n->f(name));
        out_ << buf;
        break;
      case AttributeKind::fs:
        for (double f : n->fs(name)) {
          std::snprintf(buf, sizeof(buf), "%.17g,", f);
          out_ << buf;
        }
        break;
      case AttributeKind::c:
        out_ << n->c(name);
        break;
      case AttributeKind::cs:
        for (const auto& c : n->cs(name)) out_ << c << ',';
        break;
      case AttributeKind::i:
        out_ << n->i(name);
        break;
      case AttributeKind::is:
        for (int64_t i : n->is(name)) out_ << i << ',';
        break;
      case AttributeKind::s:
        out_ << n->s(name).size() << ':' << n->s(name);
        break;
      case AttributeKind::ss:
        for (const std::string& s : n->ss(name)) out_ << s.size() << ':' << s << ',';
        break;
      case AttributeKind::t:
        WriteTensor(n->t(name), out_);
        break;
      case AttributeKind::ts:
        for (const at::Tensor& t : n->ts(name)) WriteTensor(t, out_);
        break;
      case AttributeKind::g:
        out_ << '{' << CanonicalGraphText(*n->g(name)) << '}';
        break;
      case AttributeKind::gs:
        for (const auto& g : n->gs(name)) out_ << '{' << CanonicalGraphText(*g) << '}';
        break;
      case AttributeKind::ty:
        out_ << n->ty(name)->str();
        break;
      case AttributeKind::tys:
        for (const auto& t : n->tys(name)) out_ << t->str() << ',';
        break;
      case AttributeKind::ival:
        WriteIValue(n->ival(name), out_);
        break;
      default:
        // An attribute kind this writer does not know: never equal to another node's.
        out_ << "?" << static_cast<const void*>(n);
    }
  }

  std::ostream& out_;
  std::unordered_map<const Value*, int> ids_;
  int next_ = 0;
};

}  // namespace

std::string CanonicalGraphText(const torch::jit::Graph& graph) {
  std::ostringstream out;
  Writer(out).WriteGraph(graph);
  return out.str();
}

std::string DescribeRuntimeValue(const c10::IValue& value) {
  std::ostringstream out;
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    if (!t.defined()) return "T<undefined>";
    out << c10::toString(t.scalar_type()) << t.sizes() << '|' << t.strides() << t.device()
        << (t.requires_grad() ? ",g" : "");
  } else {
    out << value.tagKind() << ':';
    WriteIValue(value, out);
  }
  return out.str();
}

}  // namespace rannc
