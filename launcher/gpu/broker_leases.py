"""The lease broker's lease table and its rules, as plain code: the per-user cap, who may tie or release what,
all-or-``count`` locking, a lease ending with its last tied process. No sockets and no selector: the daemon
(:mod:`launcher.gpu.broker`) feeds it the caller's uid (from the kernel) and a function that locks one lease
file (:func:`lock_lease_file`, the only outside system here), and watches the pidfds it stores.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.gpu.broker_wire import LeaseRequest, Refusal
from launcher.gpu.reservations import LOCK_SCHEMA

INIT_HINT = "ask the administrator to run `launcher admin init --broker ...` again"

Locker = Callable[[str], "int | None"]  # uuid -> a descriptor holding its lease file's lock; None: held already


@dataclass
class Lease:
    """One GPU leased through the broker."""

    uuid: str
    fd: int  # the broker's descriptor holding the exclusive flock
    uid: int
    user: str
    run_id: str
    since: float
    pids: dict[int, int] = field(default_factory=dict)  # tied pid -> its pidfd
    note: Path | None = None

    def describe(self) -> str:
        return f"launcher run {self.run_id} (user {self.user}, pid {', '.join(map(str, self.pids)) or '?'})"

    def to_dict(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "uid": self.uid, "user": self.user, "run_id": self.run_id,
                "pids": list(self.pids), "since": self.since}

    def note_record(self, host: str) -> dict[str, Any]:
        """The broker's holder note: ``launcher gpus`` reads who the lease is for from it."""
        pids = list(self.pids)
        return {"schema": LOCK_SCHEMA, "run_id": self.run_id, "uid": self.uid, "user": self.user, "pids": pids,
                "pid": pids[-1] if pids else None, "since": self.since, "host": host, "broker": True}


def lock_lease_file(path: Path, uuid: str) -> int | None:
    """The exclusive flock on ``uuid``'s lease file at ``path``, with a new descriptor; None when something else
    holds it. The file must be root's and regular (``admin init --broker`` makes it so).

    Raises:
        Refusal: ``bad`` when there is no such file, ``internal`` when it cannot be opened or is not root's.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Refusal("bad", f"GPU {uuid} has no lease file in the store ({path})",
                      f"{INIT_HINT} (it makes one per GPU and MIG instance it finds)") from None
    except OSError as exc:
        raise Refusal("internal", f"cannot open the lease file {path}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0:
        os.close(fd)
        raise Refusal("internal", f"the lease file {path} is not a regular file of root's (uid {st.st_uid})", INIT_HINT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def check_tie_uid(caller_uid: int, pid: int, pid_uid: int) -> None:
    """A user may tie a lease to their own processes only (root to any).

    Raises:
        Refusal: ``denied``.
    """
    if caller_uid != 0 and pid_uid != caller_uid:
        raise Refusal("denied", f"process {pid} runs as uid {pid_uid}, not as you (uid {caller_uid}): a lease can "
                      "only be tied to your own processes",
                      "tie the lease to your run's master (`launcher up` does this itself)")


class LeaseTable:
    """The leases the broker holds, by UUID, and the rules for changing them."""

    def __init__(self) -> None:
        self.leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self.leases)

    def __iter__(self) -> Any:
        return iter(list(self.leases.values()))

    def get(self, uuid: str) -> Lease | None:
        return self.leases.get(uuid)

    def held_by(self, uid: int) -> list[str]:
        return [x.uuid for x in self.leases.values() if x.uid == uid]

    def owned(self, uid: int, uuids: Iterable[str], what: str) -> list[Lease]:
        """The leases of ``uuids`` that exist; Refusal ``denied`` if one is another user's (root may touch any)."""
        found = [self.leases[u] for u in uuids if u in self.leases]
        for lease in found:
            if uid not in (0, lease.uid):
                raise Refusal("denied", f"GPU {lease.uuid} is leased by user {lease.user} (uid {lease.uid}) for run "
                              f"{lease.run_id}, not by you (uid {uid}): only its user may {what} it",
                              "name only your own run's GPUs (`launcher gpus` shows who holds what)")
        return found

    def tie_targets(self, uid: int, uuids: Iterable[str]) -> list[Lease]:
        """The caller's leases of ``uuids``, every one of which must exist. Raises Refusal."""
        uuids = list(uuids)
        leases = self.owned(uid, uuids, "tie a process to")
        gone = [u for u in uuids if u not in self.leases]
        if gone:
            raise Refusal("bad", f"GPU(s) {', '.join(gone)} are not leased through this broker (the lease may have "
                          "ended with its processes)", "lease them again")
        return leases

    def check_cap(self, uid: int, user: str, run_id: str, want: int, cap: int | None, cap_label: str) -> None:
        """Refusal ``cap`` if ``uid``'s leases plus ``want`` exceed ``cap`` (None: no cap)."""
        mine = self.held_by(uid)
        if cap is not None and len(mine) + want > cap:
            held = f"holds {len(mine)} GPU lease(s)" + (f" ({', '.join(mine)})" if mine else "")
            raise Refusal("cap", f"user {user} (uid {uid}) {held} and asks for {want} more for run {run_id}; "
                          f"{cap_label} allows {cap} at once",
                          "wait for your other runs to end (`launcher gpus` shows them), or ask for fewer GPUs")

    def grant(self, uid: int, user: str, req: LeaseRequest, *, cap: int | None, cap_label: str, lock: Locker,
              now: float | None = None) -> list[Lease]:
        """Check the cap, then lock all of ``req.uuids`` (or the first ``req.count`` free) and record the leases,
        untied (the caller ties them). Nothing is taken unless everything asked for is.

        Raises:
            Refusal: ``cap``, ``busy``, or what ``lock`` raises.
        """
        want = len(req.uuids) if req.count is None else req.count
        self.check_cap(uid, user, req.run_id, want, cap, cap_label)
        taken: list[tuple[str, int]] = []
        busy: list[str] = []
        try:
            for uuid in req.uuids:
                if len(taken) >= want:
                    break
                fd = None if uuid in self.leases else lock(uuid)
                if fd is None:
                    busy.append(uuid)
                    if req.count is None:
                        break
                else:
                    taken.append((uuid, fd))
        except BaseException:
            for _, fd in taken:
                os.close(fd)
            raise
        if len(taken) < want:
            for _, fd in taken:
                os.close(fd)
            who = "; ".join(f"{u} held by {self.leases[u].describe() if u in self.leases else 'a process outside the broker'}"
                            for u in busy)
            raise Refusal("busy", f"could not reserve {want} GPU(s) for run {req.run_id} among {len(req.uuids)}: "
                          f"{who or 'none free'}",
                          "wait for those runs to end (`launcher gpus` shows them; `launcher up --wait` queues), or "
                          "choose other GPUs with --gpus")
        since = time.time() if now is None else now
        leases = [Lease(uuid, fd, uid, user, req.run_id, since) for uuid, fd in taken]
        for lease in leases:
            self.leases[lease.uuid] = lease
        return leases

    def untie(self, uuid: str, pid: int) -> tuple[Lease | None, int | None]:
        """A tied process exited: (its lease, its pidfd to close), or (None, None) when not tied (any more). The
        lease ends with its last process: the caller drops it when its ``pids`` is then empty."""
        lease = self.leases.get(uuid)
        if lease is None or pid not in lease.pids:
            return None, None
        return lease, lease.pids.pop(pid)

    def remove(self, lease: Lease) -> None:
        """Take ``lease`` out of the table (the caller closes its pidfds and its lock)."""
        self.leases.pop(lease.uuid, None)
