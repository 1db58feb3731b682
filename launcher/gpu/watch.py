"""A running run's GPUs watched for foreign processes: flagged in the live view and in ``launcher status``.

The supervisor starts a :class:`GpuWatch` for a run on GPUs. A daemon thread reads NVML every
:data:`INTERVAL_S` seconds (under the NVML deadline, so a hung driver costs a reading, never the run) and
finds the processes on the run's GPUs that are not part of its lease (:mod:`launcher.gpu.foreign`: not a
holder of the run's leases, not a descendant of one, not in a container of the run). The supervisor's loop
calls :meth:`GpuWatch.review` twice a second: it emits an ``event`` when a foreign process appears or leaves
(the plain lines and the live view show events) and writes the current set into the launcher's own record,
``run.json`` (``gpu_watch``), which ``launcher status`` shows. A process that appears is therefore reported
within one interval, one NVML reading and one supervisor poll: about 2.6 s, under the 5 s promised.

Why ``run.json`` and not the master's ``status.json``: the launcher sees the host's processes and leases,
the master (in its container) does not; each process writes only its own file, so nothing races.
A detached run has no supervisor: ``launcher gpus`` still flags foreign processes on its GPUs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import Any

from launcher.errors import LauncherError
from launcher.gpu import foreign, nvml
from launcher.gpu.foreign import ForeignProcess, LeaseParts
from launcher.gpu.mig import placeable
from launcher.gpu.snapshots import GpuInfo, Inventory

logger = logging.getLogger(__name__)

INTERVAL_S = 2.0
RECORD_KEY = "gpu_watch"


@dataclass(frozen=True)
class Reading:
    """One look at the run's GPUs: when, the foreign processes found, or why NVML could not be read."""

    at: float  # Unix time
    foreign: tuple[ForeignProcess, ...] = ()
    error: str | None = None
    gpus: tuple[GpuInfo, ...] = ()  # every GPU and MIG instance of the reading (the live view's GPU rows)

    def to_dict(self) -> dict[str, Any]:
        return {"at": round(self.at, 3), "foreign_processes": [asdict(f) for f in self.foreign], "error": self.error}


def run_lease(run_id: str, uuids: Collection[str], *, lease_dir: Any = None,
              check_containers: bool = True) -> dict[str, LeaseParts]:
    """The parts of ``run_id``'s lease on ``uuids``: this launcher (the process backend's parts are its
    children), the kernel's holders of those leases (the master, once it took them over) and the containers
    labelled with the run."""
    from launcher.gpu import holders, leaseholders

    containers = holders.container_holders()[0] if check_containers else []
    pids = {os.getpid()}
    mates = {c.container_id for c in containers if c.run_id == run_id}
    for h in leaseholders.list_holders(lease_dir):
        if h.uuid in uuids:
            if h.pid:
                pids.add(h.pid)
            if h.container_id:
                mates.add(h.container_id)
    parts = LeaseParts(run_id, frozenset(pids), frozenset(mates))
    return {u: parts for u in uuids}


def look(run_id: str, uuids: Collection[str], *, read: Callable[[], Inventory] = nvml.read_inventory,
         leases: Callable[[], dict[str, LeaseParts]] | None = None, clock: Callable[[], float] = time.time) -> Reading:
    """One reading: NVML (under its deadline) and the run's lease parts -> the foreign processes on ``uuids``."""
    try:
        inventory = read()
    except LauncherError as exc:  # NvmlTimeout and friends: report it, keep watching
        return Reading(clock(), error=str(exc))
    if not inventory.available:
        return Reading(clock(), error=inventory.unavailable_reason)
    parts = leases() if leases is not None else run_lease(run_id, uuids)
    found = foreign.find_foreign(inventory.gpus, parts, parent_of=foreign.parent_pid,
                                 container_of=_container_of, only=uuids)
    return Reading(clock(), found, gpus=tuple(placeable(inventory.gpus)))


def _container_of(pid: int) -> str | None:
    from launcher.gpu.holders import container_id_of_pid

    return container_id_of_pid(pid)


