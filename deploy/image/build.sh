#!/bin/bash
# Builds rannc's CPU container image from Debian 12 packages only (deploy/image/README.md): a
# root filesystem made by mmdebstrap (bookworm, minbase) holding ranncd, the `rannc` CLI,
# pyrannc and the runtime libraries they need, then an OCI image made from it by umoci. No
# compilers, no Bazel, no -dev packages, nothing from PyPI or Docker Hub.
#
# The packages are not a hand-kept list: they are the Debian packages that own the shared
# libraries the two binaries name (readelf's NEEDED, resolved by ldd, owner by dpkg -S), plus
# the Python packages pyrannc imports. A binary linked against something no package owns (a
# CMake build against an unpacked prefix, a pip LibTorch) stops the build, naming the library.
#
#   deploy/image/build.sh            build, check inside the root filesystem, print the sizes
#   deploy/image/build.sh --render   resolve and print packages, commands and files; no download
#   deploy/image/build.sh --ci       --render; then the full build only when RANNC_IMAGE_BUILD=1
#
# Environment (defaults in brackets):
#   BIN_DIR [REPO/bazel-bin]   the build whose daemon/ranncd and client/rannc go in (a CMake
#                              build directory works too)
#   OUT [/tmp/rannc-image]     output: oci/ (OCI layout), rannc-cpu.tar (oci-archive),
#                              check.log; rootfs.tar (the layer) only with KEEP_ROOTFS=1
#   TAG [cpu]                  the image's tag in the layout and the archive
#   MIRROR [http://deb.debian.org/debian], SECURITY_MIRROR [http://deb.debian.org/debian-security]
#   DRY_RUN=1                  same as --render
#   CHECK=0                    skip the check inside the root filesystem (it needs root, or
#                              unprivileged user namespaces, to chroot; it is skipped, loudly,
#                              where neither is allowed)
#   SOURCE_DATE_EPOCH [HEAD's commit time]  timestamps of files, layer and image config
#
# The check runs, as the image's user and with the image's environment, `ranncd --help`,
# `rannc --help` and `python3 -c "import pyrannc"`, then starts ranncd on loopback, asks it for
# its info with `rannc info`, trains a small model through pyrannc against it for 5 steps and
# stops it with SIGTERM. Needs mmdebstrap and umoci (deploy/setup.sh installs them); root, or
# unprivileged user namespaces with newuidmap (package uidmap) for mmdebstrap's unshare mode.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

mode=build
case "${1:-}" in
  --render) mode=render ;;
  --ci) mode=ci ;;
  "") ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) echo "usage: $0 [--render|--ci]" >&2; exit 2 ;;
esac
[ "${DRY_RUN:-0}" = 1 ] && mode=render

BIN_DIR=${BIN_DIR:-$root/bazel-bin}
OUT=${OUT:-/tmp/rannc-image}
TAG=${TAG:-cpu}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${SECURITY_MIRROR:-http://deb.debian.org/debian-security}
CHECK=${CHECK:-1}
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git -C "$root" log -1 --format=%ct 2>/dev/null || date +%s)}
export SOURCE_DATE_EPOCH

suite=bookworm
uid=10001  # also the GID; the Kubernetes manifests' runAsUser/fsGroup
user=rannc
home=/var/lib/rannc
conf_dir=/etc/rannc
py_dir=/usr/local/lib/rannc/python
ports=(7411/tcp 7412/tcp 9400/tcp)  # gRPC, plaintext health (--health-listen), metrics
image_env=(
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  "HOME=$home"
  LANG=C.UTF-8
  "PYTHONPATH=$py_dir"
  "RANNC_CONF_DIR=$conf_dir"
)
# pyrannc's imports beyond the standard library (torch, grpc, google.protobuf, numpy).
# python3-tqdm: examples/train_gpt.py's progress bar (the example Job's init container).
python_packages=(python3 python3-torch python3-grpcio python3-protobuf python3-numpy python3-tqdm)
# Files of those packages' dependencies that no process of the image loads, left out by dpkg.
# Debian's LibTorch links OpenCV, whose GUI part brings Qt and Mesa: Mesa's GL drivers are opened
# only when a GL context is made, and LLVM and Z3 are theirs alone. PyTorch's C++ test programs
# are never run. (The Python packages' test suites go too, but after installation: their
# packages byte-compile them when configured; rootfs-hook.sh removes them.) The check (smoke.sh)
# runs the daemon, the CLI and pyrannc's training against what is left.
prune=(
  '/usr/lib/x86_64-linux-gnu/dri/*'
  '/usr/lib/x86_64-linux-gnu/libLLVM-15.so*'
  '/usr/lib/x86_64-linux-gnu/libz3.so*'
  '/usr/lib/libtorch-test/*'
  '/usr/lib/python3/dist-packages/torch/bin/test_*'
  '/usr/lib/python3/dist-packages/torch/bin/*Test'
)

