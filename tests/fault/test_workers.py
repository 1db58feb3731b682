"""Fault suite, worker deaths: SIGKILL worker groups again and again while CartPole PPO trains to a mean
return of 475, on the process and the Docker backend (the supervisor restarts them on both; an attached
Docker run's groups have no engine restart policy).

Claims checked: the run still reaches its target; every kill shows in metrics.jsonl (``group_left`` and
``group_joined`` events), in the result's restart counts and in the logs; no checkpoint is lost or
corrupt (every checkpoint the CheckpointManager lists restores, each newer than the one before).
CI kills twice per backend; ``FAULT_FULL=1`` five times.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.docker_fixtures import cleanup_docker
from tests.fault.helpers import (Drain, checkpoint_numbers_on_disk, count, events, first_run, group_pid, launcher_proc,
                                 record, rng, status, stop_proc, unreadable_json, verify_checkpoints)
from tests.helpers import processes_mentioning, wait_for


TARGET = 475


def _connects(run: Path, g: int) -> int:
    return int(((status(run).get("groups") or {}).get(str(g)) or {}).get("connects") or 0)


def _connected(run: Path, g: int) -> bool:
    return bool(((status(run).get("groups") or {}).get(str(g)) or {}).get("connected"))


def _note_rejoins(run: Path, done: list[dict[str, Any]], t0: float) -> None:
    """Stamp ``rejoin_s`` on each kill whose group has connected again since."""
    for d in done:
        if d["rejoin_s"] is None and _connects(run, d["group"]) > d["connects_before"]:
            d["rejoin_s"] = round(time.monotonic() - t0 - d["t_kill"], 1)


def _kill_and_train(root: Path, backend_args: tuple[str, ...], kill: Callable[[Path, int], None],
                    name: str) -> tuple[Path, dict[str, Any], list[dict[str, Any]], float]:
    """Start `up` to --until-return 475 and SIGKILL groups, alternating, ``count(2, 5)`` times; return (run dir,
    --json result, one dict per kill, wall seconds).

    CartPole PPO solves in ~100 k steps: with 8 workers that is ~6 s of training here, and the kills (each
    ~1.5 s to rejoin and up to 2 s apart) were outrun. So each group has one worker (~6 k env-steps/s, ~16 s of
    training), and a kill waits for its own group to be connected (after its last kill, to have rejoined), not
    for the other group: both groups may be down at once, which the master must ride out too."""
    r = rng(name)
    kills = count(2, 5)
    t0 = time.monotonic()
    proc = launcher_proc("up", *backend_args, "--gpus", "none", "--workers", "2", "--groups", "2", "--env", "CartPole-v1",
                         "--algo", "ppo", "--until-return", str(TARGET), "--max-steps", "1000000", "--seed", "0",
                         "--restart-budget", str(kills), "--checkpoint-every", "10", "--results", str(root),
                         "--json", "--progress", "plain")
    drain = Drain(proc)
    done: list[dict[str, Any]] = []

    def ready(g: int) -> bool:
        _note_rejoins(run, done, t0)
        back = all(d["rejoin_s"] is not None for d in done if d["group"] == g)
        return (back and _connected(run, g)) or proc.poll() is not None

    try:
        run = first_run(root, 120)
        wait_for(lambda: status(run).get("env_steps", 0) >= 2000 or proc.poll() is not None, 300, "training to start")
        groups = sorted(int(g) for g in (status(run).get("groups") or {}))
        assert len(groups) >= 2, status(run)
        for i in range(kills):
            g = groups[i % len(groups)]
            wait_for(lambda: ready(g), 180, f"group {g} to be connected")
            mean = status(run).get("mean_return") or 0
            assert proc.poll() is None, (f"the run ended after {i} of {kills} kills (mean return {mean}): {done}\n"
                                         f"{drain.stderr[-2000:]}")
            assert mean < TARGET, f"the target was reached after {i} of {kills} kills; nothing left to disturb"
            before = _connects(run, g)
            time.sleep(r.uniform(0.0, 2.0))  # somewhere in a segment or an update
            t_kill = time.monotonic() - t0
            try:
                kill(run, g)
            except AssertionError:
                if proc.poll() is not None:
                    raise AssertionError(f"the run ended before kill {i + 1} of {kills} landed: {done}") from None
                raise
            done.append({"group": g, "connects_before": before, "t_kill": t_kill, "rejoin_s": None,
                         "env_steps": status(run).get("env_steps"), "mean_return": mean})

        def all_back() -> bool:
            _note_rejoins(run, done, t0)
            return all(d["rejoin_s"] is not None for d in done) or proc.poll() is not None

        # A kill near the end may be outrun (rejoin_s stays None): the other group can reach the target first.
        wait_for(all_back, 180, "every killed group to rejoin")
        code = drain.wait(timeout=900)
    finally:
        stop_proc(proc)
    assert code == 0, f"up exited {code}: {drain.stderr[-4000:]}"
    result = json.loads(drain.stdout)
    return run, result, done, time.monotonic() - t0


def _check_run(run: Path, result: dict[str, Any], done: list[dict[str, Any]]) -> dict[str, Any]:
    """What both backends must show after the kills; returns figures for the report."""
    assert result["state"] == "finished" and result["summary"]["target_reached"], result
    assert result["summary"]["mean_return"] >= TARGET
    per_group = Counter(d["group"] for d in done)
    assert {int(k): v for k, v in result["restarts"].items() if v} == dict(per_group), result["restarts"]
    assert result["lost_groups"] == []
    left = Counter(e["group"] for e in events(run, "group_left"))
    joined = Counter(e["group"] for e in events(run, "group_joined"))
    back = Counter(d["group"] for d in done if d["rejoin_s"] is not None)
    assert sum(back.values()) >= len(done) - 1, f"only the last kill may end the run before its rejoin: {done}"
    for g, n in per_group.items():
        assert left[g] >= n, f"group {g}: {n} kills but {left[g]} group_left events"
        assert joined[g] >= back[g] + 1, f"group {g}: {back[g]} rejoins seen but {joined[g]} group_joined events"
    master_log = (run / "logs" / "master.log").read_text()
    for g, n in per_group.items():
        assert master_log.count(f"group {g} left") >= n, f"master.log misses group {g}'s departures"
        assert master_log.count(f"group {g} joined") >= back[g] + 1
    assert not unreadable_json(run), unreadable_json(run)
    # No checkpoint lost or corrupt: the manager's list is on disk, each restores, counters grow with N.
    checks = verify_checkpoints(run)
    assert checks and all(c["ok"] for c in checks), checks
    listed = [int(c["path"].rsplit("-", 1)[1]) for c in checks]
    assert set(listed) <= set(checkpoint_numbers_on_disk(run))
    assert [c["updates"] for c in checks] == listed, checks
    assert all(a["env_steps"] < b["env_steps"] for a, b in zip(checks, checks[1:])), checks
    return {"kills": len(done), "restarts": sum(per_group.values()), "group_left_events": sum(left.values()),
            "group_joined_events": sum(joined.values()), "max_rejoin_s": max((d["rejoin_s"] for d in done if d["rejoin_s"] is not None), default=None),
            "last_kill_at_env_steps": done[-1]["env_steps"], "env_steps_to_target": result["summary"]["env_steps"], "mean_return": round(result["summary"]["mean_return"], 1),
            "checkpoints_restored": f"{len(checks)}/{len(checks)}"}


def test_process_groups_sigkilled_during_training_still_reach_475(tmp_path: Path) -> None:
    root = tmp_path / "results"

    def kill(run: Path, g: int) -> None:
        pid = wait_for(lambda: group_pid(run, g), 60, f"group {g}'s process")
        os.kill(pid, signal.SIGKILL)

    run, result, done, wall = _kill_and_train(root, ("--backend", "process"), kill, "workers-process")
    figures = _check_run(run, result, done)
    for g in {d["group"] for d in done}:
        text = (run / "logs" / f"group-{g}.log").read_text()
        n = sum(1 for d in done if d["group"] == g)
        for k in range(1, n + 1):
            assert f"--- launcher: restarting group-{g} (restart {k}) ---" in text, text[-2000:]
    assert not processes_mentioning(str(run)), "a process of the run outlived it"
    record("worker_kills_process", wall_s=round(wall, 1), **figures)


@pytest.mark.docker
def test_docker_groups_sigkilled_during_training_still_reach_475(tmp_path: Path, launcher_image: str,
                                                                 engine: Any) -> None:
    from launcher.backends.docker import group_name

    root = tmp_path / "results"
    root.mkdir()

    def kill(run: Path, g: int) -> None:
        # SIGKILL of the container's main process from the host, as a crash or the OOM killer would do.
        snap = wait_for(lambda: (s := engine.inspect(group_name(run.name, g))) and s.pid > 0 and s,
                        60, f"group {g}'s container to run")
        os.kill(snap.pid, signal.SIGKILL)

    try:
        run, result, done, wall = _kill_and_train(root, ("--backend", "docker", "--image", launcher_image), kill,
                                                  "workers-docker")
    finally:
        left = cleanup_docker(engine, root)
    assert left == ([], []), f"the run left {left} on the engine"
    figures = _check_run(run, result, done)
    for g in {d["group"] for d in done}:
        n = sum(1 for d in done if d["group"] == g)
        text = (run / "logs" / f"group-{g}.log").read_text()
        assert f"{n} restart(s)" in text, text[:400]
    record("worker_kills_docker", wall_s=round(wall, 1), **figures)
