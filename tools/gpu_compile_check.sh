#!/bin/bash
# Compiles (syntax and types only) the CUDA code paths that CPU CI never builds: the NCCL
# backend (daemon/comm/nccl/*.cc, its test included) and the communicator factory with
# RANNC_WITH_NCCL, against the CUDA headers of /usr/local/cuda and the NCCL headers of python3's
# nvidia-nccl package (falling back to NCCL in /usr/local/cuda). For the GPU machine, where
# Bazel is absent; Debian's abseil and Catch2 headers come from .gpu/debs
# (../shared/tools/gpu-debs.sh) unpacked into $SYS, as tools/torch2_compile_check.sh does.
# On a machine with those headers under /usr/include already: SYS=/ tools/gpu_compile_check.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
SYS=${SYS:-/opt/sys}
if [ ! -d "$SYS/usr/include/absl" ]; then
  for f in "$root"/.gpu/debs/*.deb; do dpkg -x "$f" "$SYS"; done
fi
cuda_inc=${CUDA_INCLUDE:-/usr/local/cuda/include}
nccl_inc=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null || true)
if [ -z "$nccl_inc" ] || [ ! -f "$nccl_inc/nccl.h" ]; then nccl_inc=$cuda_inc; fi
echo "CUDA headers: $cuda_inc; NCCL headers: $nccl_inc ($(grep -hE '^#define NCCL_(MAJOR|MINOR|PATCH)' "$nccl_inc/nccl.h" | awk '{printf "%s ", $3}'))"
# NCCL's directory first: the toolkit's own nccl.h (if any) may be another version.
flags=(-std=c++17 -fsyntax-only -Wall -DRANNC_WITH_NCCL -I"$root" -isystem "$nccl_inc"
       -isystem "$cuda_inc")
# (-isystem /usr/include would break libstdc++'s #include_next <stdlib.h>.)
if [ "$SYS" != / ]; then flags+=(-isystem "$SYS/usr/include"); fi
status=0
for src in "$root"/daemon/comm/nccl/*.cc "$root/daemon/comm/factory.cc"; do
  if g++ "${flags[@]}" "$src" 2>"/tmp/gpu_compile_check.$$.log"; then
    echo "ok   ${src#$root/}"
  else
    echo "FAIL ${src#$root/}"; grep -E "error" "/tmp/gpu_compile_check.$$.log" | head -8; status=1
  fi
done
rm -f "/tmp/gpu_compile_check.$$.log"
exit $status
