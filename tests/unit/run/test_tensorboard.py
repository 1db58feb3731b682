"""A finished run's TensorBoard logs load through TensorBoard's own reader, with the scalars README lists.

The master writes event files with TensorFlow alone (worker/results.py); this checks them the way the
user's `tensorboard --logdir results` will read them: TensorBoard's EventAccumulator, in the venv that
scripts/setup.sh made.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.run_fixtures import CliRun

# The scalar tags README.md's results table promises, for a PPO run.
PPO_SCALARS = {
    "return/mean",
    "throughput/env_steps_per_s",
    "throughput/updates",
    "loss/policy_loss",
    "loss/value_loss",
    "loss/entropy",
    "loss/approx_kl",
}


def _accumulate(directory: Path):  # type: ignore[no-untyped-def]
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    return acc


def test_tensorboard_is_installed_by_setup() -> None:
    exe = Path(__file__).resolve().parents[3] / ".venv" / "bin" / "tensorboard"
    assert exe.exists() or shutil.which("tensorboard"), "scripts/setup.sh must install tensorboard into .venv"
    out = subprocess.run([str(exe) if exe.exists() else "tensorboard", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().split(".")[0].isdigit(), out.stdout


def test_event_files_load_with_the_documented_scalars(trained_cartpole: CliRun) -> None:
    assert trained_cartpole.returncode == 0, trained_cartpole.stderr[-3000:]
    tb_dir = trained_cartpole.run_dir / "tensorboard"
    assert any(tb_dir.glob("events.out.tfevents.*")), f"no event file in {tb_dir}"
    acc = _accumulate(tb_dir)
    tags = set(acc.Tags()["tensors"])
    missing = PPO_SCALARS - tags
    assert not missing, f"scalars missing from the event files: {sorted(missing)} (found {sorted(tags)})"
    assert any(t.startswith("network/") for t in tags), sorted(tags)

    # The values are the run's own: the last return/mean equals the last progress record's mean return.
    import tensorflow as tf

    events = acc.Tensors("return/mean")
    assert len(events) >= 2
    steps = [e.step for e in events]
    assert steps == sorted(steps) and steps[-1] > 0
    last_tb = float(tf.make_ndarray(events[-1].tensor_proto))
    progress = [json.loads(line) for line in (trained_cartpole.run_dir / "metrics.jsonl").read_text().splitlines()
                if '"progress"' in line]
    means = [p for p in progress if p.get("mean_return") is not None]
    assert means, "no progress record with a mean return"
    assert math.isclose(last_tb, means[-1]["mean_return"], rel_tol=1e-5, abs_tol=1e-3), (last_tb, means[-1])
    assert last_tb >= 475.0 - 1e-3
