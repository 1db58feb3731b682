"""Observation normalisation and return scaling (issue 15 item 1): the moments merge exactly, the groups
collect what the master expects, bad statistics are refused on both sides, checkpoints keep them, and the
exported Keras model applies them. Real numpy, real TensorFlow, real protocol frames; no mocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gymnasium as gym

from tests.policy_fixtures import builtin, learner_of, numpy_context, policy_of, setup_fields
from worker.algorithms import hparams
from worker.algorithms.actor_critic import env_kind
from worker.algorithms.rollout import Collector
from worker.api import Payload, Reject, Spaces
from worker.envs import make_env, make_vector_env
from worker.keras_convert import get_weights, to_program
from worker.models import with_normalization
from worker.normalize import (CLIP_OBS, EPS, OBS_MEAN, OBS_VAR, RET_SHAPE, RET_VAR, Moments, NormStats, ReturnTracker,
                              check_stats, moments_arrays, normalization)
from worker.numpy_model import NumpyModel
from worker.protocol import Message, MsgType, encode
from worker.protocol.frames import decode_payload, HEADER_SIZE
from worker.validate import check_payload

PEND = Spaces(gym.spaces.Box(-8.0, 8.0, (3,), np.float32), gym.spaces.Box(-2.0, 2.0, (1,), np.float32))

STEPS = 32


def test_merging_moments_equals_the_statistics_of_the_concatenated_data() -> None:
    rng = np.random.default_rng(0)
    # Uneven chunks, an empty one among them, far from zero mean (where a naive formula loses precision).
    chunks = [rng.normal(1e3, 5.0, (n, 3, 2)) for n in (1, 0, 7, 250, 3, 64)]
    merged = Moments.empty((3, 2))
    for c in chunks:
        merged = merged.merge(Moments.of(c))
    data = np.concatenate(chunks)
    assert merged.count == len(data)
    np.testing.assert_allclose(merged.mean, data.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(merged.var, data.var(axis=0), rtol=1e-9)
    # The order of arrival does not matter (the master merges groups as their segments come).
    other = Moments.empty((3, 2))
    for c in reversed(chunks):
        other = other.merge(Moments.of(c))
    np.testing.assert_allclose(other.mean, merged.mean, rtol=1e-12)
    np.testing.assert_allclose(other.m2, merged.m2, rtol=1e-9)
    # Nothing seen yet: normalising is the identity (variance 1, mean 0).
    assert (Moments.empty((2,)).var == 1).all()


def test_normalised_observations_and_scaled_rewards_follow_the_formula() -> None:
    stats = NormStats(np.array([1.0, -2.0]), np.array([4.0, 0.25]), ret_var=16.0)
    obs = np.array([[3.0, -2.5], [1e6, -1e6]], np.float32)
    want = np.clip((obs - stats.obs_mean) / np.sqrt(stats.obs_var + EPS), -CLIP_OBS, CLIP_OBS)
    np.testing.assert_allclose(stats.obs(obs), want, rtol=1e-6)
    assert stats.obs(obs).dtype == np.float32 and stats.obs(obs)[1].tolist() == [CLIP_OBS, -CLIP_OBS]
    np.testing.assert_allclose(stats.reward(np.array([-8.0, 400.0])), [-2.0, 10.0], rtol=1e-6)  # clipped at 10
    # Switched off: observations and rewards pass unchanged.
    off = NormStats()
    np.testing.assert_array_equal(off.obs(obs), obs)
    np.testing.assert_array_equal(off.reward(np.array([-8.0])), [-8.0])
    assert NormStats.from_arrays(stats.arrays()).ret_var == 16.0


def test_the_return_tracker_discounts_and_resets_per_env() -> None:
    t = ReturnTracker(2, gamma=0.5)
    valid = np.array([True, True])
    np.testing.assert_allclose(t.step(np.array([1.0, 2.0]), np.array([False, True]), valid)[:, 0], [1.0, 2.0])
    np.testing.assert_allclose(t.step(np.array([1.0, 2.0]), np.array([False, False]), valid)[:, 0], [1.5, 2.0])
    # A masked reset step (NEXT_STEP autoreset) neither adds nor reports.
    out = t.step(np.array([5.0, 5.0]), np.array([False, False]), np.array([False, True]))
    assert out.shape == (1, *RET_SHAPE) and out[0, 0] == 2.0 * 0.5 + 5.0


def test_collector_sends_normalised_observations_and_the_raw_moments() -> None:
    envs = make_vector_env("Pendulum-v1", 3)
    algorithm, model = builtin(envs, env_id="Pendulum-v1")
    pol = policy_of(numpy_context(algorithm, model), "float32")
    col = Collector(envs, pol, gamma=0.9, lam=0.95, seed=0, normalize_obs=True, normalize_reward=True)
    col.norm = NormStats(np.array([0.0, 0.0, 1.0]), np.array([4.0, 4.0, 9.0]), ret_var=25.0)
    seg = col.collect(STEPS)
    raw = seg.obs.reshape(-1, 3).astype(np.float64) * np.sqrt(col.norm.obs_var + EPS) + col.norm.obs_mean
    assert seg.obs_moments is not None and seg.ret_moments is not None
    assert seg.obs_moments.count == seg.steps == STEPS * 3
    np.testing.assert_allclose(seg.obs_moments.mean, raw.mean(axis=0), atol=1e-5)
    np.testing.assert_allclose(seg.obs_moments.var, raw.var(axis=0), rtol=1e-4)
    assert seg.ret_moments.count == STEPS * 3 and (seg.ret_moments.mean < 0).all()  # Pendulum's rewards are <= 0
    # Rewards for learning are scaled, reported returns are not (none ended in 32 steps of a 200-step task).
    assert np.abs(seg.returns).max() < 10 / (1 - 0.9)


def test_kind_defaults_turn_normalisation_on_for_continuous_control_only() -> None:
    pend, cart = make_env("Pendulum-v1", seed=0), make_env("CartPole-v1", seed=0)
    assert env_kind(Spaces(pend.observation_space, pend.action_space)) == "continuous"
    assert env_kind(Spaces(cart.observation_space, cart.action_space)) == "discrete"
    hp = hparams.resolve("ppo", "Pendulum-v1", kind="continuous")
    assert hp["normalize_obs"] and hp["normalize_reward"] and hp["gamma"] == 0.9 and hp["epochs"] == 10
    assert not hparams.resolve("ppo", "CartPole-v1", kind="discrete")["normalize_obs"]
    assert hparams.resolve("a3c", "Pendulum-v1", kind="continuous")["normalize_obs"]
    off = hparams.resolve("ppo", "Pendulum-v1", {"normalize_obs": False, "normalize_reward": False}, kind="continuous")
    assert not off["normalize_obs"] and not off["normalize_reward"]
    # The launcher's up-front check resolves without the kind: the same keys, so --set is checked the same.
    assert set(hparams.resolve("ppo", "Pendulum-v1")) == set(hp)
    with pytest.raises(ValueError, match="normalize_obs must be true or false"):
        hparams.resolve("ppo", "Pendulum-v1", {"normalize_obs": "yes"})
    # Image observations are never normalised, whatever the hyper-parameter says.
    assert normalization((84, 84, 4), {"normalize_obs": True, "normalize_reward": True}) == (False, True)


# ------------------------------------------------------------------------------------------ what a peer sends
@pytest.fixture(scope="module")
def pend_learner() -> Any:
    """The built-in PPO's learner on Pendulum (normalising observations and returns), and its payload schema."""
    algorithm, model = builtin(PEND, env_id="Pendulum-v1")
    return learner_of(algorithm, model), dict(algorithm.payload({}, ()))


