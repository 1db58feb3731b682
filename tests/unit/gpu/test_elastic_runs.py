"""Elastic runs between two real Unix users on a simulated 4-GPU machine (the stand-in NVML), through the real CLI:
alice's elastic run (4 groups on 4 GPUs, MIN 2) yields two groups to bob's queued run, keeps training on two,
and grows back when bob's run ends; a run that is not elastic is never asked. The test bed (an admin lease store,
``useradd`` users, ``setpriv``) is tests/broker_fixtures.py's; these runs use its store without a broker.

Throughout the exchange a sampler (tests/elastic_sampler.py) reads, every 50 ms, the kernel's lock table and every
worker group process's GPUs: no GPU may ever be held by, or run a group of, two runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from launcher.gpu import reservations
from launcher.runs import RunDir, list_runs
from launcher.safefs import read_json_at
from tests.broker_fixtures import PY, ROOT, UUIDS, Box, skip_reason, wait_until
from tests.elastic_sampler import Sampler
from tests.unix_users import User

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
FIGURES: dict[str, Any] = {}


@pytest.fixture(scope="module")
def box(broker_box: Box) -> Box:
    return broker_box


class Up:
    """One ``launcher up --backend process`` as ``user``, on the store without a broker."""

    def __init__(self, box: Box, user: User, name: str, *args: str) -> None:
        self.name, self.results = name, box.base / f"results-{name}"
        home = box.base / f"home-{name}"
        for d in (home, self.results):
            d.mkdir()
            os.chown(d, user.uid, user.gid)
        self.log = open(box.base / f"{name}.log", "w")
        env = box.env(box.plain, HOME=str(home), TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0",
                      PYTHONUNBUFFERED="1")
        argv = [str(PY), "-m", "launcher", "up", "--backend", "process", "--env", "CartPole-v1", "--results",
                str(self.results), "--progress", "plain", "--progress-interval", "2", *args]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(box.as_user(user, argv), cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def run_dir(self) -> RunDir | None:
        runs = list_runs(self.results)
        return runs[0] if runs else None

    def record(self) -> dict[str, Any]:
        rd = self.run_dir()
        return rd.read_record() if rd else {}

    def status(self) -> dict[str, Any]:
        rd = self.run_dir()
        return (read_json_at(rd.files.status) if rd else None) or {}

    def tail(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (Path(self.log.name).read_text())[-3000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout=60)
        self.log.close()
        return code


def test_an_elastic_run_yields_two_groups_to_a_queued_run_and_grows_back(box: Box) -> None:
    alice, bob = box.users
    sampler = Sampler(reservations.LeaseDir(box.plain.leases, box.plain),
                      [box.base / f"results-{who}" for who in ("alice", "bob")])
    sampler.start()
    a = Up(box, alice, "alice", "--gpus", "0,1,2,3", "--workers", "8", "--groups", "4", "--elastic", "2",
           "--max-steps", "100000000", "--timeout", "600", "--seed", "1")
    b: Up | None = None
    steps: list[tuple[float, int]] = []
    try:
        wait_until(lambda: a.proc.poll() is not None or sum(1 for g in (a.status().get("groups") or {}).values()
                                                              if g.get("connected")) == 4, timeout_s=120, poll_s=0.2)
        assert a.proc.poll() is None, a.tail()
        first_pids = dict(a.record()["pids"])
        b = Up(box, bob, "bob", "--gpus", "2,3", "--workers", "2", "--wait", "60", "--max-steps", "8000",
               "--seed", "2")

        def sample_steps() -> None:
            steps.append((time.monotonic(), int(a.status().get("env_steps") or 0)))

        def running(up: Up) -> bool:
            sample_steps()
            return up.proc.poll() is not None or up.record().get("state") == "running"

        bob_started = wait_until(lambda: running(b), timeout_s=60, poll_s=0.1)  # type: ignore[arg-type]
        assert b.proc.poll() is None, b.tail()
        el = a.record()["elastic"]
        assert el["groups"] == {"0": "active", "1": "active", "2": "yielded", "3": "yielded"}, el
        shown = subprocess.run(box.as_user(alice, [str(PY), "-m", "launcher", "status", "--json", "--results",
                                                   str(a.results), a.run_dir().run_id]),  # type: ignore[union-attr]
                               cwd=ROOT, env=box.env(box.plain), capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        view = json.loads(shown.stdout)
        assert {p["name"]: p["state"] for p in view["parts"]} == {
            "master": "running", "group-0": "running", "group-1": "running", "group-2": "yielded",
            "group-3": "yielded"}, view["parts"]
        assert view["elastic"]["active"] == 2 and view["elastic"]["min_groups"] == 2
        yielded = [e for e in el["events"] if e["event"] == "yielded"]
        assert yielded and yielded[-1]["to_user"] == bob.name and yielded[-1]["groups"] == [2, 3], el
        assert sorted(yielded[-1]["gpus"]) == UUIDS[2:], el
        bob_run = b.run_dir()
        assert bob_run is not None and yielded[-1]["to_run"] == bob_run.run_id
        (given,) = b.record()["gpus_from"]
        assert (given["from_run"], given["user"], sorted(given["gpus"])) == (a.run_dir().run_id,  # type: ignore[union-attr]
                                                                            alice.name, UUIDS[2:]), given
        # anyone sees who gave what to whom: `launcher gpus --json`, as bob
        shown = subprocess.run(box.as_user(bob, [str(PY), "-m", "launcher", "gpus", "--json", "--no-docker"]),
                               cwd=ROOT, env=box.env(box.plain), capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        doc = json.loads(shown.stdout)
        (note,) = doc["yields"]
        assert (note["from_run"], note["user"], note["to_run"], note["to_user"]) == (
            a.run_dir().run_id, alice.name, bob_run.run_id, bob.name), note  # type: ignore[union-attr]
        held = {g["uuid"]: g["lease"]["run_id"] for g in doc["gpus"] if g["lease"]}
        assert held == {**{u: a.run_dir().run_id for u in UUIDS[:2]},  # type: ignore[union-attr]
                        **{u: bob_run.run_id for u in UUIDS[2:]}}, held
        # bob's run ends; alice grows back to 4 groups, all connected to her master
        while b.proc.poll() is None:
            sample_steps()
            time.sleep(0.2)
        assert b.proc.returncode == 0, b.tail()
        bob_ended = time.monotonic()

        def regrown() -> bool:
            sample_steps()
            groups = a.status().get("groups") or {}
            return (a.record().get("elastic") or {}).get("active") == 4 and sum(
                1 for g in groups.values() if g.get("connected")) == 4

        regrow_s = wait_until(regrown, timeout_s=30, poll_s=0.1)
        for _ in range(10):  # and it trains on, on four
            sample_steps()
            time.sleep(0.2)
        assert a.proc.poll() is None, a.tail()
        last_pids = dict(a.record()["pids"])
        status = a.status()
    finally:
        code = a.stop()
        if b is not None:
            b.stop()
        sampler.stop_.set()
        sampler.join()
    assert code == 130, a.tail()  # interrupted by the test, as asked
    assert sampler.samples > 100 and sampler.both == [], sampler.detail[:3]
    runs = {a.run_dir().run_id, bob_run.run_id}  # type: ignore[union-attr]
    assert [sampler.ever.get(u, set()) & runs for u in UUIDS] == [{a.run_dir().run_id}] * 2 + [runs] * 2  # type: ignore[union-attr]
    # groups 0 and 1 played throughout (never restarted); 2 and 3 left once and came back once
    assert [last_pids[f"group-{i}"] == first_pids[f"group-{i}"] for i in range(4)] == [True, True, False, False]
    assert [status["groups"][str(i)]["connects"] for i in range(4)] == [1, 1, 2, 2], status["groups"]
    assert [status["groups"][str(i)]["yields"] for i in range(4)] == [0, 0, 1, 1], status["groups"]
    metrics = [json.loads(line) for line in (a.results / a.run_dir().run_id / "metrics.jsonl"  # type: ignore[union-attr]
                                             ).read_text().splitlines()]
    assert sorted(m["group"] for m in metrics if m.get("event") == "group_yielded") == [2, 3]
    # who to whom, in both runs' metrics: the launcher's lines beside the masters'
    (told,) = [m for m in metrics if m.get("event") == "elastic_yielded"]
    assert (told["to_run"], told["to_user"], told["groups"], told["by"]) == (bob_run.run_id, bob.name, [2, 3], "launcher")
    assert [m["event"] for m in metrics if str(m.get("event")).startswith("elastic_")] == [
        "elastic_yielding", "elastic_yielded", "elastic_regrown"]
    assert b is not None
    bob_metrics = [json.loads(line) for line in (b.results / bob_run.run_id / "metrics.jsonl").read_text().splitlines()]
    (arrived,) = [m for m in bob_metrics if m.get("event") == "gpus_from_elastic_runs"]
    assert [n["from_run"] for n in arrived["from"]] == [a.run_dir().run_id]  # type: ignore[union-attr]
    # alice trained through the whole exchange: her env steps never stalled for 3 s
    values = [s for _, s in steps]
    assert values == sorted(values) and values[-1] > values[0], values
    stalls = [t2 - t1 for (t1, s1), (t2, s2) in zip(steps, steps[1:]) if s2 == s1]
    longest, run_s = 0.0, 0.0
    for (t1, s1), (t2, s2) in zip(steps, steps[1:]):
        run_s = run_s + (t2 - t1) if s2 == s1 else 0.0
        longest = max(longest, run_s)
    assert longest < 3.0, (longest, stalls)
    FIGURES.update(bob_started_s=round(bob_started, 2), regrown_s=round(regrow_s, 2),
                   samples=sampler.samples, longest_stall_s=round(longest, 2))
    print("figures:", FIGURES)
    assert bob_started < 10.0 and regrow_s < 10.0, FIGURES
    assert bob_ended > 0


def test_a_run_that_is_not_elastic_is_never_asked(box: Box) -> None:
    alice, bob = box.users
    a = Up(box, alice, "alice-fixed", "--gpus", "0,1,2,3", "--workers", "4", "--groups", "4", "--elastic", "off",
           "--max-steps", "100000000", "--timeout", "300")
    try:
        wait_until(lambda: a.proc.poll() is not None or sum(1 for g in (a.status().get("groups") or {}).values()
                                                              if g.get("connected")) == 4, timeout_s=120, poll_s=0.2)
        assert a.proc.poll() is None, a.tail()
        b = Up(box, bob, "bob-waits", "--gpus", "2,3", "--workers", "2", "--wait", "6", "--max-steps", "8000")
        assert b.proc.wait(timeout=60) == 5, b.tail()  # the GPUs never came free: exit 5 after --wait
        assert "waited 6 s for GPUs" in b.tail()
        b.log.close()
        record, status = a.record(), a.status()
    finally:
        code = a.stop()
    assert code == 130, a.tail()
    assert "elastic" not in record
    assert [g["connects"] for _, g in sorted(status["groups"].items())] == [1, 1, 1, 1]
    assert [g.get("yields", 0) for _, g in sorted(status["groups"].items())] == [0, 0, 0, 0]
