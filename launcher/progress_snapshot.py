"""What an attached run's progress is, whichever way it is shown: the :class:`Snapshot` (with its
:class:`GroupRow` and :class:`GpuRow` rows) and the :class:`Tracker` that folds the supervisor's events into one.

The tracker takes the events ``launcher up`` and the supervisor send (``prepared`` with the plan, ``status``
with the master's status.json and the backend's view) and is pure, its clock injected: the live table
(:mod:`launcher.progress_live`) and the plain lines (:mod:`launcher.progress`) show the same numbers.
:func:`estimate` gives the percent done and ETA toward --max-steps or --until-return; :func:`read_run_gpus`
the GPU readings both views add.

Split from :mod:`launcher.progress`, which re-exports these names; this module imports neither view.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from launcher.rundata import status_doc


GPU_READ_INTERVAL_S = 2.0
RETURN_SLOPE_WINDOW_S = 30.0


@dataclass(frozen=True)
class GroupRow:
    index: int
    state: str  # running, connecting, restarting, failed, lost, exited, starting
    gpu: str  # NVML index, or "cpu"
    workers: int | None
    env_steps: int | None
    env_steps_per_s: float | None
    recent_return: float | None  # mean of the group's last 100 episodes
    restarts: int


@dataclass(frozen=True)
class GpuRow:
    index: int
    uuid: str
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_pct: int | None


@dataclass(frozen=True)
class Snapshot:
    """Everything either view shows at one moment."""

    run_id: str | None
    env_id: str | None
    algo: str | None
    state: str | None
    elapsed_s: float
    steps: int
    max_steps: int | None
    updates: int
    updates_per_s: float | None
    episodes: int
    mean_return: float | None
    best_return: float | None
    target_return: float | None
    episodes_in_window: int
    return_window: int | None
    env_steps_per_s: float | None
    queue: int | None
    checkpoint_updates: int | None
    checkpoint_age_s: float | None
    rejected: int
    progress_pct: float | None  # toward whichever end comes first
    eta_s: float | None
    eta_basis: str | None  # "steps" (--max-steps) or "return" (--until-return trend)
    master_gpu: str
    groups: tuple[GroupRow, ...] = ()
    gpus: tuple[GpuRow, ...] = ()
    # Policy lag of what the learner used (status.json's policy_lag): mean, max, dropped as too old.
    lag_mean: float | None = None
    lag_max: int | None = None
    lag_dropped: int = 0

    @property
    def groups_connected(self) -> int:
        return sum(1 for g in self.groups if g.state == "running")

    @property
    def workers(self) -> int:
        return sum(g.workers or 0 for g in self.groups if g.state == "running")


def estimate(steps: int, max_steps: int | None, rate: float | None, mean: float | None, target: float | None,
             history: Sequence[tuple[float, float]]) -> tuple[float | None, float | None, str | None]:
    """(percent done, ETA seconds, basis) toward --max-steps or --until-return, whichever ends first.

    Steps: remaining steps over the current env-steps/s. Return: the gap to the target over the slope of the
    mean return across the last ``RETURN_SLOPE_WINDOW_S`` seconds of ``history`` ((time, mean) points); no
    ETA while the mean is not rising. Percent toward the return runs from the first mean seen to the target.
    """
    options: list[tuple[float | None, float | None, str]] = []
    if max_steps:
        pct = min(100.0, 100.0 * steps / max_steps)
        eta = max(0.0, (max_steps - steps) / rate) if rate and rate > 0 else None
        options.append((pct, eta, "steps"))
    if target is not None and mean is not None and history:
        first = history[0][1]
        pct_r = 100.0 if mean >= target else (
            max(0.0, min(100.0, 100.0 * (mean - first) / (target - first))) if target > first else 0.0)
        eta_r: float | None = 0.0 if mean >= target else None
        t_end = history[-1][0]
        recent = [(t, m) for t, m in history if t >= t_end - RETURN_SLOPE_WINDOW_S]
        if eta_r is None and len(recent) >= 2 and recent[-1][0] - recent[0][0] >= 2.0:
            slope = _slope(recent)
            if slope > 0:
                eta_r = (target - mean) / slope
        options.append((pct_r, eta_r, "return"))
    if not options:
        return None, None, None
    with_eta = [o for o in options if o[1] is not None]
    if with_eta:
        return min(with_eta, key=lambda o: o[1] or 0.0)
    return max(options, key=lambda o: o[0] or 0.0)


def _slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y) points."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 0.0 if var == 0 else sum((t - mt) * (y - my) for t, y in points) / var


class Tracker:
    """Folds supervisor events into a :class:`Snapshot`. ``clock`` is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self.plan: Any = None
        self.status: dict[str, Any] = {}
        self.backend: Any = None
        self.restarts: dict[int, int] = {}
        self.history: collections.deque[tuple[float, float]] = collections.deque(maxlen=600)
        self.run_id: str | None = None

    def update(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "prepared":
            self.plan = data.get("plan")
            self.run_id = data.get("run_id")
        elif kind == "status":
            # status.json is the run's to write: a field of the wrong type is dropped here, so no reporter
            # (and no supervisor loop behind it) can be ended by "mean_return": "x" (launcher.rundata).
            self.status = status_doc(data.get("status"))
            self.backend = data.get("backend")
            self.restarts = {int(k): v for k, v in (data.get("restarts") or {}).items()}
            mean = self.status.get("mean_return")
            if mean is not None:
                self.history.append((self.clock(), float(mean)))

    def gpu_uuids(self) -> tuple[str, ...]:
        return tuple(getattr(self.plan, "gpu_uuids", ()) or ())

    def snapshot(self, gpus: Sequence[Any] = ()) -> Snapshot:
        s = self.status
        target = s.get("target") or {}
        ck = s.get("checkpoint") or {}
        rate = s.get("env_steps_per_s")
        lag = s.get("policy_lag") or {}
        pct, eta, basis = estimate(int(s.get("env_steps") or 0), target.get("max_steps"), rate,
                                   s.get("mean_return"), target.get("until_return"), list(self.history))
        return Snapshot(
            run_id=s.get("run_id") or self.run_id, env_id=s.get("env_id"), algo=s.get("algo"), state=s.get("state"),
            elapsed_s=self.clock() - self.started, steps=int(s.get("env_steps") or 0),
            max_steps=target.get("max_steps"), updates=int(s.get("updates") or 0),
            updates_per_s=s.get("updates_per_s"), episodes=int(s.get("episodes") or 0),
            mean_return=s.get("mean_return"), best_return=s.get("best_mean_return"),
            target_return=target.get("until_return"), episodes_in_window=int(s.get("episodes_in_window") or 0),
            return_window=s.get("return_window"), env_steps_per_s=rate, queue=s.get("queue_depth"),
            checkpoint_updates=ck.get("updates"), checkpoint_age_s=ck.get("age_s"),
            rejected=sum(v for k, v in (s.get("network") or {}).items() if k.startswith("rejected")),
            progress_pct=pct, eta_s=eta, eta_basis=basis,
            master_gpu=_gpu_label(getattr(self.plan, "master", None)),
            groups=self._groups(), gpus=tuple(_gpu_row(g) for g in gpus if g.uuid in self.gpu_uuids()),
            lag_mean=lag.get("mean"), lag_max=lag.get("max"), lag_dropped=int(lag.get("dropped") or 0),
        )

    def _groups(self) -> tuple[GroupRow, ...]:
        master_view = self.status.get("groups") or {}
        backend_groups = getattr(self.backend, "groups", None) or {}
        planned = {g.index: g for g in getattr(self.plan, "groups", ())}
        indices = sorted({int(i) for i in master_view} | set(backend_groups) | set(planned))
        rows = []
        for i in indices:
            m = master_view.get(str(i)) or {}
            b = backend_groups.get(i)
            if b is not None and b.state.value != "running":
                state = b.state.value
            elif m.get("connected"):
                state = "running"
            else:
                state = "connecting" if (b is not None or m) else "starting"
            plan_g = planned.get(i)
            rows.append(GroupRow(
                index=i, state=state, gpu=(b.gpus if b is not None and b.gpus else  # Slurm: what the step got
                                           _gpu_label(plan_g.share if plan_g else None)),
                workers=m.get("workers", plan_g.workers if plan_g else None), env_steps=m.get("env_steps"),
                env_steps_per_s=m.get("env_steps_per_s"), recent_return=m.get("mean_return"),
                restarts=self.restarts.get(i, b.restarts if b is not None else 0)))
        return tuple(rows)


def _gpu_label(share: Any) -> str:
    indices = getattr(share, "gpu_indices", ()) or ()
    return ",".join(str(i) for i in indices) if indices else "cpu"


def _gpu_row(g: Any) -> GpuRow:
    return GpuRow(index=g.index, uuid=g.uuid, name=g.name, memory_used_bytes=g.memory_used_bytes,
                  memory_total_bytes=g.memory_total_bytes, utilization_pct=g.gpu_utilization_pct)


def read_run_gpus() -> list[Any]:
    """Current GPU (and MIG instance) readings: the run's GPU watch's latest when one runs (it reads NVML in
    its own thread), else a reading of our own; empty when NVML is unavailable or missed its deadline."""
    from launcher.errors import LauncherError
    from launcher.gpu import mig, nvml, watch

    latest = watch.latest_gpus()
    if latest is not None:
        return latest
    try:
        return mig.placeable(nvml.read_inventory().gpus)
    except LauncherError:  # NvmlTimeout: the GPU watch reports it as an event; the view goes on without rows
        return []


__all__ = ["GPU_READ_INTERVAL_S", "GpuRow", "GroupRow", "RETURN_SLOPE_WINDOW_S", "Snapshot", "Tracker", "estimate",
           "read_run_gpus"]
