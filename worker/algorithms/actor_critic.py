"""What the built-in PPO and A3C share, written on the public API (:mod:`worker.api`) like any user's algorithm:
the default network, the per-env defaults, the segment actor, and the learner's normalisation statistics.

The model is any Keras model with two outputs, (policy logits for Discrete actions or the action mean for a
Box, value): the built-in :func:`worker.models.build_keras_model` by default, ``--model`` otherwise. A Box
policy's log standard deviation is the learner's variable, sent to the groups with every weights version
(``log_std`` among the extras), so the network itself needs no custom layer and converts to numpy.

TensorFlow is imported only by the learners and by A3C's group side, never at import: a PPO group acts in
numpy without it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from worker.algorithms import hparams as tables
from worker.algorithms.rollout import Collector, Segment
from worker.api import Actor, ActorContext, Algorithm, Field, Learner, LearnerContext, Payload, Reject, Spaces
from worker.normalize import NormStats, RunningNorm, check_moments, check_stats, moments_arrays, normalization

LOG_STD = "log_std"  # the extra that carries a Box policy's log standard deviation


def env_kind(spaces: Spaces) -> str:
    """``image`` (rank-3 observations), ``continuous`` (a Box action space) or ``discrete``: the kinds of
    :data:`worker.algorithms.hparams.KIND_DEFAULTS`."""
    if len(spaces.obs_shape) == 3:
        return "image"
    return "discrete" if spaces.discrete else "continuous"


def obs_dtype(spaces: Spaces, hp: Mapping[str, Any]) -> str:
    """How observations travel and enter the model: image frames as bytes (a quarter of float32's size; the
    network scales them), everything else (normalised or not) as float32."""
    if len(spaces.obs_shape) == 3 and spaces.obs_dtype == np.uint8 and not normalization(spaces.obs_shape, hp)[0]:
        return "uint8"
    return "float32"


class ActorCritic(Algorithm):
    """The built-ins' common parts; ``name`` picks their tables in :mod:`worker.algorithms.hparams`."""

    name = "actor_critic"

    @classmethod
    def tuned(cls, env_id: str, spaces: Spaces) -> Mapping[str, Any]:
        return tables.tuned(cls.name, env_id, env_kind(spaces))

    @classmethod
    def check_hparams(cls, hp: Mapping[str, Any]) -> list[str]:
        return tables.problems(cls.name, hp)

    def model(self) -> Any:
        from worker.models import Architecture, build_keras_model

        return build_keras_model(Architecture.for_spaces(self.spaces.observation, self.spaces.action, self.hp))

    @property
    def normalize(self) -> tuple[bool, bool]:
        """(observations normalised, rewards scaled) in this run."""
        return normalization(self.spaces.obs_shape, self.hp)

    def moments_schema(self) -> dict[str, Field]:
        """The payload fields of the raw-observation and return moments a group sends when normalising."""
        fields: dict[str, Field] = {}
        obs, ret = self.normalize
        for prefix, on, shape in (("obs", obs, self.spaces.obs_shape), ("ret", ret, (1,))):
            if on:
                fields[f"{prefix}_count"] = Field("float64", (1,), rows=False, low=0)
                fields[f"{prefix}_mean"] = Field("float64", shape, rows=False)
                fields[f"{prefix}_m2"] = Field("float64", shape, rows=False, low=0)
        return fields


