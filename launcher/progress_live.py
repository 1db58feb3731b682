"""The live view of an attached run on a terminal: a table redrawn in place (rich), events scrolling above it,
and, while a missing image builds before the start, the build's phase, step and latest line.

It shows the same :class:`~launcher.progress.Snapshot` the plain lines print (:mod:`launcher.progress`).
The two import each other on purpose: this module imports :mod:`launcher.progress` at its top, and
:func:`launcher.progress.make_reporter`, the one place that picks a reporter, imports this one inside the
function when a live view is asked for (at the top of both, each would find the other half-initialised).
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any, Callable, Sequence

from launcher.progress import GPU_READ_INTERVAL_S, Snapshot, Tracker, read_run_gpus
from launcher.units import format_size


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
                      f" · rejected {snap.rejected} · policy lag {_f(snap.lag_mean, 2)} (max {_f(snap.lag_max)}, "
                      f"dropped {snap.lag_dropped})"))
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
        elif kind == "build":
            from rich.text import Text

            self.live.update(Text(build_text(data)))
        elif kind == "prepared":
            self._say(f"run {data['run_id']} -> {data['results']}")
        elif kind == "status":
            self.live.update(self.render())
        elif kind == "result":  # the last line under the table: how the run ended and, if it failed, why
            self.live.update(self.render())
            self.live.stop()  # the final table stays where it is; the line goes below it (close() stops nothing more)
            message, error = str(data.get("message") or ""), data.get("error")
            self._say(f"{data.get('state')}: {message}" + (f" (raised {error})" if error and error not in message else ""))

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


def build_text(b: dict[str, Any]) -> str:
    """The live view's line while an image builds."""
    step = f" · step {b['step']}/{b['steps']}" if b.get("step") else ""
    return (f"building image {b.get('tag')} · {b.get('phase')}{step} · {_duration(b.get('elapsed_s'))}\n"
            f"  {(b.get('line') or '')[:150]}")


