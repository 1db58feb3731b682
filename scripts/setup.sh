#!/usr/bin/env bash
# Set up everything launcher needs on this machine: a Python 3.11 venv (.venv) with the project,
# TensorFlow (CPU wheel unless LAUNCHER_TF=gpu), TensorBoard and the test tools; and, when run as root
# with apt, the tools the registry-free image build uses (mmdebstrap, debootstrap). Idempotent and
# quick when done; prints a few lines on success and the failing tool's own output on failure.
#
# Usage: scripts/setup.sh            (CPU TensorFlow)
#        LAUNCHER_TF=gpu scripts/setup.sh   (tensorflow[and-cuda], for a GPU host)
#        PYTHON=/path/to/python3.11 scripts/setup.sh
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

# Other users run this venv too (a shared GPU box; the multi-user tests), so prefer a Python every user
# can execute: Debian's /usr/bin/python3.11 before a pyenv build under a 0700 home directory.
usable() { "$1" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; }
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in /usr/bin/python3.11 /usr/local/bin/python3.11 python3.11 python3; do
    if command -v "$cand" >/dev/null && usable "$cand"; then PY=$(command -v "$cand"); break; fi
  done
fi
if [ -z "$PY" ]; then
  echo "setup: error: Python 3.11 with the venv module not found (tried /usr/bin/python3.11, python3.11, python3)" >&2
  echo "HINT: install it (apt-get install python3.11 python3.11-venv, or pyenv install 3.11) and rerun" >&2
  exit 6
fi

# The registry-free image build (launcher build, or launcher up the first time) makes a Debian root
# filesystem with mmdebstrap or debootstrap. Install them when we can; otherwise `launcher up` says what is missing.
if ! command -v mmdebstrap >/dev/null || ! command -v debootstrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing mmdebstrap and debootstrap (for the offline image build)" >&2
    log=$(mktemp)
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap debootstrap; } >"$log" 2>&1; then
      cat "$log" >&2
      echo "setup: warning: could not install mmdebstrap/debootstrap; the offline image build will not work until they are installed" >&2
    fi
    rm -f "$log"
  fi
fi

extra=cpu
[ "${LAUNCHER_TF:-cpu}" = gpu ] && extra=gpu
stamp=.venv/.launcher-setup-$extra-$(cat pyproject.toml <(echo "$PY") | sha1sum | cut -c1-12)
if [ -f "$stamp" ]; then
  echo "setup: .venv is up to date ($extra)" >&2
  exit 0
fi
# A venv made from another interpreter (say, an older pyenv build other users cannot run) is made anew.
if [ -x .venv/bin/python ] && [ "$(.venv/bin/python -c 'import sys; print(sys._base_executable)' 2>/dev/null)" != "$PY" ] \
   && [ "$(readlink -f "$(.venv/bin/python -c 'import sys; print(sys._base_executable)' 2>/dev/null)")" != "$(readlink -f "$PY")" ]; then
  echo "setup: .venv was made from another Python; making it anew from $PY" >&2
  rm -rf .venv
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
log=$(mktemp)
trap 'rm -f "$log"' EXIT
pip=(.venv/bin/python -m pip --quiet --disable-pip-version-check --no-input)
if ! { "${pip[@]}" install --upgrade pip && "${pip[@]}" install -e ".[$extra,tensorboard,test]"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "setup: error: pip install failed (its output is above)" >&2
  exit 6
fi
rm -f .venv/.launcher-setup-*
touch "$stamp"
echo "setup: .venv ready: $(.venv/bin/python -c 'import sys, tensorflow as tf; print(f"Python {sys.version.split()[0]}, tensorflow {tf.__version__}")' 2>/dev/null), tensorboard $(.venv/bin/tensorboard --version 2>/dev/null | tail -n 1)" >&2
