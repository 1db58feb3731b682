"""How an attached run shows its progress: a live table on a terminal, plain ``key=value`` lines otherwise.

Both reporters take the same events from the supervisor and ``launcher up`` (``prepared`` with the plan,
``status`` with the master's status.json and the backend's view, ``event`` with a sentence, ``result`` at
the end) and turn them into one :class:`Snapshot` with :class:`Tracker` (pure, clock injected), so what the
live view shows and what CI logs say are the same numbers. Output goes to stderr; stdout stays for results.

The plain format (stable; docs/operator.md has it in full) is one line per record::

    <UTC time, ISO 8601, ...Z> <kind> key=value key=value ...

``kind`` is ``run``, ``event``, ``progress``, ``group``, ``gpu`` or ``end``. A value is ``-`` when unknown,
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
from dataclasses import asdict, dataclass
from typing import IO, Any, Callable, Sequence

from launcher.gpu_select import format_size

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
            self.status = data.get("status") or {}
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
                index=i, state=state, gpu=_gpu_label(plan_g.share if plan_g else None),
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
    """Current NVML readings (empty when NVML is unavailable)."""
    from launcher import nvml

    return list(nvml.read_inventory().gpus)


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
    }


def group_fields(g: GroupRow) -> dict[str, Any]:
    return {"group": g.index, "state": g.state, "gpu": g.gpu, "workers": g.workers, "env_steps": g.env_steps,
            "env_steps_per_s": g.env_steps_per_s, "recent_return": g.recent_return, "restarts": g.restarts}


def gpu_fields(g: GpuRow) -> dict[str, Any]:
    return {"gpu": g.index, "uuid": g.uuid, "memory_used_bytes": g.memory_used_bytes,
            "memory_total_bytes": g.memory_total_bytes, "utilization_pct": g.utilization_pct}


class PlainReporter:
    """Timestamped ``key=value`` lines for logs and CI: a ``progress`` block every ``interval_s`` seconds
    plus one line per event; never a control code."""

    def __init__(self, stream: IO[str] | None = None, interval_s: float = 5.0, *,
                 gpu_reader: Callable[[], Sequence[Any]] | None = read_run_gpus,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.gpu_reader = gpu_reader
        self.tracker = Tracker(clock)
        self.clock = clock
        self._next: float | None = None

    def _line(self, kind: str, fields: dict[str, Any]) -> None:
        self.stream.write(format_plain_line(kind, fields) + "\n")
        self.stream.flush()

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        self.tracker.update(kind, data)
        if kind == "event":
            self._line("event", {"message": data["message"]})
        elif kind == "prepared":
            plan = data.get("plan")
            self._line("run", {"run_id": data["run_id"], "results": data["results"],
                               "plan": getattr(plan, "kind", None), "groups": len(getattr(plan, "groups", ())),
                               "workers": getattr(plan, "total_workers", None), "format": PLAIN_FORMAT_VERSION})
        elif kind == "status":
            now = self.clock()
            if self._next is not None and now < self._next:
                return
            # A steady grid (t0, t0 + interval, ...) even when status events arrive late.
            self._next = now + self.interval_s if self._next is None else max(self._next + self.interval_s, now)
            self.emit_progress()
        elif kind == "result":
            s = data.get("summary") or {}
            self._line("end", {"run_id": data.get("run_id"), "state": data.get("state"),
                               "exit_code": data.get("exit_code"), "mean_return": s.get("mean_return"),
                               "best_return": s.get("best_mean_return"), "steps": s.get("env_steps"),
                               "updates": s.get("updates"), "wall_s": data.get("wall_s"),
                               "message": data.get("message")})

    def emit_progress(self) -> None:
        gpus = self.gpu_reader() if (self.gpu_reader and self.tracker.gpu_uuids()) else ()
        snap = self.tracker.snapshot(gpus)
        self._line("progress", progress_fields(snap))
        for g in snap.groups:
            self._line("group", group_fields(g))
        for gpu in snap.gpus:
            self._line("gpu", gpu_fields(gpu))

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------- live view
def _f(x: Any, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def render_snapshot(snap: Snapshot, events: Sequence[str] = ()) -> Any:
    """The live view of ``snap`` as a rich renderable: worker groups, master, GPUs (if any), progress."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    title = (f"run {snap.run_id or '?'} · {snap.algo or '?'} on {snap.env_id or '?'} · {snap.state or 'starting'}"
             f" · {_duration(snap.elapsed_s)}")
    groups = Table(title=title, title_justify="left", expand=False)
    for col, just in (("group", "right"), ("state", "left"), ("GPU", "left"), ("workers", "right"),
                      ("env steps/s", "right"), ("env steps", "right"), ("recent return", "right"),
                      ("restarts", "right")):
        groups.add_column(col, justify=just)  # type: ignore[arg-type]
    for g in snap.groups:
        style = None if g.state == "running" else "yellow" if g.state in ("connecting", "starting", "restarting") \
            else "red"
        groups.add_row(str(g.index), g.state, g.gpu, _f(g.workers), _f(g.env_steps_per_s, 0), _f(g.env_steps),
                       _f(g.recent_return), str(g.restarts), style=style)
    parts: list[Any] = [groups]
    ck = "-" if snap.checkpoint_updates is None else \
        f"at update {snap.checkpoint_updates:,}, {_duration(snap.checkpoint_age_s)} ago"
    where = "CPU" if snap.master_gpu == "cpu" else f"GPU {snap.master_gpu}"
    parts.append(Text(f"master on {where}: {snap.updates:,} updates ({_f(snap.updates_per_s, 2)}/s) · "
                      f"queue {_f(snap.queue)} · checkpoint {ck} · {_f(snap.env_steps_per_s, 0)} env steps/s"
                      f" · rejected {snap.rejected}"))
    if snap.gpus:
        gt = Table(title="GPUs", title_justify="left")
        for col in ("GPU", "name", "memory used / total", "util"):
            gt.add_column(col)
        for d in snap.gpus:
            gt.add_row(str(d.index), d.name, f"{format_size(d.memory_used_bytes)} / {format_size(d.memory_total_bytes)}",
                       "-" if d.utilization_pct is None else f"{d.utilization_pct}%")
        parts.append(gt)
    parts.append(Text(progress_text(snap)))
    if events:
        parts.append(Text("\n".join(events[-5:]), style="dim"))
    return Group(*parts)


