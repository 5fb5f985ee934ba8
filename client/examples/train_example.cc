// A minimal training loop with the C++ SDK: upload a TorchScript model, then forward, backward
// and step. The model takes one float32 tensor and returns one float32 tensor y; the loss,
// computed here on the client, is 0.5 * mean(y^2), whose gradient with respect to y is y / N
// (N elements), so the loop drives the model's output toward zero.
//
//   python3 -c 'import torch; m = torch.nn.Linear(8, 4);
//     torch.jit.save(torch.jit.trace(m, torch.randn(16, 8)), "linear.pt")'
//   bazel run //client:train_example -- $PWD/linear.pt --input-shape 16,8 --steps 20
//
// The daemon address comes from --daemon, else $RANNC_DAEMON, else 127.0.0.1:7411.
#include <CLI/CLI.hpp>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>

#include "client/rannc_client.h"

namespace {

int Fail(const absl::Status& status) {
  std::cerr << "train_example: " << status.message() << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a TorchScript model on a fixed random batch through ranncd"};
  std::string model_path;
  std::string daemon = "127.0.0.1:7411";
  std::vector<int64_t> input_shape = {16, 8};
  int steps = 10;
  double lr = 0.5;
  app.add_option("model", model_path, "TorchScript file")->required()->check(CLI::ExistingFile);
  app.add_option("--daemon", daemon, "ranncd address")->envname("RANNC_DAEMON");
  app.add_option("--input-shape", input_shape, "shape of the float32 input")->delimiter(',');
  app.add_option("--steps", steps, "SGD steps");
  app.add_option("--lr", lr, "learning rate");
  CLI11_PARSE(app, argc, argv);

  std::ifstream in(model_path, std::ios::binary);
  std::stringstream model;
  model << in.rdbuf();

  rannc::Client client(daemon);
  if (absl::Status s = client.WaitUntilReady(absl::Seconds(10)); !s.ok()) return Fail(s);

  // One fixed batch, like the first batch RaNNC partitions the model with.
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  int64_t numel = 1;
  for (int64_t d : input_shape) numel *= d;
  std::vector<float> x(static_cast<size_t>(numel));
  for (float& v : x) v = normal(rng);
  const rannc::HostTensor input = rannc::HostTensor::FromVector(x, input_shape);

  rannc::JobConfig config;
  config.name = "train_example";
  config.mode.set_training(true);
  config.optimizer.set_type(rannc::v1::SGD);  // no groups listed: one group of all parameters
  config.example_inputs = {input};
  absl::StatusOr<rannc::v1::CreateJobResponse> job = client.CreateJob(model.str(), config);
  if (!job.ok()) return Fail(job.status());
  std::cout << "job " << job->job_id() << " with " << job->params_size() << " parameters\n";

  rannc::v1::HyperParams sgd;
  sgd.set_lr(lr);
  absl::Status status;
  for (int step = 0; step < steps && status.ok(); ++step) {
    if (status = client.ZeroGrad(job->job_id()); !status.ok()) break;
    absl::StatusOr<rannc::ForwardResult> out = client.Forward(job->job_id(), {input});
    if (!out.ok()) {
      status = out.status();
      break;
    }
    const rannc::HostTensor& y = out->outputs.at(0);
    absl::StatusOr<std::vector<double>> values = y.ToDoubles();
    if (!values.ok()) {
      status = values.status();
      break;
    }
    const double n = static_cast<double>(values->size());
    double loss = 0;
    std::vector<double> grad;
    for (double v : *values) {
      loss += 0.5 * v * v / n;
      grad.push_back(v / n);
    }
    std::cout << "step " << step << " loss " << loss << "\n";
    absl::StatusOr<rannc::HostTensor> dy = rannc::HostTensor::FromDoubles(y.dtype, grad, y.shape);
    if (!dy.ok()) {
      status = dy.status();
      break;
    }
    if (status = client.Backward(job->job_id(), {{0, *dy}}); !status.ok()) break;
    status = client.Step(job->job_id(), {sgd});
  }
  absl::Status deleted = client.DeleteJob(job->job_id());
  if (!status.ok()) return Fail(status);
  if (!deleted.ok()) return Fail(deleted);
  return 0;
}
