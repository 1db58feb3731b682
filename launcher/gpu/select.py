"""Which GPUs a run may use: pure functions over :mod:`launcher.gpu.nvml` snapshots.

:func:`worst_of`, :func:`select_gpus` and :func:`pick_explicit` take plain data and are tested with made-up
inventories, like nvitop's ``select_devices``. Reading NVML and looking at who holds what is
:mod:`launcher.gpu.planner`'s job.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from launcher.errors import BadInput, NoResources
from launcher.gpu.mig import placeable
from launcher.gpu.nvml import GpuInfo, GpuProcess, Inventory
from launcher.gpu.request import GpuChoice
from launcher.units import format_size


@dataclass(frozen=True)
class SelectionCriteria:
    """When a GPU counts as free for a new run.

    Attributes:
        min_free_memory_bytes: a GPU needs at least this much free memory (worst sample).
        max_utilization_pct: and at most this GPU utilisation, in percent (worst sample).
        exclude_other_users: a GPU running a compute process of another user (or of an owner that cannot
            be seen from here) is not free.
        user: the user whose processes do not count as "other"; usually :func:`launcher.gpu.nvml.current_user`.
    """

    min_free_memory_bytes: int = 0
    max_utilization_pct: float = 100.0
    exclude_other_users: bool = True
    user: str | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.min_free_memory_bytes < 0:
            problems.append(f"min free memory must be >= 0 bytes, got {self.min_free_memory_bytes}")
        if not 0 <= self.max_utilization_pct <= 100:
            problems.append(f"max utilization must be within 0..100 %, got {self.max_utilization_pct}")
        if problems:
            raise BadInput("; ".join(problems))


@dataclass(frozen=True)
class Selection:
    """The outcome of :func:`select_gpus`: the free GPUs, least loaded first, and why the others are not."""

    gpus: tuple[GpuInfo, ...]
    rejected: tuple[tuple[GpuInfo, str], ...] = ()

    @property
    def reasons(self) -> list[str]:
        return [f"GPU {g.index} ({g.uuid}) not used: {why}" for g, why in self.rejected]


def _merge_processes(a: Sequence[GpuProcess], b: Sequence[GpuProcess]) -> tuple[GpuProcess, ...]:
    by_pid: dict[int, GpuProcess] = {p.pid: p for p in a}
    for p in b:
        seen = by_pid.get(p.pid)
        if seen is None or (p.used_memory_bytes or 0) > (seen.used_memory_bytes or 0):
            by_pid[p.pid] = p
    return tuple(by_pid[pid] for pid in sorted(by_pid))


def _max_optional(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def worst_of(samples: Sequence[Sequence[GpuInfo]]) -> list[GpuInfo]:
    """Combine several readings into one pessimistic reading per GPU.

    A GPU that has just started a job can look idle in one reading; taking the least free memory, the
    highest utilisation and every process seen in any reading catches it. A GPU missing from any reading
    (it errored) is left out. Order follows the first reading. MIG instances are compared one by one
    (:func:`launcher.gpu.mig.placeable`), so the result holds them in place of their GPU.
    """
    if not samples:
        return []
    units = [placeable(sample) for sample in samples]
    present = [{g.uuid: g for g in sample} for sample in units]
    merged: list[GpuInfo] = []
    for first in units[0]:
        readings = [p.get(first.uuid) for p in present]
        if any(r is None for r in readings):
            continue
        worst = first
        for r in readings[1:]:
            assert r is not None
            worst = replace(
                worst,
                memory_used_bytes=max(worst.memory_used_bytes, r.memory_used_bytes),
                memory_free_bytes=min(worst.memory_free_bytes, r.memory_free_bytes),
                gpu_utilization_pct=_max_optional(worst.gpu_utilization_pct, r.gpu_utilization_pct),
                memory_utilization_pct=_max_optional(worst.memory_utilization_pct, r.memory_utilization_pct),
                processes=_merge_processes(worst.processes, r.processes),
            )
        merged.append(worst)
    return merged


def load_key(gpu: GpuInfo) -> tuple[int, int, int]:
    """Sort key, least loaded first: lower utilisation, then more free memory, then lower index."""
    return (gpu.gpu_utilization_pct or 0, -gpu.memory_free_bytes, gpu.index)


def why_not_free(gpu: GpuInfo, criteria: SelectionCriteria, held_by: Mapping[str, str]) -> str | None:
    if gpu.uuid in held_by:
        return f"held by {held_by[gpu.uuid]}"
    if gpu.mig_mode:
        names = ", ".join(m.uuid for m in gpu.mig_devices)
        return (f"MIG mode is on: its MIG instances are placed instead ({names})" if names else
                "MIG mode is on but no MIG instance is configured (create one with `nvidia-smi mig -cgi ... -C`)")
    if gpu.memory_free_bytes < criteria.min_free_memory_bytes:
        return (
            f"{format_size(gpu.memory_free_bytes)} free < --min-free-memory "
            f"{format_size(criteria.min_free_memory_bytes)}"
        )
    util = gpu.gpu_utilization_pct
    if util is not None and util > criteria.max_utilization_pct:
        return f"{util}% utilization > --max-utilization {criteria.max_utilization_pct:g}%"
    if criteria.exclude_other_users:
        others = [p for p in gpu.processes if p.user is None or p.user != criteria.user]
        if others:
            p = others[0]
            owner = p.user or "a user not visible from here"
            more = f" and {len(others) - 1} more" if len(others) > 1 else ""
            return f"running process {p.pid} of {owner}{more} (pass --allow-other-users to share)"
    return None


def select_gpus(
    gpus: Iterable[GpuInfo],
    criteria: SelectionCriteria,
    *,
    held_by: Mapping[str, str] | None = None,
) -> Selection:
    """Keep the GPUs that are free by ``criteria`` and not held by another run; least loaded first.

    Args:
        gpus: readings (take :func:`worst_of` several first).
        criteria: the thresholds.
        held_by: UUID -> a description of the other launcher run holding it (those GPUs are excluded).

    Returns:
        A :class:`Selection`; the rejected GPUs come with a sentence saying why.
    """
    held = dict(held_by or {})
    chosen: list[GpuInfo] = []
    rejected: list[tuple[GpuInfo, str]] = []
    for gpu in gpus:
        if gpu.mig_mode and not gpu.mig_devices:
            rejected.append((gpu, str(why_not_free(gpu, criteria, {}))))
        for unit in placeable([gpu]):  # a GPU in MIG mode: each of its instances, like a GPU of its own
            why = why_not_free(unit, criteria, held)
            if why is None:
                chosen.append(unit)
            else:
                rejected.append((unit, why))
    return Selection(tuple(sorted(chosen, key=load_key)), tuple(rejected))


def pick_explicit(
    choice: GpuChoice,
    inventory: Inventory,
    criteria: SelectionCriteria,
    *,
    held_by: Mapping[str, str] | None = None,
) -> tuple[list[GpuInfo], list[str]]:
    """The GPUs an explicit ``--gpus`` names, in the order given.

    Thresholds do not apply (naming a GPU overrides them) but each one that fails them gets a warning in
    the reasons. A GPU held by another launcher run is never handed out twice.

    Raises:
        BadInput: an index or UUID that is not on this machine (the message lists what exists).
        NoResources: a named GPU is held by another launcher run, or cannot be read (e.g. lost).
    """
    by_index = {str(g.index): g for g in inventory.gpus}
    by_uuid = {g.uuid.lower(): g for g in [*inventory.gpus, *placeable(inventory.gpus)]}  # MIG instances too
    broken = {str(e.index): e for e in inventory.errors} | {e.uuid.lower(): e for e in inventory.errors if e.uuid}
    held = dict(held_by or {})
    picked: list[GpuInfo] = []
    reasons: list[str] = []
    unknown: list[str] = []
    for item in choice.items:
        gpu = by_index.get(item) or by_uuid.get(item.lower())
        if gpu is None:
            if item.lower() in broken or item in broken:
                err = broken.get(item) or broken[item.lower()]
                raise NoResources(f"--gpus {item}: GPU {err.index} cannot be read: {err.error}",
                                  hint="check `nvidia-smi`; the GPU may need a reset, or choose another")
            unknown.append(item)
            continue
        if gpu.mig_mode:
            instances = ", ".join(m.uuid for m in gpu.mig_devices) or "none configured"
            raise BadInput(f"--gpus {item}: GPU {gpu.index} is in MIG mode and runs nothing as a whole GPU; "
                           f"its MIG instances: {instances}",
                           hint="name MIG instances by UUID (`launcher gpus` lists them), or disable MIG mode")
        if gpu.uuid in held:
            raise NoResources(f"--gpus {item}: GPU {gpu.index} ({gpu.uuid}) is held by {held[gpu.uuid]}",
                              hint="wait for that run to end, stop it, or choose other GPUs (`launcher gpus`)")
        if gpu in picked:
            raise BadInput(f"--gpus names GPU {gpu.index} twice (as index and UUID)")
        warning = why_not_free(gpu, criteria, {})
        if warning:
            reasons.append(f"GPU {gpu.index} used because --gpus names it, although it is {warning}")
        picked.append(gpu)
    if unknown:
        existing = ", ".join(f"{g.index} ({g.uuid})" for g in inventory.gpus) or "none"
        raise BadInput(
            f"--gpus: no GPU {', '.join(unknown)} on this machine; GPUs here: {existing}",
            hint="run `launcher gpus` to list them",
        )
    return picked, reasons
