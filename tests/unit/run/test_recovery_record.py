"""What a new master records when it replaces a dead one (worker/recovery.py, issue 27): only a status.json left
mid-run counts as a dead master; the steps lost are the dead master's last count past the restored checkpoint
(never negative); earlier recoveries are carried over, malformed entries dropped; the record reaches the status,
metrics.jsonl and TensorBoard writers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from worker.checkpoint import Counters
from worker.recovery import MAX_KEPT, earlier_recoveries, note_recovery, previous_master, recovery_entry


@pytest.mark.parametrize("content, dead", [
    ({"state": "running", "env_steps": 5}, True),
    ({"state": "starting"}, True),
    ({"state": "stopping", "env_steps": 9}, True),
    ({"state": "finished", "env_steps": 5}, False),  # it ended: a --resume, not a recovery
    ({"state": "failed"}, False),
    (["running"], False),
    ("not json at all", False),
    (None, False),  # no file
])
def test_only_a_status_left_mid_run_is_a_dead_master(tmp_path: Path, content: Any, dead: bool) -> None:
    path = tmp_path / "status.json"
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_text(json.dumps(content))
    assert (previous_master(path) is not None) is dead


def test_steps_lost_are_the_dead_masters_count_past_the_checkpoint_and_never_negative() -> None:
    entry = recovery_entry({"env_steps": 12_000, "pid": 77}, Counters(env_steps=10_000, updates=40), "/r/ckpt-40")
    assert (entry["steps_lost"], entry["restored_env_steps"], entry["checkpoint"], entry["dead_pid"]) == \
        (2000, 10_000, "ckpt-40", 77)
    # The status is written once a second, the checkpoint at an update: the checkpoint may be the newer one.
    assert recovery_entry({"env_steps": 9_500}, Counters(env_steps=10_000), "ckpt-41")["steps_lost"] == 0
    # Nothing restored (killed before its first checkpoint): everything counted is lost; junk counts as 0.
    assert recovery_entry({"env_steps": 3_000}, None, None)["steps_lost"] == 3_000
    assert recovery_entry({"env_steps": "x", "pid": True}, None, None)["steps_lost"] == 0


def test_earlier_recoveries_are_carried_and_bounded() -> None:
    prev = {"recoveries": [{"steps_lost": 1}, "junk", 3, {"steps_lost": 2}]}
    assert earlier_recoveries(prev) == [{"steps_lost": 1}, {"steps_lost": 2}]
    assert earlier_recoveries({"recoveries": "no"}) == []
    many = {"recoveries": [{"i": i} for i in range(MAX_KEPT + 10)]}
    assert len(earlier_recoveries(many)) == MAX_KEPT and earlier_recoveries(many)[-1] == {"i": MAX_KEPT + 9}


class _Sink:
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def write(self, *args: Any) -> None:
        self.seen.append(args)


class _Tally:
    def __init__(self) -> None:
        self.c = Counters(env_steps=500, updates=5)
        self.recoveries: list[dict[str, Any]] = []


def test_the_record_reaches_the_status_metrics_and_tensorboard() -> None:
    tally, metrics, tb = _Tally(), _Sink(), _Sink()
    note_recovery({"state": "running", "env_steps": 800, "recoveries": [{"steps_lost": 7}]}, tally, "ckpt-5",
                  metrics, tb)
    assert [r["steps_lost"] for r in tally.recoveries] == [7, 300]
    ((record,),) = metrics.seen
    assert record["event"] == "master_recovered" and record["steps_lost"] == 300 and record["checkpoint"] == "ckpt-5"
    ((step, scalars),) = tb.seen
    assert step == 500 and scalars == {"recovery/count": 2, "recovery/steps_lost": 300}
    tally2, metrics2 = _Tally(), _Sink()
    note_recovery(None, tally2, "ckpt-5", metrics2, _Sink())  # a first start: nothing recorded
    assert tally2.recoveries == [] and metrics2.seen == []
