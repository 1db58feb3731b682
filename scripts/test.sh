#!/usr/bin/env bash
# Run the whole test suite against the real parts: TensorFlow training, sockets, the Docker engine
# (the image is built offline once per session by the suite), and a stand-in NVML library compiled
# with gcc. Extra arguments go to pytest (e.g. -m "not docker", -k fuzz).
#
# Two pytest-xdist workers: one runs, in order, every test that shares the Docker engine, the test beds, Slurm or
# host-wide state (the "serial" group, tests/conftest.py), the other the unit tests meanwhile,
# each in temporary directories of its own (timings: README, Tests). LAUNCHER_TEST_JOBS=0 runs everything in one
# process, in the same order.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
scripts/setup.sh
jobs=${LAUNCHER_TEST_JOBS:-2}
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=40 -n "$jobs" "$@"
