#!/bin/bash
# Builds ranncd, the `rannc` CLI and the C++ SDK example with CMake on the GPU machine, where
# there is no Bazel (docs/building.md): LibTorch with CUDA from python3's PyTorch, NCCL from its
# nvidia-nccl package (the NCCL backend is built in), and gRPC, protobuf, abseil, spdlog, UCX,
# CLI11, toml++, Catch2 and prometheus-cpp from the Debian 12 .debs in .gpu/debs (../shared/tools/gpu-debs.sh)
# unpacked into $SYS, as tools/torch2_compile_check.sh does. Then runs the smoke check
# (tools/cmake_smoke.sh, CPU devices); with TESTS=1 it also builds the C++ tests and runs them,
# the NCCL backend's GPU test included, but not the client's integration tests
# (client_*integration_test, label integration), which trace their models with /usr/bin/python3.
#
# TARGETS="ranncd pipeline_engine_cuda_test" builds only those (with the tests configured when
# TESTS=1), and CTEST="-L gpu" picks the tests ctest runs (default: all but integration); a
# test whose target was not built fails there, so "-R pipeline_engine_cuda_test" for that one.
# The smoke check runs on DEVICES (default cuda when a GPU is present, else cpu:2) when
# ranncd, rannc and train_example are all built.
#
#   SYS=/tmp/sys tools/gpu_cmake_build.sh [BUILD_DIR]        (default BUILD_DIR: build/gpu)
#   SYS=/tmp/sys TESTS=1 TARGETS="ranncd rannc train_example pipeline_engine_cuda_test" \
#     CTEST="-L gpu" tools/gpu_cmake_build.sh                 (the GPU tests only)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
SYS=${SYS:-/opt/sys}
build=${1:-$root/build/gpu}
tests=${TESTS:-0}

if [ ! -x "$SYS/usr/bin/protoc" ]; then
  for f in "$root"/.gpu/debs/*.deb; do dpkg -x "$f" "$SYS"; done
fi
missing=()
for pair in grpcpp/grpcpp.h:libgrpc++-dev google/protobuf/message.h:libprotobuf-dev \
            absl/status/statusor.h:libabsl-dev spdlog/spdlog.h:libspdlog-dev \
            fmt/format.h:libfmt-dev ucp/api/ucp.h:libucx-dev CLI/CLI.hpp:libcli11-dev \
            toml++/toml.h:libtomlplusplus-dev catch2/catch.hpp:catch2 \
            prometheus/text_serializer.h:"prometheus-cpp-dev libprometheus-cpp-core1.0"; do
  [ -e "$SYS/usr/include/${pair%%:*}" ] || missing+=("${pair#*:}")
done
# etcd's .proto files (third_party/etcd/gen.sh) and the annotations they import.
for pair in go.etcd.io/etcd/etcdserver/etcdserverpb/rpc.proto:golang-etcd-server-dev \
            github.com/gogo/protobuf/gogoproto/gogo.proto:golang-github-gogo-protobuf-dev \
            github.com/grpc-ecosystem/grpc-gateway/third_party/googleapis/google/api/annotations.proto:golang-github-grpc-ecosystem-grpc-gateway-dev; do
  [ -e "$SYS/usr/share/gocode/src/${pair%%:*}" ] || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu_cmake_build: $SYS lacks ${missing[*]}; where a registry is reachable:"
  echo "  ../shared/tools/gpu-debs.sh .gpu/debs ${missing[*]}"
  echo "then bring .gpu/debs here and run again with SYS=$SYS (or unpack them into it)"
  exit 1
fi
export LD_LIBRARY_PATH=$SYS/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}

python=$(command -v python3)
torch_prefix=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
echo "torch $("$python" -c 'import torch; print(torch.__version__)') ($torch_prefix)"
cuda=${CUDA_HOME:-/usr/local/cuda}
cuda_args=()
if [ -x "$cuda/bin/nvcc" ]; then
  cuda_args=(-DCUDAToolkit_ROOT="$cuda" -DCMAKE_CUDA_COMPILER="$cuda/bin/nvcc")
fi
build_tests=OFF
[ "$tests" = 1 ] && build_tests=ON

# CMAKE_POLICY_VERSION_MINIMUM: CMake 4 refuses package files that ask for CMake < 3.5.
cmake -S "$root" -B "$build" -DCMAKE_PREFIX_PATH="$torch_prefix" -DRANNC_SYS_PREFIX="$SYS" \
  -DRANNC_WITH_NCCL=ON -DRANNC_PYTHON="$python" -DRANNC_BUILD_TESTS=$build_tests \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_POLICY_VERSION_MINIMUM=3.5 "${cuda_args[@]}"
start=$(date +%s)
targets=()
for t in ${TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" -j"$(nproc)" "${targets[@]}"
echo "gpu_cmake_build: built in $(( $(date +%s) - start )) s"

devices=${DEVICES:-cpu:2}
if [ -z "${DEVICES:-}" ] && nvidia-smi -L >/dev/null 2>&1; then devices=cuda; fi
# The smoke check needs ranncd, rannc and train_example; a TARGETS without them skips it.
lacking=()
if [ -n "${TARGETS:-}" ]; then
  for t in ranncd rannc train_example; do
    [[ " $TARGETS " == *" $t "* ]] || lacking+=("$t")
  done
fi
if [ ${#lacking[@]} -eq 0 ]; then
  DEVICES=$devices PYTHON=$python "$root/tools/cmake_smoke.sh" "$build"
else
  echo "gpu_cmake_build: smoke check skipped (TARGETS lacks ${lacking[*]})"
fi
if [ "$tests" = 1 ]; then
  # shellcheck disable=SC2086
  (cd "$build" && ctest ${CTEST:--LE integration} --output-on-failure)
fi
