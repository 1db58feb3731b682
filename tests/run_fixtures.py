"""Pytest plugin: one real CartPole PPO run trained to a mean return of 475, shared by the session.

It goes through the real CLI (`python -m launcher up --json`) with stderr a pipe, so the same run gives the
plain progress lines (tests/unit/host/test_progress.py), the --json result and result.json (tests/unit/host/test_schemas.py), a
finished run for `launcher runs` (tests/unit/host/test_runs.py) and a trained model for `launcher eval`
(tests/unit/run/test_eval.py). About 25 s on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import child_env, launcher_cmd, run_dirs

TARGET_RETURN = 475.0


@dataclass(frozen=True)
class CliRun:
    """A finished `launcher up` invocation and where its run lives."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    root: Path
    wall_s: float

    @property
    def run_dir(self) -> Path:
        (run,) = [p for p in run_dirs(self.root) if p.is_dir()]
        return run

    @property
    def result(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.stdout)
        return doc


@pytest.fixture(scope="session")
def trained_cartpole(tmp_path_factory: pytest.TempPathFactory) -> CliRun:
    root = tmp_path_factory.mktemp("trained")
    args = ("up", "--backend", "process", "--gpus", "none", "--workers", "8", "--groups", "2", "--env", "CartPole-v1",
            "--algo", "ppo",
            "--until-return", str(TARGET_RETURN), "--max-steps", "400000", "--seed", "0", "--results", str(root),
            "--json", "--progress-interval", "1")
    t0 = time.monotonic()
    # cwd is the empty root: no launcher.toml is picked up; child_env drops the caller's LAUNCHER_* variables.
    proc = subprocess.run(launcher_cmd(*args), cwd=root, env=child_env(), capture_output=True, text=True, timeout=300)
    return CliRun(args, proc.returncode, proc.stdout, proc.stderr, root, time.monotonic() - t0)
