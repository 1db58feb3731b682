#!/usr/bin/env bash
# Run the whole test suite against the real parts: TensorFlow training, sockets, the Docker engine
# (the image is built offline once per session by the suite), and a stand-in NVML library compiled
# with gcc. Extra arguments go to pytest (e.g. -m "not docker", -k fuzz).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=40 "$@"