def progress_text(snap: Snapshot, width: int = 30) -> str:
    pct = snap.progress_pct
    bar = "-" * width if pct is None else "█" * int(width * pct / 100) + "░" * (width - int(width * pct / 100))
    goals = []
    if snap.max_steps:
        goals.append(f"{snap.steps:,}/{snap.max_steps:,} steps")
    else:
        goals.append(f"{snap.steps:,} steps")
    ret = f"mean return {_f(snap.mean_return, 2)} over {snap.episodes_in_window} episodes"
    if snap.target_return is not None:
        ret += f" (target {snap.target_return:g})"
    eta = "-" if snap.eta_s is None else f"{_duration(snap.eta_s)} (by {snap.eta_basis})"
    return f"progress {bar} {'-' if pct is None else f'{pct:.0f}%'} · {goals[0]} · {ret} · ETA {eta}"


class LiveReporter:
    """A live table (rich) redrawn in place; events scroll above it."""

    def __init__(self, stream: IO[str] | None = None, *, gpu_reader: Callable[[], Sequence[Any]] | None = read_run_gpus,
                 console: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = console or Console(file=stream or sys.stderr)
        self.live = Live(console=self.console, refresh_per_second=4, transient=False)
        self.live.start()
        self.tracker = Tracker(clock)
        self.clock = clock
        self.gpu_reader = gpu_reader
        self._gpus: Sequence[Any] = ()
        self._gpus_at: float | None = None

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        self.tracker.update(kind, data)
        if kind == "event":
            self._say(data["message"])
        elif kind == "prepared":
            self._say(f"run {data['run_id']} -> {data['results']}")
        elif kind == "status":
            self.live.update(self.render())

    def _say(self, message: str) -> None:
        """A message above the live table, with the time (rich's ``log`` would add our source path)."""
        from rich.text import Text

        self.console.print(Text(time.strftime("%H:%M:%S ") + message, style="dim"))

    def render(self) -> Any:
        now = self.clock()
        if self.gpu_reader and self.tracker.gpu_uuids() and (self._gpus_at is None or now - self._gpus_at >= GPU_READ_INTERVAL_S):
            self._gpus, self._gpus_at = self.gpu_reader(), now
        return render_snapshot(self.tracker.snapshot(self._gpus))

    def close(self) -> None:
        self.live.stop()


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
    return LiveReporter(stream) if mode == "live" else PlainReporter(stream, interval_s)


def snapshot_dict(snap: Snapshot) -> dict[str, Any]:
    return asdict(snap)


__all__ = ["GroupRow", "GpuRow", "LiveReporter", "NullReporter", "PlainReporter", "Snapshot", "Tracker", "estimate",
           "format_plain_line", "make_reporter", "parse_plain_line", "render_snapshot"]
