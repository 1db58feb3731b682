"""The learner recovered in place on the Docker backend (issue 27): the master container's main process is
SIGKILLed from the host (as the OOM killer or a crash would) twice while CartPole PPO trains; each time the
supervisor starts the same container again, it restores the newest checkpoint, the group containers (never
restarted: same start time, restart count 0) reconnect to it by name, and the run reaches a mean return of 475.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launcher.backends.containers import group_name, master_name
from launcher.engine.client import Engine
from tests.docker_fixtures import ours
from tests.helpers import ROOT, child_env, launcher_cmd, read_json, run_dirs, status_of, wait_for

KILLS = 2


def _connected(st: dict[str, object], groups: int) -> bool:
    g = st.get("groups")
    return isinstance(g, dict) and sum(bool(v.get("connected")) for v in g.values() if isinstance(v, dict)) == groups


@pytest.mark.docker
def test_a_sigkilled_master_container_is_started_again_in_place(launcher_image: str, runs_under: Path,
                                                                 engine: Engine) -> None:
    groups = 2
    proc = subprocess.Popen(
        launcher_cmd("up", "--backend", "docker", "--image", launcher_image, "--workers", str(groups), "--groups",
                     str(groups), "--until-return", "475", "--max-steps", "3000000", "--checkpoint-every", "5",
                     "--master-restarts", str(KILLS), "--results", str(runs_under), "--json", "--progress", "plain"),
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    recoveries_s: list[float] = []
    try:
        run = wait_for(lambda: next(iter(run_dirs(runs_under)), None), 60, "the run directory")
        wait_for(lambda: _connected(status_of(run), groups) or proc.poll() is not None, 180, "both groups connected")
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        started = {g: engine.inspect_raw(group_name(run.name, g))["State"]["StartedAt"] for g in range(groups)}
        for i in range(KILLS):
            base = int(status_of(run).get("updates") or 0)
            wait_for(lambda: int(status_of(run).get("updates") or 0) >= base + 5 or proc.poll() is not None, 120,
                     f"master {i} to train a few updates")
            assert proc.poll() is None, f"the run ended before kill {i + 1}"
            snap = engine.inspect(master_name(run.name))
            assert snap is not None and snap.pid > 0
            os.kill(snap.pid, signal.SIGKILL)  # from the host: not a `docker kill`
            t_kill = time.monotonic()

            def back() -> bool:
                st = status_of(run)
                # (status.json's pid is the master's in its container: 1 for the old and the new one alike)
                return len(st.get("recoveries") or []) == i + 1 and _connected(st, groups) or proc.poll() is not None

            wait_for(back, 120, f"the master and the groups after kill {i + 1}")
            assert proc.poll() is None, f"the launcher ended after kill {i + 1}: " + proc.communicate()[1][-3000:]
            recoveries_s.append(round(time.monotonic() - t_kill, 2))
            for g in range(groups):
                c = engine.inspect_raw(group_name(run.name, g))
                assert c["State"]["StartedAt"] == started[g] and c["RestartCount"] == 0, f"group {g} was restarted"
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    assert proc.returncode == 0, err[-4000:]
    result = json.loads(out)
    summary = read_json(run / "summary.json")
    assert result["state"] == "finished" and summary["target_reached"] and summary["mean_return"] >= 475
    recs = summary["recoveries"]
    assert len(recs) == KILLS and all(r["checkpoint"] and r["restored_env_steps"] > 0 for r in recs), recs
    assert err.count("the master died (killed by SIGKILL") == KILLS, err[-3000:]
    assert "resumed from" in (run / "logs" / "master.log").read_text()
    assert ours(engine, runs_under) == ([], []), "the attached up removes what it started"
    print(f"\n[recovery docker] recovery_s={recoveries_s} steps_lost={[r['steps_lost'] for r in recs]} "
          f"wall_s={result['wall_s']}")
