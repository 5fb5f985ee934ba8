#!/bin/bash
# Generates the C++ messages and gRPC stubs of etcd's v3 API (KV, Lease, Watch, Cluster,
# Maintenance, Auth, and Election) from the .proto files Debian ships, with the gogoproto and
# google.api annotations they import:
#   golang-etcd-server-dev                         go.etcd.io/etcd/...
#   golang-github-gogo-protobuf-dev                github.com/gogo/protobuf/gogoproto/gogo.proto
#   golang-github-grpc-ecosystem-grpc-gateway-dev  .../third_party/googleapis/google/api/*.proto
# etcd's files import each other as "etcd/..." (their Go module path's last element): the proto
# path maps that prefix onto go.etcd.io/etcd.
#
#   third_party/etcd/gen.sh OUT_DIR GOCODE_SRC PROTOC GRPC_CPP_PLUGIN [PROTOBUF_INCLUDE]
# (GOCODE_SRC: /usr/share/gocode/src, or the same under a prefix where the .debs are unpacked.)
set -euo pipefail
out=$1 src=$2 protoc=$3 plugin=$4 include=${5:-/usr/include}
for need in "$src/go.etcd.io/etcd/etcdserver/etcdserverpb/rpc.proto:golang-etcd-server-dev" \
            "$src/github.com/gogo/protobuf/gogoproto/gogo.proto:golang-github-gogo-protobuf-dev" \
            "$src/github.com/grpc-ecosystem/grpc-gateway/third_party/googleapis/google/api/annotations.proto:golang-github-grpc-ecosystem-grpc-gateway-dev"; do
  if [ ! -f "${need%%:*}" ]; then
    echo "etcd/gen.sh: ${need%%:*} is missing: install Debian's ${need#*:}" >&2
    exit 1
  fi
done
mkdir -p "$out"
"$protoc" -I"$src/github.com/gogo/protobuf" \
  -I"$src/github.com/grpc-ecosystem/grpc-gateway/third_party/googleapis" \
  -Ietcd="$src/go.etcd.io/etcd" -I"$include" \
  --cpp_out="$out" --grpc_out="$out" --plugin=protoc-gen-grpc="$plugin" \
  gogoproto/gogo.proto google/api/http.proto google/api/annotations.proto \
  etcd/mvcc/mvccpb/kv.proto etcd/auth/authpb/auth.proto \
  etcd/etcdserver/etcdserverpb/rpc.proto \
  etcd/etcdserver/api/v3election/v3electionpb/v3election.proto
