"""How an attached run shows its progress: a live table on a terminal, plain timestamped lines otherwise.

Both reporters take the same events from the supervisor (``status`` with the master's status.json and
the backend's view, ``event`` with a sentence). Output goes to stderr so stdout stays for results
(the final summary line, or the ``--json`` document).
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any


def _fmt(x: Any, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def progress_fraction(status: dict[str, Any]) -> tuple[float | None, str]:
    """(fraction done, what it measures) toward --until-return or --max-steps."""
    target = status.get("target") or {}
    steps, max_steps = status.get("env_steps", 0), target.get("max_steps")
    if max_steps:
        return min(1.0, steps / max_steps), f"{steps}/{max_steps} steps"
    return None, f"{steps} steps"


class PlainReporter:
    """One line every ``interval_s`` seconds plus one per event; no control codes (CI logs)."""

    def __init__(self, stream: IO[str] | None = None, interval_s: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self._next = 0.0
        self._t0 = time.monotonic()

    def _line(self, text: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.stream.write(f"{stamp} {text}\n")
        self.stream.flush()

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "event":
            self._line(data["message"])
        elif kind == "prepared":
            self._line(f"run {data['run_id']} -> {data['results']}")
        elif kind == "status":
            now = time.monotonic()
            if now < self._next:
                return
            self._next = now + self.interval_s
            s = data["status"]
            groups = s.get("groups", {})
            connected = sum(1 for g in groups.values() if g.get("connected"))
            workers = sum(g.get("workers", 0) for g in groups.values() if g.get("connected"))
            _, what = progress_fraction(s)
            self._line(f"progress steps={s.get('env_steps')} updates={s.get('updates')} "
                       f"mean_return={_fmt(s.get('mean_return'), 2)} episodes={s.get('episodes')} "
                       f"env_steps_per_s={_fmt(s.get('env_steps_per_s'), 0)} groups={connected}/{len(groups)} "
                       f"workers={workers} rejected={sum(v for k, v in (s.get('network') or {}).items() if k.startswith('rejected'))} "
                       f"({what})")

    def close(self) -> None:
        pass


class LiveReporter:
    """A live table (rich) redrawn in place: groups, master, GPUs, progress and ETA."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = Console(file=stream or sys.stderr)
        self.live = Live(console=self.console, refresh_per_second=4, transient=False)
        self.live.start()
        self.events: list[str] = []
        self._rate_hist: list[tuple[float, int]] = []

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "event":
            self.events = (self.events + [time.strftime("%H:%M:%S ") + data["message"]])[-6:]
            self.console.log(data["message"])
        elif kind == "prepared":
            self.events.append(f"run {data['run_id']} -> {data['results']}")
        elif kind == "status":
            self.live.update(self._render(data["status"], data.get("backend"), data.get("restarts", {})))

    def _render(self, s: dict[str, Any], backend: Any, restarts: dict[int, int]) -> Any:
        from rich.table import Table
        from rich.console import Group
        from rich.text import Text

        t = Table(title=f"run {s.get('run_id')} · {s.get('algo')} on {s.get('env_id')} · {s.get('state')}",
                  expand=False)
        for col in ("group", "state", "workers", "env steps/s", "env steps", "recent return", "restarts"):
            t.add_column(col, justify="right")
        bgroups = getattr(backend, "groups", {}) or {}
        for g, v in (s.get("groups") or {}).items():
            bstate = bgroups.get(int(g)).state.value if int(g) in bgroups else ("connected" if v.get("connected") else "-")
            t.add_row(g, bstate, str(v.get("workers")), _fmt(v.get("env_steps_per_s"), 0), str(v.get("env_steps")),
                      _fmt(v.get("mean_return"), 1), str(restarts.get(int(g), 0)))
        ck = s.get("checkpoint") or {}
        frac, what = progress_fraction(s)
        eta = "-"
        rate = s.get("env_steps_per_s") or 0
        target = s.get("target") or {}
        if frac is not None and rate > 0 and target.get("max_steps"):
            eta = f"{(target['max_steps'] - s.get('env_steps', 0)) / rate:.0f} s (max steps)"
        master = Text(f"master: {s.get('updates')} updates ({_fmt(s.get('updates_per_s'), 2)}/s) · queue "
                      f"{s.get('queue_depth')} · checkpoint {ck.get('path', '-')} {_fmt(ck.get('age_s'), 0)} s ago · "
                      f"mean return {_fmt(s.get('mean_return'), 2)} over {s.get('episodes_in_window')} episodes "
                      f"(target {target.get('until_return')}) · {what} · ETA {eta}")
        return Group(t, master)

    def close(self) -> None:
        self.live.stop()


def make_reporter(stream: IO[str] | None = None, *, interactive: bool | None = None) -> Any:
    stream = stream or sys.stderr
    if interactive is None:
        interactive = stream.isatty()
    return LiveReporter(stream) if interactive else PlainReporter(stream)
