#!/usr/bin/env bash
# Bring a Slurm test bed up or down by hand (root): slurmctld and N slurmd, each in network, UTS and mount
# namespaces of its own (10.216.K.0/24), with munge and fake GPUs as GRES. The suite's fixture
# (tests/slurmbed/fixtures.py) does the same.
#
# Usage: sudo scripts/slurmbed.sh up [--nodes 3] [--gpus 2] [--cpus 4]
#        sudo scripts/slurmbed.sh list
#        sudo scripts/slurmbed.sh down ID | --all
# Then: export SLURM_CONF=/var/lib/launcher-slurmbed/ID/slurm.conf; launcher up --backend slurm …
# docs/scaling-out.md has a walk-through.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
exec "$PY" -m tests.slurmbed "$@"
