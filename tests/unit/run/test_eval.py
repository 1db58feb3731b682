"""`launcher eval` on a really trained run: the return matches the end of training, the GIF has frames."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from PIL import Image

from launcher import schemas
from launcher.errors import BadInput, MissingDependency
from launcher.evaluate import evaluate, load_weights, make_render_env
from launcher.runs import RunDir
from tests.helpers import ROOT, child_env
from tests.run_fixtures import TARGET_RETURN, CliRun
from tests.policy_fixtures import export_builtin_policy


def launcher(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=ROOT, env=child_env(**env),
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def trained(trained_cartpole: CliRun) -> RunDir:
    assert trained_cartpole.returncode == 0, trained_cartpole.stderr[-3000:]
    run = trained_cartpole.run_dir
    return RunDir(run.name, run)


def test_eval_reports_a_return_close_to_the_end_of_training(trained: RunDir, tmp_path: Path) -> None:
    gif = tmp_path / "episode.gif"
    out = launcher("eval", trained.run_id, "--results", str(trained.path.parent), "--episodes", "8", "--json",
                   "--gif", str(gif))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    jsonschema.validate(doc, schemas.load(schemas.EVAL_SCHEMA))
    train_end = json.loads((trained.path / "summary.json").read_text())["mean_return"]
    assert doc["training_mean_return"] == train_end >= TARGET_RETURN
    assert doc["checkpoint"] == "final" and doc["weights_from"].endswith("model/policy.npz")
    assert len(doc["returns"]) == len(doc["lengths"]) == 8 and doc["greedy"] is True
    # Greedy play of the final policy is not always as good as the stochastic training episodes (8 greedy
    # episodes have averaged 395 against a training mean of 477), but an untrained or wrongly loaded policy
    # plays about 20 on CartPole, so half the training return still tells the trained weights apart.
    assert doc["mean_return"] >= 0.5 * train_end, doc
    assert doc["mean_return"] == pytest.approx(float(np.mean(doc["returns"])))
    assert doc["std_return"] == pytest.approx(float(np.std(doc["returns"])))

    assert doc["gif"]["path"] == str(gif.resolve()) and doc["gif"]["frames"] > 10
    with Image.open(gif) as im:
        n_frames: int = getattr(im, "n_frames")
        assert im.format == "GIF" and getattr(im, "is_animated") and n_frames > 10
        assert im.size == (600, 400)  # CartPole's frames, drawn by pygame
        im.seek(n_frames // 2)
        assert len(set(im.convert("RGB").getdata())) > 2  # a picture, not a blank

    text = launcher("eval", str(trained.path), "--episodes", "2")  # a run directory works as RUN too
    assert text.returncode == 0, text.stderr
    assert f"run {trained.run_id} · ppo on CartPole-v1 · final weights" in text.stdout
    assert "return      mean" in text.stdout and "training    mean return at the end" in text.stdout


def test_latest_checkpoint_is_the_final_model(trained: RunDir) -> None:
    """The policy saved with the newest checkpoint is exactly the one the master exported at the end."""
    final = load_weights(trained, "final")
    latest = load_weights(trained, "latest")
    assert latest.checkpoint == "latest" and "/checkpoints/policy-" in latest.source
    assert set(final.weights) == set(latest.weights)
    for name in final.weights:
        np.testing.assert_array_equal(final.weights[name], latest.weights[name])
    number = Path(latest.source).stem.split("-")[1]
    assert (trained.path / "checkpoints" / f"ckpt-{number}.index").exists()  # saved beside that checkpoint
    by_path = load_weights(trained, f"checkpoints/ckpt-{number}")
    assert by_path.checkpoint == "path" and by_path.source == latest.source

    best = evaluate(trained, episodes=2, checkpoint="best")  # kept by the master as the mean improved
    assert best["checkpoint"] == "best" and best["weights_from"].endswith("model/best_policy.npz")
    best_meta = json.loads((trained.path / "model" / "best.json").read_text())
    assert best_meta["mean_return"] == json.loads((trained.path / "summary.json").read_text())["best_mean_return"]

    with pytest.raises(BadInput, match=r"no policy saved with that checkpoint .*") as err:
        load_weights(trained, "checkpoints/ckpt-999999")
    assert err.value.hint and "ckpt-" in err.value.hint


def test_missing_pygame_is_a_clear_error(trained: RunDir, tmp_path: Path) -> None:
    blocker = tmp_path / "site" / "pygame"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('pygame blocked by the test')\n")
    out = launcher("eval", str(trained.path), "--episodes", "1", "--gif", str(tmp_path / "x.gif"),
                   PYTHONPATH=f"{blocker.parent}:{ROOT}")
    assert out.returncode == 6, out.stderr  # MISSING_DEPENDENCY
    assert out.stderr.startswith("launcher: error: --gif: CartPole-v1 draws its frames with pygame, which is not "
                                 "installed")
    assert "HINT: pip install 'launcher[render]' (pygame), or leave out --gif" in out.stderr
    assert not (tmp_path / "x.gif").exists()


def test_snake_gif_from_its_own_frames(tmp_path: Path) -> None:
    """Snake draws its grid itself (no pygame); its CNN acts in numpy from the exported program."""
    from worker.envs import SNAKE_ID

    run = tmp_path / "snake-ppo-1"
    (run / "model").mkdir(parents=True)
    (run / "spec.json").write_text(json.dumps({"run_id": run.name, "env_id": SNAKE_ID, "algo": "ppo",
                                               "return_window": 100, "hparams": {}}))
    export_builtin_policy(run, SNAKE_ID, scale=0.05)
    doc = evaluate(RunDir(run.name, run), episodes=3, gif=tmp_path / "snake.gif")
    assert doc["env_id"] == SNAKE_ID and len(doc["returns"]) == 3
    frame = make_render_env(SNAKE_ID, 0).render()
    with Image.open(tmp_path / "snake.gif") as im:
        assert getattr(im, "n_frames") >= 2 and im.size == (frame.shape[1], frame.shape[0])
    assert doc["gif"]["frames"] == doc["lengths"][0] + 1  # the first observation and one frame per step
    with pytest.raises(BadInput, match="has no model/best_policy.npz"):
        evaluate(RunDir(run.name, run), episodes=1, checkpoint="best")
    with pytest.raises(BadInput, match="--episodes must be >= 1"):
        evaluate(RunDir(run.name, run), episodes=0)


ENDLESS = '''
import gymnasium, numpy as np
from gymnasium import spaces

class Endless(gymnasium.Env):
    """Never ends by itself (as Flappy Bird under a good policy); reports a score every 10 steps."""
    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, render_mode=None):
        self.render_mode = render_mode

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, np.float32), {"score": 0}

    def step(self, action):
        self.t += 1
        return np.zeros(3, np.float32), 0.1, False, False, {"score": self.t // 10}

gymnasium.register(id="EvalEndless-v0", entry_point=Endless)
'''


def test_eval_reports_the_games_score_and_cuts_an_endless_episode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An env with no time limit must not hang eval; its info["score"] (Flappy Bird's pipes) is reported.
    The env's module lives only in the user's --env-dir, given to eval as to `up`; the directory the run's
    config.json names is never imported from (the run's containers can write that file)."""
    env_dir = tmp_path / "envs"
    env_dir.mkdir()
    (env_dir / "eval_endless_env.py").write_text(ENDLESS)
    run = tmp_path / "endless-ppo-1"
    (run / "model").mkdir(parents=True)
    env_id = "eval_endless_env:EvalEndless-v0"
    host = tmp_path / ".launcher" / run.name  # the launcher's record of the run: its env id
    host.mkdir(parents=True)
    (host / "spec.json").write_text(json.dumps({"run_id": run.name, "env_id": env_id, "algo": "ppo",
                                                "return_window": 100, "hparams": {}}))
    (run / "config.json").write_text(json.dumps({"env_dir": str(env_dir)}))
    with monkeypatch.context() as m:  # for the export here; eval must be told where the module is
        m.syspath_prepend(str(env_dir))
        export_builtin_policy(run, env_id, scale=0.05)
    import sys

    import gymnasium

    sys.modules.pop("eval_endless_env", None)
    del gymnasium.registry["EvalEndless-v0"]
    with pytest.raises(MissingDependency, match="eval_endless_env") as err:  # config.json's env_dir: not trusted
        evaluate(RunDir(run.name, run), episodes=1)
    assert err.value.hint and "--env-dir" in err.value.hint
    doc = evaluate(RunDir(run.name, run), episodes=2, max_episode_steps=57, env_dir=env_dir)
    assert doc["lengths"] == [57, 57] and doc["cut_at_max_steps"] == 2
    assert doc["scores"] == [5.0, 5.0] and doc["mean_score"] == 5.0
    jsonschema.validate(doc, schemas.load(schemas.EVAL_SCHEMA))
    with pytest.raises(BadInput, match="--max-episode-steps must be >= 1"):
        evaluate(RunDir(run.name, run), episodes=1, max_episode_steps=0, env_dir=env_dir)
