"""Hyper-parameter defaults, per algorithm, with adjustments per kind of environment and per env, and their
validation.

Precedence, lowest first: ``DEFAULTS[algo]`` < ``KIND_DEFAULTS[kind][algo]`` < ``ENV_OVERRIDES[env][algo]`` <
``--set``. The kind (``discrete``, ``continuous``, ``image``: :func:`worker.models.env_kind`) comes from the
env's spaces, which only the run's processes build; the launcher's up-front check resolves without it (the
kind changes values, never which keys exist, so what it accepts the run accepts).
"""

from __future__ import annotations

from typing import Any, Mapping

from worker.contract import plain_env_id

COMMON: dict[str, Any] = {
    "gamma": 0.99,
    "gae_lambda": 0.95,
    "lr": 1e-3,
    "ent_coef": 0.0,
    "vf_coef": 0.5,
    "max_grad_norm": 0.5,
    "hidden": (64, 64),
    # False: groups collect the next segment while the master learns (policy lag <= 1 round, corrected by
    # the learner). True: the strictly synchronous round (groups wait for the new weights; lag 0).
    "sync": False,
    # Running observation normalisation and return-based reward scaling (worker/normalize.py); on by
    # default for continuous control (KIND_DEFAULTS). Image observations are never normalised.
    "normalize_obs": False,
    "normalize_reward": False,
    # The Gaussian policy's initial log standard deviation (Box actions; state-independent, trained).
    "log_std_init": -0.5,
    # "constant", or "linear": lr falls linearly to 0 at --max-steps (a run without a step limit keeps it).
    "lr_schedule": "constant",
}

DEFAULTS: dict[str, dict[str, Any]] = {
    # PPO: each group sends n_steps x its workers per round; the master updates once every connected
    # group has sent a segment (or max_queue segments are waiting), then broadcasts the new weights.
    # Segments more than max_staleness versions behind the learner are dropped (counted); younger ones
    # are corrected with importance weights truncated at rho_bar (V-trace's rho-bar; see ppo.py).
    "ppo": {**COMMON, "n_steps": 64, "epochs": 4, "minibatches": 4, "clip": 0.2, "max_queue": 64,
            "max_staleness": 2, "update_wait_s": 5.0, "rho_bar": 1.0, "jit_compile": False},
    # A3C: each group computes a gradient on n_steps x its workers and pushes it; the master applies it
    # at once and answers with the current weights (asynchronous across groups).
    "a3c": {**COMMON, "n_steps": 32, "gae_lambda": 1.0, "lr": 1e-3, "ent_coef": 0.001, "max_staleness": 32},
}

KIND_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    # Box actions (MuJoCo-style control): the pieces of the strong PPO baselines (SB3/rl-baselines3-zoo,
    # cleanrl's ppo_continuous_action): normalised observations and scaled rewards, 10 epochs over larger
    # rounds (256 steps x workers per group) in 8 minibatches. Measured on Pendulum-v1: see ENV_OVERRIDES.
    "continuous": {
        "ppo": {"normalize_obs": True, "normalize_reward": True, "n_steps": 256, "epochs": 10, "minibatches": 8,
                "lr_schedule": "linear"},
        "a3c": {"normalize_obs": True, "normalize_reward": True},
    },
}

ENV_OVERRIDES: dict[str, dict[str, dict[str, Any]]] = {
    # rl-baselines3-zoo's Pendulum-v1 values: a short horizon (gamma 0.9) fits a task whose reward is the
    # current angle and speed; with 0.99 PPO is still at about -550 after 600 k steps.
    "Pendulum-v1": {"ppo": {"gamma": 0.9}, "a3c": {"gamma": 0.9}},
    # flappy_bird_gymnasium:FlappyBird-v0 (use_lidar=false): with A3C's CartPole entropy (0.001) the policy
    # collapsed to one action within 3 M steps (0 pipes); entropy 0.02 and lr 5e-4 (Snake's A3C values) passed
    # 7.3 pipes per greedy episode at 3 M steps (docs/environments.md). PPO's defaults reach 38.
    "FlappyBird-v0": {"a3c": {"ent_coef": 0.02, "lr": 5e-4}},
    "launcher/Snake-v0": {
        # sync: measured on this machine (seed 0, docs/benchmarks.md), overlapped collection reached 2.0-2.7
        # fruit at 300 k steps against 2.75 synchronous, and 7.4 at 750 k against the documented 13.0; Snake
        # keeps the documented synchronous round until a multi-seed study says otherwise (--set sync=false).
        "ppo": {"n_steps": 128, "lr": 5e-4, "ent_coef": 0.01, "gamma": 0.97, "sync": True},
        "a3c": {"n_steps": 32, "lr": 5e-4, "ent_coef": 0.02, "gamma": 0.97},
    },
}


def resolve(algo: str, env_id: str, overrides: Mapping[str, Any] | None = None, *,
            kind: str | None = None) -> dict[str, Any]:
    """Defaults for (algo, env) with ``overrides`` applied.

    Args:
        kind: the env's kind (:func:`worker.models.env_kind`), for :data:`KIND_DEFAULTS`; None leaves them out.

    Raises ValueError on unknown keys or bad values.
    """
    if algo not in DEFAULTS:
        raise ValueError(f"unknown algorithm {algo!r}; choose one of {', '.join(DEFAULTS)}")
    hp = dict(DEFAULTS[algo])
    if kind is not None:
        hp.update(KIND_DEFAULTS.get(kind, {}).get(algo, {}))
    hp.update(ENV_OVERRIDES.get(plain_env_id(env_id), {}).get(algo, {}))
    for key, value in (overrides or {}).items():
        if key not in hp:
            raise ValueError(f"unknown {algo} hyper-parameter {key!r}; known: {', '.join(sorted(hp))}")
        default = hp[key]
        if isinstance(default, bool) or default is None:
            hp[key] = value
        elif isinstance(default, int) and not isinstance(value, bool):
            hp[key] = int(value)
        elif isinstance(default, float):
            hp[key] = float(value)
        elif isinstance(default, tuple):
            hp[key] = tuple(int(v) for v in value)
        else:
            hp[key] = value
    problems = []
    for key in ("lr", "n_steps", "gamma"):
        if not hp[key] > 0:
            problems.append(f"{key} must be > 0, got {hp[key]}")
    if not 0 < hp["gamma"] <= 1:
        problems.append(f"gamma must be in (0, 1], got {hp['gamma']}")
    # epochs = 0 collects without learning (weights are re-broadcast unchanged): the actor-efficiency
    # benchmark uses it to measure acting and transport alone.
    if algo == "ppo" and not (hp["epochs"] >= 0 and hp["minibatches"] >= 1):
        problems.append(f"epochs must be >= 0 and minibatches >= 1, got {hp['epochs']} and {hp['minibatches']}")
    for key in ("sync", "normalize_obs", "normalize_reward"):
        if not isinstance(hp[key], bool):
            problems.append(f"{key} must be true or false, got {hp[key]!r}")
    if hp["lr_schedule"] not in ("constant", "linear"):
        problems.append(f"lr_schedule must be constant or linear, got {hp['lr_schedule']!r}")
    if algo == "ppo" and not hp["rho_bar"] > 0:
        problems.append(f"rho_bar must be > 0, got {hp['rho_bar']}")
    if problems:
        raise ValueError("; ".join(problems))
    return hp
