"""How an attached run shows its progress: a live table on a terminal (:mod:`launcher.progress_live`), plain
``key=value`` lines otherwise.

Both reporters take the same events from the supervisor and ``launcher up`` (``prepared`` with the plan,
``status`` with the master's status.json and the backend's view, ``event`` with a sentence, ``result`` at
the end) and turn them into one :class:`Snapshot` with :class:`Tracker` (pure, clock injected; both in
:mod:`launcher.progress_snapshot`, re-exported here), so what the live view shows and what CI logs say are the
same numbers. This module holds the plain lines (format, parse, :class:`PlainReporter`) and
:func:`make_reporter`, which picks the reporter. Output goes to stderr; stdout stays for results.

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

import json
import re
import sys
import time
from typing import IO, Any, Callable, Sequence

# The Snapshot, its rows and the Tracker live in launcher.progress_snapshot; the names stay importable from
# here (progress_live, the CLI and tests import them from launcher.progress).
from launcher.progress_snapshot import GPU_READ_INTERVAL_S, GpuRow, GroupRow, Snapshot, Tracker, estimate, read_run_gpus


PLAIN_FORMAT_VERSION = 1


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
        # A deliberate import cycle: progress_live draws the Snapshot with the Tracker, which it imports from
        # this module (they live in launcher.progress_snapshot, re-exported here), and this one picks the
        # reporter, so each needs the other. Keep this import inside the function (done only when a live view
        # is asked for): at module level the two would import each other half-initialised.
        from launcher.progress_live import LiveReporter

        return LiveReporter(stream)
    return PlainReporter(stream, interval_s)


__all__ = ["GPU_READ_INTERVAL_S", "GroupRow", "GpuRow", "NullReporter", "PlainReporter", "Snapshot", "Tracker",
           "build_fields", "estimate", "format_plain_line", "make_reporter", "parse_plain_line"]
