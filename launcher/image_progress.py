"""How an image build shows that it is alive: a build takes minutes and must never look hung.

Lines go to a ``progress`` callable; with ``on_build`` the build's own output goes there instead, as
:class:`BuildStatus` records (phase, ``docker build`` step, elapsed time), which ``launcher up``'s live view and
plain lines show (:mod:`launcher.progress`). The builds themselves are in :mod:`launcher.image_build` and
:mod:`launcher.image_extras`.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Callable

Progress = Callable[[str], None]
"""Receives one human-readable line (no trailing newline) per build event."""
_STEP = re.compile(r"^Step (\d+)/(\d+) :")
TICK_S = 1.0  # how often a silent build's elapsed time is reported again


@dataclass(frozen=True)
class BuildStatus:
    """Where an image build is: ``phase`` (``base rootfs``, ``wheels``, ``docker build``), the Dockerfile
    step (``step`` of ``steps``) in the last phase, seconds since the build began, and its latest line."""

    tag: str
    phase: str
    elapsed_s: float
    line: str = ""
    step: int | None = None
    steps: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class BuildReporter:
    """Turns the build's output into ``progress`` lines or, with ``on_build``, :class:`BuildStatus` records.

    With ``on_build``, a ticker thread also repeats the latest record every ``TICK_S`` with the time grown:
    debootstrap and a long ``RUN pip install`` print nothing for minutes, and the view must not look hung.
    A lock keeps the ticker's records and the build's own in order.
    """

    def __init__(self, tag: str, progress: Progress, on_build: Callable[[BuildStatus], None] | None) -> None:
        self.tag, self.progress, self.on_build = tag, progress, on_build
        self.t0 = time.monotonic()
        self.phase, self.step, self.steps, self.line = "", None, None, ""  # type: str, int | None, int | None, str
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def enter(self, phase: str) -> None:
        self.phase, self.step, self.steps = phase, None, None
        self.output(f"{phase}: started")

    def say(self, line: str) -> None:
        """A line that is not the build's output (what is being built, from what) to ``progress``."""
        with self._lock:
            self.progress(line)

    def output(self, line: str) -> None:
        with self._lock:
            if (m := _STEP.match(line)) is not None:
                self.step, self.steps = int(m.group(1)), int(m.group(2))
            self.line = line
            if self.on_build is None:
                self.progress(line)
            else:
                self.on_build(BuildStatus(self.tag, self.phase, time.monotonic() - self.t0, line, self.step,
                                          self.steps))

    @contextmanager
    def ticking(self) -> Iterator[None]:
        """Within: the latest record again every ``TICK_S`` seconds (only with ``on_build``)."""
        if self.on_build is None:
            yield
            return
        on_build = self.on_build

        def tick() -> None:
            while not self._stop.wait(TICK_S):
                with self._lock:
                    if self.phase:
                        on_build(BuildStatus(self.tag, self.phase, time.monotonic() - self.t0, self.line, self.step,
                                             self.steps))

        ticker = threading.Thread(target=tick, name="build-ticker", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            self._stop.set()
            ticker.join(timeout=2 * TICK_S)


def as_reporter(report: BuildReporter | Progress, tag: str) -> BuildReporter:
    """``report`` itself, or a reporter of plain lines to it (a step called on its own, not from a build)."""
    return report if isinstance(report, BuildReporter) else BuildReporter(tag, report, None)