def segment(**change: Any) -> Message:
    """An honest Pendulum payload with normalisation moments, through the real encoder and decoder, with
    ``change`` applied to its arrays (``obs_count``, ``obs_mean``...) first (None removes)."""
    rng = np.random.default_rng(1)
    fields: dict[str, Any] = {"version": 0, "env_steps": STEPS}
    arrays: dict[str, np.ndarray] = {
        "obs": rng.standard_normal((STEPS, 3)).astype(np.float32), "actions": np.zeros((STEPS, 1), np.float32),
        "logp": np.full(STEPS, -1.0, np.float32), "advantages": np.zeros(STEPS, np.float32),
        "returns": np.zeros(STEPS, np.float32), "ep_returns": np.zeros(0), "ep_lengths": np.zeros(0, np.int32)}
    for prefix, m in (("obs", Moments.of(rng.standard_normal((STEPS, 3)))), ("ret", Moments.of(-rng.random((STEPS, 1))))):
        arrays.update(moments_arrays(prefix, m))
    for key, value in change.items():
        if value is None:
            arrays.pop(key)
        else:
            arrays[key] = value
    data = encode(MsgType.TRAJ, fields, arrays)
    return decode_payload(MsgType.TRAJ, memoryview(data)[HEADER_SIZE:])


def judged(msg: Message, pend_learner: Any) -> tuple[str, str] | None:
    """(reason, detail) of the master's refusal (the schema, then the learner's own check), or None."""
    learner, schema = pend_learner
    refusal = check_payload(msg, schema=schema, max_steps=STEPS)
    if refusal is not None:
        return refusal.reason, refusal.detail
    payload = Payload({k: v for k, v in msg.arrays.items() if not k.startswith("ep_")}, env_steps=STEPS)
    try:
        learner.check(payload)
    except Reject as exc:
        return exc.reason, exc.detail
    return None


