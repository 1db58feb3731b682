"""Elastic runs' rules, without a run: which groups yield to what a waiter names, which come back, the tickets'
and yield notes' untrusted text, ``--elastic`` against the plan and the site policy, and a partial release that
frees a GPU even while the master holds a copy of the lease's descriptor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config import RunConfig
from launcher.config.checks import validate
from launcher.errors import BadInput
from launcher.gpu import elastic as decide
from launcher.gpu.policy import PolicyViolation, SitePolicy, elastic_minimum, narrow, parse_policy
from launcher.gpu.queue import Ticket, Waiter, read_queue
from launcher.gpu.reservations import reserve
from launcher.errors import ConfigErrors

G = [f"GPU-{i}" for i in range(4)]
# alice's plan of the issue: the master alone on GPU 0, groups 0 and 1 on GPU 1, group 2 on GPU 2, group 3 on GPU 3
ACTIVE = {0: (G[1],), 1: (G[1],), 2: (G[2],), 3: (G[3],)}


def test_a_named_set_is_given_whole_or_not_at_all() -> None:
    assert decide.choose_yield(active=ACTIVE, master=(G[0],), min_groups=2, wanted=(G[2], G[3])) == (2, 3)
    assert decide.choose_yield(active=ACTIVE, master=(G[0],), min_groups=3, wanted=(G[2], G[3])) == ()  # below MIN
    assert decide.choose_yield(active=ACTIVE, master=(G[0],), min_groups=1, wanted=(G[0], G[3])) == ()  # the master's
    assert decide.choose_yield(active=ACTIVE, master=(G[0],), min_groups=2, wanted=(G[1],)) == (0, 1)  # both on GPU 1
    # a named GPU another run holds: yielding the rest would not serve the waiter
    assert decide.choose_yield(active=ACTIVE, master=(G[0],), min_groups=1, wanted=(G[3], "GPU-9"),
                               held_elsewhere=frozenset({"GPU-9"})) == ()
    assert decide.choose_yield(active=ACTIVE, master=(G[0],), min_groups=1, wanted=(G[3], "GPU-9")) == (3,)  # free
    assert decide.choose_yield(active=ACTIVE, master=(G[0],), min_groups=1, wanted=("GPU-9",)) == ()  # none of ours


def test_any_one_gpu_costs_the_fewest_groups_and_the_last_planned() -> None:
    assert decide.choose_yield(active=ACTIVE, master=(G[0],), min_groups=2, wanted=None) == (3,)
    assert decide.choose_yield(active={0: (G[1],), 1: (G[1],)}, master=(G[0],), min_groups=1, wanted=None) == ()
    assert decide.choose_yield(active={0: (G[0],), 1: (G[1],)}, master=(G[0],), min_groups=1, wanted=None) == (1,)


def test_only_gpus_nobody_else_in_the_run_uses_are_released() -> None:
    assert decide.freed_by([2, 3], groups=ACTIVE, staying=[0, 1], master=(G[0],)) == (G[2], G[3])
    assert decide.freed_by([1], groups=ACTIVE, staying=[0, 2, 3], master=(G[0],)) == ()  # group 0 stays on GPU 1
    assert decide.freed_by([0], groups={0: (G[0],), 1: (G[1],)}, staying=[1], master=(G[0],)) == ()  # the master's


def test_regrowth_waits_for_free_gpus() -> None:
    yielded = {2: (G[2],), 3: (G[3],)}
    assert decide.choose_regrow(yielded, held=frozenset(), ours=frozenset()) == (2, 3)
    assert decide.choose_regrow(yielded, held=frozenset({G[3]}), ours=frozenset()) == (2,)
    assert decide.choose_regrow(yielded, held=frozenset({G[3]}), ours=frozenset({G[3]})) == (2, 3)


def _ticket(gpus: object) -> Ticket:
    return Ticket(name="t", uid=1000, user="bob", run_id="r", want=None, since=0.0, order=(0, "t"), gpus=gpus)


def test_a_tickets_demand_is_read_as_untrusted_text() -> None:
    assert decide.demand_of(_ticket("auto")).gpus == ()  # type: ignore[union-attr]
    assert decide.demand_of(_ticket(["2", "GPU-8f3a-01"])).gpus == ("2", "GPU-8f3a-01")  # type: ignore[union-attr]
    for bad in (None, [], "all", ["2", "../x"], [True], [{"a": 1}], ["1"] * 65, [2.5]):
        assert decide.demand_of(_ticket(bad)) is None, bad


def test_the_queue_ticket_carries_what_the_waiter_names(tmp_path: Path) -> None:
    with Waiter(tmp_path, "bob-run", "GPUs 2,3", ["2", "3"]):
        (t,) = read_queue(tmp_path)
        assert (t.run_id, t.gpus) == ("bob-run", ["2", "3"])
        assert decide.demand_of(t) == decide.Demand(t.name, os.getuid(), t.user, "bob-run", ("2", "3"))


def test_yield_notes_round_trip_and_hostile_ones_are_skipped(tmp_path: Path) -> None:
    to = decide.Demand("t", 1001, "bob", "bob-run", ("2",))
    decide.write_note(tmp_path, "alice-run", to=to, groups=[3, 2], gpus=[G[3], G[2]], since=100.0)
    (note,) = decide.read_notes(tmp_path)
    assert (note.from_run, note.uid, note.to_run, note.to_user, note.groups, note.gpus, note.since) == (
        "alice-run", os.getuid(), "bob-run", "bob", (2, 3), (G[2], G[3]), 100.0)
    assert "yielded GPU(s) GPU-2, GPU-3 (group(s) 2, 3) to run bob-run (bob)" in note.describe()
    (tmp_path / "forged.yield").write_text(json.dumps({"from_run": "someone-else"}))  # not its own name
    (tmp_path / "huge.yield").write_text(json.dumps({"from_run": "huge", "pad": "x" * 5000}))
    (tmp_path / "junk.yield").write_bytes(b"\xff\x00")
    os.mkfifo(tmp_path / "fifo.yield")  # would block a plain open
    os.symlink("/etc/passwd", tmp_path / "link.yield")
    assert [n.from_run for n in decide.read_notes(tmp_path)] == ["alice-run"]
    decide.remove_note(tmp_path, "alice-run")
    assert decide.read_notes(tmp_path) == []


def test_elastic_minimum_against_the_plan_and_the_site_policy() -> None:
    allow, default, forbid = SitePolicy(), SitePolicy(elastic="default"), SitePolicy(source="/etc/p", elastic="forbid")
    assert elastic_minimum("2", 4, allow) == 2 and elastic_minimum(None, 4, allow) is None
    assert elastic_minimum("off", 4, default) is None and elastic_minimum(None, 4, default) == 2
    assert elastic_minimum(None, 3, default) == 2 and elastic_minimum(None, 1, default) is None
    assert elastic_minimum(None, 4, forbid) is None and elastic_minimum("off", 4, forbid) is None
    with pytest.raises(PolicyViolation, match="--elastic 2: the site policy /etc/p forbids elastic runs"):
        elastic_minimum("2", 4, forbid)
    with pytest.raises(BadInput, match="--elastic 5: the plan has 4 worker group"):
        elastic_minimum("5", 4, allow)
    assert parse_policy({"elastic": "default"}).elastic == "default"
    with pytest.raises(ConfigErrors, match="elastic = 'sometimes': expected one of 'allow', 'default', 'forbid'"):
        parse_policy({"elastic": "sometimes"})
    assert narrow(default, SitePolicy(elastic="forbid")).elastic == "forbid"  # a user's policy narrows, never widens
    assert narrow(forbid, SitePolicy(elastic="allow")).elastic == "forbid"


def test_elastic_flag_problems_are_named() -> None:
    def problems(**kw: object) -> list[str]:
        return [p for p in validate(RunConfig(**kw)) if "elastic" in p]  # type: ignore[arg-type]

    assert problems(elastic="2", workers=8) == [] and problems(elastic="off") == []
    assert problems(elastic="0") == ["--elastic takes the fewest worker groups the run may shrink to (a whole number "
                                     ">= 1) or 'off', got '0'"]
    assert problems(elastic="many") and problems(elastic="-1")
    assert problems(elastic="5", workers=8, groups=4) == ["--elastic 5: the run has at most 4 worker group(s) "
                                                          "(--groups 4)"]
    assert problems(elastic="2", detach=True) == ["--elastic needs its launcher attached (it watches the GPU queue "
                                                  "for the run): leave out --detach"]


HOLD_INHERITED = "import os, sys, time; print('ready', flush=True); time.sleep(30)"


def test_a_partial_release_frees_the_gpu_though_the_master_keeps_a_copy_of_the_descriptor(tmp_path: Path) -> None:
    """The process backend's master inherits the lease descriptors; releasing a yielded group's GPU must free it at
    once all the same (LOCK_UN on the shared open file description), and taking it back must lease it again."""
    r = reserve(G, "alice-run", tmp_path)
    master = subprocess.Popen([sys.executable, "-c", HOLD_INHERITED], pass_fds=r.fds, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert master.stdout is not None and master.stdout.readline().strip() == "ready"
        with pytest.raises(Exception, match="held by"):
            reserve([G[3]], "bob-run", tmp_path)
        assert r.release_some([G[2], G[3]]) == (G[2], G[3])
        assert r.uuids == (G[0], G[1])
        bob = reserve([G[2], G[3]], "bob-run", tmp_path)  # free now, though the master still has the old fds open
        assert r.take_back([G[3]]) is False and r.uuids == (G[0], G[1])  # bob holds it: not taken, nothing half-held
        bob.release()
        assert r.take_back([G[2], G[3]]) is True and sorted(r.uuids) == G
        with pytest.raises(Exception, match="held by"):
            reserve([G[2]], "bob-run", tmp_path)
    finally:
        master.kill()
        master.wait()
        r.release()


def test_up_takes_the_minimum_from_the_flag_or_the_site_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from launcher.up import elastic_for

    said: list[str] = []
    groups = [SimpleNamespace(index=i) for i in range(4)]
    gpu, cpu = SimpleNamespace(kind="gpu", groups=groups), SimpleNamespace(kind="cpu", groups=groups)
    policy = tmp_path / "policy.toml"
    policy.write_text('elastic = "default"\n')
    monkeypatch.setenv("LAUNCHER_POLICY", str(policy))  # a user's own policy: it may narrow the site's
    assert elastic_for(RunConfig(), gpu, object(), True, said.append) == 2  # type: ignore[arg-type]
    assert elastic_for(RunConfig(elastic="off"), gpu, object(), True, said.append) is None  # type: ignore[arg-type]
    assert elastic_for(RunConfig(elastic="3"), gpu, object(), True, said.append) == 3  # type: ignore[arg-type]
    assert elastic_for(RunConfig(elastic="3"), cpu, None, True, said.append) is None  # type: ignore[arg-type]
    assert said == ["--elastic 3 does nothing here: the plan holds no GPU lease to yield"]
    policy.write_text('elastic = "forbid"\n')
    with pytest.raises(PolicyViolation, match="forbids elastic runs"):
        elastic_for(RunConfig(elastic="2"), gpu, object(), True, said.append)  # type: ignore[arg-type]
