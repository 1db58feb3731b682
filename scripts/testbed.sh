#!/usr/bin/env bash
# Bring a multi-node test bed up or down by hand (root): N extra dockerd's, each in its own network
# namespace on a private bridge (10.213.K.0/24), the first a swarm manager and the rest workers, and a
# registry on localhost:5000 that every node sees. The suite's fixtures (tests/testbed/) do the same.
#
# Usage: sudo scripts/testbed.sh up [--nodes 3] [--gpus 0,2,2] [--no-swarm] [--no-registry]
#        sudo scripts/testbed.sh list
#        sudo scripts/testbed.sh down ID | --all
# Then e.g. DOCKER_HOST=unix:///var/lib/launcher-testbed/ID/n0/docker.sock launcher up --backend swarm …
# docs/scaling-out.md has a walk-through.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
exec "$PY" -m tests.testbed "$@"