def test_an_honest_segment_with_moments_passes(pend_learner: Any) -> None:
    assert judged(segment(), pend_learner) is None


@pytest.mark.parametrize("change,reason,why", [
    ({"obs_count": None}, "schema:obs_count", "is missing"),
    ({"obs_count": np.array([1.5])}, "bad_norm", "not a whole number"),
    ({"obs_count": np.array([STEPS + 1.0])}, "bad_norm", "not a whole number in [0, 32]"),  # more than its steps
    ({"ret_count": np.array([-1.0])}, "schema:ret_count", "below its bound"),
    ({"obs_mean": None}, "schema:obs_mean", "is missing"),
    ({"obs_mean": np.zeros(4)}, "schema:obs_mean", "shape"),
    ({"ret_m2": np.zeros(2)}, "schema:ret_m2", "shape"),
    ({"obs_m2": np.zeros(3, np.float32)}, "schema:obs_m2", "dtype"),
    ({"obs_m2": np.array([1.0, -1.0, 0.0])}, "schema:obs_m2", "below its bound"),
    ({"obs_mean": np.array([np.nan, 0.0, 0.0])}, "schema:obs_mean", "NaN"),
])
def test_bad_normalisation_fields_are_refused_with_a_reason(change: dict[str, Any], reason: str, why: str,
                                                             pend_learner: Any) -> None:
    got = judged(segment(**change), pend_learner)
    assert got is not None and got[0] == reason and why in got[1], got


def test_moments_where_the_run_does_not_normalise_are_refused() -> None:
    algorithm, _ = builtin(PEND, env_id="Pendulum-v1", hparams={"normalize_obs": False})
    got = check_payload(segment(), schema=dict(algorithm.payload({}, ())), max_steps=STEPS)
    assert got is not None and got.reason == "schema:obs_count" and "not in the algorithm's schema" in got.detail


@pytest.mark.parametrize("arrays,why", [
    ({}, "missing"),
    ({OBS_MEAN: np.zeros(3), OBS_VAR: np.ones(4), RET_VAR: np.ones(1)}, "shape"),
    ({OBS_MEAN: np.zeros(3), OBS_VAR: -np.ones(3), RET_VAR: np.ones(1)}, "negative"),
    ({OBS_MEAN: np.full(3, np.inf), OBS_VAR: np.ones(3), RET_VAR: np.ones(1)}, "finite"),
    ({OBS_MEAN: np.zeros(3), OBS_VAR: np.ones(3), RET_VAR: np.ones(1, np.int64)}, "finite floats"),
])
def test_a_group_refuses_bad_statistics_from_the_master(arrays: dict[str, np.ndarray], why: str) -> None:
    problem = check_stats(arrays, (3,), obs=True, ret=True)
    assert problem is not None and why in problem, problem
    good = {OBS_MEAN: np.zeros(3), OBS_VAR: np.ones(3), RET_VAR: np.ones(1)}
    assert check_stats(good, (3,), obs=True, ret=True) is None


