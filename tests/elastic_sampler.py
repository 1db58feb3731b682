"""The judge of the elastic-run tests (tests/unit/gpu/test_elastic_runs.py, tests/docker/test_gpu_detached.py): every
50 ms, per GPU, the runs that hold its lease (the kernel's lock table) or run a worker group on it (every group
process on this host, a container's included: its run from its ``--spec`` path or its ``LAUNCHER_SPEC``, its GPUs
from its ``CUDA_VISIBLE_DEVICES``). No GPU may ever be held by, or run a group of, two runs at one instant.

Only the test's own runs count (a run with a directory in one of its results directories): another test session on
the host (a second checkout, a parallel runner) runs groups on the same made-up GPU UUIDs, in lease directories of its
own; under two pytest-xdist workers such a run showed on GPU 0 beside alice's lease for 78 samples."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from launcher.gpu import leaseholders
from launcher.gpu.reservations import LeaseDir
from worker.contract import SPEC_ENV


def _process(pid: int | str) -> tuple[str, set[str], bool] | None:
    """(its run, its GPUs, whether it is a worker group) for a launcher process (a master or a group, a container's
    included: its run from ``--spec`` or ``LAUNCHER_SPEC``, its GPUs from ``CUDA_VISIBLE_DEVICES``); None otherwise."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"worker" not in argv:
            return None
        env = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
        if b"--spec" in argv:
            run = Path(argv[argv.index(b"--spec") + 1].decode()).parent.name
        else:
            run = str(json.loads(env[SPEC_ENV.encode()])["run_id"])
    except (OSError, ValueError, IndexError, KeyError):
        return None  # gone meanwhile, or not the launcher's
    gpus = {u for u in env.get(b"CUDA_VISIBLE_DEVICES", b"").decode().split(",") if u.startswith(("GPU-", "MIG-"))}
    return run, gpus, b"group" in argv


def groups_on_gpus(mine: Callable[[str], bool]) -> dict[str, set[str]]:
    """GPU UUID -> the runs (those ``mine`` accepts) with a worker group process on it now."""
    out: dict[str, set[str]] = {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        seen = _process(pid)
        if seen is not None and seen[2] and mine(seen[0]):
            for uuid in seen[1]:
                out.setdefault(uuid, set()).add(seen[0])
    return out


def lease_holders(leases: LeaseDir) -> dict[str, str]:
    """GPU UUID -> the run holding its lease: the holder's note, else (a lease a container holds has no note) the
    run of the holding process itself."""
    out = {}
    for h in leaseholders.list_holders(leases):
        seen = _process(h.pid) if h.pid else None
        if not h.run_id and seen is None and h.pid and _exiting(h.pid):
            continue  # its holder is exiting (its lock goes with it): not a second run (CI 2026-11-29 02:11)
        out[h.uuid] = h.run_id or (seen[0] if seen else f"pid {h.pid}")
    return out


def _exiting(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie: a process whose command line can no longer be read while it exits."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


class Sampler(threading.Thread):
    """Samples every 50 ms until ``stop_`` is set: ``both`` collects each (GPU, runs) seen with two runs or more at
    one instant, ``ever`` every run seen on each GPU (so a test shows the sampler saw what it judges)."""

    def __init__(self, leases: LeaseDir, results: Sequence[Path]) -> None:
        super().__init__(daemon=True)
        self.ld = leases
        self.results = tuple(results)  # the test's results directories: the runs that count
        self.stop_ = threading.Event()
        self.samples = 0
        self.both: list[tuple[str, set[str]]] = []
        # each conflict: (when, the group processes then: pid, parent, state, run, GPUs; the leases; the groups)
        self.detail: list[tuple[float, str, dict[str, str], dict[str, set[str]]]] = []
        self.ever: dict[str, set[str]] = {}

    def run(self) -> None:
        while not self.stop_.is_set():
            users: dict[str, set[str]] = {}
            leases, groups = lease_holders(self.ld), groups_on_gpus(self._mine)
            for uuid, run in leases.items():
                users.setdefault(uuid, set()).add(run)
            for uuid, runs in groups.items():
                users.setdefault(uuid, set()).update(runs)
            self.both.extend((u, r) for u, r in users.items() if len(r) > 1)
            if any(len(r) > 1 for r in users.values()):
                procs = []
                for pid in (p for p in os.listdir("/proc") if p.isdigit()):
                    seen = _process(pid)
                    if seen and seen[2]:
                        try:
                            st = Path(f"/proc/{pid}/stat").read_text().split()
                        except OSError:
                            continue
                        procs.append(f"{pid} ppid {st[3]} state {st[2]} {seen[0][-4:]} {sorted(seen[1])}")
                self.detail.append((time.time(), "; ".join(procs), leases, groups))
            for u, r in users.items():
                self.ever.setdefault(u, set()).update(r)
            self.samples += 1
            self.stop_.wait(0.05)

    def _mine(self, run: str) -> bool:
        return any((r / run).is_dir() for r in self.results)
