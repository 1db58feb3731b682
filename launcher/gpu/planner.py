"""From a :class:`~launcher.gpu.request.GpuRequest` to a plan on leased GPUs: the impure steps, in order.

Read NVML a few times (:func:`read_samples`), look at who holds what (:func:`held_by_other_runs`), select with
the pure functions of :mod:`launcher.gpu.select`, apply the site policy (:mod:`launcher.gpu.policy`), place
(:func:`launcher.gpu.placement.make_plan`) and lock the GPUs the plan uses (:mod:`launcher.gpu.reservations`).
:func:`plan_and_reserve` is the whole sequence; ``launcher up`` and ``launcher plan`` reach it through the
facade in :mod:`launcher.gpu`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from launcher.errors import MissingDependency, NoResources
from launcher.gpu import holders, leaseholders, nvml, policy, reservations
from launcher.gpu.mig import placeable
from launcher.gpu.nvml import GpuInfo, Inventory
from launcher.gpu.placement import Plan, PlanRequest, make_plan
from launcher.gpu.request import GpuRequest
from launcher.gpu.store import NO_STORE_NOTE, no_broker_note
from launcher.gpu.select import SelectionCriteria, why_not_free, pick_explicit, select_gpus, worst_of

logger = logging.getLogger(__name__)

GpuFilter = Callable[[list[GpuInfo]], tuple[list[GpuInfo], list[str]]]


@dataclass(frozen=True)
class Outcome:
    """What planning produced: the plan, the lease on its GPUs (None for a CPU plan or a preview), the GPUs
    the plan was made from (least loaded first) and the site policy it obeys."""

    plan: Plan
    reservation: reservations.Reservation | None
    gpus: tuple[GpuInfo, ...]
    site: policy.SitePolicy


def read_samples(samples: int, interval_s: float, *, sleep: Callable[[float], None] = time.sleep) -> list[Inventory]:
    """Read the inventory ``samples`` times, ``interval_s`` seconds apart (at least one read)."""
    readings = [nvml.read_inventory()]
    for _ in range(max(1, samples) - 1):
        if not readings[-1].available:
            break
        sleep(interval_s)
        readings.append(nvml.read_inventory())
    return readings


def held_by_other_runs(lock_dir: str | None = None, *, check_containers: bool = True) -> dict[str, str]:
    """UUID -> who holds it, from the GPU lock files and from labelled launcher containers.

    A detached Docker run's leases are held by its master container, which writes no holder note (the store is
    not mounted into it), so the kernel gives the pid and the container but no run id; the container's
    ``launcher.run`` label names the run then.
    """
    containers = holders.container_holders()[0] if check_containers else []
    run_of = {c.container_id: c.run_id for c in containers if c.run_id}
    held: dict[str, str] = {}
    for h in leaseholders.list_holders(lock_dir):
        if h.run_id is None and h.container_id in run_of:
            h = replace(h, run_id=run_of[h.container_id])
        held.setdefault(h.uuid, h.describe())
    for c in containers:
        for uuid in c.gpu_uuids:
            held.setdefault(uuid, c.describe())
    return held


def criteria_for(request: GpuRequest, *, min_free_memory_bytes: int | None = None) -> SelectionCriteria:
    """The selection thresholds of ``request`` (the policy may raise the memory floor)."""
    return SelectionCriteria(
        min_free_memory_bytes=request.min_free_memory_bytes if min_free_memory_bytes is None else min_free_memory_bytes,
        max_utilization_pct=float(request.max_utilization_pct),
        exclude_other_users=request.exclude_other_users,
        user=nvml.current_user(),
    )


def resolve_gpus(
    request: GpuRequest,
    *,
    criteria: SelectionCriteria | None = None,
    exclude_uuids: Iterable[str] = (),
    check_containers: bool = True,
) -> tuple[list[GpuInfo], list[str]]:
    """The GPUs a new run may use now, least loaded first, with the reasons for what was left out.

    Selection alone cannot keep two runs started at the same moment apart; :func:`plan_and_reserve` locks
    what the plan uses and selects again on a conflict.

    Args:
        request: the choice (``auto``/``none``/explicit), thresholds, samples and lock directory.
        criteria: thresholds to use instead of the request's (the policy's raised memory floor).
        exclude_uuids: GPUs to leave out in addition (e.g. ones this run already failed to reserve).
        check_containers: also treat GPUs named by running launcher containers' labels as held.

    Returns:
        (GPUs, reasons). With ``none``, or with ``auto`` on a machine where NVML is unavailable, the list
        is empty and the reasons say why (the caller then plans on CPU).

    Raises:
        BadInput: an explicit GPU that does not exist.
        MissingDependency: explicit GPUs were named but NVML is unavailable (reason and hint included).
        NoResources: an explicit GPU is held by another run or cannot be read.
    """
    choice = request.choice
    if choice.mode == "none":
        return [], ["--gpus none: CPU only"]
    criteria = criteria or criteria_for(request)
    readings = read_samples(request.samples if choice.mode == "auto" else 1, request.interval_s)
    first = readings[0]
    if not first.available:
        if choice.mode == "explicit":
            raise MissingDependency(f"--gpus {choice}: {first.unavailable_reason}", hint=first.hint)
        return [], [str(first.unavailable_reason)]
    errors = {e.index: e for r in readings for e in r.errors}
    reasons = [f"GPU {e.index} ({e.uuid or 'uuid unknown'}) skipped: {e.error}" for _, e in sorted(errors.items())]
    lock_dir = None if request.lock_dir is None else str(request.lock_dir)
    held = held_by_other_runs(lock_dir, check_containers=check_containers)
    for uuid in exclude_uuids:
        held.setdefault(uuid, "this run's earlier attempt")
    if choice.mode == "explicit":
        picked, warnings = pick_explicit(choice, first, criteria, held_by=held)
        return picked, reasons + warnings
    selection = select_gpus(worst_of([r.gpus for r in readings]), criteria, held_by=held)
    if len(readings) > 1:
        reasons.append(f"took the worst of {len(readings)} readings {request.interval_s:g} s apart")
    return list(selection.gpus), reasons + selection.reasons


def _plan_once(
    request: GpuRequest,
    placement: PlanRequest,
    *,
    run_id: str | None,
    cpu_count: int,
    criteria: SelectionCriteria,
    gpu_filter: GpuFilter | None,
    check_containers: bool,
    attempts: int,
    cpu_fallback: bool,
) -> tuple[Plan, reservations.Reservation | None, list[GpuInfo]]:
    """Select, filter, place and (with a ``run_id``) lock; select again when another run took a GPU first
    or a locked GPU turned busy (a job from outside the launcher started on it since it was sampled)."""
    mode = request.choice.mode
    excluded: set[str] = set()
    for _ in range(max(1, attempts)):
        gpus, reasons = resolve_gpus(request, criteria=criteria, exclude_uuids=excluded,
                                     check_containers=check_containers)
        if gpu_filter is not None:  # the site policy: reserved GPUs, a per-user cap
            gpus, limited = gpu_filter(gpus)
            reasons = [*reasons, *limited]
        plan = make_plan(placement, gpus, cpu_count, reasons=reasons)
        if plan.kind == "cpu" and not cpu_fallback and mode == "auto" and nvml.read_inventory().gpus:
            raise NoResources(
                "no GPU is free for this run:\n" + "\n".join(f"  - {r}" for r in reasons),
                hint="wait for a GPU (`launcher gpus` shows who holds them; `launcher up --wait` queues), relax "
                "--min-free-memory/--max-utilization, or pass --gpus none to run on CPU",
            )
        if plan.kind == "cpu" or run_id is None:
            return plan, None, gpus
        lock_dir = None if request.lock_dir is None else str(request.lock_dir)
        try:
            reservation = reservations.reserve(plan.gpu_uuids, run_id, lock_dir)
        except NoResources:
            if mode == "explicit":
                raise
            logger.info("another run took one of %s first; selecting again", ", ".join(plan.gpu_uuids))
            continue
        if mode == "explicit":
            return plan, reservation, gpus
        try:
            now = {g.uuid: g for g in placeable(nvml.read_inventory().gpus)}  # MIG instances by their own UUID
        except BaseException:  # NvmlTimeout (exit 6): give the GPUs back before it goes up
            reservation.release()
            raise
        turned = {u for u in reservation.uuids if u not in now or why_not_free(now[u], criteria, {}) is not None}
        if not turned:
            return plan, reservation, gpus
        logger.info("GPUs %s changed after locking; selecting again", ", ".join(sorted(turned)))
        reservation.release()
        excluded |= turned
    raise NoResources(
        f"could not lock the GPUs for run {run_id} in {attempts} attempts: other runs or jobs kept taking them",
        hint="try again, or name GPUs with --gpus (`launcher gpus` shows who holds what)",
    )


def plan_and_reserve(
    request: GpuRequest,
    *,
    run_id: str | None,
    cpu_count: int,
    site: policy.SitePolicy | None = None,
    check_containers: bool = True,
    attempts: int = 3,
    cpu_fallback: bool = True,
) -> Outcome:
    """Select GPUs, plan on them within the site policy, and lock the ones the plan uses.

    Steps: policy floor on ``--min-free-memory`` -> :func:`resolve_gpus` -> the policy's GPU filter ->
    :func:`launcher.gpu.placement.make_plan` -> :func:`launcher.gpu.reservations.reserve` of ``plan.gpu_uuids``
    -> one fresh NVML reading of the locked GPUs; a plan the policy refuses for its workers per GPU is made
    again with the master sharing a GPU (:func:`launcher.gpu.policy.plan_obeying`).

    Args:
        request: the parsed GPU options.
        run_id: the run the lease is for; None plans without locking anything (``launcher plan``).
        cpu_count: cores the run may use.
        site: the site policy (None: :func:`launcher.gpu.policy.load_policy`).
        check_containers: also treat GPUs named by running launcher containers' labels as held.
        attempts: selections to try when other runs keep taking the chosen GPUs.
        cpu_fallback: False: ``auto`` on a machine whose GPUs are all taken or busy raises NoResources instead
            of planning on CPU (a machine without NVML still plans on CPU).

    Returns:
        An :class:`Outcome`; hold ``outcome.reservation`` for the life of the run.

    Raises:
        BadInput, MissingDependency: as :func:`resolve_gpus`; PolicyViolation (a BadInput) from the policy.
        NoResources: the plan does not fit, or other runs kept taking the GPUs.
    """
    leases = None if request.on_cpu else reservations.lease_dir(request.lock_dir)  # refuses a bypassing --lock-dir
    site = policy.load_policy() if site is None else site
    floor, notes = policy.floor_min_free_memory(request.min_free_memory_bytes, site)
    criteria = criteria_for(request, min_free_memory_bytes=floor)
    lock_dir = None if request.lock_dir is None else str(request.lock_dir)
    gpu_filter = policy.gpu_filter_for(site, explicit=request.choice.mode == "explicit", lock_dir=lock_dir,
                                       run_id=run_id)
    used: list[GpuInfo] = []

    def make(placement: PlanRequest) -> tuple[Plan, reservations.Reservation | None]:
        plan, reservation, gpus = _plan_once(request, placement, run_id=run_id, cpu_count=cpu_count,
                                             criteria=criteria, gpu_filter=gpu_filter,
                                             check_containers=check_containers, attempts=attempts,
                                             cpu_fallback=cpu_fallback)
        used[:] = gpus
        return plan, reservation

    plan, reservation, limits = policy.plan_obeying(make, request.placement, site)
    if request.on_cpu:
        notes = []
    single_user = [NO_STORE_NOTE] if leases is not None and leases.site is None and plan.kind == "gpu" else []
    cap = site.max_gpus_per_user
    if leases is not None and (leases.site is None or leases.site.broker is None) and cap is not None:
        single_user.append(no_broker_note(cap))
    plan = replace(plan, reasons=(*notes, *plan.reasons, *limits, *single_user))
    return Outcome(plan=plan, reservation=reservation, gpus=tuple(used), site=site)
