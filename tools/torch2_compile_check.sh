#!/bin/bash
# Compiles (syntax and types only) every daemon source that includes LibTorch against the
# LibTorch of whatever `python3` has — used on the GPU machine (torch 2.x) to keep the code
# building on both 1.13 and 2.x until the CMake build exists. Needs Debian's gRPC/protobuf/absl/
# spdlog headers: unpacked from .gpu/debs (../shared/tools/gpu-debs.sh) into $SYS.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
SYS=${SYS:-/opt/sys}
if [ ! -x "$SYS/usr/bin/protoc" ]; then
  for f in "$root"/.gpu/debs/*.deb; do dpkg -x "$f" "$SYS"; done
fi
export LD_LIBRARY_PATH=$SYS/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
gen=$(mktemp -d)
"$SYS/usr/bin/protoc" -I"$root/proto" --cpp_out="$gen" --grpc_out="$gen" \
  --plugin=protoc-gen-grpc="$SYS/usr/bin/grpc_cpp_plugin" "$root"/proto/rannc/v1/*.proto
torch_dir=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')
abi=$(python3 -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
echo "torch $(python3 -c 'import torch; print(torch.__version__)') at $torch_dir"
flags=(-std=c++17 -fsyntax-only -D_GLIBCXX_USE_CXX11_ABI=$abi -DSPDLOG_COMPILED_LIB
       -DSPDLOG_FMT_EXTERNAL -I"$root" -I"$gen" -isystem "$SYS/usr/include"
       -isystem "$torch_dir/include" -isystem "$torch_dir/include/torch/csrc/api/include")
# (Debian's headers first: pip's torch ships google/protobuf headers of another version.)
srcs=$(grep -lE "include <(ATen|torch)/" $(find "$root/daemon" "$root/tests/fixtures" -name '*.cc'))
for src in $srcs; do
  ( if g++ "${flags[@]}" "$src" >"$gen/$(basename "$src").log" 2>&1; then echo 0; else echo 1; fi >"$gen/$(basename "$src").rc" ) &
done
wait
status=0
for src in $srcs; do
  log="$gen/$(basename "$src")"
  if [ "$(cat "$log.rc")" = 0 ]; then
    echo "ok   ${src#$root/}"
  else
    echo "FAIL ${src#$root/}"; grep -E "error" "$log.log" | head -8; status=1
  fi
done
exit $status
