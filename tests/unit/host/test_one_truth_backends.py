"""Issue 23, item 4 and its small items: what the backends say is what they do.

* one backend object per run: made once by ``prepare()`` and used for preflight, env check, start and stop;
* ``--backend``'s choices are the registry's (``launcher.backends.BACKENDS``), not a second list;
* the parts of a process run come in the one order (``base.name_order``): ``group-2`` before ``group-10``;
* the swarm backend's labels come from :mod:`launcher.engine.labels`.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from launcher import up as up_mod
from launcher.backends import swarm
from launcher.backends.base import Backend, BackendStatus
from launcher.backends.process import ProcessRun
from launcher.config import RunConfig
from launcher.errors import LauncherError
from launcher.runs import RunDir
from tests.helpers import ROOT


class Recording(Backend):
    """A backend that records each object made and what was asked of it; its start fails."""

    name = "process"
    made: list["Recording"] = []

    def __init__(self) -> None:
        Recording.made.append(self)
        self.calls: list[str] = []

    def preflight(self, plan: Any) -> None:
        self.calls.append("preflight")

    def check_env(self, cfg: RunConfig, plan: Any, run_id: str) -> dict[str, Any]:
        self.calls.append("check_env")
        return {}

    def start(self, run: Any) -> None:
        self.calls.append("start")
        raise LauncherError("no start in this test")

    def poll(self) -> BackendStatus:  # pragma: no cover - never reached
        raise AssertionError("poll after a failed start")

    def restart_group(self, index: int) -> None:  # pragma: no cover
        raise AssertionError("restart after a failed start")

    def stop(self, *, grace_s: float = 8.0) -> None:
        self.calls.append("stop")


def test_one_backend_object_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Recording.made.clear()
    monkeypatch.setattr(up_mod, "backend_class", lambda name: Recording)
    cfg = RunConfig(workers=2, backend="process", gpus="none", results=tmp_path / "results", max_steps=1000)
    with pytest.raises(LauncherError, match="no start in this test"):
        up_mod.up(cfg)
    assert len(Recording.made) == 1, "the backend was made more than once for one run"
    assert Recording.made[0].calls == ["preflight", "check_env", "start", "stop"]


def test_backend_choices_are_the_registry() -> None:
    """A backend added to the one table is a --backend choice: the config reads the table (loading the table
    must not load the config first)."""
    code = ("import launcher.backends as b; b.BACKENDS['fake'] = ('launcher.backends.process', 'ProcessBackend'); "
            "import launcher.config as c; assert c.BACKENDS == ('auto', *b.BACKENDS), c.BACKENDS")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]


def test_process_run_parts_are_in_part_order(tmp_path: Path) -> None:
    run_dir = tmp_path / "r1"
    run_dir.mkdir(mode=0o755)
    pid = os.getpid()  # any pid: the order is what is tested, not whether it belongs to the run
    record = {"pids": {"group-10": pid, "group-2": pid, "master": pid, "group-1": pid}}
    names = [p.name for p in ProcessRun("r1", RunDir("r1", run_dir), record).parts()]
    assert names == ["master", "group-1", "group-2", "group-10"]


def test_swarm_writes_no_label_literal() -> None:
    assert '"launcher.' not in inspect.getsource(swarm)