class ActorCriticPolicy:
    """The policy the built-in collector acts with: the model's outputs (``model(obs)``: the group's numpy or
    TensorFlow runtime, ``ctx.policy``) turned into sampled actions, their log-probabilities and the values.

    Args:
        model: observations -> (policy logits or action mean, value, ...).
        spaces: the env's spaces; dtype: how observations are batched (uint8 frames, else float32).
        version: the weights version now acting (``lambda: ctx.version`` in a group).
    """

    def __init__(self, model: Callable[[np.ndarray], Sequence[np.ndarray]], spaces: Spaces, dtype: str, *,
                 log_std_init: float = -0.5, version: Callable[[], int] = lambda: 0) -> None:
        self.model = model
        self.continuous = not spaces.discrete
        self.low, self.high = spaces.action_low, spaces.action_high
        self.obs_dtype = dtype
        self.log_std = np.full(spaces.n_actions if self.continuous else 0, log_std_init, np.float32)
        self._version = version

    @property
    def version(self) -> int:
        return self._version()

    def forward(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(policy output (B, n), values (B,))."""
        out = self.model(obs)
        return out[0], np.reshape(out[1], (-1,))

    def act(self, obs: np.ndarray, rng: np.random.Generator, *, greedy: bool = False
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sample actions. Returns (actions, log-probabilities, values)."""
        out, values = self.forward(obs)
        if not self.continuous:
            z = out - out.max(axis=1, keepdims=True)
            logp_all = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
            if greedy:
                actions = out.argmax(axis=1)
            else:  # Gumbel-max: one vectorised draw for the whole batch
                actions = (logp_all - np.log(-np.log(rng.random(out.shape)))).argmax(axis=1)
            logp = logp_all[np.arange(len(actions)), actions]
            return actions.astype(np.int64), logp.astype(np.float32), values.astype(np.float32)
        noise = np.zeros_like(out) if greedy else rng.standard_normal(out.shape).astype(np.float32)
        actions = out + np.exp(self.log_std) * noise
        logp = (-0.5 * noise**2 - self.log_std - 0.5 * np.log(2 * np.pi)).sum(axis=1)
        return actions.astype(np.float32), logp.astype(np.float32), values.astype(np.float32)

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        """What the vector env steps with (Box actions clipped to the bounds; the log-probability stays the
        unclipped sample's, as in SB3 and cleanrl)."""
        if not self.continuous:
            return actions
        clipped: np.ndarray = np.clip(actions, self.low, self.high)
        return clipped


class SegmentActor(Actor):
    """Collects ``n_steps`` of every env per payload with GAE advantages and returns (:class:`Collector`),
    acting on normalised observations when the run normalises them."""

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        algo: ActorCritic = ctx.algorithm  # type: ignore[assignment]
        self.normalize = algo.normalize
        hp = ctx.hparams
        self.policy = ActorCriticPolicy(ctx.policy, ctx.spaces, obs_dtype(ctx.spaces, hp),
                                        log_std_init=float(hp.get("log_std_init", -0.5)), version=lambda: ctx.version)
        self.n_steps = int(hp["n_steps"])
        self.collector = Collector(ctx.envs, self.policy, gamma=float(hp["gamma"]), lam=float(hp["gae_lambda"]),
                                   seed=ctx.seed, normalize_obs=self.normalize[0], normalize_reward=self.normalize[1])

    def on_weights(self, extras: Mapping[str, np.ndarray]) -> None:
        # The statistics as of this weights version: swapped in with the weights, at a segment boundary.
        obs, ret = self.normalize
        problem = check_stats(extras, self.ctx.spaces.obs_shape, obs=obs, ret=ret)
        if problem is None and self.policy.continuous:
            log_std = extras.get(LOG_STD)
            if log_std is None or log_std.shape != (self.ctx.spaces.n_actions,) or not np.isfinite(log_std).all():
                problem = f"{LOG_STD} missing, of the wrong shape or not finite"
        if problem is not None:
            raise Reject("bad_norm" if problem.startswith("norm/") else "bad_extras",
                         f"the master's statistics: {problem}")
        self.collector.norm = NormStats.from_arrays(extras)
        if LOG_STD in extras:
            self.policy.log_std = np.asarray(extras[LOG_STD], np.float32)

    def segment(self) -> tuple[Segment, dict[str, np.ndarray]]:
        """One segment and its moments arrays (empty without normalisation)."""
        seg = self.collector.collect(self.n_steps)
        moments: dict[str, np.ndarray] = {}
        for prefix, m in (("obs", seg.obs_moments), ("ret", seg.ret_moments)):
            if m is not None:  # what the master merges into its running statistics
                moments.update(moments_arrays(prefix, m))
        return seg, moments

    def collect(self) -> Mapping[str, np.ndarray]:
        seg, moments = self.segment()
        return {**seg.flat(), **moments}


class ActorCriticLearner(Learner):
    """The built-in learners' common part around their TensorFlow ``impl`` (a
    :class:`worker.algorithms.tfdist.LearnerBase`): the run's normalisation statistics (merged from every
    accepted payload, even one too stale to learn from; checkpointed; shipped with the weights) and the
    Gaussian policy's log standard deviation (checkpointed; shipped with the weights)."""

    impl: Any

    def __init__(self, ctx: LearnerContext) -> None:
        super().__init__(ctx)
        import tensorflow as tf

        algo: ActorCritic = ctx.algorithm  # type: ignore[assignment]
        obs, ret = algo.normalize
        self.norm = RunningNorm(ctx.spaces.obs_shape if obs else None, ret)
        # The moments in variables, for the checkpoint: (count, mean, M2) per normalised stream.
        self._norm_vars: dict[str, Any] = {}
        for prefix in ("obs", "ret"):
            m = getattr(self.norm, prefix)
            if m is not None:
                for part, shape in (("count", ()), ("mean", m.mean.shape), ("m2", m.m2.shape)):
                    self._norm_vars[f"norm_{prefix}_{part}"] = tf.Variable(np.zeros(shape, np.float64),
                                                                           trainable=False, name=f"norm_{prefix}_{part}")

    def check(self, payload: Payload) -> None:
        for prefix in ("obs", "ret"):
            if getattr(self.norm, prefix) is not None:
                problem = check_moments(prefix, payload, payload.env_steps)
                if problem is not None:
                    raise Reject("bad_norm", problem)

    def observe(self, payload: Payload) -> None:
        if self.norm.enabled:
            self.norm.add(payload)

    def extras(self) -> Mapping[str, np.ndarray]:
        extra = self.norm.stats().arrays()
        if self.impl.log_std is not None:
            extra[LOG_STD] = np.asarray(self.impl.log_std.numpy(), np.float32)
        return extra

    def checkpoint(self) -> Mapping[str, Any]:
        """The model, the optimiser, the log standard deviation and the moments' variables (brought up to date:
        called before every save)."""
        for prefix in ("obs", "ret"):
            m = getattr(self.norm, prefix)
            if m is not None:
                self._norm_vars[f"norm_{prefix}_count"].assign(m.count)
                self._norm_vars[f"norm_{prefix}_mean"].assign(m.mean)
                self._norm_vars[f"norm_{prefix}_m2"].assign(m.m2)
        parts: dict[str, Any] = {"model": self.ctx.model, "optimizer": self.impl.optimizer, **self._norm_vars}
        if self.impl.log_std is not None:
            parts[LOG_STD] = self.impl.log_std
        return parts

    def restored(self) -> None:
        from worker.normalize import Moments

        for prefix in ("obs", "ret"):
            if getattr(self.norm, prefix) is not None:
                v = {part: self._norm_vars[f"norm_{prefix}_{part}"].numpy() for part in ("count", "mean", "m2")}
                setattr(self.norm, prefix, Moments(float(v["count"]), v["mean"].copy(), v["m2"].copy()))

    def export_model(self) -> Any:
        """The model behind the observation normalisation the actors applied: raw observations in."""
        from worker.models import with_normalization

        stats = self.norm.stats()
        return with_normalization(self.ctx.model, stats.obs_mean, stats.obs_var)

    def shape_args(self) -> dict[str, Any]:
        """What the TensorFlow learners need to know of the spaces."""
        spaces = self.ctx.spaces
        return {"continuous": not spaces.discrete, "n_outputs": spaces.n_actions, "obs_shape": spaces.obs_shape,
                "obs_dtype": obs_dtype(spaces, self.ctx.hparams)}
