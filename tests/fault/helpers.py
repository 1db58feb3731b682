"""Helpers of the fault-injection suite (``tests/fault/``, ``pytest tests/fault`` or ``-m fault``).

Counts: each test runs its CI count unless ``FAULT_FULL=1`` asks for the full one (docs/reliability.md);
``FAULT_SEED`` fixes the random moments. Figures: :func:`record` prints a measured figure and, when
``FAULT_REPORT`` names a file, appends it there as a JSON line, so ``bench/reliability.py`` can make the
table of docs/reliability.md from one full run.

Everything here waits by polling with generous deadlines: other engineers' CPU-heavy tests share the two
cores, so no helper assumes a speed.

Two programs the suite runs in their own interpreters live beside this module: ``tests/fault/checkpoints.py``
(restores every checkpoint of a run, so TensorFlow stays out of the pytest process) and ``tests/fault/racer.py``
(one launcher of the concurrency test).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.helpers import ROOT, child_env, processes_mentioning, read_json, wait_for, run_dirs

FULL = os.environ.get("FAULT_FULL") == "1"
SEED = int(os.environ.get("FAULT_SEED") or random.SystemRandom().randrange(1 << 30))
REPORT = os.environ.get("FAULT_REPORT")
# A uid that is neither root nor the one test_docker_backend.py acts as (4242), so `down --all` run as it
# can only ever see this suite's runs, never another engineer's on the shared engine.
FAULT_UID = 4917


def count(ci: int, full: int) -> int:
    """How many repetitions: ``full`` with FAULT_FULL=1, else ``ci``."""
    return full if FULL else ci


def rng(name: str) -> random.Random:
    """A random source per test, reproducible with FAULT_SEED (printed on failure by :func:`record`)."""
    return random.Random(f"{SEED}-{name}")


def record(section: str, **figures: Any) -> None:
    """Print measured figures (pytest -s shows them) and append them to $FAULT_REPORT as one JSON line."""
    line = {"section": section, "full": FULL, "seed": SEED, "t": round(time.time(), 1), **figures}
    print(f"\n[fault] {section}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
    if REPORT:
        with open(REPORT, "a") as fh:
            fh.write(json.dumps(line, default=str) + "\n")


# ---------------------------------------------------------------------------------------------- files
def tree_digest(root: Path) -> dict[str, str]:
    """relative path -> sha256 (files), ``dir``, or ``link -> target``, plus each entry's mode and mtime:
    any change below ``root`` changes the result."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        st = p.lstat()
        meta = f"{st.st_mode:o}:{st.st_mtime_ns}"
        if p.is_symlink():
            out[rel] = f"link -> {os.readlink(p)} {meta}"
        elif p.is_dir():
            out[rel] = f"dir {meta}"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() + " " + meta
    return out


