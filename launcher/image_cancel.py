"""Stopping an image build at once on SIGINT/SIGTERM, and leaving nothing of it behind.

SIGINT/SIGTERM during a build raise :class:`BuildInterrupted` at once (exit 130): a preparation script's
process group is killed (:func:`run_script`), the engine's build is cancelled by dropping its connection, and
the steps it had finished (untagged images) are removed (:func:`stoppable`).
"""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from launcher.engine.images import remove_untagged
from launcher.errors import ExitCode, LauncherError, MissingDependency
from launcher.image_progress import BuildReporter

if TYPE_CHECKING:
    from launcher.engine.client import DockerClient

log = logging.getLogger(__name__)

KILL_GRACE_S = 5.0


class BuildInterrupted(LauncherError):
    """SIGINT or SIGTERM arrived during an image build; the build was stopped and cleaned up."""

    exit_code = ExitCode.INTERRUPTED


@contextmanager
def interruptible() -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise :class:`BuildInterrupted` in the main thread, even while it waits on
    the engine or a script (Python retries a waiting system call only when the handler returns)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: Any) -> None:
        raise BuildInterrupted(f"image build interrupted by {signal.Signals(signum).name}; it was stopped and "
                               "its half-built layers removed")

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


@contextmanager
def stoppable(report: BuildReporter, client: "DockerClient") -> Iterator[list[str]]:
    """Within: a build that a signal stops at once (:func:`interruptible`) and whose silent steps still
    report (``report.ticking``). Yields the list the build notes each image it made in; on
    :class:`BuildInterrupted` those half-built layers are removed before it propagates."""
    layers: list[str] = []
    with interruptible(), report.ticking():
        try:
            yield layers
        except BuildInterrupted:
            gone = remove_untagged(layers, client)
            log.info("build of %s interrupted; removed %d half-built layer(s)", report.tag, gone)
            raise


def run_script(argv: list[str], env: dict[str, str], report: BuildReporter, *, hint: str) -> None:
    """Run a preparation script in its own process group, its output as build lines; on any exception
    (a signal's :class:`BuildInterrupted` included) the whole group is stopped before it propagates.

    Raises:
        MissingDependency: the script cannot be run, or it exited non-zero (with its last line and ``hint``).
    """
    name = Path(argv[-1]).name
    try:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)
    except OSError as exc:
        raise MissingDependency(f"cannot run {name}: {exc}", hint=hint) from exc
    tail: list[str] = []
    assert proc.stdout is not None
    try:
        for line in _lines(proc.stdout):
            tail = (tail + [line])[-10:]
            report.output(line)
        code = proc.wait()
    except BaseException:
        _stop_group(proc)
        raise
    if code != 0:
        raise MissingDependency(f"{name} failed with exit status {code}: " + (tail[-1] if tail else "no output"),
                                hint=hint)


def _stop_group(proc: "subprocess.Popen[str]") -> None:
    """SIGTERM the script's process group (sudo passes it on to debootstrap), SIGKILL after a grace."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _lines(stream: io.TextIOBase | IO[str]) -> Iterator[str]:
    for line in stream:
        line = line.rstrip()
        if line:
            yield line
