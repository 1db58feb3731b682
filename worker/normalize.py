"""Running observation normalisation and return scaling, kept in step between the groups and the learner.

The pieces of a strong PPO for continuous control (SB3's ``VecNormalize``, cleanrl's ``NormalizeObservation``
and ``NormalizeReward``), split the way our actors and learner are split:

* a group acts on ``clip((obs - mean) / sqrt(var + eps), -clip_obs, clip_obs)`` with the ``mean``/``var``
  that came with its weights (:class:`NormStats`), and sends the normalised observations it acted on, so
  the learner trains on exactly what the policy saw;
* with the segment it sends the moments (count, mean, M2) of the *raw* observations it saw and of the
  discounted returns it accumulated (:class:`Moments`), nothing more: a segment's statistics are a few
  numbers per observation dimension, however many steps it holds;
* the master merges the moments of every group into its running :class:`Moments` (Chan et al.'s parallel
  variance formula, exact for any split of the data), checkpoints them, and ships the new ``mean``/``var``
  with every weights broadcast;
* rewards used for learning are divided by ``sqrt(var(return) + eps)`` (not centred: centring a reward
  changes the optimal policy of an episodic task) and clipped; reported episode returns stay raw.

Why moments and not the statistics themselves: the merge of (count, mean, M2) is associative and exact, so
the master's statistics equal those of all the data any group ever saw, in any order of arrival.
Image (uint8) observations are never normalised: the network scales them by 1/255 itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

EPS = 1e-8
CLIP_OBS = 10.0
CLIP_REWARD = 10.0

# The names of the normalisation entries in messages, checkpoints and the exported policy.npz.
OBS_MEAN, OBS_VAR = "norm/obs_mean", "norm/obs_var"
RET_VAR = "norm/ret_var"
# Return moments and the return variance are arrays of shape (1,): the wire format sends no 0-d arrays.
RET_SHAPE = (1,)


@dataclass
class Moments:
    """Count, mean and M2 (sum of squared deviations) of a stream of arrays of one shape, in float64."""

    count: float
    mean: np.ndarray
    m2: np.ndarray

    @classmethod
    def empty(cls, shape: tuple[int, ...] = ()) -> "Moments":
        return cls(0.0, np.zeros(shape, np.float64), np.zeros(shape, np.float64))

    @classmethod
    def of(cls, x: np.ndarray) -> "Moments":
        """The moments of the rows of ``x`` (shape (n, *shape))."""
        x = np.asarray(x, np.float64)
        n = x.shape[0]
        if n == 0:
            return cls.empty(x.shape[1:])
        mean = x.mean(axis=0)
        return cls(float(n), mean, ((x - mean) ** 2).sum(axis=0))

    @property
    def var(self) -> np.ndarray:
        """The population variance (1 where nothing was seen yet: normalising then changes nothing)."""
        if self.count <= 0:
            return np.ones_like(self.mean)
        return self.m2 / self.count

    def merge(self, other: "Moments") -> "Moments":
        """The moments of both streams together (Chan, Golub and LeVeque's parallel formula)."""
        if other.count <= 0:
            return Moments(self.count, self.mean.copy(), self.m2.copy())
        if self.count <= 0:
            return Moments(other.count, np.array(other.mean, np.float64), np.array(other.m2, np.float64))
        n = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / n)
        m2 = self.m2 + other.m2 + delta**2 * (self.count * other.count / n)
        return Moments(n, mean, m2)


@dataclass(frozen=True)
class NormStats:
    """What a group normalises with: observation mean/variance and the return variance (None: that part is off)."""

    obs_mean: np.ndarray | None = None
    obs_var: np.ndarray | None = None
    ret_var: float | None = None

    def obs(self, obs: np.ndarray) -> np.ndarray:
        """Observations as the policy sees them (float32)."""
        if self.obs_mean is None or self.obs_var is None:
            return np.asarray(obs, np.float32)
        z = (np.asarray(obs, np.float64) - self.obs_mean) / np.sqrt(self.obs_var + EPS)
        out: np.ndarray = np.clip(z, -CLIP_OBS, CLIP_OBS).astype(np.float32)
        return out

    def reward(self, reward: np.ndarray) -> np.ndarray:
        """Rewards as the learner sees them: divided by the return's standard deviation, clipped."""
        if self.ret_var is None:
            return np.asarray(reward, np.float32)
        out: np.ndarray = np.clip(np.asarray(reward, np.float64) / np.sqrt(self.ret_var + EPS),
                                  -CLIP_REWARD, CLIP_REWARD).astype(np.float32)
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        """The entries that travel with the weights and go into ``policy.npz`` (float64)."""
        out: dict[str, np.ndarray] = {}
        if self.obs_mean is not None and self.obs_var is not None:
            out[OBS_MEAN] = np.asarray(self.obs_mean, np.float64)
            out[OBS_VAR] = np.asarray(self.obs_var, np.float64)
        if self.ret_var is not None:
            out[RET_VAR] = np.full(RET_SHAPE, self.ret_var, np.float64)
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> "NormStats":
        mean, var, ret = arrays.get(OBS_MEAN), arrays.get(OBS_VAR), arrays.get(RET_VAR)
        return cls(None if mean is None else np.array(mean, np.float64),
                   None if var is None else np.array(var, np.float64),
                   None if ret is None else float(np.asarray(ret).reshape(-1)[0]))


