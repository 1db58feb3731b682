"""A fair wait queue for GPUs across users: ``launcher up --wait``.

A waiter makes a ticket file in the store's ``queue/`` directory (root 1777, sticky: anyone may add a ticket
and list the queue, nobody may remove another user's) and holds an exclusive ``flock`` on it for as long as it waits. Order is the
kernel's ctime of the ticket (nanoseconds; set by the kernel at creation, and any later change of the file
only moves it back), then the name. A ticket whose lock is free belongs to a waiter that died (SIGKILL): it
is skipped, and removed by its owner's next launcher or by root. Only the head of the queue may take GPUs;
the others poll twice a second, so the head starts within about a second of the GPUs freeing.

Who a ticket belongs to is the kernel's file owner; the run id inside is the owner's word.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from launcher import safefs
from launcher.errors import BadInput, NoResources
from launcher.gpu.holders import user_name

logger = logging.getLogger(__name__)

POLL_S = 0.5
# The loop's own check comes first; the alarm is for an attempt that blocks.
DEADLINE_GRACE_S = 0.5
_T = TypeVar("_T")


@dataclass(frozen=True)
class Ticket:
    """One live waiter, as anyone can read it."""

    name: str
    uid: int
    user: str
    run_id: str | None
    want: str | None  # what it waits for, in words (e.g. "2 GPU(s)")
    since: float  # Unix time it joined (the ticket's ctime)
    order: tuple[int, str]  # (ctime ns, name): the queue order
    gpus: Any = None  # the GPUs it waits for, unchecked: a list of indices/UUIDs or "auto" (launcher.gpu.elastic)

    def to_dict(self) -> dict[str, object]:
        return {"user": self.user, "uid": self.uid, "run_id": self.run_id, "want": self.want, "since": self.since}


TICKET_MAX_BYTES = 4096  # a ticket is ~100 bytes of JSON; a bigger one is read as having no run id


def _alive(fd: int) -> bool:
    """True: the ticket's waiter holds its lock; False: stale (its waiter died)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _read_ticket(queue_dir: Path, name: str, *, clean: bool) -> Ticket | None:
    """One ticket, or None when it is stale (removed, if ours and ``clean``), gone, or not a regular file.

    ``queue/`` is world-writable, so anything can be there under a ticket's name: the file is opened once
    through :mod:`launcher.safefs` (``O_NONBLOCK|O_NOFOLLOW``, then ``fstat``: a FIFO, a device or a link is
    skipped before any read), and the owner, the order, the lock probe and the text all come from that one
    descriptor; the text is read only when it is at most :data:`TICKET_MAX_BYTES` (a huge sparse file costs
    one ``fstat``)."""
    try:
        fd = safefs.open_beneath(queue_dir, name, os.O_RDONLY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not _alive(fd):
            if clean and (st.st_uid == os.geteuid() or os.geteuid() == 0):
                with contextlib.suppress(OSError):
                    (queue_dir / name).unlink()
            return None
        raw = os.pread(fd, TICKET_MAX_BYTES, 0) if st.st_size <= TICKET_MAX_BYTES else b""
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        data = json.loads(raw.decode("utf-8") or "{}")
    except (UnicodeDecodeError, ValueError, RecursionError):
        data = {}
    data = data if isinstance(data, dict) else {}
    return Ticket(name=name, uid=st.st_uid, user=user_name(st.st_uid),
                  run_id=data.get("run_id") if isinstance(data.get("run_id"), str) else None,
                  want=data.get("want") if isinstance(data.get("want"), str) else None,
                  since=st.st_ctime_ns / 1e9, order=(st.st_ctime_ns, name), gpus=data.get("gpus"))


def read_queue(queue_dir: Path, *, clean: bool = True) -> list[Ticket]:
    """The live tickets, in queue order. With ``clean``, stale tickets this user may remove are removed."""
    try:
        names = sorted(p for p in os.listdir(queue_dir) if p.endswith(".ticket"))
    except OSError:
        return []
    tickets = [t for t in (_read_ticket(queue_dir, name, clean=clean) for name in names) if t is not None]
    return sorted(tickets, key=lambda t: t.order)


class Waiter:
    """This launcher's place in the queue; a context manager that always leaves it (Ctrl-C included)."""

    def __init__(self, queue_dir: Path, run_id: str, want: str, gpus: list[str] | str = "auto") -> None:
        self.queue_dir = queue_dir
        self.name = f"{user_name(os.geteuid())}-{os.getpid()}-{secrets.token_hex(4)}.ticket"
        self.path = queue_dir / self.name
        # Locked and written under a name readers ignore, then renamed in: no reader ever sees it unlocked
        # (and takes it for a dead waiter's).
        tmp = queue_dir / f".{self.name}.new"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"run_id": run_id, "want": want, "pid": os.getpid(), "gpus": gpus}).encode())
        os.rename(tmp, self.path)
        self.fd = fd

    def place(self) -> tuple[int, list[Ticket]]:
        """(0-based place, live tickets in order)."""
        tickets = read_queue(self.queue_dir)
        for i, t in enumerate(tickets):
            if t.name == self.name:
                return i, tickets
        # Our own ticket is locked, so only a queue we cannot list hides it; then nobody's order is known.
        raise BadInput(f"cannot read the GPU wait queue {self.queue_dir} (uid {os.geteuid()} cannot list it)",
                       hint="ask the administrator to run `sudo launcher admin init` again (the queue must be "
                       "mode 1777)")

    def leave(self) -> None:
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> Waiter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()


