#!/usr/bin/env bash
# Set up everything launcher needs on this machine: a Python 3.11 venv (.venv) with the project,
# TensorFlow (CPU wheel unless LAUNCHER_TF=gpu) and the test tools. Idempotent and quick when done.
#
# Usage: scripts/setup.sh            (CPU TensorFlow)
#        LAUNCHER_TF=gpu scripts/setup.sh   (tensorflow[and-cuda], for a GPU host)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PY=$cand; break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "setup: error: Python 3.11 not found (tried python3.11, python3)" >&2
  echo "HINT: install it (apt-get install python3.11 python3.11-venv, or pyenv install 3.11) and rerun" >&2
  exit 6
fi
extra=cpu
[ "${LAUNCHER_TF:-cpu}" = gpu ] && extra=gpu
stamp=.venv/.launcher-setup-$extra-$(sha1sum pyproject.toml | cut -c1-12)
if [ -f "$stamp" ]; then
  echo "setup: .venv is up to date ($extra)" >&2
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip >&2
.venv/bin/python -m pip install --quiet -e ".[$extra,test]" >&2
rm -f .venv/.launcher-setup-*
touch "$stamp"
echo "setup: .venv ready ($(.venv/bin/python -c 'import tensorflow as tf; print("tensorflow", tf.__version__)' 2>/dev/null))" >&2
