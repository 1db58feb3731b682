"""Fault suite, a backend that fails while starting (an engine error after the checks passed, a container
that cannot be created): ``up`` raises the error for the CLI to report, stops whatever had started, leaves
run.json saying how the run ended (not stuck at "stopping", which ``launcher runs`` shows as stale), and
gives the process its SIGINT/SIGTERM handlers back.

In-process with a stand-in backend: the edge faked is the one this machine cannot produce on demand.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from launcher import up as up_mod
from launcher.backends.base import Backend, BackendStatus
from launcher.config import RunConfig
from launcher.errors import ExitCode, LauncherError
from tests.fault.helpers import unreadable_json
from tests.helpers import read_json, run_dirs



class FailingBackend(Backend):
    name = "process"

    def __init__(self) -> None:
        self.stopped = 0

    def start(self, run: Any) -> None:
        raise LauncherError("cannot create container launcher-x-group-0: the engine said no",
                            hint="`launcher down --all` removes leftovers of earlier runs")

    def poll(self) -> BackendStatus:  # pragma: no cover - never reached
        raise AssertionError("poll after a failed start")

    def restart_group(self, index: int) -> None:  # pragma: no cover
        raise AssertionError("restart after a failed start")

    def stop(self, *, grace_s: float = 8.0) -> None:
        self.stopped += 1


def test_a_backend_that_fails_to_start_leaves_a_final_record_and_the_handlers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = FailingBackend()
    monkeypatch.setattr(up_mod, "make_backend", lambda name, cfg, **_: backend)
    cfg = RunConfig(workers=2, backend="process", gpus="none", results=tmp_path / "results", max_steps=1000)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(LauncherError, match="the engine said no"):
        up_mod.up(cfg)
    assert backend.stopped == 1, "whatever had started must be stopped"
    (run,) = [p for p in run_dirs(tmp_path / "results")]
    rec = read_json(run / "run.json")
    assert rec["state"] == "failed", rec
    assert rec["exit_code"] == int(ExitCode.INTERNAL) and "the engine said no" in rec["message"], rec
    assert not unreadable_json(run)
    assert {s: signal.getsignal(s) for s in handlers} == handlers, "up() kept its signal handlers installed"
