#!/usr/bin/env bash
# Build the base image `launcher-base:bookworm` with no registry at all.
#
# Why this exists: on machines with no registry (CI here, air-gapped clusters) `FROM python:3.11-slim`
# cannot be pulled. debootstrap builds a minimal Debian bookworm root filesystem (Python 3.11,
# python3-venv, ca-certificates) from the Debian mirror apt already uses on the host, and
# `docker import` turns it into an image. Nothing from the host is copied into it: no apt/pip
# configuration, no CA certificates beyond Debian's own bundle.
#
# Usage: sudo bash docker/build-base.sh            (root is needed by debootstrap: mknod, chroot, chown)
# Env:   BASE_IMAGE  image name to create             (default launcher-base:bookworm)
#        MIRROR      Debian mirror URL                (default: the one in the host's apt sources)
#        BOOTSTRAP   debootstrap | mmdebstrap | auto  (default auto: mmdebstrap when installed; it
#                    resolves with apt and uses ~2.5x less CPU, which matters on a busy 2-core host)
#        FORCE=1     rebuild even if the image exists
# Idempotent: exits at once when BASE_IMAGE already exists. Cold: 1-2 min with debootstrap (CPU-bound),
# ~50 s with mmdebstrap; docs/image.md has the measurements.
set -euo pipefail

BASE_IMAGE=${BASE_IMAGE:-launcher-base:bookworm}
SUITE=bookworm
# libglib2.0-0 (~4 MB with its few dependencies minbase lacks): pygame's mixer, which pygame-based env packages
# (flappy-bird-gymnasium) touch on import, loads libgthread-2.0 from the system; without it they cannot be made.
PACKAGES=python3,python3-venv,ca-certificates,libglib2.0-0
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORK="$HERE/build"

log() { printf 'build-base: %s\n' "$*" >&2; }
die() { printf 'build-base: error: %s\n' "$1" >&2; [ -n "${2:-}" ] && printf 'HINT: %s\n' "$2" >&2; exit "${3:-1}"; }

command -v docker >/dev/null || die "docker CLI not found" "install Docker Engine (docker-ce or docker.io)" 6
docker version --format '{{.Server.Version}}' >/dev/null 2>&1 \
  || die "no Docker engine answers (DOCKER_HOST=${DOCKER_HOST:-unset})" "start dockerd or set DOCKER_HOST" 6

if [ "${FORCE:-0}" != 1 ] && docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  log "$BASE_IMAGE already exists; nothing to do (FORCE=1 rebuilds it)"
  exit 0
fi

if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || die "debootstrap needs root (mknod, chroot) and sudo is not installed" \
    "run this script as root" 2
  log "re-running as root via sudo"
  exec sudo --preserve-env=BASE_IMAGE,MIRROR,BOOTSTRAP,FORCE,DOCKER_HOST bash "$0" "$@"
fi
BOOTSTRAP=${BOOTSTRAP:-auto}
if [ "$BOOTSTRAP" = auto ]; then
  if command -v mmdebstrap >/dev/null; then BOOTSTRAP=mmdebstrap; else BOOTSTRAP=debootstrap; fi
fi
case "$BOOTSTRAP" in
  debootstrap|mmdebstrap) command -v "$BOOTSTRAP" >/dev/null || die "$BOOTSTRAP not found" "apt-get install $BOOTSTRAP" 6 ;;
  *) die "BOOTSTRAP must be debootstrap, mmdebstrap or auto, got $BOOTSTRAP" "" 2 ;;
esac

# The mirror apt already uses on this host: deb822 .sources files first, then one-line sources.list.
find_mirror() {
  local f uris suites
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -r "$f" ] || continue
    # Stanzas are separated by blank lines; take the first whose Suites include the plain suite.
    awk -v suite="$SUITE" '
      BEGIN { RS=""; FS="\n" }
      {
        uris=""; ok=0; enabled=1
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^URIs:/)    { sub(/^URIs:[ \t]*/, "", $i); split($i, u, /[ \t]+/); uris=u[1] }
          if ($i ~ /^Suites:/)  { n = split($i, s, /[ \t]+/); for (j = 2; j <= n; j++) if (s[j] == suite) ok=1 }
          if ($i ~ /^Enabled:[ \t]*no/) enabled=0
        }
        if (ok && enabled && uris != "") { print uris; exit }
      }' "$f"
  done | head -n1
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -r "$f" ] || continue
    awk -v suite="$SUITE" '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/) { if ($(i+1) == suite) { print $i; exit } ; break } }' "$f"
  done | head -n1
}
if [ -z "${MIRROR:-}" ]; then
  MIRROR=$(find_mirror | head -n1)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi
log "building $BASE_IMAGE from $SUITE ($PACKAGES) via $MIRROR with $BOOTSTRAP"

mkdir -p "$WORK/debootstrap-cache"
ROOTFS=$(mktemp -d "$WORK/rootfs.XXXXXX")
trap 'rm -rf "$ROOTFS"' EXIT
start=$(date +%s)
if [ "$BOOTSTRAP" = debootstrap ]; then
  # --cache-dir keeps the .debs so a rebuild (FORCE=1, or after `docker rmi`) does not download again.
  set -- debootstrap --variant=minbase --include="$PACKAGES" --cache-dir="$WORK/debootstrap-cache"
else
  # The merged-usr hook sets up the /usr merge itself; without it bookworm gets usrmerge and so perl (+47 MB).
  set -- mmdebstrap --variant=minbase --include="$PACKAGES" --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
fi
# The full log goes to a file; its "I:" milestones (retrieving, extracting, configuring) also reach stderr, so
# `launcher up` shows the minutes of a cold base build as progress instead of silence.
"$@" "$SUITE" "$ROOTFS" "$MIRROR" 2>&1 | tee "$WORK/$BOOTSTRAP.log" | sed -un 's/^I: /build-base: /p' >&2 \
  || { tail -n 20 "$WORK/$BOOTSTRAP.log" >&2; die "$BOOTSTRAP failed (log: $WORK/$BOOTSTRAP.log)" \
       "check that $MIRROR is reachable (MIRROR=... overrides it)"; }
log "$BOOTSTRAP done in $(( $(date +%s) - start )) s"

# Trim what a container never needs, and drop anything describing the build host.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/lib/apt/lists/* \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
       "$ROOTFS"/var/log/* "$ROOTFS"/var/cache/debconf/*-old "$ROOTFS"/var/lib/dpkg/*-old \
       "$ROOTFS"/debootstrap
: >"$ROOTFS/etc/resolv.conf"   # Docker bind-mounts its own; the host's must not ship in the image
echo launcher >"$ROOTFS/etc/hostname"
# The image must not trust any CA the build host added: only Debian's bundle may be there.
if [ -n "$(ls -A "$ROOTFS/usr/local/share/ca-certificates" 2>/dev/null)" ]; then
  die "unexpected certificates in $ROOTFS/usr/local/share/ca-certificates" "report this as a bug"
fi

# The PATH/LANG a Dockerfile expects from a Debian image; CMD python3 like python:3.11-slim.
tar --numeric-owner --xattrs -C "$ROOTFS" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  --message "debootstrap --variant=minbase --include=$PACKAGES $SUITE $MIRROR" \
  - "$BASE_IMAGE" >/dev/null
log "imported $BASE_IMAGE in $(( $(date +%s) - start )) s total: $(docker image inspect -f '{{.Size}}' "$BASE_IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
