"""Fault suite, master deaths: SIGKILL the master (some kills while it writes a checkpoint), tear the newest
checkpoint's data file, and ``launcher up --resume`` each time.

Claims checked: the attached ``up`` exits 7 and says how to resume; ``--resume`` restores the newest intact
checkpoint (the torn one is skipped); the work lost is at most one checkpoint interval; the counters
(env steps, updates, episodes) never go backwards from one master to the next; in the end every
checkpoint the CheckpointManager lists restores.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any


from tests.fault.helpers import (Drain, checkpoint_numbers_on_disk, count, events, first_run, launcher_proc,
                                 master_pid, metrics, record, rng, status, stop_proc, unreadable_json,
                                 verify_checkpoints)
from tests.helpers import processes_mentioning, read_json, wait_for


CHECKPOINT_EVERY = 1  # every update: a kill at a random moment often finds a checkpoint being written


def _ckpt_dir_entries(run: Path) -> list[str]:
    try:
        return os.listdir(run / "checkpoints")
    except FileNotFoundError:
        return []


def _listed(run: Path) -> list[int]:
    """Checkpoint numbers the CheckpointManager's state file lists (``checkpoints/checkpoint``)."""
    path = run / "checkpoints" / "checkpoint"
    if not path.exists():
        return []
    nums = []
    for line in path.read_text().splitlines():
        if line.startswith("all_model_checkpoint_paths:"):
            nums.append(int(line.split('"')[1].rsplit("-", 1)[1]))
    return nums


