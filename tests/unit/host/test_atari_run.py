"""End to end on Atari: a short process-backend run on ``ALE/Pong-v5`` (preprocessed to 84x84x4 uint8 by
worker/envs/atari.py, learned by the Nature CNN that worker/models.py picks for such frames) that completes and
writes its results. Needs the ``atari`` extra (``pip install -e '.[atari]'``: ale-py, opencv-python-headless);
skipped without it. About a minute on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import child_env, launcher_cmd

pytest.importorskip("ale_py")
pytest.importorskip("cv2")
pytestmark = pytest.mark.atari

STEPS = 2048


def test_a_short_pong_run_completes_and_writes_its_results(tmp_path: Path) -> None:
    root = tmp_path / "results"
    done = subprocess.run(
        launcher_cmd("up", "--backend", "process", "--gpus", "none", "--workers", "2", "--env", "ALE/Pong-v5",
                     "--max-steps", str(STEPS), "--results", str(root), "--progress", "off", "--json"),
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["state"] == "finished" and result["summary"]["env_steps"] >= STEPS
    assert result["summary"]["updates"] >= 1
    run = root / result["run_id"]
    for name in ("summary.json", "status.json", "metrics.jsonl", "model/policy.npz", "model/policy.json",
                 "model/final_model.keras", "logs/master.log", "logs/group-0.log"):
        assert (run / name).is_file() and (run / name).stat().st_size > 0, name
    doc = json.loads((run / "model" / "policy.json").read_text())
    kernels = [n["weights"][0] for n in doc["program"]["nodes"] if n["op"] == "Conv2D"]
    assert len(kernels) == 3, "84x84x4 uint8 frames get the Nature CNN: three convolutions"
    assert doc["program"]["input_dtype"] == "uint8" and doc["acting"]["path"] == "numpy"
