"""The process backend's reaper: SIGKILL for a run's children that outlive their launcher by a grace period.

Each child asks the kernel for SIGTERM when the launcher dies (``PR_SET_PDEATHSIG``); a master then
checkpoints and exits. One that is stuck (a hung driver call, a blocked write) would run on with its GPUs no
longer leased by anyone. The reaper is a tiny process (``python -m launcher.reaper GRACE_S``, standard library
only) in its own session; the launcher writes ``<pgid> <start ticks>`` to its stdin for every child it
starts. When stdin ends (the launcher exited, however it died) it waits ``GRACE_S`` seconds, then SIGKILLs
each recorded process group whose leader is still the process that was recorded (same pid *and* start time,
so a recycled pid is never signalled). A line ``run ["cmd", "arg", ...]`` (JSON) names a command to run after
that, with a deadline (the Slurm backend's ``scancel JOB``: a job left holding its nodes when its launcher died).
A line ``done`` (the launcher stopped its children itself) makes it exit at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

RUN_TIMEOUT_S = 30.0  # each `run` command's deadline


def start_ticks(pid: int) -> int | None:
    """``/proc/<pid>/stat`` field 22 (start time, clock ticks after boot); None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            rest = fh.read(4096).rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if rest[0] == b"Z":
        return None
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def parse_run(line: str) -> list[str] | None:
    """The command of a ``run [...]`` line; None for anything else."""
    if not line.startswith("run "):
        return None
    try:
        argv = json.loads(line[4:])
    except ValueError:
        return None
    return [str(a) for a in argv] if isinstance(argv, list) and argv else None


def parse(line: str) -> tuple[int, int] | None:
    """``"<pgid> <ticks>"`` as numbers; None for anything else."""
    parts = line.split()
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def reap(groups: dict[int, int], grace_s: float, *, poll_s: float = 0.1) -> list[int]:
    """Wait up to ``grace_s`` seconds for the recorded groups' leaders to exit, then SIGKILL the groups whose
    leaders are still the recorded processes. Returns the process groups killed."""
    deadline = time.monotonic() + grace_s
    alive = {g: t for g, t in groups.items() if start_ticks(g) == t}
    while alive and time.monotonic() < deadline:
        time.sleep(poll_s)
        alive = {g: t for g, t in alive.items() if start_ticks(g) == t}
    killed = []
    for pgid, ticks in alive.items():
        if start_ticks(pgid) == ticks:  # once more, right before the signal
            try:
                os.killpg(pgid, signal.SIGKILL)
                killed.append(pgid)
            except OSError:
                pass
    return killed


def main(argv: list[str]) -> int:
    grace_s = float(argv[1]) if len(argv) > 1 else 10.0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the launcher; its own end is stdin's EOF
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    groups: dict[int, int] = {}
    commands: list[list[str]] = []
    for line in sys.stdin:
        if line.strip() == "done":
            return 0
        entry = parse(line)
        if entry is not None:
            groups[entry[0]] = entry[1]
        else:
            command = parse_run(line.strip())
            if command is not None:
                commands.append(command)
    killed = reap(groups, grace_s)
    if killed:
        print(f"launcher reaper: SIGKILLed process group(s) {killed}: still running {grace_s:g} s after their "
              f"launcher died", file=sys.stderr)
    for command in commands:
        try:
            done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, timeout=RUN_TIMEOUT_S)
            print(f"launcher reaper: ran {' '.join(command)} (exit {done.returncode}) after the launcher died",
                  file=sys.stderr)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"launcher reaper: {' '.join(command)} failed: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
