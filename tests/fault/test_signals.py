"""Fault suite, signals and teardown: SIGINT or SIGTERM to ``launcher up`` at random moments (from the
first milliseconds of start-up to the middle of training), on the process backend and on the Docker
backend (two launchers at once, so their runs must also keep apart), once during an image build, and a
``kill -9`` of the launcher followed by ``launcher down --all``.

After each: no process, container or network of the run remains; every JSON file of the results parses;
the exit code is 130 (or death by the signal itself, when it came before ``up`` installed its handler,
in which case nothing was created yet).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.docker_fixtures import cleanup_docker, ours
from tests.fault.helpers import (FAULT_UID, Drain, count, first_run, launcher_proc, record, rng, status, stop_proc,
                                 unreadable_json)
from tests.helpers import ROOT, child_env, launcher_cmd, processes_mentioning, read_json, wait_for, run_dirs


SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _phase(root: Path, before: set[Path]) -> str:
    """How far a launch had got when it was signalled, from what it had written (runs not in ``before``)."""
    runs = sorted(p for p in (run_dirs(root) if root.is_dir() else []) if p.is_dir() and p not in before)
    if not runs:
        return "starting"  # parsing, config, planning: nothing on disk yet
    run = runs[-1]
    rec = read_json(run / "run.json") if (run / "run.json").exists() else {}
    if not (rec.get("pids") or rec.get("containers")):
        return "preparing"
    if not status(run):
        return "master starting"
    return "training" if status(run).get("env_steps") else "connecting"


def _after(root: Path, code: int, sig: int, new_runs: list[Path]) -> None:
    """What must hold after one signalled launch whose runs are ``new_runs``."""
    assert code in (130, -sig), f"exit {code} after {signal.Signals(sig).name}"
    if code == -sig:
        # Killed by the signal itself: it came before `up` installed its handler, before any run existed.
        assert not new_runs, f"died of {signal.Signals(sig).name} after creating {new_runs}"
    wait_for(lambda: not processes_mentioning(str(root)), 15, "the run's processes to be gone")
    assert not unreadable_json(root), unreadable_json(root)
    for run in new_runs:
        rec = read_json(run / "run.json")
        assert rec["state"] == "interrupted", rec


def test_process_up_signalled_at_random_moments_leaves_nothing(tmp_path: Path) -> None:
    r = rng("signals-process")
    cycles = count(3, 20)
    window_s = 12.0  # start-up under load takes ~5-10 s: the window covers start-up and early training
    root = tmp_path / "results"
    rows: list[dict[str, Any]] = []
    for i in range(cycles):
        sig = SIGNALS[i % 2]
        # Spread over the window; the first always inside the first 0.6 s (imports, before any handler).
        edges = [0.0, 0.6] + [0.6 + (window_s - 0.6) * k / (cycles - 1) for k in range(1, cycles)]
        delay = r.uniform(edges[i], edges[i + 1])
        before = set(run_dirs(root)) if root.is_dir() else set()
        proc = launcher_proc("up", "--backend", "process", "--gpus", "none", "--workers", "2", "--groups", "2", "--max-steps",
                             "100000000", "--results", str(root), "--progress", "plain")
        drain = Drain(proc)
        try:
            time.sleep(delay)
            phase = _phase(root, before)
            t0 = time.monotonic()
            proc.send_signal(sig)
            try:
                code = drain.wait(timeout=60)
            except subprocess.TimeoutExpired:
                children = subprocess.run(["ps", "-o", "pid,stat,etime,args", "--ppid", str(proc.pid)],
                                          capture_output=True, text=True).stdout
                pytest.fail(f"`up` still running 60 s after {signal.Signals(sig).name} at {delay:.1f} s (phase "
                            f"{phase}); its children:\n{children}\nstderr:\n{drain.stderr[-3000:]}")
            took = time.monotonic() - t0
        finally:
            stop_proc(proc)
        new = sorted(set(run_dirs(root) if root.is_dir() else []) - before)
        _after(root, code, sig, new)
        if code == 130:
            assert took < 10, f"teardown took {took:.1f} s (README: within 10 s)"
            assert "Traceback" not in drain.stderr, drain.stderr[-3000:]
        rows.append({"signal": signal.Signals(sig).name, "delay_s": round(delay, 1), "phase": phase, "exit": code,
                     "teardown_s": round(took, 1)})
    record("signals_process", cycles=cycles, exits=dict(sorted(_tally(r["exit"] for r in rows).items())),
           phases=_tally(r["phase"] for r in rows), max_teardown_s=max(r["teardown_s"] for r in rows),
           leftovers=0)


def _tally(items: Any) -> dict[Any, int]:
    out: dict[Any, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


@pytest.mark.docker
def test_two_docker_launchers_signalled_at_random_moments(tmp_path: Path, launcher_image: str, engine: Any) -> None:
    """Two `up --backend docker` at once, then SIGINT/SIGTERM to both at a random moment: while both live
    their runs have distinct networks, container names and results directories; afterwards nothing of
    either remains on the engine."""
    from launcher.engine import labels as dc

    r = rng("signals-docker")
    cycles = count(1, 6)
    root = tmp_path / "results"
    root.mkdir()
    rows: list[dict[str, Any]] = []
    try:
        for i in range(cycles):
            before = set(run_dirs(root))
            procs = [launcher_proc("up", "--backend", "docker", "--image", launcher_image, "--gpus", "none",
                                   "--workers", "2", "--groups", "2", "--max-steps", "100000000", "--results", str(root),
                                   "--progress", "plain") for _ in range(2)]
            drains = [Drain(p) for p in procs]
            sigs = [SIGNALS[(i + k) % 2] for k in range(2)]
            try:
                # Half the cycles: wait until both train and check they keep apart; the rest: a random moment.
                if i % 2 == 0:
                    def both_train() -> bool:
                        runs = [p for p in run_dirs(root) if p not in before]
                        return len(runs) == 2 and all(status(p).get("env_steps") for p in runs) or \
                            any(p.poll() is not None for p in procs)
                    wait_for(both_train, 300, "both runs to train")
                    assert all(p.poll() is None for p in procs), [d.stderr[-2000:] for d in drains]
                    snaps, nets = ours(engine, root)
                    by_run: dict[str, list[str]] = {}
                    for s in snaps:
                        by_run.setdefault(s.labels[dc.RUN_LABEL], []).append(s.name)
                    assert len(by_run) == 2 and len(nets) == 2 and len(set(nets)) == 2, (by_run, nets)
                    names = [n for v in by_run.values() for n in v]
                    assert len(names) == len(set(names)) == 6
                    dirs = {s.labels[dc.RESULTS_LABEL] for s in snaps}
                    assert len(dirs) == 2
                    phase = "training"
                else:
                    time.sleep(r.uniform(0.0, 20.0))
                    phase = _phase(root, before)
                t0 = time.monotonic()
                for p, sig in zip(procs, sigs):
                    p.send_signal(sig)
                codes = [d.wait(timeout=120) for d in drains]
                took = time.monotonic() - t0
            finally:
                for p in procs:
                    stop_proc(p)
            new = sorted(set(run_dirs(root)) - before)
            for code, sig in zip(codes, sigs):
                assert code in (130, -sig), (codes, [d.stderr[-2000:] for d in drains])
            assert ours(engine, root) == ([], []), f"cycle {i} left {ours(engine, root)}"
            assert not unreadable_json(root), unreadable_json(root)
            assert len({p.name for p in new}) == len(new)
            for run in new:
                assert read_json(run / "run.json")["state"] == "interrupted"
            rows.append({"phase": phase, "exits": codes, "teardown_s": round(took, 1)})
    finally:
        left = cleanup_docker(engine, root)
    assert left == ([], [])
    record("signals_docker", cycles=cycles, launchers=2 * cycles, phases=_tally(r["phase"] for r in rows),
           exits=_tally(c for r in rows for c in r["exits"]), max_teardown_s=max(r["teardown_s"] for r in rows),
           leftover_containers=0, leftover_networks=0)


@pytest.mark.docker
def test_signal_during_image_build(tmp_path: Path, launcher_image: str, engine: Any, docker_client: Any) -> None:
    """`up` with an image tag that does not exist builds it first (a throwaway tag: every layer comes from
    the cache). SIGINT while it builds: the launcher must end with 130 and leave no container or network."""
    tag = f"launcher-fault-throwaway:{secrets.token_hex(4)}"
    root = tmp_path / "results"
    root.mkdir()
    proc = launcher_proc("up", "--backend", "docker", "--image", tag, "--gpus", "none", "--workers", "2", "--groups", "2",
                         "--max-steps", "100000000", "--results", str(root), "--progress", "plain")
    drain = Drain(proc)
    try:
        wait_for(lambda: "building" in drain.stderr or proc.poll() is not None, 300, "the image build to start")
        assert proc.poll() is None, drain.stderr[-3000:]
        time.sleep(rng("build").uniform(0.5, 3.0))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = drain.wait(timeout=600)
        took = time.monotonic() - t0
    finally:
        stop_proc(proc)
        try:
            docker_client.images.remove(tag, force=True)
        except Exception:  # noqa: BLE001 - the build may not have got as far as tagging
            pass
        left = cleanup_docker(engine, root)
    assert code == 130, drain.stderr[-3000:]
    assert left == ([], []), f"left {left}"
    assert not unreadable_json(root), unreadable_json(root)
    # What the launcher does with a signal during a build (docs/reliability.md): the flag is read only
    # after backend.start() returns, so the build runs to its end and the containers start, then go.
    built = "built " + tag in drain.stderr
    started = "started on the docker backend" in drain.stderr
    record("signal_during_build", exit=code, signal_to_exit_s=round(took, 1), build_finished_first=built,
           containers_started_after_signal=started, leftovers=0)


@pytest.fixture
def foreign_root() -> Iterator[Path]:
    """A results root owned by FAULT_UID, outside root's private pytest directory."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user (the engine is shared: `down --all` must see only ours)")
    d = Path(tempfile.mkdtemp(prefix="fault-down-"))
    os.chmod(d, 0o755)
    os.chown(d, FAULT_UID, FAULT_UID)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.docker
