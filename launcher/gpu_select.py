"""Which GPUs a run may use: pure functions over :mod:`launcher.nvml` snapshots, and one reader on top.

The pure part (:func:`parse_size`, :func:`parse_gpu_choice`, :func:`worst_of`, :func:`select_gpus`,
:func:`pick_explicit`) takes plain data and is tested with made-up inventories, like nvitop's
``select_devices``. :func:`resolve_gpus` is what ``launcher plan`` and ``launcher up`` call: it reads NVML a
few times, looks at who holds what, and applies the pure functions.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from launcher import nvml, placement, reservations
from launcher.errors import BadInput, MissingDependency, NoResources
from launcher.nvml import GpuInfo, GpuProcess, Inventory

logger = logging.getLogger(__name__)

DEFAULT_MIN_FREE_MEMORY = "1GiB"
DEFAULT_MAX_UTILIZATION_PCT = 50.0
DEFAULT_SAMPLES = 3
DEFAULT_INTERVAL_S = 0.2

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int, *, what: str = "size") -> int:
    """Parse a memory size into bytes.

    Accepts a plain byte count or a number with a unit: ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024),
    ``KB``/``MB``/``GB``/``TB`` (powers of 1000) and Docker's one-letter ``k``/``m``/``g``/``t`` (powers of
    1024); case-insensitive. ``"8GiB"`` -> 8589934592, ``"500MB"`` -> 500000000.

    Args:
        value: the text (or an int, taken as bytes).
        what: how to name the value in an error, e.g. ``"--min-free-memory"``.

    Raises:
        BadInput: not a non-negative size.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise BadInput(f"{what} must not be negative, got {value}")
        return value
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise BadInput(
            f"{what}: cannot read {value!r} as a memory size",
            hint="write a number with a unit, e.g. 8GiB, 500MB, 1.5g or a byte count",
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(n_bytes: int | None) -> str:
    """``85899345920`` -> ``"80.0 GiB"`` (binary units, one decimal); ``None`` -> ``"?"``."""
    if n_bytes is None:
        return "?"
    size = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover


@dataclass(frozen=True)
class GpuChoice:
    """A parsed ``--gpus`` value: ``auto``, ``none``, or explicit indices and/or UUIDs (in the given order)."""

    mode: str  # "auto" | "none" | "explicit"
    items: tuple[str, ...] = ()


def parse_gpu_choice(text: str) -> GpuChoice:
    """Parse ``--gpus auto|none|<indices>|<UUIDs>`` (comma-separated; indices and UUIDs may be mixed).

    Raises:
        BadInput: empty, an item that is neither an index nor a ``GPU-``/``MIG-`` UUID, or a repeated item.
    """
    value = text.strip()
    if value.lower() in ("auto", "none"):
        return GpuChoice(value.lower())
    items = tuple(item.strip() for item in value.split(","))
    problems = [
        repr(item)
        for item in items
        if not (item.isdigit() or re.fullmatch(r"(GPU|MIG)-[0-9A-Za-z-]+", item, flags=re.IGNORECASE))
    ]
    if not value or problems:
        raise BadInput(
            f"--gpus: cannot read {text!r}" + (f" (bad item(s): {', '.join(problems)})" if problems else ""),
            hint="use auto, none, GPU indices like 0,2 or UUIDs like GPU-8f3a... (see `launcher gpus`)",
        )
    duplicates = sorted({item for item in items if items.count(item) > 1})
    if duplicates:
        raise BadInput(f"--gpus names {', '.join(duplicates)} more than once")
    return GpuChoice("explicit", items)


@dataclass(frozen=True)
class SelectionCriteria:
    """When a GPU counts as free for a new run.

    Attributes:
        min_free_memory_bytes: a GPU needs at least this much free memory (worst sample).
        max_utilization_pct: and at most this GPU utilisation, in percent (worst sample).
        exclude_other_users: a GPU running a compute process of another user (or of an owner that cannot
            be seen from here) is not free.
        user: the user whose processes do not count as "other"; usually :func:`launcher.nvml.current_user`.
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
    (it errored) is left out. Order follows the first reading.
    """
    if not samples:
        return []
    present = [{g.uuid: g for g in sample} for sample in samples]
    merged: list[GpuInfo] = []
    for first in samples[0]:
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


def _rejection(gpu: GpuInfo, criteria: SelectionCriteria, held_by: Mapping[str, str]) -> str | None:
    if gpu.uuid in held_by:
        return f"held by {held_by[gpu.uuid]}"
    if gpu.mig_mode:
        return "MIG mode is on (the launcher places whole GPUs; disable MIG or use another GPU)"
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
        why = _rejection(gpu, criteria, held)
        if why is None:
            chosen.append(gpu)
        else:
            rejected.append((gpu, why))
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
    by_uuid = {g.uuid.lower(): g for g in inventory.gpus}
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
        if gpu.uuid in held:
            raise NoResources(f"--gpus {item}: GPU {gpu.index} ({gpu.uuid}) is held by {held[gpu.uuid]}",
                              hint="wait for that run to end, stop it, or choose other GPUs (`launcher gpus`)")
        if gpu in picked:
            raise BadInput(f"--gpus names GPU {gpu.index} twice (as index and UUID)")
        warning = _rejection(gpu, criteria, {})
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


def read_samples(samples: int, interval_s: float, *, sleep: Callable[[float], None] = time.sleep) -> list[Inventory]:
    """Read the inventory ``samples`` times, ``interval_s`` seconds apart (at least one read)."""
    readings = [nvml.read_inventory()]
    for _ in range(max(1, samples) - 1):
        if not readings[-1].available:
            break
        sleep(interval_s)
        readings.append(nvml.read_inventory())
    return readings


def held_by_other_runs(lock_dir: str | Path | None = None, *, check_containers: bool = True) -> dict[str, str]:
    """UUID -> who holds it, from the GPU lock files and from labelled launcher containers."""
    held: dict[str, str] = {}
    for h in reservations.list_holders(lock_dir):
        held.setdefault(h.uuid, h.describe())
    if check_containers:
        containers, _reason = reservations.container_holders()
        for c in containers:
            for uuid in c.gpu_uuids:
                held.setdefault(uuid, c.describe())
    return held


def _criteria(min_free_memory: str | int, max_utilization_pct: float, exclude_other_users: bool) -> SelectionCriteria:
    return SelectionCriteria(
        min_free_memory_bytes=parse_size(min_free_memory, what="--min-free-memory"),
        max_utilization_pct=float(max_utilization_pct),
        exclude_other_users=exclude_other_users,
        user=nvml.current_user(),
    )


def resolve_gpus(
    choice: str,
    *,
    min_free_memory: str | int = DEFAULT_MIN_FREE_MEMORY,
    max_utilization_pct: float = DEFAULT_MAX_UTILIZATION_PCT,
    exclude_other_users: bool = True,
    samples: int = DEFAULT_SAMPLES,
    interval_s: float = DEFAULT_INTERVAL_S,
    lock_dir: str | Path | None = None,
    exclude_uuids: Iterable[str] = (),
    check_containers: bool = True,
) -> tuple[list[GpuInfo], list[str]]:
    """The GPUs a new run may use now, least loaded first, with the reasons for what was left out.

    This is the entry point for ``launcher plan`` and ``launcher up``: pass the list to
    :func:`launcher.placement.make_plan`, then take the GPUs the plan uses with
    :func:`launcher.reservations.reserve` (which is what makes two runs started at the same moment
    disjoint: selection alone cannot). On a conflict, call this again: the other run's locks now exclude
    its GPUs. :func:`plan_and_reserve` does exactly that.

    Args:
        choice: ``--gpus``: ``auto`` (free GPUs by the thresholds), ``none`` (CPU), or indices/UUIDs.
        min_free_memory: least free memory per GPU, as bytes or text such as ``"8GiB"``.
        max_utilization_pct: highest GPU utilisation, percent.
        exclude_other_users: whether other users' compute processes make a GPU unavailable.
        samples: readings to take (``auto`` only); the worst of them counts.
        interval_s: seconds between readings.
        lock_dir: the reservation lock directory (None: ``$LAUNCHER_LOCK_DIR`` or the default).
        exclude_uuids: GPUs to leave out in addition (e.g. ones this run already failed to reserve).
        check_containers: also treat GPUs named by running launcher containers' labels as held.

    Returns:
        (GPUs, reasons). With ``none``, or with ``auto`` on a machine where NVML is unavailable, the list
        is empty and the reasons say why (the caller then plans on CPU).

    Raises:
        BadInput: a malformed ``choice``/threshold, or an explicit GPU that does not exist.
        MissingDependency: explicit GPUs were named but NVML is unavailable (reason and hint included).
        NoResources: an explicit GPU is held by another run or cannot be read.
    """
    parsed = parse_gpu_choice(choice)
    if parsed.mode == "none":
        return [], ["--gpus none: CPU only"]
    criteria = _criteria(min_free_memory, max_utilization_pct, exclude_other_users)
    readings = read_samples(samples if parsed.mode == "auto" else 1, interval_s)
    first = readings[0]
    if not first.available:
        if parsed.mode == "explicit":
            raise MissingDependency(f"--gpus {choice}: {first.unavailable_reason}", hint=first.hint)
        return [], [str(first.unavailable_reason)]
    errors = {e.index: e for r in readings for e in r.errors}
    reasons = [f"GPU {e.index} ({e.uuid or 'uuid unknown'}) skipped: {e.error}" for _, e in sorted(errors.items())]
    held = held_by_other_runs(lock_dir, check_containers=check_containers)
    for uuid in exclude_uuids:
        held.setdefault(uuid, "this run's earlier attempt")
    if parsed.mode == "explicit":
        picked, warnings = pick_explicit(parsed, first, criteria, held_by=held)
        return picked, reasons + warnings
    selection = select_gpus(worst_of([r.gpus for r in readings]), criteria, held_by=held)
    if len(readings) > 1:
        reasons.append(f"took the worst of {len(readings)} readings {interval_s:g} s apart")
    return list(selection.gpus), reasons + selection.reasons


def plan_and_reserve(
    request: placement.PlanRequest,
    *,
    choice: str,
    run_id: str,
    cpu_count: int,
    lock_dir: str | Path | None = None,
    min_free_memory: str | int = DEFAULT_MIN_FREE_MEMORY,
    max_utilization_pct: float = DEFAULT_MAX_UTILIZATION_PCT,
    exclude_other_users: bool = True,
    samples: int = DEFAULT_SAMPLES,
    interval_s: float = DEFAULT_INTERVAL_S,
    check_containers: bool = True,
    attempts: int = 3,
    cpu_fallback: bool = True,
    gpu_filter: Callable[[list[GpuInfo]], tuple[list[GpuInfo], list[str]]] | None = None,
) -> tuple[placement.Plan, reservations.Reservation | None]:
    """Select GPUs, plan on them and lock the ones the plan uses: what ``launcher up`` does before starting.

    Steps: :func:`resolve_gpus` -> :func:`launcher.placement.make_plan` -> :func:`launcher.reservations.reserve`
    of ``plan.gpu_uuids`` -> one fresh NVML reading of the locked GPUs (a job from outside the launcher may
    have started on one since it was sampled). A GPU another run locked first, or one that turned busy, is
    left out and the whole thing runs again, up to ``attempts`` times. The selection keyword arguments are
    those of :func:`resolve_gpus`. ``gpu_filter`` narrows each selection further and says why (the site
    policy's hook; it may raise for GPUs the user named). With ``cpu_fallback`` False, ``auto`` on a machine
    whose GPUs are all taken or busy raises instead of planning on CPU (a machine without NVML still plans
    on CPU).

    Returns:
        (plan, reservation): hold the reservation for the life of the run (``with`` or ``.release()``). A
        CPU plan comes with no reservation.

    Raises:
        BadInput, MissingDependency: as :func:`resolve_gpus`.
        NoResources: the plan does not fit, or other runs kept taking the GPUs.
    """
    parsed = parse_gpu_choice(choice)
    criteria = _criteria(min_free_memory, max_utilization_pct, exclude_other_users)
    excluded: set[str] = set()
    for _ in range(max(1, attempts)):
        gpus, reasons = resolve_gpus(
            choice,
            min_free_memory=criteria.min_free_memory_bytes,
            max_utilization_pct=max_utilization_pct,
            exclude_other_users=exclude_other_users,
            samples=samples,
            interval_s=interval_s,
            lock_dir=lock_dir,
            exclude_uuids=excluded,
            check_containers=check_containers,
        )
        if gpu_filter is not None:  # e.g. the site policy (launcher.policy): reserved GPUs, a per-user cap
            gpus, limited = gpu_filter(gpus)
            reasons = [*reasons, *limited]
        plan = placement.make_plan(request, gpus, cpu_count, reasons=reasons)
        if plan.kind == "cpu":
            if not cpu_fallback and parsed.mode == "auto" and nvml.read_inventory().gpus:
                raise NoResources(
                    "no GPU is free for this run:\n" + "\n".join(f"  - {r}" for r in reasons),
                    hint="wait for a GPU (`launcher gpus` shows who holds them), relax --min-free-memory/"
                    "--max-utilization, or pass --gpus none to run on CPU",
                )
            return plan, None
        try:
            reservation = reservations.reserve(plan.gpu_uuids, run_id, lock_dir)
        except NoResources:
            if parsed.mode == "explicit":
                raise
            logger.info("another run took one of %s first; selecting again", ", ".join(plan.gpu_uuids))
            continue
        if parsed.mode == "explicit":
            return plan, reservation
        now = {g.uuid: g for g in nvml.read_inventory().gpus}
        turned = {u for u in reservation.uuids if u not in now or _rejection(now[u], criteria, {}) is not None}
        if not turned:
            return plan, reservation
        logger.info("GPUs %s changed after locking; selecting again", ", ".join(sorted(turned)))
        reservation.release()
        excluded |= turned
    raise NoResources(
        f"could not lock the GPUs for run {run_id} in {attempts} attempts: other runs or jobs kept taking them",
        hint="try again, or name GPUs with --gpus (`launcher gpus` shows who holds what)",
    )
