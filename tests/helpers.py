"""Helpers shared by the training-core tests: run the real CLI and the real worker processes."""

from __future__ import annotations

import json
import os
import socket
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SECRET = "test-secret-0123456789abcdef0123456789"


def launcher_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher", *args]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAUNCHER_")}
    env.update({"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def run_launcher(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(launcher_cmd(*args), cwd=ROOT, env=child_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def run_dirs(root: Path) -> list[Path]:
    """The runs' results directories under a results root, by name: not the launcher's records (``.launcher``)."""
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


def only_run(root: Path) -> Path:
    runs = [p for p in run_dirs(root) if p.is_dir()]
    assert len(runs) == 1, f"expected one run under {root}, found {runs}"
    return runs[0]


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def status_of(run_dir: Path) -> dict[str, Any]:
    try:
        return read_json(run_dir / "status.json")
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def processes_mentioning(needle: str) -> list[tuple[int, str]]:
    """(pid, cmdline) of live processes whose command line contains ``needle`` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state = stat.rsplit(")", 1)[-1].split()[0]
        if needle in cmd and state != "Z" and int(entry.name) != os.getpid():
            found.append((int(entry.name), cmd))
    return found


def kill_all(needle: str) -> None:
    for pid, _ in processes_mentioning(needle):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the kernel's choice, released at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
