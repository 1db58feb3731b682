"""The bed's image registry: Debian's ``docker-registry`` binary, run by hand with a config of ours.

Why by hand: the package's service needs systemd, and its default config listens on every interface
(``:5000``). Ours listens on the host's 127.0.0.1 only and keeps its blobs under the bed's directory, so
teardown deletes them with the bed. The forwarder (``forward.py``) makes the same address reach it
from every node's namespace.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.testbed.daemon import _wait_gone

BINARY = "docker-registry"
PACKAGE = "docker-registry"  # Debian's package that ships the binary
PORT = 5000
START_TIMEOUT_S = 20.0

CONFIG = """\
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {store}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
"""


def available() -> str | None:
    """None when the registry can run here, else why not (for a skip message)."""
    if shutil.which(BINARY) is None:
        return f"`{BINARY}` is not installed (apt-get install {PACKAGE})"
    return None


def answers(port: int = PORT) -> bool:
    """Whether a registry answers ``GET /v2/`` on 127.0.0.1:``port``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start(root: Path, port: int = PORT) -> int:
    """Start the registry with its store and config under ``root``; return its pid once it answers.

    Raises:
        RuntimeError: the port already answers (someone else's registry: never shared), or it did not start.
    """
    if answers(port):
        raise RuntimeError(f"something already answers on 127.0.0.1:{port}; a test bed never shares a registry "
                           "(bring the other bed down: scripts/testbed.sh down)")
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yml").write_text(CONFIG.format(store=root / "store", port=port))
    with open(root / "registry.log", "ab") as out:
        proc = subprocess.Popen([BINARY, "serve", str(root / "config.yml")], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=out, start_new_session=True)
    (root / "registry.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if answers(port):
            return proc.pid
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the registry did not answer on 127.0.0.1:{port}: "
                       f"{(root / 'registry.log').read_text(errors='replace')[-2000:]}")


def stop_pidfile(pidfile: Path) -> None:
    """SIGTERM the process named in ``pidfile`` (if it is still the one we started), then SIGKILL."""
    import os
    import signal

    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return
    if str(pidfile.parent).encode() not in cmdline and b"tests.testbed.forward" not in cmdline:
        return  # the pid was reused by a process that is not ours
    os.kill(pid, signal.SIGTERM)
    if not _wait_gone(pid, 5):
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, 5)
