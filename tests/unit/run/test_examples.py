"""The examples (examples/*.py) in one process, no sockets: each actor's payloads pass the master's own checks
(:func:`worker.validate.check_payload`, with the example's schema and row limit) and its learner learns from
them; plus the return computation of the A3C example (the recipe's discount bug, fixed). The runs in containers
are tests/docker/test_examples.py.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from tests.helpers import ROOT
from worker.api import ActorContext, LearnerContext, Payload, Spaces
from worker.protocol import Message, MsgType
from worker.segments import EpisodeCounter
from worker.validate import EP_LENGTHS, EP_RETURNS, check_payload

A3C = f"{ROOT}/examples/a3c_parameter_server.py:A3CParameterServer"
DPPO = f"{ROOT}/examples/dppo_pendulum.py:DPPO"
SNAKE = f"{ROOT}/examples/snake_a2c.py:SnakeA2C"


def test_a3c_returns_discount_each_step_once_then_are_standardised() -> None:
    from worker.algorithms import load_algorithm

    module = sys.modules[load_algorithm(A3C).__module__]
    got = module.normalised_returns(np.ones(3, np.float32), 0.5)
    ret = np.array([1 + 0.5 + 0.25, 1 + 0.5, 1.0])  # the recipe's logspace gave 1 + 0.5**1.5 + 0.5**3 first
    np.testing.assert_allclose(got, (ret - ret.mean()) / ret.std(), rtol=1e-5)


def in_process(ref: str, env_id: str, k: int, overrides: dict[str, Any]) -> tuple[Any, Any, Any, Any, Any]:
    """(algorithm, actor, learner, the group's counted envs, the learner's model), wired as a run wires them:
    the group acts with the numpy program the master converted from the model."""
    from worker.acting import ActingRuntime, Setup
    from worker.algorithms import build_model, load_algorithm, resolve_hparams
    from worker.envs import make_vector_env
    from worker.keras_convert import convert, get_weights, weight_names

    cls = load_algorithm(ref)
    envs = EpisodeCounter(make_vector_env(env_id, k))
    spaces = Spaces(envs.single_observation_space, envs.single_action_space)
    hp = resolve_hparams(cls, ref, env_id, spaces, overrides)
    algo = cls(spaces, hp, num_workers=k)
    model = build_model(algo, None, 0)
    variables = dict(zip(weight_names(model), model.weights))
    trainable = tuple(n for n, v in variables.items() if v.trainable)
    learner = algo.learner(LearnerContext(spaces=spaces, hparams=hp, model=model, variables=variables,
                                          trainable=trainable, seed=0, num_workers=k, algorithm=algo))
    conversion = convert(model, spaces.observation, seed=0)
    assert conversion.program is not None, conversion.reason  # every example acts in numpy in the groups
    setup = Setup("numpy", conversion.reason, tuple((n, tuple(v.shape)) for n, v in variables.items()), trainable,
                  False, conversion.program)
    runtime = ActingRuntime(setup, lambda: build_model(algo, None, 0))
    runtime.swap_in(get_weights(model), 0)
    actor = algo.actor(ActorContext(spaces=spaces, hparams=hp, envs=envs, num_envs=k, group=0, seed=0,
                                    policy=runtime.policy, rng=np.random.default_rng(0), algorithm=algo,
                                    _runtime=runtime))
    return algo, actor, learner, envs, model


@pytest.mark.parametrize("ref,env_id,k,overrides,payloads", [
    (A3C, "CartPole-v1", 2, {}, 3),
    (DPPO, "Pendulum-v1", 2, {"max_qsize": 4, "jit_compile": False}, 2),
    (SNAKE, "launcher/Snake-v0", 4, {"batch_steps": 400}, 2),
    (SNAKE, "launcher/Snake-v0", 4, {"batch_steps": 400, "target": "gae"}, 2),
])
def test_example_payloads_pass_the_masters_checks_and_move_the_weights(
        ref: str, env_id: str, k: int, overrides: dict[str, Any], payloads: int) -> None:
    from worker.keras_convert import get_weights

    algo, actor, learner, envs, model = in_process(ref, env_id, k, overrides)
    shapes = {n: tuple(v.shape) for n, v in learner.ctx.variables.items()}
    schema = algo.payload(shapes, learner.ctx.trainable)
    taken = []
    for _ in range(payloads):
        arrays = dict(actor.collect())
        steps, returns, lengths = envs.take()
        episodes = {EP_RETURNS: np.asarray(returns, np.float64), EP_LENGTHS: np.asarray(lengths, np.int32)}
        msg = Message(MsgType.TRAJ, {"version": 0, "env_steps": steps}, {**arrays, **episodes})
        assert steps > 0
        assert check_payload(msg, schema=schema, max_steps=algo.max_rows(k)) is None
        taken.append(Payload(arrays, env_steps=steps))
    before = get_weights(model)
    stats = learner.update(taken)
    after = get_weights(model)
    assert stats and all(np.isfinite(v) for v in stats.values()), stats
    assert any(not np.allclose(before[n], after[n]) for n in learner.ctx.trainable), "the update changed nothing"


def test_snake_targets_are_the_recipes_a_step_is_1_when_a_fruit_follows_before_the_end() -> None:
    """Every step the Snake actor plays is sent exactly once, with the recipe's target: 1 when the snake eats
    a fruit at it or later without its episode ending between, 0 when the episode ends first. A step whose
    target is not known yet waits for the next payload (at most 100: the env ends an episode 100 steps
    without fruit)."""
    _, actor, _, envs, _ = in_process(SNAKE, "launcher/Snake-v0", 3, {"batch_steps": 600})
    played = sent = 0
    seen: set[float] = set()
    for _ in range(4):
        arrays = actor.collect()
        labels = arrays["labels"]
        assert len(labels) == len(arrays["obs"]) == len(arrays["actions"])
        seen |= set(np.unique(labels).tolist())
        sent += len(labels)
        played += envs.take()[0]
        assert sent + sum(len(p) for p in actor.pending) == played
        assert all(len(p) <= 100 for p in actor.pending)
    assert seen == {0.0, 1.0}, f"targets seen: {seen} (a random snake eats ~0.18 fruit in ~15 steps)"


def test_snake_gae_target_sends_every_step_of_the_round_at_once() -> None:
    """With ``target=gae`` (the departure that reaches the target) nothing waits for a fruit: each payload holds
    exactly the steps played, with bootstrapped targets that are not the recipe's 0/1 labels."""
    _, actor, _, envs, _ = in_process(SNAKE, "launcher/Snake-v0", 3, {"batch_steps": 600, "target": "gae"})
    for _ in range(2):
        arrays = actor.collect()
        assert len(arrays["labels"]) == len(arrays["advantages"]) == envs.take()[0] > 0
        assert all(len(p) == 0 for p in actor.pending)
        assert np.isfinite(arrays["labels"]).all() and np.isfinite(arrays["advantages"]).all()
        assert not set(np.unique(arrays["labels"]).tolist()) <= {0.0, 1.0}
