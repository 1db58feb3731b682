"""The examples (examples/*.py, written on worker.api) run in containers, and their payloads pass the master's
checks: each trains a short while (a few workers, a small --max-steps) on the image the session builds.

What is checked: ``launcher up`` exits 0, env steps and updates were counted, and the master refused nothing
(no ``rejected.*`` counter in summary.json or status.json: a payload that broke the example's schema would show
as ``rejected.schema:<field>``). A connection the master refused while it was still starting
(``rejected.handshake_aborted``: a group dialled before the master accepted) is the launcher's start on a loaded
host, not the example's payload, and is allowed.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from launcher.engine import Engine
from tests.docker_fixtures import ours
from tests.helpers import ROOT, child_env, launcher_cmd, only_run, read_json

STARTUP_REJECTIONS = {"rejected.handshake_aborted"}

EXAMPLES = {
    # One group of 2 envs (one TensorFlow import less than 2 groups): it computes episode gradients with
    # TensorFlow, a row per finished episode, and the master applies them as they come.
    "a3c": ("a3c_parameter_server.py:A3CParameterServer", "CartPole-v1", ["--workers", "2", "--max-steps", "400"]),
    # An update every 2 payloads (4 segments of 32 steps, 2 envs); no XLA compile (seconds) for a few updates.
    "dppo": ("dppo_pendulum.py:DPPO", "Pendulum-v1",
             ["--workers", "2", "--max-steps", "400", "--set", "max_qsize=4", "--set", "jit_compile=false"]),
    # Rounds of 200 steps over 2 envs: a round's targets resolve only when a fruit or an end comes, so rows vary.
    "snake": ("snake_a2c.py:SnakeA2C", "launcher/Snake-v0", ["--workers", "2", "--max-steps", "600", "--set",
                                                             "batch_steps=200"]),
}


def rejections(doc: dict[str, Any]) -> dict[str, int]:
    counters = {**(doc.get("network") or {}), **{k: v for k, v in doc.items() if k.startswith("rejected.")}}
    return {k: v for k, v in counters.items() if k.startswith("rejected.") and k not in STARTUP_REJECTIONS}


@pytest.mark.docker
def test_examples_train_in_containers_and_their_payloads_validate(launcher_image: str, runs_under: Path,
                                                                   engine: Engine) -> None:
    # All at once: most of a short run is starting containers and importing TensorFlow, which overlap. The
    # --timeout ends a run whose payloads are all refused (refused payloads count no env steps): exit 4.
    procs = {}
    for name, (ref, env_id, args) in EXAMPLES.items():
        root = runs_under / name
        root.mkdir()
        procs[name] = subprocess.Popen(
            launcher_cmd("up", "--backend", "docker", "--image", launcher_image, "--algo", f"examples/{ref}",
                         "--env", env_id, *args, "--results", str(root), "--json", "--timeout", "240s"),
            cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outputs = {}
    try:
        for name, proc in procs.items():
            outputs[name] = proc.communicate(timeout=330)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=60)
    for name, proc in procs.items():
        out, err = outputs[name]
        run = only_run(runs_under / name)
        status = read_json(run / "status.json")
        assert rejections(status) == {}, (name, status)  # first: a refused payload also fails what follows
        assert proc.returncode == 0, f"{name}: {err[-4000:]}"
        result, summary = json.loads(out), read_json(run / "summary.json")
        assert rejections(summary) == {}, (name, summary)
        assert summary["outcome"] == "max_steps" and summary["error"] is None, (name, summary)
        assert summary["env_steps"] > 0 and summary["updates"] > 0, (name, summary)
        assert result["state"] == "finished" and status["updates"] == summary["updates"], name
    assert ours(engine, runs_under) == ([], []), "up must remove the containers and the networks it started"
