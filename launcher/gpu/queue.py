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
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from launcher.errors import BadInput, NoResources
from launcher.gpu.holders import user_name

logger = logging.getLogger(__name__)

POLL_S = 0.5
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

    def to_dict(self) -> dict[str, object]:
        return {"user": self.user, "uid": self.uid, "run_id": self.run_id, "want": self.want, "since": self.since}


def _alive(path: Path) -> bool | None:
    """True: its waiter holds the ticket's lock; False: stale; None: gone or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops our probe
    return False


def read_queue(queue_dir: Path, *, clean: bool = True) -> list[Ticket]:
    """The live tickets, in queue order. With ``clean``, stale tickets this user may remove are removed."""
    try:
        names = sorted(p for p in os.listdir(queue_dir) if p.endswith(".ticket"))
    except OSError:
        return []
    tickets = []
    for name in names:
        path = queue_dir / name
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        alive = _alive(path)
        if alive is False:
            if clean and (st.st_uid == os.geteuid() or os.geteuid() == 0):
                with contextlib.suppress(OSError):
                    path.unlink()
            continue
        if alive is None:
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError):
            data = {}
        data = data if isinstance(data, dict) else {}
        tickets.append(Ticket(name=name, uid=st.st_uid, user=user_name(st.st_uid),
                              run_id=data.get("run_id") if isinstance(data.get("run_id"), str) else None,
                              want=data.get("want") if isinstance(data.get("want"), str) else None,
                              since=st.st_ctime_ns / 1e9, order=(st.st_ctime_ns, name)))
    return sorted(tickets, key=lambda t: t.order)


class Waiter:
    """This launcher's place in the queue; a context manager that always leaves it (Ctrl-C included)."""

    def __init__(self, queue_dir: Path, run_id: str, want: str) -> None:
        self.queue_dir = queue_dir
        self.name = f"{user_name(os.geteuid())}-{os.getpid()}-{secrets.token_hex(4)}.ticket"
        self.path = queue_dir / self.name
        # Locked and written under a name readers ignore, then renamed in: no reader ever sees it unlocked
        # (and takes it for a dead waiter's).
        tmp = queue_dir / f".{self.name}.new"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"run_id": run_id, "want": want, "pid": os.getpid()}).encode())
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


def wait_in_queue(queue_dir: Path, *, run_id: str, want: str, wait_s: float, attempt: Callable[[], _T],
                  report: Callable[[str], None] | None = None, busy: Callable[[], str] | None = None,
                  sleep: Callable[[float], None] = time.sleep) -> _T:
    """Queue until this launcher is at the head and ``attempt()`` succeeds; returns what it returned.

    ``attempt`` raises NoResources while the GPUs are taken; ``report`` receives a line when the place or the
    holders change; ``busy`` says who holds what we wait for. Raises NoResources after ``wait_s`` seconds.
    """
    deadline = time.monotonic() + wait_s
    last_line = None
    with Waiter(queue_dir, run_id, want) as me:
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
            sleep(POLL_S)
