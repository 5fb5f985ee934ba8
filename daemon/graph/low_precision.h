// Whole-forward low precision (config amp_level=O2, with enable_apex_amp): the imported graph is
// rewritten so that the forward computes in bf16 (or fp16) from end to end, as FSDP2's
// MixedPrecisionPolicy(param_dtype=bf16) and Apex's O2 do, while the parameters themselves stay
// fp32 (the masters the optimizer steps).
//
// Every floating parameter is read through one `aten::to(param, dtype)` and every floating user
// input is cast the same way on entry; nothing else changes. Autograd does the rest: the cast's
// backward turns each low-precision gradient back into fp32 before it reaches the parameter's
// leaf, so gradients accumulate in fp32 over micro-batches and replicas all-reduce fp32, as under
// autocast (O1). What differs from O1 is everything between the GEMMs: LayerNorm, softmax, GELU
// and the residual stream run in the low precision too, halving their memory traffic. Such a job
// runs without autocast.
//
// A parameter cast is a parameter-only op, so the IR makes it a helper (graph/ir.h): each stage
// that reads the parameter casts its own copy, and no bf16 weight ever crosses a stage boundary.
// Parameters read only by batch norm stay fp32, as Apex's O2 keeps them (batch norm takes a
// low-precision input with fp32 weights and statistics; the statistics are buffers, which are
// never cast). Outputs keep whatever dtype the graph computes (a loss computed in the model is
// bf16).
//
//   absl::Status cast = CastForwardTo(&model, at::kBFloat16, {at::kLong, at::kFloat});
//
// A pure rewrite of `model->graph`; the module's tensors are not touched.
#ifndef RANNC_DAEMON_GRAPH_LOW_PRECISION_H_
#define RANNC_DAEMON_GRAPH_LOW_PRECISION_H_

#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/status/status.h"
#include "daemon/graph/torchscript_import.h"

namespace rannc {

// `input_dtypes`: the dtype of each user input, as the job's example inputs have them (a
// floating input other than `dtype` is cast; integer inputs are left alone). INVALID_ARGUMENT
// when their number differs from the graph's or `dtype` is not a floating type.
absl::Status CastForwardTo(ImportedModel* model, c10::ScalarType dtype,
                           const std::vector<c10::ScalarType>& input_dtypes);

}  // namespace rannc

#endif  // RANNC_DAEMON_GRAPH_LOW_PRECISION_H_
