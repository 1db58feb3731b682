"""The elastic run's controller (launcher/elastic.py) step by step, with an injected clock, a real queue directory
with real tickets, and a scripted backend that records what it is asked (the backends' own side is run for real
in tests/unit/gpu/test_elastic_runs.py and tests/docker/test_gpu_detached.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from launcher.backends.base import BackendStatus, Part, PartState
from launcher.elastic import Elastic, GroupState
from launcher.gpu import elastic as decide
from launcher.gpu.queue import Waiter

G = [f"GPU-{i}" for i in range(4)]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Backend:
    """Answers like a backend and records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.regrow_ok = True
        self.leases: Any = None  # the run's reservation, as the real backends change it

    def yield_group(self, index: int) -> None:
        self.calls.append(("yield", index))

    def kill_group(self, index: int) -> None:
        self.calls.append(("kill", index))

    def release_yielded(self, uuids: tuple[str, ...]) -> tuple[str, ...]:
        self.calls.append(("release", uuids))
        self.leases.uuids = tuple(u for u in self.leases.uuids if u not in uuids)
        return uuids

    def regrow(self, indices: tuple[int, ...], uuids: tuple[str, ...]) -> bool:
        self.calls.append(("regrow", (indices, uuids)))
        if self.regrow_ok:
            self.leases.uuids = (*self.leases.uuids, *uuids)
        return self.regrow_ok

    def describe(self) -> dict[str, Any]:
        return {}


def _run(records: list[dict[str, Any]], results: Path) -> Any:
    share = lambda *u: SimpleNamespace(gpu_uuids=u, gpu_indices=tuple(int(x[-1]) for x in u))  # noqa: E731
    plan = SimpleNamespace(master=share(G[0]), kind="gpu",
                           groups=[SimpleNamespace(index=i, share=share(g)) for i, g in enumerate([G[1], G[1], G[2], G[3]])])
    return SimpleNamespace(run_id="alice-run", plan=plan, reservation=SimpleNamespace(uuids=tuple(G)),
                           run_dir=SimpleNamespace(update_record=lambda **kw: records.append(kw), path=results))


def _status(states: dict[int, PartState]) -> BackendStatus:
    return BackendStatus(Part("master", PartState.RUNNING), {i: Part(f"group-{i}", s) for i, s in states.items()})


RUNNING = {i: PartState.RUNNING for i in range(4)}


def _elastic(tmp_path: Path, held: set[str], **kw: Any) -> tuple[Elastic, Backend, Clock, list[dict[str, Any]]]:
    backend, clock, records = Backend(), Clock(), []
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "metrics.jsonl").write_text('{"type":"event","event":"group_joined","group":0}\n')
    run = _run(records, tmp_path / "results")
    backend.leases = run.reservation
    el = Elastic(run, backend, 2, tmp_path, holders=lambda: set(held), uuid_of=lambda i: f"GPU-{i}",  # type: ignore[arg-type]
                 clock=clock, **kw)
    return el, backend, clock, records


def test_an_auto_waiter_gets_one_gpu_once_and_the_gpu_is_released_only_after_the_group_left(tmp_path: Path) -> None:
    held = set(G)
    el, backend, clock, records = _elastic(tmp_path, held)
    with Waiter(tmp_path, "bob-run", "free GPUs", "auto"):
        el.review(_status(RUNNING))
        assert backend.calls == [("yield", 3)]  # GPU 3 costs one group; GPU 1 two; the master's never
        (note,) = decide.read_notes(tmp_path)
        assert (note.to_run, note.groups, note.gpus) == ("bob-run", (3,), (G[3],))
        el.review(_status(RUNNING))  # still leaving: nothing released, nothing more asked
        assert backend.calls == [("yield", 3)]
        el.review(_status({**RUNNING, 3: PartState.YIELDED}))
        assert backend.calls[-1] == ("release", (G[3],)) and el.state[3] == GroupState.YIELDED
        held.discard(G[3])
        for _ in range(3):  # the same ticket is not yielded to again, though it still waits
            el.review(_status({**RUNNING, 3: PartState.YIELDED}))
        assert [c for c in backend.calls if c[0] == "yield"] == [("yield", 3)]
    assert records[-1]["elastic"]["groups"] == {"0": "active", "1": "active", "2": "active", "3": "yielded"}
    assert [e["event"] for e in records[-1]["elastic"]["events"]] == ["yielding", "yielded"]
    lines = [json.loads(line) for line in (tmp_path / "results" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["event"], m.get("to_run"), m.get("groups")) for m in lines] == [
        ("group_joined", None, None), ("elastic_yielding", "bob-run", [3]), ("elastic_yielded", "bob-run", [3])]


