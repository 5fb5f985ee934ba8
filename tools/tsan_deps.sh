#!/bin/bash
# Builds ThreadSanitizer-instrumented copies of the libraries that hand memory between rannc's
# threads: abseil (absl::Mutex, under gRPC's gpr_mu), gRPC core and C++ (completion queues,
# their atomics) and protobuf, from Debian 12's own source packages (the same versions and
# patches as the installed libraries, so the same ABI), into
#
#   ~/.cache/rannc-tsan-deps/<key>/lib      (RANNC_TSAN_DEPS overrides the root)
#
# under the installed libraries' file names (libgrpc.so.29, libabsl_synchronization.so.20220623,
# ...). tools/sanitize.sh tsan then links the TSan binaries with an rpath to that directory, so
# that they load these instead of the installed libraries they were linked against, and TSan
# sees the synchronization inside them (docs/hardening.md, "TSan and gRPC").
#
#   tools/tsan_deps.sh            builds what is missing (~17 min on 2 cores: abseil and
#                                 protobuf ~1.5 each, gRPC ~13; nothing when built), prints the
#                                 lib directory on its last line
#   tools/tsan_deps.sh --check    prints the lib directory if it is complete, else exits 1
#
# Needs: dpkg-source, cmake, ninja, curl, and the -dev packages gRPC builds against (installed
# with libgrpc++-dev: c-ares, re2, OpenSSL, zlib). The sources come from deb.debian.org's pool.
set -euo pipefail
root=${RANNC_TSAN_DEPS:-$HOME/.cache/rannc-tsan-deps}
absl_v=20220623.1 absl_deb=20220623.1-1+deb12u2
grpc_v=1.51.1 grpc_deb=1.51.1-3
pb_v=3.21.12 pb_deb=3.21.12-3+deb12u1
key=absl-$absl_deb.grpc-$grpc_deb.protobuf-$pb_deb
prefix=$root/$key
lib=$prefix/lib
# What the tests load: each of these must exist in $lib for the build to count as complete.
want=(libabsl_synchronization.so.20220623 libabsl_base.so.20220623 libgpr.so.29 libgrpc.so.29
      libgrpc++.so.1.51 libupb.so.29 libaddress_sorting.so.29 libprotobuf.so.32)

complete() {
  for f in "${want[@]}"; do [ -e "$lib/$f" ] || return 1; done
}
if [ "${1:-}" = --check ]; then
  complete && { echo "$lib"; exit 0; }
  exit 1
fi
if complete; then
  echo "$lib"
  exit 0
fi

flags="-fsanitize=thread -O1 -g1 -fPIC"
jobs=${JOBS:-$(nproc)}
src=$root/src
mkdir -p "$src" "$prefix"
cd "$src"

# fetch PKG DEBVERSION: the .dsc and its files from Debian's pool, unpacked with the Debian
# patches applied (dpkg-source -x) into $src/PKG-UPSTREAMVERSION.
fetch() {
  local pkg=$1 deb=$2 dsc=${1}_${2}.dsc
  local pool=http://deb.debian.org/debian/pool/main/${pkg:0:1}/$pkg
  local dir=$pkg-${deb%-*}
  [ -d "$dir" ] && return 0
  [ -f "$dsc" ] || curl -sfO "$pool/$dsc"
  local f
  # The Files section's lines (" md5 size name"), up to the next field or the signature.
  for f in $(awk '/^Files:/ {on = 1; next} on && /^ / {print $3; next} {on = 0}' "$dsc"); do
    [ -f "$f" ] || curl -sfO "$pool/$f"
  done
  dpkg-source -x "$dsc" >/dev/null
}

fetch abseil "$absl_deb"
fetch grpc "$grpc_deb"
fetch protobuf "$pb_deb"

say() { echo "[tsan_deps +$SECONDS s] $*"; }

# abseil: as debian/rules' shared build (C++17, shared libraries), instrumented.
if [ ! -e "$lib/libabsl_synchronization.so.20220623" ]; then
  say "abseil $absl_deb"
  cmake -S "abseil-$absl_v" -B build-absl -G Ninja -DCMAKE_BUILD_TYPE=None \
    -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON -DBUILD_TESTING=OFF \
    -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" \
    -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread \
    -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_INSTALL_LIBDIR=lib >/dev/null
  ninja -C build-absl -j "$jobs" install >/dev/null
fi

# protobuf: the runtime library only (Debian builds it with autotools as libprotobuf.so.32;
# CMake names the same code libprotobuf.so.3.21.12.0, so the Debian name is a link to it).
if [ ! -e "$lib/libprotobuf.so.32" ]; then
  say "protobuf $pb_deb"
  cmake -S "protobuf-$pb_v" -B build-protobuf -G Ninja -DCMAKE_BUILD_TYPE=None \
    -DCMAKE_CXX_STANDARD=17 -Dprotobuf_BUILD_SHARED_LIBS=ON -Dprotobuf_BUILD_TESTS=OFF \
    -Dprotobuf_BUILD_PROTOC_BINARIES=OFF -Dprotobuf_WITH_ZLIB=ON \
    -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" \
    -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread \
    -DCMAKE_INSTALL_PREFIX="$prefix/protobuf" -DCMAKE_INSTALL_LIBDIR=lib >/dev/null
  ninja -C build-protobuf -j "$jobs" libprotobuf >/dev/null
  so=$(cd build-protobuf && ls libprotobuf.so.3.21.* | head -1)
  cp -a "build-protobuf/$so" "$lib/"
  ln -sf "$so" "$lib/libprotobuf.so.32"
fi

# gRPC: as debian/rules (abseil, c-ares, protobuf, re2, OpenSSL and zlib from the system), the
# libraries rannc links only, against the abseil built above. (The protoc plugins are not built,
# but their target names libprotoc, whose -dev link Debian's libprotoc32 alone lacks.)
if [ ! -e "$lib/libgrpc++.so.1.51" ]; then
  say "grpc $grpc_deb"
  cmake -S "grpc-$grpc_v" -B build-grpc -G Ninja -DCMAKE_BUILD_TYPE=None \
    -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON -DgRPC_BUILD_TESTS=OFF \
    -DgRPC_ABSL_PROVIDER=package -DgRPC_CARES_PROVIDER=package \
    -DgRPC_PROTOBUF_PROVIDER=package -DgRPC_RE2_PROVIDER=package \
    -DgRPC_SSL_PROVIDER=package -DgRPC_ZLIB_PROVIDER=package \
    -DgRPC_BACKWARDS_COMPATIBILITY_MODE=OFF -DgRPC_BUILD_CODEGEN=OFF \
    -DProtobuf_PROTOC_LIBRARY=/usr/lib/x86_64-linux-gnu/libprotoc.so.32 \
    -DCMAKE_PREFIX_PATH="$prefix" \
    -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" \
    -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread >/dev/null
  ninja -C build-grpc -j "$jobs" grpc++ grpc gpr upb address_sorting >/dev/null
  for name in libgrpc++.so.1.51 libgrpc.so.29 libgpr.so.29 libupb.so.29 \
              libaddress_sorting.so.29; do
    real=$(readlink -f "build-grpc/$name")
    cp "$real" "$lib/"
    ln -sf "$(basename "$real")" "$lib/$name"
  done
fi
complete
say "done"
echo "$lib"
