#!/usr/bin/env bash
# Set everything up and run the default job: PPO on CartPole-v1 with 8 workers until the mean return of
# the last 100 episodes reaches 475. Uses Docker when an engine answers (building the image offline the
# first time), local processes otherwise. Extra arguments go to `launcher up`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
scripts/setup.sh
exec .venv/bin/launcher up --workers 8 --env CartPole-v1 --algo ppo --until-return 475 "$@"
