"""Models and algorithms: the numpy program of every built-in network matches Keras, GAE is right, updates
learn, and every algorithm x env kind runs for real for a few thousand steps (cleanrl-style smoke tests)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from tests.helpers import only_run, read_json, run_launcher
from tests.policy_fixtures import builtin, numpy_context, policy_of

from worker.algorithms.rollout import Collector
from worker.api import Spaces
from worker.keras_convert import check_program, get_weights, to_program, weight_names
from worker.numpy_model import NumpyModel
from worker.segments import gae

BOX = Spaces(gym.spaces.Box(-1.0, 1.0, (3,), np.float32), gym.spaces.Box(-2.0, 2.0, (1,), np.float32))
CARTPOLE = Spaces(gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), gym.spaces.Discrete(2))
GRID = Spaces(gym.spaces.Box(0.0, 1.0, (10, 10, 3), np.float32), gym.spaces.Discrete(4))
FRAMES = Spaces(gym.spaces.Box(0, 255, (4, 84, 84), np.uint8), gym.spaces.Discrete(6))


@pytest.mark.parametrize("spaces", [CARTPOLE, BOX, GRID, FRAMES], ids=["mlp-discrete", "mlp-box", "cnn", "nature"])
def test_numpy_program_of_every_builtin_network_matches_keras(spaces: Spaces) -> None:
    _, model = builtin(spaces, seed=1)
    program = to_program(model)
    assert check_program(model, program, spaces.observation, n=8) <= 1.0  # within float32 rounding
    assert [n for n, _ in program.weights] == weight_names(model)


def test_weights_with_a_wrong_shape_are_refused() -> None:
    _, model = builtin(CARTPOLE)
    numpy_model = NumpyModel(to_program(model))
    w = get_weights(model)
    w["pi_out/kernel"] = np.zeros((64, 3), np.float32)
    with pytest.raises(ValueError, match="pi_out/kernel"):
        numpy_model.check_weights(w)


def test_gae_against_a_hand_computation() -> None:
    r = np.array([[1.0], [1.0], [1.0]], np.float32)
    v = np.array([[0.5], [0.4], [0.3]], np.float32)
    d = np.array([[0.0], [1.0], [0.0]], np.float32)  # the episode ends after step 1
    adv, ret = gae(r, v, d, np.array([0.2], np.float32), gamma=0.9, lam=0.8)
    d2 = 1 + 0.9 * 0.2 - 0.3
    d1 = 1 - 0.4  # terminal: no bootstrap
    d0 = 1 + 0.9 * 0.4 - 0.5
    np.testing.assert_allclose(adv[:, 0], [d0 + 0.9 * 0.8 * d1, d1, d2], rtol=1e-6)
    np.testing.assert_allclose(ret, adv + v, rtol=1e-6)


def test_collector_bootstraps_truncated_episodes() -> None:
    envs = [gym.make("CartPole-v1", max_episode_steps=5) for _ in range(2)]
    algorithm, model = builtin(envs[0])
    pol = policy_of(numpy_context(algorithm, model, version=3), "float32")
    col = Collector(envs, pol, gamma=0.99, lam=0.95, seed=0)
    seg = col.collect(12)
    assert seg.obs.shape == (12, 2, 4) and seg.actions.shape == (12, 2) and seg.version == 3
    assert seg.steps == 24 and col.total_steps == 24
    assert all(length == 5 for length in seg.episode_lengths) and len(seg.episode_lengths) >= 4
    assert np.isfinite(seg.advantages).all()


def test_ppo_update_moves_the_policy_toward_advantageous_actions() -> None:
    from worker.algorithms.ppo_update import PPOLearner

    _, model = builtin(CARTPOLE)
    hp = {"lr": 3e-3, "clip": 0.2, "vf_coef": 0.5, "ent_coef": 0.0, "max_grad_norm": 0.5, "epochs": 4, "minibatches": 2}
    learner = PPOLearner(model, hp, 0, continuous=False, n_outputs=2, obs_shape=(4,), obs_dtype="float32")
    pol = NumpyModel(to_program(model))
    pol.set_weights(get_weights(model), 0)
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((256, 4)).astype(np.float32)
    actions = rng.integers(0, 2, 256)
    advantages = np.where(actions == 1, 1.0, -1.0).astype(np.float32)  # action 1 was better everywhere
    out, _ = pol(obs)
    logp_all = out - np.log(np.exp(out).sum(1, keepdims=True))
    logp = logp_all[np.arange(256), actions].astype(np.float32)
    stats = learner.update({"obs": obs, "actions": actions, "logp": logp, "advantages": advantages,
                            "returns": np.ones(256, np.float32)})
    pol.set_weights(get_weights(model), 1)
    out2, _ = pol(obs)
    p_before = np.exp(logp_all[:, 1]).mean()
    p_after = (np.exp(out2) / np.exp(out2).sum(1, keepdims=True))[:, 1].mean()
    assert p_after > p_before + 0.01, (p_before, p_after)
    assert set(stats) >= {"policy_loss", "value_loss", "entropy", "approx_kl", "clip_frac"}


def test_a3c_gradients_applied_on_the_master_change_the_weights() -> None:
    from worker.algorithms.a3c_grads import A3CGradients, A3CLearner

    _, master_model = builtin(CARTPOLE, seed=0)
    _, group_model = builtin(CARTPOLE, seed=5)  # another process's copy, with other weights until it gets ours
    names = [n for n, v in zip(weight_names(master_model), master_model.weights) if v.trainable]
    hp = {"lr": 1e-3, "vf_coef": 0.5, "ent_coef": 0.01, "max_grad_norm": 0.5}
    shape = {"continuous": False, "n_outputs": 2}
    master = A3CLearner(master_model, names, hp, obs_shape=(4,), obs_dtype="float32", **shape)
    group = A3CGradients(group_model, names, hp, **shape)
    w0 = get_weights(master_model)
    rng = np.random.default_rng(1)
    batch = {"obs": rng.standard_normal((64, 4)).astype(np.float32), "actions": rng.integers(0, 2, 64),
             "advantages": rng.standard_normal(64).astype(np.float32), "returns": rng.standard_normal(64).astype(np.float32)}
    grads, losses = group.compute(batch, None)
    assert set(grads) == set(names) and all(np.isfinite(g).all() for g in grads.values())
    assert set(losses) == {"policy_loss", "value_loss", "entropy"}
    norm = master.apply(grads)
    w1 = get_weights(master_model)
    assert norm > 0 and any(not np.allclose(w0[k], w1[k]) for k in w0)


@pytest.mark.parametrize("env_id,algo,workers", [
    ("launcher/Snake-v0", "ppo", 4),
    ("launcher/Snake-v0", "a3c", 2),
    ("Pendulum-v1", "ppo", 2),
    ("Pendulum-v1", "a3c", 2),
])
def test_smoke_every_algorithm_and_env_kind(tmp_path, env_id: str, algo: str, workers: int) -> None:
    from launcher.evaluate import load_weights
    from launcher.runs import RunDir
    from worker.envs import make_env

    proc = run_launcher("up", "--backend", "process", "--workers", str(workers), "--env", env_id, "--algo", algo,
                        "--max-steps", "3000", "--results", str(tmp_path), "--checkpoint-every", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run(tmp_path)
    summary = read_json(run / "summary.json")
    assert summary["outcome"] == "max_steps" and summary["updates"] >= 1 and summary["env_steps"] >= 3000
    assert summary["acting"] == "numpy" and summary["error"] is None
    assert (run / "model" / "policy.npz").exists()
    doc = read_json(run / "model" / "policy.json")
    convs = [n["op"] for n in doc["program"]["nodes"] if n["op"] == "Conv2D"]
    assert len(convs) == (2 if "Snake" in env_id else 0)
    assert doc["action"]["discrete"] == (env_id != "Pendulum-v1")
    # The saved policy acts in the env, on observations normalised with the statistics saved beside it
    # (continuous control normalises by default; image observations never), and a Box policy's log standard
    # deviation is among the learner's extras.
    loaded = load_weights(RunDir(run.name, run), "final")
    assert (loaded.norm.obs_mean is not None) == (env_id == "Pendulum-v1")
    saved = dict(np.load(run / "model" / "policy.npz"))
    assert ("x/log_std" in saved) == (env_id == "Pendulum-v1")
    env = make_env(env_id, seed=0)
    obs, _ = env.reset(seed=0)
    action = loaded.policy()(obs)
    env.step(action)
    assert env.action_space.contains(np.asarray(action, env.action_space.dtype) if env_id == "Pendulum-v1" else action)


def test_policy_swaps_in_received_weights_without_copying() -> None:
    _, model = builtin(CARTPOLE)
    pol = NumpyModel(to_program(model))
    shapes = pol.shapes
    first = {k: np.full(s, 1.0, np.float32) for k, s in shapes.items()}
    pol.set_weights(first, 0)
    spare = pol.spare()
    for arr in spare.values():
        arr.fill(2.0)
    assert pol.swap_in(spare, 1) is True
    assert pol.version == 1 and all(pol.w[k] is spare[k] for k in spare)
    assert pol.spare() is not spare and all(pol.spare()[k] is not pol.w[k] for k in spare)
    # Arrays that are not the spare set are copied in instead.
    other = {k: np.full(s, 3.0, np.float32) for k, s in shapes.items()}
    assert pol.swap_in(other, 2) is False and all((pol.w[k] == 3.0).all() and pol.w[k] is not other[k] for k in other)


def test_a_box_policy_starts_in_the_middle_of_its_bounds() -> None:
    """Actions are clipped to the bounds for the env: a mean starting at 0 for [0, 1] would pin half the
    actions to an edge. Symmetric bounds keep 0; an infinite bound keeps 0 for that dimension."""
    spaces = Spaces(gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
                    gym.spaces.Box(np.array([0.0, -2.0, -np.inf], np.float32), np.array([1.0, 2.0, np.inf], np.float32)))
    algorithm, model = builtin(spaces, env_id="Box3-v0")
    pol = policy_of(numpy_context(algorithm, model), "float32")
    actions, _, _ = pol.act(np.zeros((64, 3), np.float32), np.random.default_rng(0), greedy=True)
    np.testing.assert_allclose(actions, np.tile([0.5, 0.0, 0.0], (64, 1)), atol=1e-6)
    sampled, _, _ = pol.act(np.random.default_rng(1).standard_normal((4096, 3)).astype(np.float32),
                            np.random.default_rng(0))
    env_actions = pol.env_actions(sampled)
    assert env_actions[:, 0].min() >= 0.0 and env_actions[:, 0].max() <= 1.0
    assert 0.3 < (env_actions[:, 0] > 0.5).mean() < 0.7  # as many above the middle as below
