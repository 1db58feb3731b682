"""An elastic run (``launcher up --elastic MIN_GROUPS``): its worker groups yield their GPUs to the run at the head
of the fair queue, and grow back when the GPUs free.

The supervisor calls :meth:`Elastic.review` on every poll. Per group the lifecycle is explicit::

    ACTIVE --(the head of the queue needs its GPUs)--> YIELDING --(the group exited)--> YIELDED
    YIELDED --(nobody waits for them; its GPUs leased again)--> ACTIVE

The decisions are :mod:`launcher.gpu.elastic`'s pure functions; this module acts on them, in an order that keeps
the lease store the only authority: a yielding group is asked to leave (it sends the segment it is collecting,
says goodbye and exits; the master's rounds go on without it) and only once its process has exited are the
leases of the GPUs no other part of the run uses released, so the waiter takes them through the normal queue.
A regrowth first leases the GPUs again (without waiting: a GPU another run took is not free), then starts the
group. At no instant do two runs hold, or run on, one GPU. One exchange at a time; the master never stops.

What it did is in ``run.json`` (``elastic``: the minimum, each group's state, the last events), in the live
view's events, in the master's metrics (``group_yielded``, then ``group_joined``), and in a yield note in the
queue's directory for ``launcher gpus`` and the receiving run (:mod:`launcher.gpu.elastic`).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from launcher import safefs
from launcher.backends.base import Backend, BackendStatus, PartState, PreparedRun
from launcher.errors import LauncherError
from launcher.gpu import elastic as decide
from launcher.gpu.queue import Ticket, read_queue
from worker.contract import METRICS_FILE

log = logging.getLogger(__name__)

YIELD_TIMEOUT_S = 20.0  # a group asked to leave that has not exited by then is killed (its segment is lost)
# A yielded group comes back only once its GPUs have been free, with nobody waiting for them, this long: a run that
# just took them may be handing its leases to its master container (docker: a gap of about a container start).
REGROW_SETTLE_S = 3.0
MAX_EVENTS = 50


class GroupState(str, enum.Enum):
    ACTIVE = "active"
    YIELDING = "yielding"
    YIELDED = "yielded"


@dataclass
class Elastic:
    """One elastic run's side of the exchange. ``holders()`` lists the GPUs leased now (UUIDs, by anyone);
    ``uuid_of`` maps a GPU index a waiter named to its UUID (NVML), None when unknown."""

    run: PreparedRun
    backend: Backend
    min_groups: int
    queue_dir: Path
    holders: Callable[[], set[str]]
    uuid_of: Callable[[str], str | None]
    emit: Callable[[str, dict[str, Any]], None] = lambda kind, data: None
    clock: Callable[[], float] = time.monotonic
    yield_timeout_s: float = YIELD_TIMEOUT_S
    settle_s: float = REGROW_SETTLE_S
    state: dict[int, GroupState] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    _deadline: dict[int, float] = field(default_factory=dict)
    _served: set[str] = field(default_factory=set)  # tickets already yielded to: never twice
    _to: decide.Demand | None = None
    _settling: tuple[tuple[int, ...], float] = ((), 0.0)  # the groups that could come back, and since when

    def __post_init__(self) -> None:
        self.gpus = {g.index: tuple(g.share.gpu_uuids) for g in self.run.plan.groups}
        self.master = tuple(self.run.plan.master.gpu_uuids)
        self.state = {i: GroupState.ACTIVE for i in self.gpus}
        self.record()

    # ------------------------------------------------------------------------------------------- reading
    def _in(self, *states: GroupState) -> dict[int, tuple[str, ...]]:
        return {i: self.gpus[i] for i, s in self.state.items() if s in states}

    def _ours(self) -> set[str]:
        """The GPUs this run holds or runs on now (its leases may be the launcher's, the master's or the groups')."""
        return set(self.run.reservation.uuids) | decide.gpus_in_use(
            self._in(GroupState.ACTIVE, GroupState.YIELDING), self.master)

    def _wanted(self, demand: decide.Demand) -> tuple[str, ...] | None:
        """The UUIDs the waiter named (None: any one GPU).

        Raises:
            LookupError: it named a GPU index NVML does not know (then nothing is given to it)."""
        if not demand.gpus:
            return None
        out = []
        for item in demand.gpus:
            uuid = item if not item.isdigit() else self.uuid_of(item)
            if uuid is None:
                raise LookupError(f"GPU {item}")
            out.append(uuid)
        return tuple(out)

    def _blocks_regrowth(self, ticket: Ticket, gpus: tuple[str, ...]) -> bool:
        """Whether a waiter could take any of ``gpus``: then they stay free for it."""
        if ticket.run_id == self.run.run_id:
            return False
        demand = decide.demand_of(ticket)
        if demand is None or not demand.gpus:
            return True  # any GPU will do for it (or it does not say: assume so)
        try:
            wanted = self._wanted(demand)
        except LookupError:
            return True
        return wanted is None or bool(set(wanted) & set(gpus))

    # ------------------------------------------------------------------------------------------- acting
    def review(self, st: BackendStatus) -> None:
        """One step: finish the yields under way, else yield to the head of the queue, else grow back."""
        try:
            if self._finish_yields(st):
                return
            tickets = read_queue(self.queue_dir, clean=False)
            if tickets and tickets[0].run_id != self.run.run_id and self._yield_to(tickets[0]):
                return
            self._regrow(tickets)
        except (OSError, LauncherError) as exc:  # the queue or a lease could not be read: try again next poll
            log.warning("elastic run %s: %s", self.run.run_id, getattr(exc, "message", exc))

    def _finish_yields(self, st: BackendStatus) -> bool:
        """Release the GPUs of the groups that have left; kill one past its deadline. True while any is leaving."""
        done = []
        for i, deadline in list(self._deadline.items()):
            part = st.groups.get(i)
            if part is not None and part.state == PartState.YIELDED:
                done.append(i)
            elif self.clock() > deadline:
                log.warning("group %d did not leave within %.0f s of being asked; killing it", i, self.yield_timeout_s)
                self.backend.kill_group(i)
                self._deadline[i] = self.clock() + self.yield_timeout_s
        if done:
            for i in done:
                self._deadline.pop(i)
                self.state[i] = GroupState.YIELDED
            staying = [i for i, s in self.state.items() if s != GroupState.YIELDED]
            freed = decide.freed_by(done, groups=self.gpus, staying=staying, master=self.master)
            released = self.backend.release_yielded(freed) if freed else ()
            self._event("yielded", done, released)
        return bool(self._deadline)

    def _yield_to(self, ticket: Ticket) -> bool:
        if ticket.name in self._served:
            return False
        demand = decide.demand_of(ticket)
        if demand is None:
            return False
        try:
            wanted = self._wanted(demand)
        except LookupError:
            return False
        held_elsewhere = frozenset(self.holders() - self._ours())
        victims = decide.choose_yield(active=self._in(GroupState.ACTIVE), master=self.master,
                                      min_groups=self.min_groups, wanted=wanted,
                                      held_elsewhere=held_elsewhere)
        if not victims:
            return False
        self._served.add(ticket.name)
        self._to = demand
        for i in victims:
            self.state[i] = GroupState.YIELDING
            self._deadline[i] = self.clock() + self.yield_timeout_s
            self.backend.yield_group(i)
        gpus = decide.freed_by(victims, groups=self.gpus, master=self.master,
                               staying=[i for i, s in self.state.items() if s == GroupState.ACTIVE])
        decide.write_note(self.queue_dir, self.run.run_id, to=demand, groups=victims, gpus=gpus, since=time.time())
        self._event("yielding", victims, gpus)
        return True

    def _regrow(self, tickets: list[Ticket]) -> None:
        yielded = self._in(GroupState.YIELDED)
        if not yielded:
            return
        free_of_waiters = {i: g for i, g in yielded.items() if not any(self._blocks_regrowth(t, g) for t in tickets)}
        ready = decide.choose_regrow(free_of_waiters, held=frozenset(self.holders()),
                                     ours=frozenset(self._ours()))
        if ready != self._settling[0]:  # the same groups must stay free for settle_s (REGROW_SETTLE_S)
            self._settling = (ready, self.clock())
        if not ready or self.clock() - self._settling[1] < self.settle_s:
            return
        self._settling = ((), 0.0)
        active = [i for i, s in self.state.items() if s == GroupState.ACTIVE]
        gpus = decide.freed_by(ready, groups=self.gpus, staying=active, master=self.master)
        if not self.backend.regrow(ready, gpus):
            return  # another run took one of them a moment ago: not free after all; try again later
        for i in ready:
            self.state[i] = GroupState.ACTIVE
        self._event("regrown", ready, gpus)
        if not self._in(GroupState.YIELDED, GroupState.YIELDING):
            decide.remove_note(self.queue_dir, self.run.run_id)
            self._to = None

    def close(self) -> None:
        """The run ends: its yield note goes (its GPUs are released with the rest of the run's leases)."""
        decide.remove_note(self.queue_dir, self.run.run_id)

    # ------------------------------------------------------------------------------------------- telling
    def _event(self, kind: str, groups: Any, gpus: Any) -> None:
        groups, gpus = sorted(groups), sorted(gpus)
        active = len(self._in(GroupState.ACTIVE))
        to = self._to
        whom = f" to run {to.run_id or '?'} of {to.user}" if to is not None and kind != "regrown" else ""
        words = {"yielding": f"yielding group(s) {', '.join(map(str, groups))}{whom}, which waits for GPU(s) "
                             f"{', '.join(gpus) or '(none freed)'}",
                 "yielded": f"group(s) {', '.join(map(str, groups))} left; GPU(s) {', '.join(gpus) or '(none)'} "
                            f"released{whom}",
                 "regrown": f"group(s) {', '.join(map(str, groups))} back on GPU(s) {', '.join(gpus)}"}[kind]
        self.emit("event", {"message": f"elastic: {words}; {active} of {len(self.gpus)} groups playing "
                                       f"(minimum {self.min_groups})"})
        self.events.append({"t": time.time(), "event": kind, "groups": groups, "gpus": gpus,
                            "to_run": to.run_id if to and kind != "regrown" else None,
                            "to_user": to.user if to and kind != "regrown" else None})
        del self.events[:-MAX_EVENTS]
        self.record()
        tell_metrics(self.run.run_dir.path, {**self.events[-1], "type": "event", "event": f"elastic_{kind}",
                                             "active_groups": active, "by": "launcher"})

    def to_dict(self) -> dict[str, Any]:
        return {"min_groups": self.min_groups, "groups": {str(i): s.value for i, s in sorted(self.state.items())},
                "active": len(self._in(GroupState.ACTIVE)), "events": list(self.events)}

    def record(self) -> None:
        """run.json's ``elastic``, with the parts' pids as they are now (a regrown group is a new process)."""
        self.run.run_dir.update_record(elastic=self.to_dict(), **self.backend.describe())


def tell_metrics(results: Path, record: dict[str, Any]) -> bool:
    """Append ``record`` as one line to the run's ``metrics.jsonl``, which its master writes too (each of its records
    is one ``write`` of a whole line in append mode, as is this one). Only an existing file is appended to (the
    master made it, with its owner); False when there is none yet or it cannot be written."""
    line = (json.dumps({**record, "t": record.get("t", time.time())}, separators=(",", ":")) + "\n").encode()
    try:
        fd = safefs.open_beneath(results, METRICS_FILE, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return False
    try:
        os.write(fd, line)
    except OSError as exc:
        log.warning("could not add to %s/%s: %s", results, METRICS_FILE, exc)
        return False
    finally:
        os.close(fd)
    return True


class Arrival:
    """A run that got its GPUs from elastic runs (its record's ``gpus_from``): said in its metrics once its master
    has made them (:meth:`tell`, every poll until it is done)."""

    def __init__(self, run: PreparedRun) -> None:
        self.results = run.run_dir.path
        self.notes = [n for n in run.run_dir.read_record().get("gpus_from") or [] if isinstance(n, dict)]

    def tell(self) -> None:
        if self.notes and tell_metrics(self.results, {"type": "event", "event": "gpus_from_elastic_runs",
                                                      "from": self.notes, "by": "launcher"}):
            self.notes = []


def for_run(run: PreparedRun, backend: Backend, emit: Callable[[str, dict[str, Any]], None]) -> Elastic | None:
    """The run's :class:`Elastic`, or None when it is not elastic (or holds no GPU leases: nothing to yield)."""
    if not run.elastic_min or run.reservation is None or run.plan.kind != "gpu":
        return None
    from launcher.gpu import leaseholders, reservations

    ld = reservations.lease_dir(run.config.lock_dir)
    known = {str(i): u for share in (run.plan.master, *(g.share for g in run.plan.groups))
             for i, u in zip(share.gpu_indices, share.gpu_uuids)}
    nvml: dict[str, str] | None = None

    def uuid_of(index: str) -> str | None:
        nonlocal nvml
        if index in known:
            return known[index]
        if nvml is None:  # once: indices do not change while the machine runs
            from launcher.gpu import inventory

            try:
                nvml = {str(g.index): g.uuid for g in inventory().gpus}
            except LauncherError:
                nvml = {}
        return nvml.get(index)

    return Elastic(run, backend, run.elastic_min, ld.queue, holders=lambda: {h.uuid for h in leaseholders.list_holders(ld)},
                   uuid_of=uuid_of, emit=emit)