def check_stats(arrays: Mapping[str, np.ndarray], obs_shape: tuple[int, ...], *, obs: bool, ret: bool) -> str | None:
    """Why the normalisation entries of a weights frame (or a ``policy.npz``) are unusable, or None.

    Args:
        arrays: the frame's arrays; ``norm/*`` entries are checked.
        obs_shape: the observation shape ``norm/obs_mean`` and ``norm/obs_var`` must have.
        obs, ret: whether observation statistics / the return variance must be there.
    """
    want = ({OBS_MEAN: obs_shape, OBS_VAR: obs_shape} if obs else {}) | ({RET_VAR: RET_SHAPE} if ret else {})
    for name, shape in want.items():
        a = arrays.get(name)
        if a is None:
            return f"{name} is missing"
        if tuple(a.shape) != tuple(shape):
            return f"{name} has shape {tuple(a.shape)}, expected {tuple(shape)}"
        if a.dtype.kind != "f" or not np.isfinite(a).all():
            return f"{name} is not finite floats"
    for name in (OBS_VAR, RET_VAR):
        if name in want and (arrays[name] < 0).any():
            return f"{name} has a negative variance"
    return None


def normalization(obs_shape: tuple[int, ...], hp: Mapping[str, Any]) -> tuple[bool, bool]:
    """(observations normalised, rewards scaled) for a run: the ``normalize_obs`` and ``normalize_reward``
    hyper-parameters, except that image observations (rank 3: the conv torsos scale them) are never normalised."""
    return bool(hp.get("normalize_obs", False)) and len(obs_shape) != 3, bool(hp.get("normalize_reward", False))


class ReturnTracker:
    """Each env copy's discounted return, reset when its episode ends (``NormalizeReward``'s accumulator)."""

    def __init__(self, k: int, gamma: float) -> None:
        self.gamma = gamma
        self.ret = np.zeros(k, np.float64)

    def step(self, rewards: np.ndarray, ended: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """Add one step's raw rewards; returns the returns of the copies that took a real step (``valid``),
        as rows of shape :data:`RET_SHAPE`."""
        self.ret = np.where(valid, self.ret * self.gamma + rewards, self.ret)
        out: np.ndarray = self.ret[valid].reshape(-1, *RET_SHAPE)
        self.ret[ended] = 0.0
        return out


def moments_arrays(prefix: str, m: Moments) -> dict[str, np.ndarray]:
    """A segment's moments as payload arrays: ``<prefix>_count`` (shape (1,)), ``<prefix>_mean``, ``<prefix>_m2``
    (float64)."""
    return {f"{prefix}_count": np.full(RET_SHAPE, m.count, np.float64), f"{prefix}_mean": np.asarray(m.mean, np.float64),
            f"{prefix}_m2": np.asarray(m.m2, np.float64)}


def moments_from(prefix: str, arrays: Mapping[str, np.ndarray]) -> Moments:
    """The inverse of :func:`moments_arrays` (for a payload whose schema and :func:`check_moments` passed)."""
    return Moments(float(arrays[f"{prefix}_count"][0]), np.asarray(arrays[f"{prefix}_mean"], np.float64),
                   np.asarray(arrays[f"{prefix}_m2"], np.float64))


def check_moments(prefix: str, arrays: Mapping[str, np.ndarray], max_count: int) -> str | None:
    """Why a peer's ``<prefix>`` moments are unusable (a sentence), or None. Shapes and dtypes are the payload
    schema's to check; here: the count is a whole number in [0, ``max_count``] (no more than the payload's env
    steps: the master weighs a group's statistics by it) and M2 is not negative."""
    count = float(arrays[f"{prefix}_count"][0])
    if count != int(count) or not 0 <= count <= max_count:
        return f"{prefix}_count {count:g} is not a whole number in [0, {max_count}] (the payload's env steps)"
    if (arrays[f"{prefix}_m2"] < 0).any():
        return f"{prefix}_m2 is negative"
    return None


class RunningNorm:
    """The master's side: the running moments of observations and returns, and the stats to ship.

    Args:
        obs_shape: the observation shape (for the observation moments), or None when observations are not
            normalised.
        returns: whether rewards are scaled by the return's standard deviation.
    """

    def __init__(self, obs_shape: tuple[int, ...] | None, returns: bool) -> None:
        self.obs = None if obs_shape is None else Moments.empty(obs_shape)
        self.ret = Moments.empty(RET_SHAPE) if returns else None

    @property
    def enabled(self) -> bool:
        return self.obs is not None or self.ret is not None

    def add(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Merge one accepted payload's moments."""
        if self.obs is not None:
            self.obs = self.obs.merge(moments_from("obs", arrays))
        if self.ret is not None:
            self.ret = self.ret.merge(moments_from("ret", arrays))

    def stats(self) -> NormStats:
        return NormStats(None if self.obs is None else self.obs.mean.copy(),
                         None if self.obs is None else self.obs.var,
                         None if self.ret is None else float(self.ret.var[0]))