def unreadable_json(root: Path) -> list[str]:
    """Every ``*.json`` below ``root`` that does not parse, and every ``*.jsonl`` line that does not, except
    a torn last line (a SIGKILLed master may leave one; readers skip it)."""
    bad: list[str] = []
    for p in sorted(root.rglob("*.json")):
        try:
            json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            bad.append(f"{p}: {exc}")
    for p in sorted(root.rglob("*.jsonl")):
        lines = p.read_text().split("\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError as exc:
                if i < len(lines) - 1 or lines[-1] == "":  # torn lines are fine only at the very end
                    bad.append(f"{p}:{i + 1}: {exc}: {line[:80]!r}")
    return bad


def metrics(run: Path) -> list[dict[str, Any]]:
    """The records of the run's metrics.jsonl (none yet: empty), skipping unparsable lines."""
    out = []
    try:
        text = (run / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def events(run: Path, name: str) -> list[dict[str, Any]]:
    return [r for r in metrics(run) if r.get("type") == "event" and r.get("event") == name]


def files_containing(root: Path, needle: bytes) -> list[str]:
    """Files below ``root`` whose bytes contain ``needle``."""
    return [str(p) for p in root.rglob("*") if p.is_file() and not p.is_symlink() and needle in p.read_bytes()]


def checkpoint_numbers_on_disk(run: Path) -> list[int]:
    """N of every ``ckpt-N.index`` in the run's checkpoints (listed by the manager or not)."""
    return sorted(int(m.group(1)) for p in (run / "checkpoints").glob("ckpt-*.index")
                  if (m := re.fullmatch(r"ckpt-(\d+)\.index", p.name)))


def verify_checkpoints(run: Path, timeout: float = 240) -> list[dict[str, Any]]:
    """Restore every checkpoint the run's CheckpointManager lists, each on its own, in a fresh interpreter.

    Returns one dict per listed checkpoint: ``path``, ``ok`` (restored), ``error``, and the counters it
    holds (``env_steps``, ``updates``, ``episodes``, ``version``)."""
    proc = subprocess.run([sys.executable, "-m", "tests.fault.checkpoints", str(run)], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc: list[dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc


# ------------------------------------------------------------------------------------------ processes
def launcher_proc(*args: str, cwd: Path | None = None, user: int | None = None, **env: str) -> subprocess.Popen[str]:
    """``python -m launcher ARGS`` in the background, stdout and stderr pipes (read by :class:`Drain`).

    ``user``: run it as this uid (and gid), with the docker group, through ``setpriv``. SIGINT starts at its
    default, as in a terminal (tests/conftest.py: a suite that inherited it ignored gives it its handler back)."""
    argv = [sys.executable, "-m", "launcher", *args]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", f"--groups={docker_gid()}", *argv]
    return subprocess.Popen(argv, cwd=cwd or ROOT, env=child_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=False)


class Drain:
    """Reads a Popen's stdout and stderr in threads (a full pipe would stall the launcher), keeping lines."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [threading.Thread(target=self._read, args=(s, buf), daemon=True)
                         for s, buf in ((proc.stdout, self.out), (proc.stderr, self.err)) if s is not None]
        for t in self._threads:
            t.start()

    @staticmethod
    def _read(stream: Any, buf: list[str]) -> None:
        for line in stream:
            buf.append(line)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        for t in self._threads:
            t.join(timeout=10)
        return code

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)


def stop_proc(proc: subprocess.Popen[str], timeout: float = 60) -> None:
    """Finally-block cleanup: SIGINT a launcher still running, then SIGKILL it if it does not go."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def first_run(root: Path, timeout: float, *, needs: str = "run.json") -> Path:
    """The first run directory under ``root`` that has ``needs`` (waits for it)."""
    found: Path = wait_for(lambda: next((p for p in sorted(run_dirs(root)) if (p / needs).exists()), None)
                           if root.is_dir() else None, timeout, f"a run directory with {needs} under {root}")
    return found


def status(run: Path) -> dict[str, Any]:
    try:
        doc: dict[str, Any] = read_json(run / "status.json")
        return doc
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def group_pid(run: Path, index: int) -> int | None:
    """The live process of worker group ``index`` of a process-backend run (found by its command line)."""
    needle = f"group --index {index} --spec {run}/spec.json"
    found = processes_mentioning(needle)
    return found[0][0] if found else None


def master_pid(run: Path) -> int | None:
    found = processes_mentioning(f"worker master --spec {run}/spec.json")
    return found[0][0] if found else None


def environ_of(pid: int) -> dict[str, str]:
    """The environment a process started with (``/proc/PID/environ``; root reads anyone's)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def cmdlines() -> Iterator[tuple[int, bytes]]:
    """(pid, raw argv) of every process on the host, containers' included (they share its /proc)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                yield int(entry.name), (entry / "cmdline").read_bytes()
            except OSError:
                continue


def docker_gid() -> int:
    import grp

    try:
        return grp.getgrnam("docker").gr_gid
    except KeyError:
        return os.stat("/var/run/docker.sock").st_gid


