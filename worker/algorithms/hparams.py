"""Hyper-parameters: the :class:`HParam` declaration every algorithm uses, how values are resolved and checked,
and the built-in algorithms' tables (defaults per algorithm, adjusted per kind of environment and per env).

Precedence, lowest first: the algorithm's declared defaults < its per-env tuning (for the built-ins:
``KIND_DEFAULTS[kind][algo]`` then ``ENV_OVERRIDES[env][algo]``) < ``--set``. The kind (``discrete``,
``continuous``, ``image``) comes from the env's spaces, which only the run's processes build; the launcher's
up-front check of a built-in resolves without it (the kind changes values, never which keys exist, so what it
accepts the run accepts).

Standard library only: the launcher's up-front check (:mod:`launcher.config.checks`) imports this module, so that
it refuses, before anything starts, what the master would refuse. It imports :mod:`worker.contract` and never the
reverse: the contract is the bottom layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from worker.contract import plain_env_id


@dataclass(frozen=True)
class HParam:
    """One hyper-parameter: its default (whose type ``--set`` values are read as: int, float, bool, str or a
    tuple of ints) and a one-line doc (``launcher up --algo X --set help`` lists them)."""

    default: Any
    doc: str


def defaults_of(declared: Mapping[str, HParam]) -> dict[str, Any]:
    return {k: h.default for k, h in declared.items()}


def merge(declared: Mapping[str, Any], overrides: Mapping[str, Any] | None, *, algo: str) -> dict[str, Any]:
    """``declared`` (resolved defaults) with ``overrides`` read as the defaults' types.

    Raises:
        ValueError: an unknown key (listing the known ones) or a value that is not of the default's type.
    """
    hp = dict(declared)
    for key, value in (overrides or {}).items():
        if key not in hp:
            raise ValueError(f"unknown {algo} hyper-parameter {key!r}; known: {', '.join(sorted(hp))}")
        default = hp[key]
        try:
            if isinstance(default, bool) or default is None:
                hp[key] = value
            elif isinstance(default, int) and not isinstance(value, bool):
                hp[key] = int(value)
            elif isinstance(default, float):
                hp[key] = float(value)
            elif isinstance(default, tuple):
                hp[key] = tuple(int(v) for v in value)
            elif isinstance(default, str) and not isinstance(value, str):
                hp[key] = str(value).lower() if isinstance(value, float) else str(value)  # --set x=nan is 'nan'
            else:
                hp[key] = value
        except (TypeError, ValueError):
            raise ValueError(f"{algo} hyper-parameter {key}={value!r} is not a {type(default).__name__} "
                             f"(default {default!r})") from None
    return hp


def help_text(algo: str, docs: Mapping[str, str], values: Mapping[str, Any], env_id: str) -> str:
    """The hyper-parameter list ``launcher up --set help`` prints: name, value for ``env_id``, one-line doc."""
    width = max((len(k) for k in docs), default=4)
    lines = [f"hyper-parameters of {algo} on {env_id} (set with --set NAME=VALUE, or [up.hparams] in launcher.toml):"]
    for name in sorted(docs):
        value = values.get(name)
        lines.append(f"  {name:<{width}}  {value!r:<12}  {docs[name]}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- the built-ins' tables
COMMON: dict[str, HParam] = {
    "gamma": HParam(0.99, "discount factor"),
    "gae_lambda": HParam(0.95, "GAE lambda (1.0: plain discounted returns minus the value)"),
    "lr": HParam(1e-3, "Adam learning rate"),
    "ent_coef": HParam(0.0, "entropy bonus coefficient"),
    "vf_coef": HParam(0.5, "value loss coefficient"),
    "max_grad_norm": HParam(0.5, "gradients are clipped to this global norm"),
    "hidden": HParam((64, 64), "units of each hidden layer of the built-in MLP (policy and value towers)"),
    "sync": HParam(False, "true: groups wait for new weights after each segment (lag 0); false: they collect "
                          "the next one meanwhile (lag <= 1 round, corrected by the learner)"),
    "normalize_obs": HParam(False, "running observation normalisation (on by default for continuous control)"),
    "normalize_reward": HParam(False, "rewards scaled by the running return's standard deviation"),
    "log_std_init": HParam(-0.5, "initial log standard deviation of the Gaussian policy (Box actions)"),
    "lr_schedule": HParam("constant", "constant, or linear: lr falls to 0 at --max-steps"),
}

DECLARED: dict[str, dict[str, HParam]] = {
    "ppo": {**COMMON,
            "n_steps": HParam(64, "steps each env of a group plays per segment"),
            "epochs": HParam(4, "passes over each round's data (0: learning off, for benchmarks)"),
            "minibatches": HParam(4, "minibatches per epoch"),
            "clip": HParam(0.2, "PPO clipping range"),
            "max_queue": HParam(64, "update once this many groups' segments are waiting"),
            "max_staleness": HParam(2, "segments more than this many versions behind the learner are dropped"),
            "update_wait_s": HParam(5.0, "update once the first segment of a round has waited this long"),
            "rho_bar": HParam(1.0, "truncation of the importance weight of a lagging segment (V-trace's rho-bar)"),
            "jit_compile": HParam(False, "compile the update with XLA (faster per update, seconds to compile)")},
    "a3c": {**COMMON,
            "n_steps": HParam(32, "steps each env of a group plays per gradient"),
            "gae_lambda": HParam(1.0, COMMON["gae_lambda"].doc),
            "ent_coef": HParam(0.001, COMMON["ent_coef"].doc),
            "max_staleness": HParam(32, "gradients on weights more than this many versions old are dropped")},
}
DEFAULTS: dict[str, dict[str, Any]] = {algo: defaults_of(d) for algo, d in DECLARED.items()}

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


def tuned(algo: str, env_id: str, kind: str | None) -> dict[str, Any]:
    """A built-in's defaults for one env: its kind's, then the env's own (no ``--set``)."""
    hp: dict[str, Any] = {}
    if kind is not None:
        hp.update(KIND_DEFAULTS.get(kind, {}).get(algo, {}))
    hp.update(ENV_OVERRIDES.get(plain_env_id(env_id), {}).get(algo, {}))
    return hp