ranncd=$BIN_DIR/daemon/ranncd
cli=$BIN_DIR/client/rannc
for b in "$ranncd" "$cli"; do
  if [ ! -x "$b" ]; then
    echo "image: no $b; build it first (bazel build //daemon:ranncd //client:rannc, or" \
      "docs/building.md's CMake build with BIN_DIR=build)" >&2
    exit 1
  fi
done

# --- Packages: the owners of the libraries the binaries name, and pyrannc's Python side.
declare -A lib_owner=()
resolve_library_packages() {
  local needed ldd_map lib path real patterns=() line pkgs file
  needed=$(readelf -d "$ranncd" "$cli" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort -u)
  ldd_map=$(ldd "$ranncd" "$cli" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u)
  declare -A real_of=()
  for lib in $needed; do
    [[ $lib == ld-linux* ]] && continue  # the loader: libc6, which libc.so.6 names already
    path=$(awk -v n="$lib" '$1 == n {print $2; exit}' <<<"$ldd_map")
    if [ -z "$path" ]; then
      echo "image: ldd finds no $lib for the binaries in $BIN_DIR" >&2
      exit 1
    fi
    real=$(readlink -f "$path")
    real_of[$lib]=$real
    # Merged /usr: dpkg knows a file by the path its package ships, /lib/... or /usr/lib/....
    patterns+=("$real" "${real#/usr}")
    [[ $real == /usr/* ]] || patterns+=("/usr$real")
  done
  declare -A owner_of_file=()
  while IFS= read -r line; do
    pkgs=${line%%: /*}
    file=/${line#*: /}
    owner_of_file[$file]=$(sed 's/:[a-z0-9]*//g; s/, /,/g' <<<"$pkgs")
  done < <(dpkg -S "${patterns[@]}" 2>/dev/null || true)
  local missing=()
  for lib in "${!real_of[@]}"; do
    real=${real_of[$lib]}
    for file in "$real" "${real#/usr}" "/usr$real"; do
      if [ -n "${owner_of_file[$file]:-}" ]; then
        lib_owner[$lib]=${owner_of_file[$file]}
        break
      fi
    done
    [ -n "${lib_owner[$lib]:-}" ] || missing+=("$lib ($real)")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    printf 'image: no Debian package owns %s\n' "${missing[@]}" >&2
    echo "image: the CPU image takes its libraries from Debian's packages only; build the" \
      "binaries against them (deploy/setup.sh); other builds go in the GPU image (Containerfile.gpu)" >&2
    exit 1
  fi
}
resolve_library_packages
mapfile -t library_packages < <(tr ',' '\n' <<<"$(IFS=,; echo "${lib_owner[*]}")" | sort -u)
packages=("${library_packages[@]}" "${python_packages[@]}")

# --- The files that go in: SRC<TAB>DEST<TAB>MODE, read by rootfs-hook.sh's install step.
files=()
files+=("$ranncd"$'\t'/usr/local/bin/ranncd$'\t'0755)
files+=("$cli"$'\t'/usr/local/bin/rannc$'\t'0755)
while IFS= read -r f; do
  files+=("$f"$'\t'"$py_dir/${f#"$root/python_client/"}"$'\t'0644)
done < <(find "$root/python_client/pyrannc" -name __pycache__ -prune -o -type f ! -name '*.pyc' \
  -print | LC_ALL=C sort)
# The examples, where deploy/k8s/jobs/submit-example runs them from.
for f in detached_gpt.py train_gpt.py; do
  files+=("$root/examples/$f"$'\t'/usr/local/share/rannc/examples/$f$'\t'0644)
done

# --- The commands.
quoted() { printf '%q ' "$@" | sed 's/ $//'; }
# root, or unprivileged user namespaces (the build checks that they work).
mm_mode=root
[ "$(id -u)" -eq 0 ] || mm_mode=unshare
created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
version=$("$ranncd" --version 2>/dev/null | awk '{print $NF; exit}')
revision=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
# shellcheck disable=SC2016 # the hooks' variables are expanded by mmdebstrap's sh ($1: the root).
mmdebstrap_cmd=(
  mmdebstrap --variant=minbase --mode="$mm_mode"
  --include="$(IFS=,; echo "${packages[*]}")"
  --dpkgopt='path-exclude=/usr/share/man/*'
  --dpkgopt='path-exclude=/usr/share/locale/*'
  --dpkgopt='path-include=/usr/share/locale/locale.alias'
  --dpkgopt='path-exclude=/usr/share/doc/*'
  --dpkgopt='path-include=/usr/share/doc/*/copyright'
  --dpkgopt='path-exclude=/usr/share/info/*'
  "${prune[@]/#/--dpkgopt=path-exclude=}"
  --customize-hook='"$RANNC_IMAGE_HOOK" install "$1"'
)
# shellcheck disable=SC2016
[ "$CHECK" = 1 ] && mmdebstrap_cmd+=(--customize-hook='"$RANNC_IMAGE_HOOK" check "$1"')
mmdebstrap_cmd+=(
  "$suite" -
  "deb $MIRROR $suite main"
  "deb $MIRROR $suite-updates main"
  "deb $SECURITY_MIRROR $suite-security main"
)
layout=$OUT/oci
image="$layout:$TAG"
config_args=(
  --created "$created" --history.created "$created" --history.created_by "deploy/image/build.sh"
  --config.user "$uid:$uid" --config.workingdir "$home"
  --config.entrypoint /usr/local/bin/ranncd
)
for p in "${ports[@]}"; do config_args+=(--config.exposedports "$p"); done
for e in "${image_env[@]}"; do config_args+=(--config.env "$e"); done
for l in "title=rannc" \
    "description=ranncd (the rannc training daemon), the rannc CLI and pyrannc; CPU; Debian $suite packages (mmdebstrap minbase)" \
    "version=$version" "revision=$revision" "created=$created"; do
  config_args+=(--config.label "org.opencontainers.image.$l")
done
umoci_cmds=(
  "$(quoted umoci init --layout "$layout")"
  "$(quoted umoci new --image "$image")"
  "$(quoted umoci raw add-layer --image "$image" --history.created "$created" \
    --history.created_by "mmdebstrap $suite minbase + rannc" "$OUT/rootfs.tar")"
  "$(quoted umoci config --image "$image" "${config_args[@]}")"
  "$(quoted umoci gc --layout "$layout")"
  "$(quoted tar -C "$layout" -cf "$OUT/rannc-$TAG.tar" oci-layout index.json blobs)"
)

render() {
  echo "== binaries: $BIN_DIR (ranncd $version)"
  echo "== packages (${#packages[@]}), with what they are for:"
  local pkg libs
  for pkg in "${library_packages[@]}"; do
    libs=$(for l in "${!lib_owner[@]}"; do
      if [[ ,${lib_owner[$l]}, == *,$pkg,* ]]; then echo "$l"; fi
    done | sort | awk '{n++} n <= 4 {printf "%s ", $0} END {if (n > 4) printf "and %d more", n - 4}')
    printf '  %-28s %s\n' "$pkg" "$libs"
  done
  for pkg in "${python_packages[@]}"; do printf '  %-28s %s\n' "$pkg" "pyrannc"; done
  echo "== root filesystem:"
  local arg
  printf '  mmdebstrap'
  for arg in "${mmdebstrap_cmd[@]:1}"; do printf ' \\\n    %s' "$(quoted "$arg")"; done
  echo " | mmtarfilter --path-exclude='/dev/*' > $(quoted "$OUT/rootfs.tar")"
  echo "== files copied in (then: user $user $uid:$uid, home $home, $conf_dir, pyrannc compiled," \
    "/usr/lib/python3/dist-packages/*/**/tests removed):"
  local entry
  for entry in "${files[@]}"; do
    IFS=$'\t' read -r src dest m <<<"$entry"
    printf '  %s %s -> %s\n' "$m" "${src#"$root/"}" "$dest"
  done
  echo "== image:"
  printf '  %s\n' "${umoci_cmds[@]}"
}

if [ "$mode" != build ]; then
  render
  if [ "$mode" = render ] || [ "${RANNC_IMAGE_BUILD:-0}" != 1 ]; then
    echo "image: rendered only; no build (set RANNC_IMAGE_BUILD=1 with --ci, or run without --render)"
    exit 0
  fi
fi

# --- The build.
skip_or_fail() {
  if [ "$mode" = ci ]; then
    echo "WARNING: image: full build SKIPPED: $*"
    exit 0
  fi
  echo "image: $*" >&2
  exit 1
}
for tool in mmdebstrap mmtarfilter umoci; do
  command -v "$tool" >/dev/null || skip_or_fail "no $tool here; deploy/setup.sh installs it"
done
if [ "$mm_mode" = unshare ]; then
  if ! command -v newuidmap >/dev/null || ! unshare --user --map-root-user true 2>/dev/null; then
    skip_or_fail "needs root, or unprivileged user namespaces with newuidmap (package uidmap)"
  fi
fi
mkdir -p "$OUT"
rm -rf "$layout" "$OUT/rootfs.tar" "$OUT/rannc-$TAG.tar" "$OUT/check.log"
files_list=$(mktemp)
trap 'rm -f "$files_list"' EXIT
printf '%s\n' "${files[@]}" >"$files_list"
export RANNC_IMAGE_HOOK=$here/rootfs-hook.sh RANNC_IMAGE_FILES=$files_list
export RANNC_IMAGE_UID=$uid RANNC_IMAGE_USER=$user RANNC_IMAGE_HOME=$home
export RANNC_IMAGE_CONF_DIR=$conf_dir RANNC_IMAGE_PY_DIR=$py_dir RANNC_IMAGE_OUT=$OUT
RANNC_IMAGE_ENV=$(printf '%s\n' "${image_env[@]}")
export RANNC_IMAGE_ENV

start=$(date +%s)
render
echo "== building (mmdebstrap downloads from $MIRROR; minutes)"
# mmtarfilter is a Python script; the system's Python runs it, whatever python3 is first on PATH.
"${mmdebstrap_cmd[@]}" | /usr/bin/python3 "$(command -v mmtarfilter)" --path-exclude='/dev/*' \
  >"$OUT/rootfs.tar"
rootfs_done=$(date +%s)
for c in "${umoci_cmds[@]}"; do
  echo "+ ${c:0:160}$([ ${#c} -gt 160 ] && echo ...)"
  eval "$c"
done
unpacked=$(tar -tvf "$OUT/rootfs.tar" | awk '{s += $3} END {print s}')
files_in=$(tar -tf "$OUT/rootfs.tar" | wc -l)
[ "${KEEP_ROOTFS:-0}" = 1 ] || rm -f "$OUT/rootfs.tar"
compressed=$(/usr/bin/python3 - "$layout" "$TAG" <<'EOF'
import json, os, sys
layout, tag = sys.argv[1:]
def blob(digest):
    return os.path.join(layout, "blobs", *digest.split(":"))
index = json.load(open(os.path.join(layout, "index.json")))
desc = next(m for m in index["manifests"]
            if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag)
manifest = json.load(open(blob(desc["digest"])))
print(sum(layer["size"] for layer in manifest["layers"]))
EOF
)
end=$(date +%s)
mib() { awk -v b="$1" 'BEGIN {printf "%.0f MiB", b / 1048576}'; }
echo "== image rannc:$TAG (${#packages[@]} packages asked for, $files_in paths in the root filesystem)"
echo "  compressed layer (gzip): $compressed bytes ($(mib "$compressed"))"
echo "  unpacked root filesystem: $unpacked bytes ($(mib "$unpacked"))"
echo "  oci-archive $OUT/rannc-$TAG.tar: $(stat -c %s "$OUT/rannc-$TAG.tar") bytes;" \
  "OCI layout $layout (tag $TAG)"
[ -f "$OUT/check.log" ] && echo "  check: $OUT/check.log"
echo "  built in $((end - start)) s (root filesystem $((rootfs_done - start)) s," \
  "image $((end - rootfs_done)) s)"
