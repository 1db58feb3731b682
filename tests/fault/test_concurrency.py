"""Fault suite, concurrency: launchers started at the same moment on a simulated 4-GPU machine (the
stand-in NVML of tests/nvml_fixtures.py).

* Many trials of two and of four launchers, each doing exactly what ``launcher up`` does before it
  starts a backend (``launcher.up.prepare``: validate, read the GPUs, plan, reserve, create the results
  directory), released together by one line on their stdin and holding what they got until the trial
  ends: GPU sets never overlap; run ids, results directories, network and container names never repeat.
* With ``FAULT_FULL=1``, four real ``launcher up`` runs at once on the same machine: disjoint GPUs in
  their plan.json, their own results directories, and both finish.
* Two launches that draw the same run id: the second fails with exit 2 and holds no GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import ExitStack
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest

from tests.fault.helpers import FULL, count, record
from tests.helpers import ROOT, wait_for, run_dirs
from tests.nvml_fixtures import NvmlStub, machine



def _racer(env: dict[str, str], root: Path, workers: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.fault.racer", str(root), str(workers)],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, bufsize=1)


def _line(p: subprocess.Popen[str]) -> str:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line, f"racer {p.pid} ended (exit {p.poll()})"
    return line.strip()


def _check_apart(got: list[dict[str, Any]]) -> None:
    ok = [g for g in got if "error" not in g]
    for a, b in combinations(ok, 2):
        assert not set(a["gpus"]) & set(b["gpus"]), f"GPU overlap: {a} / {b}"
        assert a["run_id"] != b["run_id"] and a["results"] != b["results"] and a["network"] != b["network"], (a, b)
        assert not set(a["containers"]) & set(b["containers"]), (a, b)


def test_simultaneous_launchers_never_share_gpus_names_or_directories(nvml_stub: NvmlStub, tmp_path: Path) -> None:
    nvml_stub.configure(machine(4))
    trials = count(20, 200)
    root = tmp_path / "results"
    env = nvml_stub.env()
    tallies: dict[int, dict[str, int]] = {}
    wall: list[float] = []
    for n in (2, 4):
        # One worker: a plan takes 2 idle GPUs (the master alone on one, the group on another), so two runs
        # fit the machine exactly and four do not: the late ones must plan around the held GPUs, or on CPU.
        racers = [_racer(env, root, 1) for _ in range(n)]
        tally = {"gpu_plans": 0, "cpu_plans": 0, "errors": 0, "gpus_held_max": 0}
        try:
            for p in racers:
                assert _line(p) == "ready"
            for _ in range(trials // 2):
                t0 = time.monotonic()
                for p in racers:  # as close to the same moment as two writes can be
                    assert p.stdin is not None
                    p.stdin.write("go\n")
                for p in racers:
                    assert p.stdin is not None
                    p.stdin.flush()
                got = [json.loads(_line(p)) for p in racers]
                wall.append(time.monotonic() - t0)
                _check_apart(got)
                for g in got:
                    if "error" in g:
                        tally["errors"] += 1
                    elif g["gpus"]:
                        tally["gpu_plans"] += 1
                    else:
                        tally["cpu_plans"] += 1
                tally["gpus_held_max"] = max(tally["gpus_held_max"], sum(len(g.get("gpus", [])) for g in got))
                for p in racers:
                    assert p.stdin is not None
                    p.stdin.write("release\n")
                    p.stdin.flush()
        finally:
            for p in racers:
                if p.stdin is not None:
                    p.stdin.close()
            for p in racers:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        tallies[n] = tally
        assert tally["errors"] == 0, tally
        assert tally["gpus_held_max"] <= 4
    dirs = [p for p in run_dirs(root) if p.is_dir()]
    assert len(dirs) == len({p.name for p in dirs}) == trials // 2 * 6, "one results directory per launch"
    record("concurrency_prepare", trials=f"{trials // 2} x 2 launchers + {trials // 2} x 4 launchers",
           launches=trials // 2 * 6, overlaps=0, shared_names=0, two=tallies[2], four=tallies[4],
           trial_s_max=round(max(wall), 2))


def test_real_launchers_at_once_on_a_4_gpu_machine(nvml_stub: NvmlStub, tmp_path: Path) -> None:
    """Full counts only: the path up to the backend is the one the trials above race (up.prepare), and
    two real docker launchers run at once in test_signals.py; this adds the whole run, ~20 s."""
    if not FULL:
        pytest.skip("FAULT_FULL=1 runs real launchers at once on the simulated machine")
    nvml_stub.configure(machine(4))
    n = 4
    root = tmp_path / "results"
    env = nvml_stub.env(TF_CPP_MIN_LOG_LEVEL="3")
    env = {k: v for k, v in env.items() if not k.startswith("LAUNCHER_") or k == "LAUNCHER_LOCK_DIR"}
    procs = [subprocess.Popen([sys.executable, "-m", "launcher", "up", "--backend", "process", "--workers", "2",
                               "--max-steps", "3000", "--results", str(root), "--json", "--progress", "off"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(n)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for code, out, err in outs:
        assert code == 0, err[-3000:]
    results = [json.loads(out) for _, out, _ in outs]
    runs = [Path(r["results_dir"]) for r in results]
    assert len(set(runs)) == n
    plans = [json.loads((run / "plan.json").read_text()) for run in runs]
    gpu_sets = [set(p["gpu_uuids"]) for p in plans]
    for a, b in combinations(gpu_sets, 2):
        assert not a & b, f"two concurrent runs planned on the same GPU: {gpu_sets}"
    assert sum(1 for s in gpu_sets if s) >= 1
    record("concurrency_real_up", launchers=n, gpu_sets=[sorted(s) for s in gpu_sets], all_finished=True, overlaps=0)


def test_two_launches_with_the_same_run_id_fail_safe(nvml_stub: NvmlStub, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ids carry 16 random bits per second: two launches in the same second collide with odds of
    1 in 65,536. Then the second must stop with exit 2 and a clear message, and keep no GPU."""
    from launcher import up
    from launcher.gpu import leaseholders
    from launcher.config import RunConfig
    from launcher.errors import BadInput

    nvml_stub.configure(machine(4))
    monkeypatch.setattr(up, "new_run_id", lambda env_id, algo: "cartpole-ppo-20260101-000000-abcd")
    cfg = RunConfig(workers=8, backend="process", results=tmp_path / "results", max_steps=1000,
                    lock_dir=nvml_stub.lock_dir)
    with ExitStack() as first:
        run = up.prepare(cfg, first).run
        held = {h.uuid for h in leaseholders.list_holders(nvml_stub.lock_dir)}
        assert held == set(run.plan.gpu_uuids) and held
        with ExitStack() as second:
            with pytest.raises(BadInput) as err:
                up.prepare(cfg, second)
        assert "already exists" in err.value.message
        assert {h.uuid for h in leaseholders.list_holders(nvml_stub.lock_dir)} == held, "the loser kept a GPU"
    wait_for(lambda: not leaseholders.list_holders(nvml_stub.lock_dir), 5, "the locks to be released")