# ------------------------------------------------------------------------------------------- kept and exported
def test_checkpoints_keep_the_running_statistics(tmp_path: Path) -> None:
    from worker.checkpoint import Checkpointer, Counters

    rng = np.random.default_rng(2)
    algorithm, model = builtin(PEND, env_id="Pendulum-v1")
    learner = learner_of(algorithm, model)
    norm = learner.norm
    for _ in range(3):
        learner.observe(Payload({**moments_arrays("obs", Moments.of(rng.normal(2.0, 3.0, (50, 3)))),
                                 **moments_arrays("ret", Moments.of(rng.normal(-5.0, 1.0, (50, 1))))}))
    ckpt = Checkpointer(tmp_path, learner.checkpoint(), window=10)
    learner.checkpoint()
    ckpt.save(Counters(env_steps=150, updates=3, version=3), [1.0])

    again = learner_of(*builtin(PEND, env_id="Pendulum-v1", seed=1))
    restored = Checkpointer(tmp_path, again.checkpoint(), window=10).restore_latest()
    assert restored is not None and restored[0].env_steps == 150
    again.restored()
    fresh = again.norm
    assert fresh.obs is not None and fresh.ret is not None and norm.obs is not None and norm.ret is not None
    assert fresh.obs.count == norm.obs.count == 150
    np.testing.assert_array_equal(fresh.obs.mean, norm.obs.mean)
    np.testing.assert_array_equal(fresh.obs.m2, norm.obs.m2)
    np.testing.assert_array_equal(fresh.ret.m2, norm.ret.m2)
    for a, b in zip(fresh.stats().arrays().values(), norm.stats().arrays().values()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(again.extras()["log_std"], learner.extras()["log_std"])

    # A checkpoint written without normalisation restores with empty statistics.
    old = tmp_path / "old"
    plain = learner_of(*builtin(PEND, env_id="Pendulum-v1", hparams={"normalize_obs": False,
                                                                     "normalize_reward": False}))
    Checkpointer(old, plain.checkpoint(), window=10).save(Counters(), [])
    empty = learner_of(*builtin(PEND, env_id="Pendulum-v1"))
    Checkpointer(old, empty.checkpoint(), window=10).restore_latest()
    empty.restored()
    assert empty.norm.obs is not None and empty.norm.obs.count == 0 and (empty.norm.stats().obs_var == 1).all()


def test_the_exported_keras_model_normalises_raw_observations_like_the_actors() -> None:
    _, model = builtin(PEND, env_id="Pendulum-v1", seed=3)
    pol = NumpyModel(to_program(model))
    pol.set_weights(get_weights(model), 0)
    stats = NormStats(np.array([0.5, -0.2, 1.0]), np.array([0.3, 0.6, 9.0]), 4.0)
    exported = with_normalization(model, stats.obs_mean, stats.obs_var)
    raw = np.random.default_rng(4).normal(0.0, 5.0, (64, 3)).astype(np.float32)  # some clip at +-10
    assert (np.abs(stats.obs(raw)) == CLIP_OBS).any()
    mean_keras, value_keras = exported(raw)
    mean_np, value_np = pol(stats.obs(raw))
    np.testing.assert_allclose(mean_keras.numpy(), mean_np, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(value_keras.numpy(), value_np, rtol=1e-4, atol=1e-5)
    assert with_normalization(model, None, None) is model


def test_a_group_swaps_in_statistics_with_the_weights_and_refuses_bad_ones(tmp_path: Path) -> None:
    """The group half of the exchange, on a real WorkerGroup (its envs built, no master needed): the built-in
    actor takes the statistics with the weights, and refuses bad ones before anything of the frame is taken."""
    from worker.contract import GroupAssignment, RunSpec
    from worker.group import WorkerGroup
    from worker.protocol import ProtocolError

    spec = RunSpec(run_id="g", env_id="Pendulum-v1", algo="ppo", seed=0, results_dir=str(tmp_path),
                   groups=(GroupAssignment(0, 2),))
    group = WorkerGroup(spec, 0, b"secret", ("127.0.0.1", 9))
    _, model = builtin(group.spaces, env_id="Pendulum-v1")
    group._set_up(Message(MsgType.SETUP, setup_fields(model, group.spaces.observation), {}))
    group._make_actor()
    assert group.actor.normalize == (True, True)
    weights = {k: np.zeros(v.shape, np.float32) for k, v in get_weights(model).items()}
    good = NormStats(np.array([0.1, 0.2, 0.3]), np.array([1.0, 2.0, 3.0]), 5.0)
    extras = {f"x/{k}": v for k, v in good.arrays().items()} | {"x/log_std": np.full(1, -0.5, np.float32)}
    group._take_weights(Message(MsgType.WEIGHTS, {"version": 4}, {**weights, **extras}))
    assert group.runtime is not None and group.runtime.version == 4 and group.actor.collector.norm.ret_var == 5.0
    np.testing.assert_array_equal(group.actor.collector.norm.obs_var, [1.0, 2.0, 3.0])
    bad = {**extras, f"x/{OBS_VAR}": np.array([1.0, -2.0, 3.0])}
    with pytest.raises(ProtocolError) as err:
        group._take_weights(Message(MsgType.WEIGHTS, {"version": 5}, {**weights, **bad}))
    assert err.value.reason == "bad_norm" and "negative variance" in err.value.detail
    assert group.runtime.version == 4  # nothing of the refused frame was taken
    np.testing.assert_array_equal(group.actor.collector.norm.obs_var, [1.0, 2.0, 3.0])
    missing = {k: v for k, v in extras.items() if k != f"x/{RET_VAR}"}
    with pytest.raises(ProtocolError, match="norm/ret_var is missing"):
        group._take_weights(Message(MsgType.WEIGHTS, {"version": 5}, {**weights, **missing}))
    group.envs.close()
