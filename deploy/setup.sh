#!/bin/bash
# Installs everything rannc needs on Debian 12 (bookworm) from Debian's own packages: LibTorch
# and PyTorch 1.13 (CPU), gRPC 1.51, protobuf 3.21, spdlog, Catch2, UCX, Bazel 4.2.3, CMake and
# ccache (the build without Bazel, docs/building.md), the Python test tools (torchvision: the
# real models of the tests), prometheus-cpp (the metrics endpoint) and the Prometheus server (its
# test scrapes ranncd), and etcd and etcdctl (its .proto files make the cluster store's client,
# third_party/etcd; its tests run real etcd), and what tools/check_k8s.py validates the
# Kubernetes manifests with (python3-jsonschema, python3-yaml; kubectl renders them), and what
# deploy/image/build.sh makes the CPU container image with (mmdebstrap, umoci; 7 MB). Idempotent:
# installs only what is missing. Needs root (uses sudo if not).
set -euo pipefail

packages=(
  build-essential
  libtorch-dev python3-torch
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev catch2 libucx-dev ucx-utils
  libcli11-dev libtomlplusplus-dev nlohmann-json3-dev prometheus-cpp-dev
  bazel-bootstrap bazel-platforms bazel-rules-java
  cmake ccache
  python3-grpcio python3-protobuf python3-pytest python3-numpy python3-tqdm python3-torchvision
  etcd-server etcd-client golang-etcd-server-dev golang-github-gogo-protobuf-dev
  golang-github-grpc-ecosystem-grpc-gateway-dev
  openssl prometheus
  python3-jsonschema python3-yaml
  mmdebstrap umoci
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo
echo "setup: installing ${missing[*]}"
$sudo apt-get update -q
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
