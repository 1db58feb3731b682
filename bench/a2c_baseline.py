"""The baseline every time-to-solve figure is divided by: a tuned single-process A2C.

Same env, same network (worker.models: 64-64 tanh towers), 8 envs stepped as one vector env exactly as a
worker group steps them (``worker.envs.make_vector_env``: gymnasium's own numpy CartPole), numpy
inference, a TF train step, no transport. This is the best a user gets from one process on this machine;
the launcher has to beat it by using both cores.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import numpy as np


@dataclass
class SolveResult:
    solved: bool
    wall_s: float
    env_steps: int
    mean_return: float


def solve_cartpole(seed: int, *, target: float = 475.0, window: int = 100, n_envs: int = 8, n_steps: int = 32,
                   lr: float = 1e-3, max_steps: int = 1_000_000, time_limit_s: float = 300.0) -> SolveResult:
    """Train A2C on CartPole-v1 until the mean of the last ``window`` returns reaches ``target``."""
    t0 = time.perf_counter()
    import tensorflow as tf

    import keras

    from worker.algorithms.a3c_grads import A3CGradients
    from worker.algorithms.actor_critic import ActorCriticPolicy
    from worker.algorithms.rollout import Collector
    from worker.api import Spaces
    from worker.envs import make_vector_env
    from worker.keras_convert import get_weights, to_program, weight_names
    from worker.models import Architecture, build_keras_model
    from worker.numpy_model import NumpyModel

    envs = make_vector_env("CartPole-v1", n_envs)
    spaces = Spaces(envs.single_observation_space, envs.single_action_space)
    hp = {"vf_coef": 0.5, "ent_coef": 0.001}
    keras.utils.set_random_seed(seed)
    model = build_keras_model(Architecture.for_spaces(spaces.observation, spaces.action))
    names = [n for n, v in zip(weight_names(model), model.weights) if v.trainable]
    # One model: compute gradients and apply them in place.
    learner = A3CGradients(model, names, hp, continuous=False, n_outputs=spaces.n_actions)
    opt = tf.keras.optimizers.Adam(learning_rate=lr, epsilon=1e-5)
    variables = learner.variables
    numpy_model = NumpyModel(to_program(model))  # numpy inference, as a group acts
    numpy_model.set_weights(get_weights(model), 0)
    policy = ActorCriticPolicy(numpy_model, spaces, "float32")
    collector = Collector(envs, policy, gamma=0.99, lam=1.0, seed=seed * 100)
    recent: collections.deque[float] = collections.deque(maxlen=window)
    version = 0

    @tf.function(reduce_retracing=True)
    def apply(grads: list[tf.Tensor]) -> None:
        clipped, _ = tf.clip_by_global_norm(grads, 0.5)
        opt.apply_gradients(zip(clipped, variables))

    while collector.total_steps < max_steps and time.perf_counter() - t0 < time_limit_s:
        seg = collector.collect(n_steps)
        recent.extend(seg.episode_returns)
        if len(recent) >= window and np.mean(recent) >= target:
            return SolveResult(True, time.perf_counter() - t0, collector.total_steps, float(np.mean(recent)))
        batch = seg.flat()
        g, _, _, _ = learner._grads(batch["obs"], batch["actions"], batch["advantages"], batch["returns"])
        apply(list(g))
        version += 1
        numpy_model.set_weights(get_weights(model), version)
    return SolveResult(False, time.perf_counter() - t0, collector.total_steps, float(np.mean(recent)) if recent else 0.0)


if __name__ == "__main__":
    import sys

    r = solve_cartpole(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    print(r)
