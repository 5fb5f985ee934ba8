#include "daemon/graph/ir_testing.h"

#include <stdexcept>

#include "daemon/graph/low_precision.h"

namespace rannc::testing {

FixtureIr BuildFixtureIr(const std::string& name, const IrOptions& options) {
  FixtureIr out;
  out.fixture = LoadFixture(name);
  absl::StatusOr<ImportedModel> model = ImportTorchScript(out.fixture.model_bytes);
  if (!model.ok()) throw std::runtime_error(std::string(model.status().message()));
  out.model = std::move(*model);
  for (const std::string& tensor_name : out.model.graph_tensor_names) {
    for (const ModuleTensor& t : out.model.tensors) {
      if (t.name == tensor_name) out.tensors.push_back(t.tensor);
    }
  }
  out.ir = BuildIr(out.model, out.tensors, out.fixture.inputs, options);
  if (out.ir.ok()) {
    absl::StatusOr<std::vector<at::Tensor>> user =
        WithStepInputs(*out.ir, out.fixture.inputs, out.tensors);
    if (!user.ok()) throw std::runtime_error(std::string(user.status().message()));
    out.user_inputs = std::move(*user);
  }
  return out;
}

FixtureIr BuildO2FixtureIr(const std::string& name) {
  FixtureIr out = BuildFixtureIr(name);
  std::vector<c10::ScalarType> dtypes;
  for (const at::Tensor& t : out.fixture.inputs) dtypes.push_back(t.scalar_type());
  absl::Status cast = CastForwardTo(&out.model, at::kBFloat16, dtypes);
  if (!cast.ok()) throw std::runtime_error(std::string(cast.message()));
  out.ir = BuildIr(out.model, out.tensors, out.fixture.inputs);
  if (!out.ir.ok()) throw std::runtime_error(std::string(out.ir.status().message()));
  absl::StatusOr<std::vector<at::Tensor>> user =
      WithStepInputs(*out.ir, out.fixture.inputs, out.tensors);
  if (!user.ok()) throw std::runtime_error(std::string(user.status().message()));
  out.user_inputs = std::move(*user);
  return out;
}

}  // namespace rannc::testing
