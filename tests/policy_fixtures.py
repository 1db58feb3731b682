"""A run's exported policy made without a run: the model a built-in algorithm builds for an env, converted and
written as the master writes it (``model/policy.json``, ``model/policy.npz``). For eval and export tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from worker.contract import RunFiles


def export_builtin_policy(run: Path, env_id: str, *, algo: str = "ppo", seed: int = 0,
                          scale: float | None = None) -> dict[str, np.ndarray]:
    """Write ``run/model/policy.{json,npz}`` for ``algo``'s default model on ``env_id`` (weights as initialised
    with ``seed``, or drawn from N(0, ``scale``)); returns the weights by name."""
    from worker.algorithms import build_model, load_algorithm, resolve_hparams
    from worker.api import Spaces
    from worker.envs import make_env
    from worker.keras_convert import convert, get_weights, weight_names
    from worker.reporting import policy_doc, write_policy_doc

    env = make_env(env_id, seed=0)
    spaces = Spaces(env.observation_space, env.action_space)
    env.close()
    cls = load_algorithm(algo)
    algorithm = cls(spaces, resolve_hparams(cls, algo, env_id, spaces, {}))
    model = build_model(algorithm, None, seed)
    conversion = convert(model, spaces.observation)
    weights = get_weights(model)
    if scale is not None:
        rng = np.random.default_rng(seed)
        weights = {k: rng.normal(0, scale, v.shape).astype(np.float32) for k, v in weights.items()}
    files = RunFiles(run)
    write_policy_doc(files, policy_doc(env_id=env_id, algo=algo, version=0, policy_output=0, spaces=spaces,
                                       names=weight_names(model), program=conversion.program,
                                       acting={"path": "numpy", "reason": conversion.reason}))
    np.savez(files.model_dir / "policy.npz", **weights)  # type: ignore[arg-type]
    return weights


def builtin(spaces_or_env: Any, *, algo: str = "ppo", env_id: str = "CartPole-v1", seed: int = 0,
            hparams: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """(the built-in ``algo`` for these spaces, the Keras model it builds, seeded)."""
    from worker.algorithms import build_model, load_algorithm, resolve_hparams
    from worker.api import Spaces

    if isinstance(spaces_or_env, Spaces):
        spaces = spaces_or_env
    elif hasattr(spaces_or_env, "single_observation_space"):  # a vector env
        spaces = Spaces(spaces_or_env.single_observation_space, spaces_or_env.single_action_space)
    else:
        spaces = Spaces(spaces_or_env.observation_space, spaces_or_env.action_space)
    cls = load_algorithm(algo)
    algorithm = cls(spaces, resolve_hparams(cls, algo, env_id, spaces, hparams or {}))
    return algorithm, build_model(algorithm, None, seed)


def setup_fields(model: Any, observation_space: Any) -> dict[str, Any]:
    """The fields of the SETUP frame a master sends for ``model`` when it acts in numpy."""
    from worker.keras_convert import convert, weight_names

    conversion = convert(model, observation_space)
    assert conversion.program is not None, conversion.reason
    return {"acting": "numpy", "reason": conversion.reason, "program": conversion.program.to_dict(),
            "weights": [[n, list(v.shape)] for n, v in zip(weight_names(model), model.weights)],
            "trainable": [n for n, v in zip(weight_names(model), model.weights) if v.trainable]}


def numpy_context(algorithm: Any, model: Any, *, envs: Any = None, seed: int = 0, version: int = 0) -> Any:
    """The :class:`worker.api.ActorContext` a group gives its actor when the model acts in numpy: the model
    converted (and checked against Keras) and its current weights swapped in as ``version``."""
    from worker.acting import ActingRuntime, Setup
    from worker.api import ActorContext
    from worker.keras_convert import get_weights

    setup = Setup.from_fields(setup_fields(model, algorithm.spaces.observation))
    runtime = ActingRuntime(setup, lambda: model)
    runtime.swap_in(get_weights(model), version)
    return ActorContext(spaces=algorithm.spaces, hparams=algorithm.hp, envs=envs,
                        num_envs=getattr(envs, "num_envs", 1), group=0, seed=seed, policy=runtime.policy,
                        rng=np.random.default_rng(seed), algorithm=algorithm, _runtime=runtime)


def learner_of(algorithm: Any, model: Any, *, seed: int = 0) -> Any:
    """The algorithm's learner in a :class:`worker.api.LearnerContext` as the master makes it."""
    from worker.api import LearnerContext
    from worker.keras_convert import weight_names

    variables = dict(zip(weight_names(model), model.weights))
    ctx = LearnerContext(spaces=algorithm.spaces, hparams=algorithm.hp, model=model, variables=variables,
                         trainable=tuple(n for n, v in variables.items() if v.trainable), seed=seed, num_workers=1,
                         algorithm=algorithm)
    return algorithm.learner(ctx)


def policy_of(ctx: Any, dtype: str) -> Any:
    """The built-in actor-critic policy acting through ``ctx`` (a :func:`numpy_context`), as the group's
    segment actor makes it."""
    from worker.algorithms.actor_critic import ActorCriticPolicy

    return ActorCriticPolicy(ctx.policy, ctx.spaces, dtype, log_std_init=float(ctx.hparams.get("log_std_init", -0.5)),
                             version=lambda: ctx.version)
