"""When the learner updates: the four schedules of :class:`worker.api.Schedule`, apart from the learner and
the sockets (plain values in, decisions out), so they are tested without either.

* ``sync`` and ``overlapped`` (a barrier): one payload per group waits until every connected group has sent
  one, or ``round_size`` groups are waiting, or the first has waited ``max_wait_s``; then one update on all of
  them and every waiting group gets the new weights. With ``overlapped`` groups collect their next payload
  meanwhile (:mod:`worker.group`), so a payload is normally one version behind when it is used: its *policy
  lag*. With ``sync`` groups wait for the weights and the lag is 0.
* ``async``: every payload is its own update, and only its group is answered (A3C).
* ``queue``: payloads from any group queue up, each answered at once (its group keeps collecting), until
  ``size`` are waiting; the one that fills the queue is answered after the update on all of them (DPPO).

In every kind a payload more than ``max_lag`` versions behind the learner is dropped and counted, never learnt
from. A version from the future (a group that kept weights across a master restart that resumed from an older
checkpoint) counts as lag 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from worker.api import Payload, Schedule


def policy_lag(learner_version: int, behaviour_version: int) -> int:
    """Versions between the policy that collected a payload and the learner's (0: on-policy)."""
    return max(0, learner_version - behaviour_version)


@dataclass
class Taken:
    """One update's worth: the links to answer afterwards, the payloads to learn from (their ``lag`` set), and
    how many were dropped as too old."""

    links: list[Any] = field(default_factory=list)
    payloads: list[Payload] = field(default_factory=list)
    stale: int = 0

    @property
    def lags(self) -> list[int]:
        return [p.lag for p in self.payloads]


class Scheduler:
    """Holds the payloads waiting for the learner and decides, per :class:`worker.api.Schedule`, when they are
    used and who is answered. ``link`` is whatever gets new weights afterwards (opaque here)."""

    def __init__(self, schedule: Schedule, *, clock: Any = time.monotonic) -> None:
        self.schedule = schedule
        self.clock = clock
        self._barrier: dict[int, tuple[Any, Payload]] = {}  # sync/overlapped: one per group
        self._queue: list[tuple[Any, Payload, bool]] = []  # async/queue: (link, payload, answered already)
        self._first_at = 0.0

    def __len__(self) -> int:
        return len(self._barrier) + len(self._queue)

    @property
    def barrier(self) -> bool:
        return self.schedule.kind in ("sync", "overlapped")

    def offer(self, link: Any, payload: Payload) -> bool:
        """Queue ``payload`` from ``link``; True when its group is to be answered now (with the weights it has,
        or newer), False when the answer comes after the update that uses it."""
        if not len(self):
            self._first_at = self.clock()
        if self.barrier:
            self._barrier[payload.group] = (link, payload)
            return False
        answer_now = self.schedule.kind == "queue" and len(self._queue) + 1 < self.schedule.size
        self._queue.append((link, payload, answer_now))
        return answer_now

    def waiting_groups(self, alive: Any = lambda link: True) -> set[int]:
        """The groups whose payload waits in the barrier and whose link is still ``alive``."""
        return {g for g, (link, _) in self._barrier.items() if alive(link)}

    def due(self, live: set[int] | None = None, waiting: set[int] | None = None) -> bool:
        """Whether to update now. Barriers: given the connected groups (``live``) and those whose payload waits
        (``waiting``, default: all that sent one)."""
        if not len(self):
            return False
        kind = self.schedule.kind
        if kind == "async":
            return True
        if kind == "queue":
            return len(self._queue) >= self.schedule.size
        waiting = set(self._barrier) if waiting is None else waiting
        waited = self.clock() - self._first_at
        return (live is not None and live <= waiting) or len(self._barrier) >= self.schedule.round_size \
            or waited >= self.schedule.max_wait_s

    def take(self, version: int) -> Taken:
        """End the round at learner version ``version`` (async: take the oldest payload alone)."""
        out = Taken()
        if self.barrier:
            entries = [(link, p, False) for link, p in self._barrier.values()]
            self._barrier.clear()
        elif self.schedule.kind == "async":
            entries = [self._queue.pop(0)]
        else:
            entries, self._queue = self._queue, []
        for link, payload, answered in entries:
            if not answered:
                out.links.append(link)
            payload.lag = policy_lag(version, payload.version)
            if payload.lag > self.schedule.max_lag:
                out.stale += 1
            else:
                out.payloads.append(payload)
        if len(self):
            self._first_at = self.clock()
        return out