def problems(algo: str, hp: Mapping[str, Any]) -> list[str]:
    """What is wrong with a built-in's resolved hyper-parameters (each a sentence with the value seen)."""
    found = []
    for key in ("lr", "n_steps", "gamma"):
        if not hp[key] > 0:
            found.append(f"{key} must be > 0, got {hp[key]}")
    if not 0 < hp["gamma"] <= 1:
        found.append(f"gamma must be in (0, 1], got {hp['gamma']}")
    # epochs = 0 collects without learning (weights are re-broadcast unchanged): the actor-efficiency
    # benchmark uses it to measure acting and transport alone.
    if algo == "ppo" and not (hp["epochs"] >= 0 and hp["minibatches"] >= 1):
        found.append(f"epochs must be >= 0 and minibatches >= 1, got {hp['epochs']} and {hp['minibatches']}")
    for key in ("sync", "normalize_obs", "normalize_reward"):
        if not isinstance(hp[key], bool):
            found.append(f"{key} must be true or false, got {hp[key]!r}")
    if hp["lr_schedule"] not in ("constant", "linear"):
        found.append(f"lr_schedule must be constant or linear, got {hp['lr_schedule']!r}")
    if algo == "ppo" and not hp["rho_bar"] > 0:
        found.append(f"rho_bar must be > 0, got {hp['rho_bar']}")
    return found


def resolve(algo: str, env_id: str, overrides: Mapping[str, Any] | None = None, *,
            kind: str | None = None) -> dict[str, Any]:
    """A built-in's hyper-parameters for (algo, env) with ``overrides`` applied.

    Args:
        kind: the env's kind (``discrete``, ``continuous``, ``image``), for :data:`KIND_DEFAULTS`; None leaves them out.

    Raises ValueError on unknown algorithms or keys, and on bad values.
    """
    if algo not in DEFAULTS:
        raise ValueError(f"unknown algorithm {algo!r}; choose one of {', '.join(DEFAULTS)}")
    hp = merge({**DEFAULTS[algo], **tuned(algo, env_id, kind)}, overrides, algo=algo)
    found = problems(algo, hp)
    if found:
        raise ValueError("; ".join(found))
    return hp
