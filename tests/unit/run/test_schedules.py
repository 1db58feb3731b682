"""The four schedules of the public API (worker.schedules), pure: who is answered when, what is learned from,
what is dropped as too old. The clock is injected; no sockets, no TensorFlow."""

from __future__ import annotations

import numpy as np
import pytest

from worker.api import Payload, Schedule
from worker.schedules import Scheduler, policy_lag


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def payload(group: int, version: int) -> Payload:
    return Payload({"x": np.zeros((2, 1), np.float32)}, group=group, version=version)


def test_sync_waits_for_every_connected_group_then_answers_them_all() -> None:
    clock = Clock()
    s = Scheduler(Schedule.sync(max_wait_s=5.0), clock=clock)
    assert not s.due({0, 1, 2})
    assert s.offer("L0", payload(0, 3)) is False and s.offer("L1", payload(1, 3)) is False
    assert not s.due(live={0, 1, 2}, waiting=s.waiting_groups())  # group 2 is connected and has not sent
    clock.t += 4.9
    assert not s.due(live={0, 1, 2}, waiting=s.waiting_groups())
    clock.t += 0.2  # the first payload has waited max_wait_s: a silent group does not stall the others
    assert s.due(live={0, 1, 2}, waiting=s.waiting_groups())
    taken = s.take(3)
    assert taken.links == ["L0", "L1"] and [p.group for p in taken.payloads] == [0, 1] and taken.lags == [0, 0]
    assert len(s) == 0 and not s.due({0, 1, 2})
    assert Schedule.sync().groups_wait and not Schedule.overlapped().groups_wait


def test_a_barrier_updates_when_every_live_group_has_sent_and_a_newer_payload_replaces_the_older() -> None:
    s = Scheduler(Schedule.overlapped(max_lag=1, round_size=64))
    s.offer("old link", payload(0, 0))
    s.offer("new link", payload(0, 1))  # group 0 reconnected and sent again: one payload per group per round
    assert len(s) == 1
    assert s.due(live={0}, waiting=s.waiting_groups())
    taken = s.take(1)
    assert taken.links == ["new link"] and taken.payloads[0].version == 1
    # A link that died is not waited for (the master asks with alive=...).
    s.offer("dead", payload(1, 1))
    assert s.waiting_groups(alive=lambda link: link != "dead") == set()


def test_round_size_ends_a_round_early() -> None:
    s = Scheduler(Schedule.overlapped(round_size=2, max_wait_s=60))
    s.offer("a", payload(0, 0))
    assert not s.due(live={0, 1, 2, 3}, waiting=s.waiting_groups())
    s.offer("b", payload(1, 0))
    assert s.due(live={0, 1, 2, 3}, waiting=s.waiting_groups())


def test_async_takes_one_payload_per_update_and_answers_only_its_group() -> None:
    s = Scheduler(Schedule.asynchronous(max_lag=2))
    assert s.offer("A", payload(0, 10)) is False and s.offer("B", payload(1, 5)) is False
    assert s.due()
    first = s.take(10)
    assert first.links == ["A"] and first.lags == [0] and first.stale == 0
    second = s.take(10)  # five versions old, past max_lag 2: dropped and counted, but B is still answered
    assert second.links == ["B"] and second.payloads == [] and second.stale == 1
    assert not s.due()


def test_a_queue_answers_at_once_until_it_is_full_then_updates_on_all_of_it() -> None:
    s = Scheduler(Schedule.queue(4, max_lag=1))
    assert s.offer("A", payload(0, 4)) is True  # answered now: group 0 keeps collecting
    assert not s.due()
    assert s.offer("B", payload(1, 4)) is True
    assert s.offer("A", payload(0, 4)) is True  # a group may have several payloads queued
    assert not s.due()
    assert s.offer("C", payload(2, 4)) is False  # the fourth fills the queue: answered after the update
    assert s.due()
    taken = s.take(4)
    assert taken.links == ["C"]  # only the one held for the update; the others were answered already
    assert [p.group for p in taken.payloads] == [0, 1, 0, 2]


def test_the_queue_fills_at_its_size() -> None:
    s = Scheduler(Schedule.queue(2))
    assert s.offer("A", payload(0, 0)) is True
    assert s.offer("B", payload(1, 0)) is False and s.due()
    taken = s.take(1)
    assert taken.links == ["B"] and taken.lags == [1, 1]


def test_lag_of_a_payload_from_the_future_is_zero() -> None:
    assert policy_lag(5, 7) == 0  # weights from before a resume are not "negative lag"
    assert policy_lag(9, 7) == 2


@pytest.mark.parametrize("make,problem", [
    (lambda: Schedule("later"), "schedule kind must be one of sync, overlapped, async, queue"),
    (lambda: Schedule.queue(0), "size and round_size must be >= 1"),
    (lambda: Schedule.asynchronous(max_lag=-1), "max_lag must be >= 0"),
    (lambda: Schedule.sync(max_wait_s=0), "max_wait_s must be > 0"),
])
def test_a_bad_schedule_says_what_is_wrong(make, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        make()
