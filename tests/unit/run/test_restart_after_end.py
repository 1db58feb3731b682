"""A master restarted after its run ended does not train again (issue 27, detached Docker runs): the engine's
``on-failure`` policy restarts any non-zero exit, a master that recorded a failure in ``summary.json`` and exited
1 included; ``python -m worker master`` then exits 0 at once (so the engine stops), before it takes the GPU
leases, leaving ``summary.json``, ``status.json`` and the checkpoints as they were; ``launcher status`` still
says failed. A summary of another run, or none (``up --resume`` deletes it), is no end."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from launcher.runstate import Seen, derive_state
from worker.contract import LEASES_ENV, RunSpec
from worker.ending import RunState
from worker.recovery import recorded_end

ROOT = Path(__file__).resolve().parents[3]
RUN_ID = "cartpole-ppo-ended-0001"


@pytest.mark.parametrize("content, outcome", [
    ({"run_id": RUN_ID, "outcome": "failed", "error": {"type": "RuntimeError"}}, "failed"),
    ({"run_id": RUN_ID, "outcome": "max_steps"}, "max_steps"),
    ({"outcome": "interrupted"}, "interrupted"),  # no run_id: the file is in this run's directory
    ({"run_id": "another-run", "outcome": "failed"}, None),
    ({"run_id": RUN_ID, "outcome": "exploded"}, None),  # not one of ours
    ({"run_id": RUN_ID}, None),
    (["failed"], None),
    ("{not json", None),
    (None, None),  # no summary: a fresh run, or one `up --resume` prepared
])
def test_only_this_runs_summary_with_an_outcome_is_a_recorded_end(tmp_path: Path, content: Any,
                                                                  outcome: str | None) -> None:
    path = tmp_path / "summary.json"
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_text(json.dumps(content))
    assert recorded_end(path, RUN_ID) == outcome


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_master_started_after_its_run_ended_exits_0_at_once_touching_nothing(tmp_path: Path) -> None:
    results = tmp_path / "run"
    (results / "checkpoints" / "ckpt-40").mkdir(parents=True)
    (results / "checkpoints" / "ckpt-40" / "state").write_bytes(b"weights")
    (results / "summary.json").write_text(json.dumps({
        "schema": "launcher.summary/v1", "run_id": RUN_ID, "outcome": "failed", "target_reached": False,
        "error": {"type": "RuntimeError", "message": "boom", "where": "the master"}}))
    (results / "status.json").write_text(json.dumps({"run_id": RUN_ID, "state": "failed", "env_steps": 9000}))
    before = _tree(results)
    spec = tmp_path / "spec.json"
    spec.write_text(RunSpec(run_id=RUN_ID, env_id="CartPole-v1", algo="ppo", results_dir=str(results)).to_json())
    # A GPU lease another run holds: a master that took its leases first would exit 75 (and be restarted).
    lease = tmp_path / "lease-GPU-0"
    lease.write_text("")
    held = os.open(lease, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "worker", "master", "--spec", str(spec)], cwd=ROOT, text=True,
                              env={**os.environ, LEASES_ENV: str(lease)}, capture_output=True, timeout=60)
        took = time.monotonic() - t0
    finally:
        os.close(held)
    assert done.returncode == 0, done.stderr
    assert "already ended (summary.json: outcome failed)" in done.stderr and "not training it again" in done.stderr
    assert f"launcher up --resume {RUN_ID}" in done.stderr
    assert "tensorflow" not in done.stderr.lower() and took < 20, "it must exit before any heavy import"
    assert _tree(results) == before, "summary.json, status.json and the checkpoints stay as they were"


def test_status_still_says_failed_when_the_restarted_master_exited_0() -> None:
    """The container's last exit is the restarted master's 0; the outcome in summary.json decides."""
    summary = {"outcome": "failed", "error": {"type": "RuntimeError", "message": "boom", "where": "the master"}}
    d = derive_state(RUN_ID, {"state": "running", "detached": True}, summary, Seen(master_exit=0))
    assert d.state == RunState.FAILED and "boom" in d.note and f"up --resume {RUN_ID}" in d.note
