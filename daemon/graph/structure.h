// What a graph computes, written so that two graphs that compute the same thing on the same
// kinds of inputs get the same text: the structural identity the planner uses to measure the
// repeated parts of a model (every layer of a transformer) once.
//
// CanonicalGraphText writes a graph's inputs (their types), its ops in order (kinds, every
// attribute with its value, constant tensors by dtype, shape and a hash of their contents),
// how the ops connect, nested blocks, and the outputs. Value names, source locations, scopes
// and call stacks are left out, so two layers of one model, which differ only in the names of
// their parameters, get the same text. DescribeRuntimeValue writes what an input value brings
// to a run besides its contents: a tensor's dtype, sizes, strides, device and requires_grad;
// a scalar's value.
//
//   std::string key = CanonicalGraphText(*sub.graph);
//   for (const c10::IValue& v : inputs) key += DescribeRuntimeValue(v);
//   // equal keys: the same ops on inputs of the same kinds, so the same shapes, time and memory
//
// Pure functions; safe from any thread on graphs nobody is changing.
#ifndef RANNC_DAEMON_GRAPH_STRUCTURE_H_
#define RANNC_DAEMON_GRAPH_STRUCTURE_H_

#include <string>

#include <ATen/core/ivalue.h>

namespace torch {
namespace jit {
struct Graph;
}  // namespace jit
}  // namespace torch

namespace rannc {

// Equal for graphs that are the same up to the names of their values.
std::string CanonicalGraphText(const torch::jit::Graph& graph);

// A tensor as "Float[2,3|3,1]cpu,g" (dtype, sizes|strides, device, requires_grad); any other
// value as its type and printed value. Contents of tensors are left out.
std::string DescribeRuntimeValue(const c10::IValue& value);

}  // namespace rannc

#endif  // RANNC_DAEMON_GRAPH_STRUCTURE_H_