def _kill_while_writing(run: Path, pid: int, deadline_s: float) -> bool:
    """SIGKILL ``pid`` the moment a checkpoint write shows in the directory (TensorFlow's ``ckpt-N_temp``
    shard directory, or the state file's temporary). False if none showed before the deadline."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if any("_temp" in e or e.startswith("checkpoint.tmp") for e in _ckpt_dir_entries(run)):
            os.kill(pid, signal.SIGKILL)
            return True
    return False


def _session_updates(run: Path, session: int) -> int:
    """The highest ``updates`` the master of session ``session`` (0-based, by master_started) reported."""
    seen, best = -1, 0
    for r in metrics(run):
        if r.get("event") == "master_started":
            seen += 1
            if seen == session:
                best = max(best, int(r["updates"]))
        elif seen == session and r.get("type") == "progress":
            best = max(best, int(r["updates"]))
    return best


def test_master_sigkill_and_torn_checkpoint_then_resume(tmp_path: Path) -> None:
    r = rng("master")
    kills = count(2, 8)
    torn_at = {1} if kills > 1 else set()  # after this kill, tear the newest checkpoint's data file
    if kills > 4:
        torn_at.add(kills - 2)
    root = tmp_path / "results"
    common = ("--results", str(root), "--progress", "plain", "--max-steps", "100000000")
    # Recovery in place is off: this test is about `up --resume` (tests/fault/test_master_recovery.py: on).
    run: Path | None = None
    cycles: list[dict[str, Any]] = []
    for i in range(kills):
        if run is None:
            proc = launcher_proc("up", "--backend", "process", "--gpus", "none", "--workers", "4", "--groups", "2",
                                 "--checkpoint-every", str(CHECKPOINT_EVERY), "--master-restarts", "0", *common)
        else:
            proc = launcher_proc("up", "--resume", run.name, *common)
        drain = Drain(proc)
        try:
            run = first_run(root, 120)
            wait_for(lambda: len(events(run, "master_started")) == i + 1 or proc.poll() is not None, 180,
                     f"master {i} to start")
            assert proc.poll() is None, drain.stderr[-3000:]
            restored = int(events(run, "master_started")[i]["updates"])
            pid = wait_for(lambda: master_pid(run), 30, "the master's pid")
            # A few updates after the restored point, then the kill: at a random moment, or (every other
            # cycle) the moment a checkpoint write is seen, so some kills land mid-write for sure.
            more = r.randint(2, 6)
            wait_for(lambda: status(run).get("pid") == pid and status(run).get("updates", 0) >= restored + more,
                     180, f"{more} updates after update {restored}")
            mode = "random" if i % 2 == 0 else "mid-write"
            if mode == "random":
                time.sleep(r.uniform(0.0, 1.5))
                os.kill(pid, signal.SIGKILL)
            else:
                assert _kill_while_writing(run, pid, 60), "no checkpoint write seen within 60 s"
            t_kill = time.monotonic()
            code = drain.wait(timeout=120)
            detect_s = time.monotonic() - t_kill
        finally:
            stop_proc(proc)
        assert code == 7, f"kill {i}: up exited {code}; {drain.stderr[-2000:]}"
        assert f"launcher up --resume {run.name}" in drain.stdout + drain.stderr
        wait_for(lambda: not processes_mentioning(str(run)), 30, "the run's processes to be gone")
        entries = _ckpt_dir_entries(run)
        listed = _listed(run)
        on_disk = checkpoint_numbers_on_disk(run)
        mid_write = any("_temp" in e or e.startswith("checkpoint.tmp") for e in entries) or \
            any(n > max(listed, default=-1) for n in on_disk)
        cyc: dict[str, Any] = {"kill": i, "mode": mode, "restored": restored, "seen_updates": _session_updates(run, i),
               "on_disk_max": max(on_disk, default=0), "listed": listed, "landed_mid_write": mid_write,
               "exit_detect_s": round(detect_s, 1), "torn": False}
        if i in torn_at and listed:
            # the shard holding the variables (a traced write puts the object graph in a small shard of its own)
            newest = max((run / "checkpoints").glob(f"ckpt-{listed[-1]}.data-*"), key=lambda p: p.stat().st_size)
            size = newest.stat().st_size
            with open(newest, "r+b") as fh:  # a torn write: the file stops part-way
                fh.truncate(size // 2)
            cyc["torn"] = True
        cycles.append(cyc)
        assert not unreadable_json(run), unreadable_json(run)

    # The last resume runs to its end: a little further than the last master got.
    assert run is not None
    last = read_json(run / "status.json")
    target = int(last["env_steps"]) + 3000
    proc = launcher_proc("up", "--resume", run.name, "--results", str(root), "--progress", "plain",
                         "--max-steps", str(target))
    drain = Drain(proc)
    try:
        code = drain.wait(timeout=300)
    finally:
        stop_proc(proc)
    assert code == 0, drain.stderr[-3000:]

    starts = events(run, "master_started")
    assert len(starts) == kills + 1
    lost = []
    for i, cyc in enumerate(cycles):
        nxt = starts[i + 1]
        # Counters never go backwards from one master to the next.
        for key in ("updates", "env_steps"):
            assert int(nxt[key]) >= int(starts[i][key]), f"{key} went back after kill {i}: {starts[i]} -> {nxt}"
        # The newest intact checkpoint is the one restored.
        listed = cyc["listed"]
        intact = listed[:-1] if cyc["torn"] else listed
        assert int(nxt["updates"]) == (intact[-1] if intact else 0), (cyc, nxt)
        # At most one checkpoint interval lost (beyond the torn one, when it was torn on purpose).
        done = max(int(cyc["seen_updates"]), int(cyc["on_disk_max"]))
        interval = CHECKPOINT_EVERY * (2 if cyc["torn"] else 1)
        assert done - int(nxt["updates"]) <= interval, (cyc, nxt)
        lost.append(done - int(nxt["updates"]))
    # Within each master's life, progress never goes backwards.
    session, prev = -1, None
    for rec in metrics(run):
        if rec.get("event") == "master_started":
            session, prev = session + 1, None
        elif rec.get("type") == "progress":
            cur = (rec["updates"], rec["env_steps"], rec["episodes"])
            assert prev is None or all(c >= p for c, p in zip(cur, prev)), (session, prev, cur)
            prev = cur
    summary = read_json(run / "summary.json")
    assert summary["outcome"] == "max_steps" and summary["env_steps"] >= target
    assert not unreadable_json(run), unreadable_json(run)  # a torn metrics line may only ever be the last
    log = (run / "logs" / "master.log").read_text()
    assert log.count("resumed from") == kills
    if any(c["torn"] for c in cycles):
        assert "is unreadable" in log, "the torn checkpoint was not reported"
    checks = verify_checkpoints(run)
    assert checks and all(c["ok"] for c in checks), checks
    record("master_kills", kills=kills, landed_mid_write=sum(c["landed_mid_write"] for c in cycles),
           torn_checkpoints=sum(c["torn"] for c in cycles), max_updates_lost=max(lost),
           checkpoint_every=CHECKPOINT_EVERY, resumes_ok=kills, checkpoints_restored=f"{len(checks)}/{len(checks)}",
           exit_detect_s_max=max(c["exit_detect_s"] for c in cycles))
