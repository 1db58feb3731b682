"""How an attached run shows its progress: a live table on a terminal (:mod:`launcher.progress_live`), plain
``key=value`` lines otherwise.

Both reporters take the same events from the supervisor and ``launcher up`` (``prepared`` with the plan,
``status`` with the master's status.json and the backend's view, ``event`` with a sentence, ``result`` at
the end) and turn them into one :class:`Snapshot` with :class:`Tracker` (pure, clock injected), so what the
live view shows and what CI logs say are the same numbers. Output goes to stderr; stdout stays for results.

The plain format (stable; docs/operator.md has it in full) is one line per record::

    <UTC time, ISO 8601, ...Z> <kind> key=value key=value ...

``kind`` is ``run``, ``event``, ``build``, ``progress``, ``group``, ``gpu`` or ``end``. ``build`` lines come
while a missing image is built before the start (phase ``base rootfs``, ``wheels`` or ``docker build``, the
Dockerfile ``step`` of ``steps``, the latest output ``line``): one per phase or step change, else one every
``--progress-interval`` seconds. A value is ``-`` when unknown,
a bare token when it has no space, quote, ``=`` or backslash, else a JSON string. :func:`parse_plain_line`
reads a line back. ``progress`` (then one ``group`` line per worker group and one ``gpu`` line per GPU of
the run) comes every ``--progress-interval`` seconds; the lines never contain terminal control codes.
"""

from __future__ import annotations

import collections
import json
import re
import sys
import time
from dataclasses import dataclass
from typing import IO, Any, Callable, Sequence

from launcher.rundata import status_doc


PLAIN_FORMAT_VERSION = 1
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


# ------------------------------------------------------------------------------------------ plain lines
_BARE = re.compile(r"^[^\s\"'=\\]+$")
_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def format_value(value: Any) -> str:
    """``-`` for None, numbers as they are (floats rounded), bare tokens, else a JSON string."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 1e6 else f"{value:.0f}"
    text = str(value)
    return text if _BARE.match(text) and text.isprintable() else json.dumps(text)


def format_plain_line(kind: str, fields: dict[str, Any], *, now: float | None = None) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    return " ".join([stamp, kind, *(f"{k}={format_value(v)}" for k, v in fields.items())])


def parse_plain_line(line: str) -> tuple[str, str, dict[str, str | None]]:
    """(timestamp, kind, fields) of one plain line; values are strings (None for ``-``).

    Raises:
        ValueError: not a line of this format.
    """
    parts = line.rstrip("\n").split(" ", 2)
    if len(parts) < 2 or not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", parts[0]):
        raise ValueError(f"not a progress line: {line!r}")
    fields: dict[str, str | None] = {}
    rest = parts[2] if len(parts) == 3 else ""
    for key, raw in _PAIR.findall(rest):
        fields[key] = None if raw == "-" else json.loads(raw) if raw.startswith('"') else raw
    return parts[0], parts[1], fields


def progress_fields(snap: Snapshot) -> dict[str, Any]:
    return {
        "run_id": snap.run_id, "state": snap.state, "elapsed_s": round(snap.elapsed_s, 1), "steps": snap.steps,
        "max_steps": snap.max_steps, "updates": snap.updates, "updates_per_s": snap.updates_per_s,
        "episodes": snap.episodes, "mean_return": snap.mean_return, "best_return": snap.best_return,
        "target_return": snap.target_return, "env_steps_per_s": snap.env_steps_per_s, "queue": snap.queue,
        "checkpoint_updates": snap.checkpoint_updates, "checkpoint_age_s": snap.checkpoint_age_s,
        "groups": f"{snap.groups_connected}/{len(snap.groups)}", "workers": snap.workers,
        "rejected": snap.rejected, "progress_pct": snap.progress_pct,
        "eta_s": None if snap.eta_s is None else round(snap.eta_s), "eta_basis": snap.eta_basis,
        "lag_mean": snap.lag_mean, "lag_max": snap.lag_max, "lag_dropped": snap.lag_dropped,
    }


def group_fields(g: GroupRow) -> dict[str, Any]:
    return {"group": g.index, "state": g.state, "gpu": g.gpu, "workers": g.workers, "env_steps": g.env_steps,
            "env_steps_per_s": g.env_steps_per_s, "recent_return": g.recent_return, "restarts": g.restarts}


def gpu_fields(g: GpuRow) -> dict[str, Any]:
    return {"gpu": g.index, "uuid": g.uuid, "memory_used_bytes": g.memory_used_bytes,
            "memory_total_bytes": g.memory_total_bytes, "utilization_pct": g.utilization_pct}


def build_fields(b: dict[str, Any]) -> dict[str, Any]:
    """A ``build`` line's fields from an image build record (``launcher.image_build.BuildStatus``)."""
    return {"tag": b.get("tag"), "phase": b.get("phase"), "step": b.get("step"), "steps": b.get("steps"),
            "elapsed_s": round(float(b.get("elapsed_s") or 0.0), 1), "line": (b.get("line") or "")[:200]}


