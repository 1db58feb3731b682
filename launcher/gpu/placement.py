"""Placement: a pure function from (free GPUs, CPUs, request) to a typed :class:`Plan`.

No NVML, Docker or environment access here: inputs are plain data so the planner is tested with made-up
inventories (tests/test_placement*.py) and ``launcher plan`` shows exactly what ``up`` would do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from launcher.errors import NoResources

# Enough envs per group process to amortise the policy forward pass over a batch, few enough that a
# dead group loses little; and bounded so one group's step loop does not starve on a shared core.
DEFAULT_MAX_WORKERS_PER_GROUP = 16

GiB = 1024**3
MiB = 1024**2
# Memory figures of the GPU model (PlanRequest fields; `launcher plan --master-memory/--worker-memory`).
# TF's allocator limit covers the model, optimizer state and batches; the CUDA context, cuDNN/cuBLAS
# handles and kernels live outside it, hence a per-process overhead on top.
DEFAULT_MASTER_MEMORY_BYTES = 4 * GiB  # the learner: network, optimizer state, a training batch
DEFAULT_GROUP_MEMORY_BYTES = 1 * GiB  # a worker-group process: policy copy and inference workspace
DEFAULT_WORKER_MEMORY_BYTES = 256 * MiB  # each worker's share of its group's inference batch
DEFAULT_PROCESS_OVERHEAD_BYTES = 512 * MiB  # CUDA context and library handles, outside TF's limit
DEFAULT_MEMORY_HEADROOM_FRACTION = 0.05  # of each GPU's free memory, left for fragmentation and others


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for, in placement terms."""

    workers: int
    max_workers_per_group: int = DEFAULT_MAX_WORKERS_PER_GROUP
    groups: int | None = None  # force a number of groups (None: computed)
    master_memory_bytes: int = DEFAULT_MASTER_MEMORY_BYTES
    group_memory_bytes: int = DEFAULT_GROUP_MEMORY_BYTES
    worker_memory_bytes: int = DEFAULT_WORKER_MEMORY_BYTES
    process_overhead_bytes: int = DEFAULT_PROCESS_OVERHEAD_BYTES
    memory_headroom_fraction: float = DEFAULT_MEMORY_HEADROOM_FRACTION
    # None: the master gets a GPU of its own when the workers fit on the others; True: it must (or the
    # plan fails); False: it shares the first GPU and the workers spread over every GPU.
    isolate_master: bool | None = None
    # True: collection overlaps learning (the default), so on CPU the learner keeps a core of its own; False
    # (``sync=true``): actors and learner take turns and every core gets a group.
    learner_core: bool = True

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.max_workers_per_group < 1:
            raise ValueError(f"max_workers_per_group must be >= 1, got {self.max_workers_per_group}")
        if self.groups is not None and not 1 <= self.groups <= self.workers:
            raise ValueError(f"groups must be in 1..workers ({self.workers}), got {self.groups}")
        for name in ("master_memory_bytes", "group_memory_bytes", "worker_memory_bytes", "process_overhead_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.memory_headroom_fraction < 1.0:
            raise ValueError(f"memory_headroom_fraction must be in [0, 1), got {self.memory_headroom_fraction}")


@dataclass(frozen=True)
class ProcessShare:
    """The devices and limits one process (master or worker group) gets."""

    gpu_uuids: tuple[str, ...] = ()
    memory_limit_bytes: int | None = None  # TF GPU memory cap for this process; None on CPU
    cpus: float = 1.0  # CPU limit (Docker ``nano_cpus``); the process backend uses it for thread counts
    # No environment here: each backend makes a share's variables (launcher.backends.containers.worker_env) and
    # its specs (Backend.specs, `launcher plan --backend X`) show them.
    gpu_indices: tuple[int, ...] = ()  # NVML indices of gpu_uuids, for people; processes use the UUIDs

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

    One group per core but one (at most ``max_workers_per_group`` workers each): collection overlaps
    learning, so the learner is busy while the groups step envs and needs a core of its own. Measured on
    2 cores, CartPole PPO, 8 workers (docs/benchmarks.md, section 1): one group of 8 collects at ~27 k
    env-steps/s while learning, two groups of 4 at ~19 k (three busy processes on two cores, and half the
    envs per batched call); A3C 22-23 k against ~17 k. A synchronous round (``learner_core=False``) takes
    turns, so there every core gets a group (CartPole: the same either way; heavier envs step in parallel).
    CPU limits are not slices: each process may use every core; hard slices would leave cores idle when
    one side waits for the other.
    """
    cores = max(1, cpu_count)
    keep_core = request.groups is None and request.learner_core and cores >= 2  # one core is the learner's
    if request.groups is not None:
        n_groups = request.groups
    else:
        actor_cores = cores - 1 if keep_core else cores
        n_groups = max(min(request.workers, actor_cores), math.ceil(request.workers / request.max_workers_per_group))
    sizes = split_evenly(request.workers, n_groups)
    groups = tuple(GroupPlan(index=i, workers=n, share=ProcessShare(cpus=float(cores))) for i, n in enumerate(sizes))
    master = ProcessShare(cpus=float(cores))
    reasons = (
        f"no GPU selected: CPU plan over {cores} core(s), "
        f"{request.workers} worker(s) in {n_groups} group(s) of {max(sizes)} or fewer"
        + (" (one core left to the learner)" if keep_core else ""),
    )
    return Plan(master=master, groups=groups, kind="cpu", reasons=reasons)


class GpuCapacity(Protocol):
    """What the planner needs to know about a GPU (``launcher.gpu.nvml.GpuInfo`` has it)."""

    @property
    def index(self) -> int: ...

    @property
    def uuid(self) -> str: ...

    @property
    def memory_free_bytes(self) -> int: ...


def _group_cost(request: PlanRequest) -> int:
    return request.process_overhead_bytes + request.group_memory_bytes


def _master_cost(request: PlanRequest) -> int:
    return request.process_overhead_bytes + request.master_memory_bytes


def _groups_for(workers: int, request: PlanRequest) -> int:
    return math.ceil(workers / request.max_workers_per_group) if workers else 0


def worker_capacity(available_bytes: int, request: PlanRequest) -> int:
    """The most workers that fit in ``available_bytes`` of one GPU ."""
    per_group, per_worker, size = _group_cost(request), request.worker_memory_bytes, request.max_workers_per_group
    full = per_group + size * per_worker
    if full == 0:
        return request.workers if available_bytes >= 0 else 0  # nothing costs memory: anything fits
    if available_bytes <= 0:
        return 0
    groups, rest = divmod(available_bytes, full)
    if rest < per_group + per_worker:
        extra = 0
    elif per_worker == 0:
        extra = size
    else:
        extra = min(size, (rest - per_group) // per_worker)
    return min(groups * size + extra, request.workers)


def _water_fill(total: int, caps: Sequence[int]) -> list[int]:
    """Spread ``total`` as evenly as ``caps`` allow; earlier positions get the remainders. sum(caps) >= total."""
    counts = [0] * len(caps)
    active = [i for i, c in enumerate(caps) if c > 0]
    remaining = total
    while remaining > 0 and active:
        still_open = []
        for i, share in zip(active, split_evenly(remaining, len(active))):
            take = min(share, caps[i] - counts[i])
            counts[i] += take
            remaining -= take
            if counts[i] < caps[i]:
                still_open.append(i)
        active = still_open
    if remaining:
        raise AssertionError(f"water fill left {remaining} of {total} over caps {list(caps)}")
    return counts


@dataclass(frozen=True)
class _Layout:
    master: int  # position of the master's GPU in the preference order
    isolated: bool
    group_sizes: tuple[tuple[int, ...], ...]  # per GPU position: workers of each group there


def _sizes_on_gpu(workers: int, request: PlanRequest) -> tuple[int, ...]:
    return tuple(split_evenly(workers, _groups_for(workers, request))) if workers else ()


def _layout_computed(request: PlanRequest, usable: list[int]) -> _Layout | None:
    """Per-GPU worker counts when the group count is free: isolate the master if possible, else put as few
    workers as possible beside it (the others filled to capacity first)."""
    n, master_cost = len(usable), _master_cost(request)
    caps = [worker_capacity(u, request) for u in usable]
    fits_master = [i for i in range(n) if usable[i] >= master_cost]
    if request.isolate_master is not False and n >= 2:
        for i in fits_master:
            others = [0 if j == i else caps[j] for j in range(n)]
            if sum(others) >= request.workers:
                counts = _water_fill(request.workers, others)
                return _Layout(i, True, tuple(_sizes_on_gpu(c, request) for c in counts))
    if request.isolate_master:
        return None
    best: tuple[int, int] | None = None  # (workers beside the master, position)
    for i in fits_master:
        caps_i = [worker_capacity(usable[i] - master_cost, request) if j == i else caps[j] for j in range(n)]
        if sum(caps_i) < request.workers:
            continue
        beside = max(0, request.workers - (sum(caps) - caps[i]))
        if request.isolate_master is False:
            beside = 0  # ranking only; the spread below decides
        if best is None or beside < best[0]:
            best = (beside, i)
    if best is None:
        return None
    i = best[1]
    caps_i = [worker_capacity(usable[i] - master_cost, request) if j == i else caps[j] for j in range(n)]
    if request.isolate_master is False:
        counts = _water_fill(request.workers, caps_i)
    else:
        beside = max(0, request.workers - (sum(caps) - caps[i]))
        counts = _water_fill(request.workers - beside, [0 if j == i else caps[j] for j in range(n)])
        counts[i] = beside
    return _Layout(i, False, tuple(_sizes_on_gpu(c, request) for c in counts))


def _pack_groups(sizes: Sequence[int], room: list[int], request: PlanRequest, skip: int | None) -> list[list[int]] | None:
    """Worst-fit: each group, largest first, on the GPU with the most room left; None if one does not fit."""
    placed: list[list[int]] = [[] for _ in room]
    room = list(room)
    for size in sorted(sizes, reverse=True):
        cost = _group_cost(request) + size * request.worker_memory_bytes
        order = sorted((i for i in range(len(room)) if i != skip), key=lambda i: (-room[i], i))
        target = next((i for i in order if room[i] >= cost), None)
        if target is None:
            return None
        room[target] -= cost
        placed[target].append(size)
    return placed


def _layout_forced(request: PlanRequest, usable: list[int]) -> _Layout | None:
    """Placement of exactly ``request.groups`` groups (sizes as even as possible)."""
    assert request.groups is not None
    sizes = split_evenly(request.workers, request.groups)
    n, master_cost = len(usable), _master_cost(request)
    fits_master = [i for i in range(n) if usable[i] >= master_cost]
    if request.isolate_master is not False and n >= 2:
        for i in fits_master:
            placed = _pack_groups(sizes, usable, request, skip=i)
            if placed is not None:
                return _Layout(i, True, tuple(tuple(p) for p in placed))
    if request.isolate_master:
        return None
    for i in fits_master:
        room = [u - master_cost if j == i else u for j, u in enumerate(usable)]
        placed = _pack_groups(sizes, room, request, skip=None)
        if placed is not None:
            return _Layout(i, False, tuple(tuple(p) for p in placed))
    return None


def _limits(needs: Sequence[int], usable: int, overhead: int) -> list[int]:
    """Give each process on a GPU its need plus a share of the spare memory proportional to that need."""
    spare = usable - sum(needs) - overhead * len(needs)
    total = sum(needs)
    if total == 0:
        return [n + spare // len(needs) for n in needs]
    return [n + spare * n // total for n in needs]


def _no_room(request: PlanRequest, gpus: Sequence[GpuCapacity], usable: list[int]) -> NoResources:
    free = ", ".join(f"GPU {g.index}: {u / GiB:.1f} GiB" for g, u in zip(gpus, usable))
    what = "with the master on a GPU of its own " if request.isolate_master else ""
    return NoResources(
        f"cannot place the master and {request.workers} worker(s) {what}on {len(gpus)} GPU(s) "
        f"(usable memory {free}; master {_master_cost(request) / GiB:.1f} GiB, each group process "
        f"{_group_cost(request) / GiB:.1f} GiB + {request.worker_memory_bytes / GiB:.2f} GiB per worker)",
        hint="use fewer --workers or less --worker-memory, free or add GPUs (`launcher gpus`), "
        "or run on CPU with --gpus none",
    )


def make_plan(
    request: PlanRequest,
    gpus: Sequence[GpuCapacity],
    cpu_count: int,
    *,
    reasons: Sequence[str] = (),
) -> Plan:
    """Place the master and the worker groups on ``gpus`` (pure; the same input gives the same plan).

    Policy: each group process sees one GPU. The master gets a GPU of its own whenever the workers fit on
    the others; otherwise it shares the GPU where the fewest workers must go beside it, the other GPUs
    being filled to their capacity first (32 workers on 4 GPUs that hold 10 each: master + 2, 10, 10, 10).
    Workers spread evenly over the worker GPUs, in groups of at most ``max_workers_per_group``. Capacity
    comes from the request's memory figures against each GPU's free memory less the headroom; each process
    then gets a TF memory limit of its need plus a share of the GPU's spare memory, so no GPU is
    over-committed. With no GPUs, this is :func:`cpu_plan`.

    Args:
        request: workers, group size and memory figures.
        gpus: the usable GPUs, in order of preference (least loaded first, as ``resolve_gpus`` returns them).
        cpu_count: cores this run may use.
        reasons: sentences from GPU selection, put first in ``Plan.reasons``.

    Raises:
        NoResources: the workers and the master do not fit in the GPUs' free memory (the message has the
            figures).
    """
    if not gpus:
        plan = cpu_plan(request, cpu_count)
        return replace(plan, reasons=tuple(reasons) + plan.reasons)
    cores = max(1, cpu_count)
    usable = [int(g.memory_free_bytes * (1.0 - request.memory_headroom_fraction)) for g in gpus]
    layout = _layout_computed(request, usable) if request.groups is None else _layout_forced(request, usable)
    if layout is None:
        raise _no_room(request, gpus, usable)

    master_share: ProcessShare | None = None
    groups: list[GroupPlan] = []
    notes = list(reasons)
    for pos, gpu in enumerate(gpus):
        sizes = layout.group_sizes[pos]
        with_master = pos == layout.master
        if not sizes and not with_master:
            notes.append(f"GPU {gpu.index} not used: the workers fit on the other GPUs")
            continue
        needs = [request.group_memory_bytes + n * request.worker_memory_bytes for n in sizes]
        if with_master:
            needs.insert(0, request.master_memory_bytes)
        limits = _limits(needs, usable[pos], request.process_overhead_bytes)
        if with_master:
            master_share = ProcessShare((gpu.uuid,), limits.pop(0), float(cores), gpu_indices=(gpu.index,))
        for n, limit in zip(sizes, limits):
            cpus = max(0.1, round(cores * n / request.workers, 2))
            share = ProcessShare((gpu.uuid,), limit, cpus, gpu_indices=(gpu.index,))
            groups.append(GroupPlan(index=len(groups), workers=n, share=share))
    assert master_share is not None

    master_gpu = gpus[layout.master]
    beside = sum(layout.group_sizes[layout.master])
    if layout.isolated:
        notes.append(f"master alone on GPU {master_gpu.index}: the {request.workers} worker(s) fit on the other GPUs")
    elif len(gpus) == 1:
        notes.append(f"master shares GPU {master_gpu.index}, the only GPU, with {beside} worker(s)")
    else:
        notes.append(
            f"master shares GPU {master_gpu.index} with {beside} worker(s): the other GPUs do not have memory "
            f"for all {request.workers} workers" + (" (the request does not isolate it)" if request.isolate_master is False else "")
        )
    per_gpu = ", ".join(
        f"GPU {g.index}: " + ("master" + (" + " if layout.group_sizes[p] else "") if p == layout.master else "")
        + "+".join(str(n) for n in layout.group_sizes[p])
        for p, g in enumerate(gpus)
        if layout.group_sizes[p] or p == layout.master
    )
    notes.append(f"workers per GPU: {per_gpu}")
    notes.append(
        f"memory model: master {request.master_memory_bytes / GiB:.2f} GiB, group process "
        f"{request.group_memory_bytes / GiB:.2f} GiB + {request.worker_memory_bytes / GiB:.2f} GiB per worker, "
        f"{request.process_overhead_bytes / GiB:.2f} GiB CUDA context per process, "
        f"{request.memory_headroom_fraction:.0%} of free memory kept back; TF limits share out the rest"
    )
    notes.append(
        f"CPUs: groups share the {cores} core(s) by worker count (they step envs at the same time); the "
        "master may use all of them (it trains while the actors wait)"
    )
    return Plan(master=master_share, groups=tuple(groups), kind="gpu", reasons=tuple(notes))