def test_a_group_that_does_not_leave_is_killed_at_its_deadline(tmp_path: Path) -> None:
    el, backend, clock, _ = _elastic(tmp_path, set(G), yield_timeout_s=20.0)
    with Waiter(tmp_path, "bob-run", "GPUs 2,3", ["2", "3"]):
        el.review(_status(RUNNING))
        assert backend.calls == [("yield", 2), ("yield", 3)]
        clock.t = 19.0
        el.review(_status({**RUNNING, 2: PartState.YIELDED}))  # 2 left: its GPU goes at once; 3 has not left
        assert backend.calls[-1] == ("release", (G[2],)) and ("kill", 3) not in backend.calls
        clock.t = 21.0
        el.review(_status({**RUNNING, 2: PartState.YIELDED}))
        assert backend.calls[-1] == ("kill", 3)
        el.review(_status({**RUNNING, 2: PartState.YIELDED, 3: PartState.YIELDED}))  # killed: it has left now
        assert backend.calls[-1] == ("release", (G[3],))


def test_regrowth_waits_for_the_queue_and_for_the_gpus_to_stay_free(tmp_path: Path) -> None:
    held = set(G)
    el, backend, clock, records = _elastic(tmp_path, held, settle_s=3.0)
    waiter = Waiter(tmp_path, "bob-run", "GPUs 2,3", ["2", "3"])
    el.review(_status(RUNNING))
    el.review(_status({**RUNNING, 2: PartState.YIELDED, 3: PartState.YIELDED}))
    assert backend.calls[-1] == ("release", (G[2], G[3]))
    held -= {G[2], G[3]}
    other = Waiter(tmp_path, "carol-run", "free GPUs", "auto")  # any GPU would do for her: nothing comes back
    waiter.leave()
    for t in (1.0, 5.0, 9.0):
        clock.t = t
        el.review(_status({**RUNNING, 2: PartState.YIELDED, 3: PartState.YIELDED}))
    assert not [c for c in backend.calls if c[0] == "regrow"]
    other.leave()
    clock.t = 10.0
    el.review(_status({**RUNNING, 2: PartState.YIELDED, 3: PartState.YIELDED}))  # free from now...
    held.add(G[3])  # ... until a run takes GPU 3 for a moment: the settle starts again when it is free again
    clock.t = 12.0
    el.review(_status({**RUNNING, 2: PartState.YIELDED, 3: PartState.YIELDED}))
    held.discard(G[3])
    for t in (12.5, 14.0, 15.0):
        clock.t = t
        el.review(_status({**RUNNING, 2: PartState.YIELDED, 3: PartState.YIELDED}))
    assert not [c for c in backend.calls if c[0] == "regrow"]  # 12.5 -> 15.0 is under 3 s
    backend.regrow_ok = False  # another run took one at the last moment: they stay yielded
    clock.t = 15.6
    el.review(_status({**RUNNING, 2: PartState.YIELDED, 3: PartState.YIELDED}))
    assert backend.calls[-1] == ("regrow", ((2, 3), (G[2], G[3]))) and el.state[2] == GroupState.YIELDED
    backend.regrow_ok = True
    for t in (16.0, 19.0):
        clock.t = t
        el.review(_status({**RUNNING, 2: PartState.YIELDED, 3: PartState.YIELDED}))
    assert el.state == {i: GroupState.ACTIVE for i in range(4)}
    assert decide.read_notes(tmp_path) == []  # back to full size: the note is gone
    assert records[-1]["elastic"]["active"] == 4
