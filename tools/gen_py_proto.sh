#!/bin/bash
# Regenerates pyrannc's committed Python stubs from proto/. Run after editing a .proto file.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/python_client/pyrannc/proto}
mkdir -p "$out/rannc/v1"
protoc -I"$root/proto" --python_out="$out" --grpc_out="$out" \
  --plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin "$root/proto/rannc/v1/training.proto" \
  "$root/proto/rannc/v1/deployment.proto" "$root/proto/rannc/v1/cluster.proto"
# Generated code imports "rannc.v1.training_pb2"; make that resolve inside our package.
sed -i 's/^from rannc\.v1 import \(training_pb2\|deployment_pb2\|cluster_pb2\)/from pyrannc.proto.rannc.v1 import \1/' \
  "$out/rannc/v1/training_pb2_grpc.py" "$out/rannc/v1/training_pb2.py" \
  "$out/rannc/v1/cluster_pb2_grpc.py"
for d in "$out" "$out/rannc" "$out/rannc/v1"; do touch "$d/__init__.py"; done