@contextlib.contextmanager
def _hard_deadline(wait_s: float, run_id: str) -> Iterator[None]:
    """Raise NoResources in the main thread once ``wait_s`` seconds have passed, whatever it is doing then.

    The loop in :func:`wait_in_queue` checks its deadline between attempts; this bounds one attempt too
    (reading NVML and the engine, listing the holders, placing), so ``--wait 10s`` answers in about 10 s even
    if a step blocks. ``SIGALRM`` interrupts a blocking system call; off the main thread (or with no
    ``SIGALRM``) only the loop's own check applies."""
    if not math.isfinite(wait_s) or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: object) -> None:
        raise NoResources(f"waited {wait_s:g} s for GPUs for run {run_id}, and placing the run had not finished "
                          "by then", hint="try again later, wait longer (--wait 1h), or see `launcher gpus`")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(wait_s, 0.001) + DEADLINE_GRACE_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def wait_in_queue(queue_dir: Path, *, run_id: str, want: str, wait_s: float, attempt: Callable[[], _T],
                  report: Callable[[str], None] | None = None, busy: Callable[[], str] | None = None,
                  sleep: Callable[[float], None] = time.sleep, gpus: list[str] | str = "auto") -> _T:
    """Queue until this launcher is at the head and ``attempt()`` succeeds; returns what it returned.

    ``attempt`` raises NoResources while the GPUs are taken; ``report`` receives a line when the place or the
    holders change; ``busy`` says who holds what we wait for; ``gpus`` (the ``--gpus`` items, or ``"auto"``) goes on
    the ticket, for elastic runs to read (:mod:`launcher.gpu.elastic`). Raises NoResources after ``wait_s`` seconds,
    also when an attempt is still running then (:func:`_hard_deadline`).
    """
    deadline = time.monotonic() + wait_s
    last_line = None
    with _hard_deadline(wait_s, run_id), Waiter(queue_dir, run_id, want, gpus) as me:
        while True:
            place, tickets = me.place()
            why = ""
            if place == 0:
                try:
                    return attempt()
                except NoResources as exc:
                    why = exc.message.splitlines()[0]
            ahead = ", ".join(f"{t.user} ({t.run_id or '?'})" for t in tickets[:place])
            line = (f"waiting for GPUs: place {place + 1} of {len(tickets)} in the queue"
                    + (f" behind {ahead}" if ahead else "") + (f"; {busy()}" if busy else f"; {why}" if why else ""))
            if report and line != last_line:
                report(line)
                last_line = line
            if time.monotonic() >= deadline:
                raise NoResources(f"waited {wait_s:g} s for GPUs and none came free for run {run_id}: {line}",
                                  hint="try again later, wait longer (--wait 1h), or see `launcher gpus`")
            sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
