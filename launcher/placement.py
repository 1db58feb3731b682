"""Placement: a pure function from (free GPUs, CPUs, request) to a typed :class:`Plan`.

No NVML, Docker or environment access here: inputs are plain data so the planner is tested with made-up
inventories (tests/test_placement*.py) and ``launcher plan`` shows exactly what ``up`` would do.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

# Enough envs per group process to amortise the policy forward pass over a batch, few enough that a
# dead group loses little; and bounded so one group's step loop does not starve on a shared core.
DEFAULT_MAX_WORKERS_PER_GROUP = 16


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for, in placement terms."""

    workers: int
    max_workers_per_group: int = DEFAULT_MAX_WORKERS_PER_GROUP
    groups: int | None = None  # force a number of groups (None: computed)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.max_workers_per_group < 1:
            raise ValueError(f"max_workers_per_group must be >= 1, got {self.max_workers_per_group}")
        if self.groups is not None and not 1 <= self.groups <= self.workers:
            raise ValueError(f"groups must be in 1..workers ({self.workers}), got {self.groups}")


@dataclass(frozen=True)
class ProcessShare:
    """The devices and limits one process (master or worker group) gets."""

    gpu_uuids: tuple[str, ...] = ()
    memory_limit_bytes: int | None = None  # TF GPU memory cap for this process; None on CPU
    cpus: float = 1.0  # CPU limit (Docker ``nano_cpus``); the process backend uses it for thread counts
    env: Mapping[str, str] = field(default_factory=dict)  # NVIDIA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER, ...

    @property
    def on_gpu(self) -> bool:
        return bool(self.gpu_uuids)


@dataclass(frozen=True)
class GroupPlan:
    index: int
    workers: int
    share: ProcessShare


@dataclass(frozen=True)
class Plan:
    """Where the master and each worker group run. Build with :func:`make_plan`."""

    master: ProcessShare
    groups: tuple[GroupPlan, ...]
    kind: str  # "cpu" or "gpu"
    reasons: tuple[str, ...] = ()  # human sentences saying why the plan looks the way it does

    @property
    def total_workers(self) -> int:
        return sum(g.workers for g in self.groups)

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for share in (self.master, *(g.share for g in self.groups)):
            for u in share.gpu_uuids:
                seen[u] = None
        return tuple(seen)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_workers"] = self.total_workers
        d["gpu_uuids"] = list(self.gpu_uuids)
        return d


def split_evenly(total: int, parts: int) -> list[int]:
    """Split ``total`` items into ``parts`` sizes differing by at most one, largest first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def cpu_plan(request: PlanRequest, cpu_count: int) -> Plan:
    """A plan with no GPU: groups sized to the cores.

    One group per core (at most ``max_workers_per_group`` workers each) keeps every core busy stepping
    envs while the learner trains. CPU limits are not slices: actors and learner alternate (PPO waits for
    the update), so each process may use every core; hard slices would leave cores idle.
    """
    cores = max(1, cpu_count)
    if request.groups is not None:
        n_groups = request.groups
    else:
        n_groups = max(min(request.workers, cores), math.ceil(request.workers / request.max_workers_per_group))
    sizes = split_evenly(request.workers, n_groups)
    cpu_env = {"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": ""}
    groups = tuple(
        GroupPlan(index=i, workers=n, share=ProcessShare(cpus=float(cores), env=dict(cpu_env)))
        for i, n in enumerate(sizes)
    )
    master = ProcessShare(cpus=float(cores), env=dict(cpu_env))
    reasons = (
        f"no GPU selected: CPU plan over {cores} core(s), "
        f"{request.workers} worker(s) in {n_groups} group(s) of {max(sizes)} or fewer",
    )
    return Plan(master=master, groups=groups, kind="cpu", reasons=reasons)
