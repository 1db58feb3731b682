#!/usr/bin/env bash
# Download every wheel the image needs (Linux x86_64, CPython 3.11) into docker/wheels/, on the host.
#
# Why on the host: pip inside a build container cannot reach PyPI on machines whose package traffic
# goes through a TLS proxy only the host trusts, and air-gapped clusters have no index at all. The
# Dockerfile then installs with `pip install --no-index --find-links` and needs no network.
#
# Usage: bash docker/fetch-wheels.sh               (FLAVOUR=gpu bash docker/fetch-wheels.sh for GPU images)
# Env:   FLAVOUR     cpu (default) or gpu
#        TF_PACKAGE  default tensorflow-cpu for cpu, tensorflow[and-cuda] for gpu (~3 GB more: CUDA wheels)
#        WHEELS      target directory                    (default docker/wheels/$FLAVOUR)
#        PYTHON      interpreter whose pip downloads      (default .venv/bin/python, else python3)
# Cached: a stamp per requirement set lists the files; when they are all there it exits at once.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
FLAVOUR=${FLAVOUR:-cpu}
case "$FLAVOUR" in
  cpu) TF_PACKAGE=${TF_PACKAGE:-tensorflow-cpu} ;;
  gpu) TF_PACKAGE=${TF_PACKAGE:-tensorflow[and-cuda]} ;;
  *) printf 'fetch-wheels: error: FLAVOUR must be cpu or gpu, got %s\n' "$FLAVOUR" >&2; exit 2 ;;
esac
# One directory per flavour: a CPU build context then never carries the GPU build's CUDA wheels.
WHEELS=${WHEELS:-$HERE/wheels/$FLAVOUR}
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
log() { printf 'fetch-wheels: %s\n' "$*" >&2; }

mkdir -p "$WHEELS"
reqs=$("$PYTHON" "$HERE/requirements.py" --pyproject "$ROOT/pyproject.toml" --tf "$TF_PACKAGE" --build-system)
# The target's platform, stated in full: pip only widens manylinux2014 to 2010/1 by itself, and the
# image's glibc (bookworm: 2.36) runs every manylinux_2_5 .. manylinux_2_36 wheel.
platforms=(--platform manylinux2014_x86_64)
for minor in $(seq 5 36); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done

stamp="$WHEELS/.complete-$(printf '%s\n%s\n' "$reqs" "${platforms[*]}" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  missing=0
  while IFS= read -r f; do [ -f "$WHEELS/$f" ] || { missing=1; break; }; done <"$stamp"
  if [ "$missing" = 0 ]; then
    log "all $(wc -l <"$stamp") wheels for $TF_PACKAGE already in $WHEELS; nothing to do"
    exit 0
  fi
fi

log "downloading wheels for $TF_PACKAGE (cp311, manylinux x86_64) into $WHEELS"
reqfile=$(mktemp)
out=$(mktemp)
trap 'rm -f "$reqfile" "$out"' EXIT
printf '%s\n' "$reqs" >"$reqfile"
start=$(date +%s)
# PIP_FIND_LINKS/PIP_NO_INDEX are unset because a host's own wheel directories hold wheels built for the
# host, not for the image; the index (and the host's CA settings) stay as the host configured them.
env -u PIP_FIND_LINKS -u PIP_NO_INDEX PIP_DISABLE_PIP_VERSION_CHECK=1 \
  "$PYTHON" -m pip download --dest "$WHEELS" --only-binary=:all: \
    --implementation cp --python-version 3.11 --abi cp311 --abi abi3 --abi none "${platforms[@]}" \
    -r "$reqfile" 2>&1 | tee "$out" >&2
# pip prints "Saved <path>" for new files and "File was already downloaded <path>" for cached ones.
sed -n -e 's/^Saved //p' -e 's/^ *File was already downloaded //p' "$out" | xargs -r -n1 basename | sort -u >"$stamp.tmp"
[ -s "$stamp.tmp" ] || { rm -f "$stamp.tmp"; log "error: pip reported no files"; exit 1; }
mv "$stamp.tmp" "$stamp"
log "$(wc -l <"$stamp") wheels ($(cd "$WHEELS" && du -ch $(cat "$stamp") | tail -n1 | cut -f1)) in $(( $(date +%s) - start )) s"
