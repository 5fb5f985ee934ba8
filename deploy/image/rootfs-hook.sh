#!/bin/bash
# mmdebstrap's customize hook for deploy/image/build.sh; runs outside the root filesystem ROOTFS
# (as root, or as the namespace's root in unshare mode), after its packages are installed and
# with /proc, /sys and /dev mounted in it. Not meant to be run by hand: build.sh exports what it
# reads (RANNC_IMAGE_*), so that the user, paths and environment have one definition, there.
#
#   rootfs-hook.sh install ROOTFS   the files of $RANNC_IMAGE_FILES (SRC<TAB>DEST<TAB>MODE), the
#                                   user, its home, the config directory; pyrannc byte-compiled;
#                                   the Python packages' test suites removed
#   rootfs-hook.sh check ROOTFS     smoke.sh, inside ROOTFS as the image's user with the image's
#                                   environment; its output also goes to $RANNC_IMAGE_OUT/check.log
#
# mmdebstrap may be writing the tarball to standard output: everything here goes to stderr.
set -euo pipefail
exec >&2
action=${1:?usage: rootfs-hook.sh install|check ROOTFS}
rootfs=${2:?usage: rootfs-hook.sh install|check ROOTFS}
uid=$RANNC_IMAGE_UID

install_files() {
  local src dest mode
  while IFS=$'\t' read -r src dest mode; do
    install -D -o 0 -g 0 -m "$mode" "$src" "$rootfs$dest"
  done <"$RANNC_IMAGE_FILES"
  chroot "$rootfs" groupadd --gid "$uid" "$RANNC_IMAGE_USER"
  chroot "$rootfs" useradd --uid "$uid" --gid "$uid" --home-dir "$RANNC_IMAGE_HOME" \
    --no-create-home --shell /usr/sbin/nologin --comment "rannc daemon" "$RANNC_IMAGE_USER"
  install -d -o "$uid" -g "$uid" -m 0750 "$rootfs$RANNC_IMAGE_HOME"
  install -d -o 0 -g 0 -m 0755 "$rootfs$RANNC_IMAGE_CONF_DIR"
  # The Python packages' test suites: never imported, 77 MB (sympy's alone 59 MB). Removed only
  # now, as their packages byte-compile them when configured.
  find "$rootfs/usr/lib/python3/dist-packages" -mindepth 2 -type d -name tests -prune \
    -exec rm -rf {} +
  # The user cannot write next to the package at run time, so compile it now.
  chroot "$rootfs" python3 -m compileall -q "$RANNC_IMAGE_PY_DIR"
  # The runtime provides these; the host's would make the image differ between build machines.
  rm -f "$rootfs/etc/resolv.conf" "$rootfs/etc/hostname"
}

check() {
  if ! chroot "$rootfs" /bin/true 2>/dev/null; then
    echo "WARNING: image check SKIPPED: cannot chroot into the root filesystem here"
    return 0
  fi
  local env_args=()
  mapfile -t env_args <<<"$RANNC_IMAGE_ENV"
  # /tmp is emptied by mmdebstrap's cleanup after this hook: the script does not stay.
  install -m 0755 "$(dirname "$0")/smoke.sh" "$rootfs/tmp/rannc-smoke.sh"
  # shellcheck disable=SC2016 # $HOME is the image's, expanded inside.
  chroot --userspec="$uid:$uid" "$rootfs" /usr/bin/env -i "${env_args[@]}" \
    /bin/bash -c 'cd "$HOME" && /tmp/rannc-smoke.sh'
}

case "$action" in
  install) install_files ;;
  check) check 2>&1 | tee "$RANNC_IMAGE_OUT/check.log"; exit "${PIPESTATUS[0]}" ;;
  *) echo "rootfs-hook.sh: unknown action $action" >&2; exit 2 ;;
esac