def test_kill_9_of_the_launcher_then_down_all(foreign_root: Path, launcher_image: str, engine: Any) -> None:
    """The launcher (as an ordinary user in the docker group, so `down --all` is limited to that user's
    runs and cannot touch anyone else's on this shared engine) is SIGKILLed mid-run: its containers keep
    running; `launcher down --all` then stops them master first and removes them and the network."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is needed to act as an ordinary user")
    root = foreign_root / "results"
    home: dict[str, Any] = {"HOME": str(foreign_root)}
    proc = launcher_proc("up", "--backend", "docker", "--image", launcher_image, "--gpus", "none", "--workers", "2", "--groups", "2",
                         "--max-steps", "100000000", "--results", str(root), "--progress", "plain",
                         user=FAULT_UID, **home)
    drain = Drain(proc)
    try:
        run = first_run(root, 120)
        wait_for(lambda: status(run).get("env_steps") or proc.poll() is not None, 300, "training")
        assert proc.poll() is None, drain.stderr[-3000:]
        proc.kill()
        proc.wait(timeout=30)
    finally:
        stop_proc(proc)
    try:
        snaps, nets = ours(engine, root)
        assert len(snaps) == 3 and len(nets) == 1, "a SIGKILLed launcher leaves its containers running"
        t0 = time.monotonic()
        down = subprocess.run(["setpriv", f"--reuid={FAULT_UID}", f"--regid={FAULT_UID}",
                               f"--groups={os.stat('/var/run/docker.sock').st_gid}",
                               *launcher_cmd("down", "--all", "--results", str(root), "--json")],
                              cwd=ROOT, env=child_env(**home), capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
        assert down.returncode == 0, down.stderr
        doc = json.loads(down.stdout)
        assert [r["run_id"] for r in doc["runs"]] == [run.name], doc
        assert sorted(doc["runs"][0]["containers"]) == sorted(s.name for s in snaps)
        assert ours(engine, root) == ([], [])
    finally:
        left = cleanup_docker(engine, root)
    assert left == ([], [])
    summary = read_json(run / "summary.json")
    assert summary["outcome"] == "interrupted", "the master did not get its SIGTERM (and last checkpoint) first"
    assert not unreadable_json(root), unreadable_json(root)
    assert "listening on" in (run / "logs" / "master.log").read_text(), "down keeps the containers' output"
    record("kill9_then_down_all", containers_removed=len(snaps), networks_removed=len(nets),
           down_s=round(took, 1), master_checkpointed=True, leftovers=0)