class GpuWatch:
    """Watches one run's GPUs in a daemon thread; :meth:`review` reports changes from the caller's thread.

    Args:
        run_id: the run; its GPU (or MIG) UUIDs are ``uuids``.
        look_once: one reading (tests inject a clock or a reader through :func:`look`'s arguments).
        interval_s: seconds between readings.
        check_containers: also count the containers labelled with the run as its parts (not for the process
            backend, which has none: saves asking the engine every reading).
    """

    def __init__(self, run_id: str, uuids: Collection[str], *, interval_s: float = INTERVAL_S,
                 look_once: Callable[[], Reading] | None = None, check_containers: bool = True) -> None:
        self.run_id = run_id
        self.uuids = frozenset(uuids)
        self.interval_s = interval_s
        self._look = look_once or (lambda: look(run_id, self.uuids, leases=lambda: run_lease(
            run_id, self.uuids, check_containers=check_containers)))
        self._latest: Reading | None = None
        self._reported: tuple[tuple[int, str], ...] | None = None
        self._error_reported: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"gpu-watch-{run_id}", daemon=True)

    def start(self) -> GpuWatch:
        global _active
        self._thread.start()
        _active = self
        return self

    def stop(self) -> None:
        """Stop watching. Waits at most a second for a reading under way (the thread is a daemon)."""
        global _active
        if _active is self:
            _active = None
        self._stop.set()
        self._thread.join(timeout=1.0)

    def latest(self) -> Reading | None:
        return self._latest

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._latest = self._look()
            except Exception as exc:  # noqa: BLE001 - a watch must never take the run down
                logger.debug("GPU watch reading failed: %s", exc)
                self._latest = Reading(time.time(), error=f"{type(exc).__name__}: {exc}")
            self._stop.wait(self.interval_s)

    def review(self, emit: Callable[[str, dict[str, Any]], None], record: Callable[..., Any]) -> None:
        """Report what changed since the last review: an ``event`` per foreign process that appeared or left
        (and once when NVML cannot be read), and ``record(gpu_watch=...)`` (the run record) on any change."""
        reading = self._latest
        if reading is None:
            return
        key = tuple((f.pid, f.gpu_uuid) for f in reading.foreign)
        if reading.error is not None:
            if reading.error != self._error_reported:
                self._error_reported = reading.error
                emit("event", {"message": f"GPU watch: cannot read the GPUs: {reading.error}"})
                record(**{RECORD_KEY: reading.to_dict()})
            return
        recovered = self._error_reported is not None
        if recovered:
            emit("event", {"message": "GPU watch: the GPUs can be read again"})
        self._error_reported = None
        if key == self._reported and not recovered:
            return
        before = set(self._reported or ())
        for f in reading.foreign:
            if (f.pid, f.gpu_uuid) not in before:
                emit("event", {"message": f"FOREIGN process on this run's GPU: {f.describe()}"})
        now = set(key)
        for pid, uuid in sorted(before - now):
            emit("event", {"message": f"foreign process pid {pid} left GPU {uuid}"})
        self._reported = key
        record(**{RECORD_KEY: reading.to_dict()})


_active: GpuWatch | None = None


def latest_gpus() -> list[GpuInfo] | None:
    """The GPUs (and MIG instances) of the running watch's latest reading, so the live view shows them without
    asking NVML itself (and never waits on a hung driver): empty until its first good reading; None when no
    watch runs."""
    if _active is None:
        return None
    reading = _active.latest()
    return [] if reading is None or reading.error is not None else list(reading.gpus)


def start_for(run_id: str, gpu_uuids: Collection[str], *, backend: str,
              interval_s: float = INTERVAL_S) -> GpuWatch | None:
    """A started watch for a run on GPUs; None for a CPU plan (nothing to watch) or a swarm run (its tasks run
    on other nodes, whose processes this machine's NVML does not see)."""
    if not gpu_uuids or backend == "swarm":
        return None
    return GpuWatch(run_id, gpu_uuids, interval_s=interval_s, check_containers=backend != "process").start()