class PlainReporter:
    """Timestamped ``key=value`` lines for logs and CI: a ``progress`` block every ``interval_s`` seconds
    plus one line per event, and a last block with the final figures before the ``end`` line when the status
    changed since the last one printed; never a control code."""

    def __init__(self, stream: IO[str] | None = None, interval_s: float = 5.0, *,
                 gpu_reader: Callable[[], Sequence[Any]] | None = read_run_gpus,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.gpu_reader = gpu_reader
        self.tracker = Tracker(clock)
        self.clock = clock
        self._next: float | None = None
        self._build_key: tuple[Any, Any] | None = None
        self._build_next = 0.0
        self._unshown = False  # a status arrived after the last progress block printed

    def _line(self, kind: str, fields: dict[str, Any]) -> None:
        self.stream.write(format_plain_line(kind, fields) + "\n")
        self.stream.flush()

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        self.tracker.update(kind, data)
        if kind == "event":
            self._line("event", {"message": data["message"]})
        elif kind == "build":
            key, now = (data.get("phase"), data.get("step")), self.clock()
            if key != self._build_key or now >= self._build_next:
                self._build_key, self._build_next = key, now + self.interval_s
                self._line("build", build_fields(data))
        elif kind == "prepared":
            plan = data.get("plan")
            self._line("run", {"run_id": data["run_id"], "results": data["results"],
                               "plan": getattr(plan, "kind", None), "groups": len(getattr(plan, "groups", ())),
                               "workers": getattr(plan, "total_workers", None), "format": PLAIN_FORMAT_VERSION})
        elif kind == "status":
            now = self.clock()
            if self._next is not None and now < self._next:
                self._unshown = True
                return
            # A steady grid (t0, t0 + interval, ...) even when status events arrive late.
            self._next = now + self.interval_s if self._next is None else max(self._next + self.interval_s, now)
            self.emit_progress()
        elif kind == "result":
            if self._unshown:  # the run ended between two blocks: its final figures, not ones up to a period old
                self.emit_progress()
            s = data.get("summary") or {}
            self._line("end", {"run_id": data.get("run_id"), "state": data.get("state"),
                               "exit_code": data.get("exit_code"), "mean_return": s.get("mean_return"),
                               "best_return": s.get("best_mean_return"), "steps": s.get("env_steps"),
                               "updates": s.get("updates"), "wall_s": data.get("wall_s"),
                               "message": data.get("message"), "error": data.get("error")})

    def emit_progress(self) -> None:
        self._unshown = False
        gpus = self.gpu_reader() if (self.gpu_reader and self.tracker.gpu_uuids()) else ()
        snap = self.tracker.snapshot(gpus)
        self._line("progress", progress_fields(snap))
        for g in snap.groups:
            self._line("group", group_fields(g))
        for gpu in snap.gpus:
            self._line("gpu", gpu_fields(gpu))

    def close(self) -> None:
        pass


class NullReporter:
    """``--progress off``: nothing on stderr but errors."""

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def make_reporter(stream: IO[str] | None = None, *, interactive: bool | None = None, mode: str = "auto",
                  interval_s: float = 5.0) -> Any:
    """The reporter for ``--progress mode``: ``auto`` is live on a terminal (not TERM=dumb), else plain."""
    import os

    stream = stream or sys.stderr
    if mode == "off":
        return NullReporter()
    if mode == "auto":
        if interactive is None:
            interactive = stream.isatty() and os.environ.get("TERM", "") != "dumb"
        mode = "live" if interactive else "plain"
    if mode == "live":
        # A deliberate import cycle: progress_live draws this module's Snapshot with its Tracker, and this one
        # picks the reporter, so each needs the other. Keep this import inside the function (done only when a
        # live view is asked for): at module level the two would import each other half-initialised.
        from launcher.progress_live import LiveReporter

        return LiveReporter(stream)
    return PlainReporter(stream, interval_s)


__all__ = ["GroupRow", "GpuRow", "NullReporter", "PlainReporter", "Snapshot", "Tracker", "build_fields", "estimate",
           "format_plain_line", "make_reporter", "parse_plain_line"]
