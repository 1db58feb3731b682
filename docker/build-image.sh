#!/usr/bin/env bash
# Build the worker image with no registry and no package index inside the build: base image
# (debootstrap; root or sudo the first time), wheels (downloaded on the host), then `docker build`
# with --network none. One code path: this runs `launcher build --offline` from the project's venv.
#
# Usage: bash docker/build-image.sh [launcher build options, e.g. --gpu --tag launcher:dev]
# Prints the image tag on stdout; build progress goes to stderr.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
if ! "$PYTHON" -c 'import launcher, docker' 2>/dev/null; then
  printf 'build-image: error: %s cannot import launcher and docker\nHINT: %s\n' "$PYTHON" \
    "create the venv first: python3.11 -m venv .venv && .venv/bin/pip install -e ." >&2
  exit 6
fi
# From the root, `python -m launcher` imports this tree's package even if the venv has another installed.
cd "$ROOT"
exec "$PYTHON" -m launcher build --offline --context "$ROOT" "$@"
