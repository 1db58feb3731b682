"""Foreign processes: compute processes on a leased GPU that are not part of its lease.

The rule, the same for ``launcher gpus`` and a run's watch (:mod:`launcher.gpu.watch`): a process on a leased
GPU (or MIG instance) is part of the lease when its pid is a lease holder, a descendant of one (the process
backend's groups are children of the launcher that holds the leases), or it runs in a container of the lease
(the holder's container, or a container labelled with the lease's run: the Docker backend's group containers
beside the master that holds the leases). Anything else is foreign: another user's job, or the same user's
notebook, started on a GPU a run was promised. Same user is not enough: a lease is a run's, not a user's.

A process on a GPU nobody leases is not foreign (nothing was promised); ``--allow-other-users`` and the
selection thresholds deal with it. Pure functions; the impure lookups (``/proc/<pid>/stat`` for the parent,
``/proc/<pid>/cgroup`` for the container) are passed in, so tests use made-up process trees.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from launcher.gpu.snapshots import GpuInfo, GpuProcess


@dataclass(frozen=True)
class LeaseParts:
    """What belongs to one lease: its holder pids, and the containers of its run (ids, 64 hex)."""

    run_id: str | None
    holder_pids: frozenset[int]
    container_ids: frozenset[str] = frozenset()

    def describe(self) -> str:
        return f"run {self.run_id}" if self.run_id else "a lease of unknown run"


@dataclass(frozen=True)
class ForeignProcess:
    """A process found on a leased GPU that its lease does not account for (``nvidia-smi`` would list it)."""

    pid: int
    user: str | None  # None: not visible from here (another PID namespace)
    used_memory_bytes: int | None
    command: str | None
    gpu_uuid: str  # the leased unit: a GPU or a MIG instance
    gpu_index: int
    lease: str  # whose lease it intrudes on, e.g. "run cartpole-ppo-..."

    def describe(self) -> str:
        from launcher.units import format_size

        memory = "memory unknown" if self.used_memory_bytes is None else format_size(self.used_memory_bytes)
        cmd = f", {self.command[:60]}" if self.command else ""
        return (f"pid {self.pid} (user {self.user or 'not visible from here'}, {memory}{cmd}) on GPU "
                f"{self.gpu_index} ({self.gpu_uuid}), leased by {self.lease}")


ParentOf = Callable[[int], "int | None"]
ContainerOf = Callable[[int], "str | None"]


def part_of_lease(pid: int, lease: LeaseParts, *, parent_of: ParentOf, container_of: ContainerOf,
                  max_depth: int = 64) -> bool:
    """Whether ``pid`` is a holder of ``lease``, a descendant of one, or runs in one of its containers."""
    seen: set[int] = set()
    p: int | None = pid
    while p is not None and p > 0 and p not in seen and len(seen) < max_depth:
        if p in lease.holder_pids:
            return True
        seen.add(p)
        p = parent_of(p)
    cid = container_of(pid)
    return cid is not None and cid in lease.container_ids


def lease_unit(gpu: GpuInfo, process: GpuProcess) -> str:
    """The UUID a process's GPU memory is leased under: its MIG instance's on a GPU in MIG mode, else the GPU's."""
    if gpu.mig_mode:
        for m in gpu.mig_devices:
            if m.gpu_instance_id is not None and m.gpu_instance_id == process.gpu_instance_id:
                return m.uuid
    return gpu.uuid


def find_foreign(gpus: Sequence[GpuInfo], leases: Mapping[str, LeaseParts], *, parent_of: ParentOf,
                 container_of: ContainerOf, only: Collection[str] | None = None) -> tuple[ForeignProcess, ...]:
    """Every foreign process on the leased GPUs/MIG instances in ``leases`` (UUID -> its parts).

    Args:
        gpus: an inventory's GPUs (MIG instances inside them).
        leases: the leases to check, by GPU or MIG UUID.
        only: check these UUIDs alone (a run's own GPUs); None: every leased one.

    Returns:
        The foreign processes, by GPU index then pid.
    """
    found = []
    for gpu in gpus:
        for p in gpu.processes:
            unit = lease_unit(gpu, p)
            lease = leases.get(unit)
            if lease is None or (only is not None and unit not in only):
                continue
            if part_of_lease(p.pid, lease, parent_of=parent_of, container_of=container_of):
                continue
            found.append(ForeignProcess(p.pid, p.user, p.used_memory_bytes, p.command, unit, gpu.index,
                                        lease.describe()))
    return tuple(sorted(found, key=lambda f: (f.gpu_index, f.gpu_uuid, f.pid)))


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` from ``/proc/<pid>/stat``; None when it is not visible from here."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def leases_from(holders: Sequence[Any], containers: Sequence[Any]) -> dict[str, LeaseParts]:
    """UUID -> :class:`LeaseParts` from the kernel's lease holders (:func:`launcher.gpu.leaseholders.list_holders`)
    and the run-labelled containers (:func:`launcher.gpu.holders.container_holders`)."""
    out: dict[str, LeaseParts] = {}
    for h in holders:
        mates = {c.container_id for c in containers if h.run_id and c.run_id == h.run_id}
        if h.container_id:
            mates.add(h.container_id)
        old = out.get(h.uuid)
        pids = {h.pid} if h.pid else set()
        if old is not None:  # a lease being handed to a child: both pids hold it for a moment
            pids |= old.holder_pids
            mates |= old.container_ids
        out[h.uuid] = LeaseParts(h.run_id, frozenset(pids), frozenset(mates))
    return out
