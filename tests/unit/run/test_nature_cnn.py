"""The Nature CNN for Atari-style frames (issue 15 item 4): chosen for 84x84x4 uint8 observations in either
channel layout, its shapes, and the actors' numpy program equal to the learner's Keras model."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.wrappers import FrameStackObservation

from tests.policy_fixtures import builtin, numpy_context, policy_of
from worker.api import Spaces
from worker.keras_convert import get_weights, to_program
from worker.models import Architecture
from worker.numpy_model import OPS, NumpyModel


class Frames(gym.Env[np.ndarray, int]):
    """What ``AtariPreprocessing`` hands on: 84x84 grey uint8 frames (the Atari env itself is another
    engineer's, in worker/envs/; this stand-in has its spaces)."""

    observation_space = spaces.Box(0, 255, (84, 84), np.uint8)
    action_space = spaces.Discrete(6)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        return self.observation_space.sample(), 0.0, False, False, {}


def test_frame_stacks_get_the_nature_cnn_in_either_layout() -> None:
    stacked = FrameStackObservation(Frames(), 4)
    assert stacked.observation_space.shape == (4, 84, 84)  # gymnasium stacks channels first
    first = Architecture.for_spaces(stacked.observation_space, stacked.action_space)
    assert first.kind == "nature" and first.channels_first and first.image_shape == (84, 84, 4)
    assert first.obs_scale == pytest.approx(1 / 255) and first.dense_units == 512
    last = Architecture.for_spaces(spaces.Box(0, 255, (84, 84, 4), np.uint8), spaces.Discrete(6))
    assert last.kind == "nature" and not last.channels_first
    # Small grids (Snake) keep the small stride-1 torso, float observations no scaling.
    snake = Architecture.for_spaces(spaces.Box(0.0, 1.0, (10, 10, 3), np.float32), spaces.Discrete(4))
    assert snake.kind == "cnn" and not snake.channels_first and snake.obs_scale == 1.0


FRAMES = Spaces(spaces.Box(0, 255, (4, 84, 84), np.uint8), spaces.Discrete(6))


def test_nature_cnn_shapes() -> None:
    _, model = builtin(FRAMES)
    shapes = {k: tuple(v.shape) for k, v in get_weights(model).items()}
    assert shapes["conv0/kernel"] == (8, 8, 4, 32) and shapes["conv1/kernel"] == (4, 4, 32, 64)
    assert shapes["conv2/kernel"] == (3, 3, 64, 64)
    assert shapes["dense0/kernel"] == (7 * 7 * 64, 512)  # 84 -> 20 -> 9 -> 7
    assert shapes["pi_out/kernel"] == (512, 6) and shapes["v_out/kernel"] == (512, 1)
    out, value = model(np.zeros((2, 4, 84, 84), np.uint8))
    assert tuple(out.shape) == (2, 6) and tuple(value.shape) == (2,)


@pytest.mark.parametrize("shape", [(4, 84, 84), (84, 84, 4)], ids=["channels-first", "channels-last"])
def test_numpy_forward_equals_keras_on_uint8_frames(shape: tuple[int, ...]) -> None:
    _, model = builtin(Spaces(spaces.Box(0, 255, shape, np.uint8), spaces.Discrete(6)), seed=1)
    pol = NumpyModel(to_program(model))  # channels first: a Permute layer, converted like any other
    pol.set_weights(get_weights(model), 0)
    frames = np.random.default_rng(0).integers(0, 256, (8, *shape), dtype=np.uint8)
    out, value = model(frames)
    out_np, value_np = pol(frames)
    np.testing.assert_allclose(out_np, out.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(value_np, value.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stride", [1, 2, 4])
def test_strided_convolution_against_a_direct_loop(stride: int) -> None:
    rng = np.random.default_rng(stride)
    x = rng.standard_normal((2, 11, 13, 3)).astype(np.float32)
    k = rng.standard_normal((3, 3, 3, 5)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    def conv(inp: np.ndarray) -> np.ndarray:
        return OPS["Conv2D"]({"strides": [stride, stride], "padding": "valid", "activation": "linear"}, [k, b], [inp])[0]

    got = conv(x)
    ho, wo = (11 - 3) // stride + 1, (13 - 3) // stride + 1
    want = np.empty((2, ho, wo, 5), np.float32)
    for i in range(ho):
        for j in range(wo):
            patch = x[:, i * stride:i * stride + 3, j * stride:j * stride + 3, :]
            want[:, i, j] = np.tensordot(patch, k, axes=([1, 2, 3], [0, 1, 2])) + b
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    permuted = OPS["Permute"]({"dims": [2, 3, 1]}, [], [np.ascontiguousarray(x.transpose(0, 3, 1, 2))])[0]
    np.testing.assert_allclose(conv(permuted), want, rtol=1e-5, atol=1e-5)


def test_frames_travel_as_bytes_and_the_learner_takes_them() -> None:
    """Frames stay uint8 from the env to the learner (a quarter of float32's bytes on the wire); the
    network converts them itself."""
    from gymnasium.vector import AutoresetMode, SyncVectorEnv

    from worker.algorithms.actor_critic import obs_dtype
    from worker.algorithms.ppo_update import PPOLearner
    from worker.algorithms.rollout import Collector
    from worker.protocol import Message, MsgType
    from worker.validate import check_payload

    vec = SyncVectorEnv([lambda: FrameStackObservation(Frames(), 4) for _ in range(2)],
                        autoreset_mode=AutoresetMode.SAME_STEP)
    algorithm, model = builtin(Spaces(vec.single_observation_space, vec.single_action_space), env_id="Frames-v0")
    assert obs_dtype(algorithm.spaces, algorithm.hp) == "uint8"
    hp = {"lr": 1e-4, "clip": 0.2, "vf_coef": 0.5, "ent_coef": 0.01, "max_grad_norm": 0.5, "epochs": 1, "minibatches": 2}
    learner = PPOLearner(model, hp, 0, continuous=False, n_outputs=6, obs_shape=(4, 84, 84), obs_dtype="uint8")
    pol = policy_of(numpy_context(algorithm, model), "uint8")
    seg = Collector(vec, pol, gamma=0.99, lam=0.95, seed=0).collect(4)
    batch = seg.flat()
    assert batch["obs"].dtype == np.uint8 and batch["obs"].shape == (8, 4, 84, 84)
    arrays = {**batch, "ep_returns": np.zeros(0), "ep_lengths": np.zeros(0, np.int32)}
    msg = Message(MsgType.TRAJ, {"version": 0, "env_steps": 8}, arrays)
    schema = dict(algorithm.payload({}, ()))
    assert check_payload(msg, schema=schema, max_steps=8) is None
    as_float = Message(MsgType.TRAJ, msg.fields, {**arrays, "obs": batch["obs"].astype(np.float32)})
    refused = check_payload(as_float, schema=schema, max_steps=8)
    assert refused is not None and refused.reason == "schema:obs" and "dtype float32" in refused.detail
    stats = learner.update(batch)
    assert np.isfinite(list(stats.values())).all()
