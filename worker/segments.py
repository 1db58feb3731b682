"""Stepping a group's vector env for an actor of your own: :class:`Rollout` and the :class:`Segment` it returns,
and the return estimators most actors need (:func:`discounted_returns`, :func:`gae`). Public through
:mod:`worker.api`; numpy only.

Why a helper: gymnasium 1.x vector envs reset finished copies in one of two ways. ``NEXT_STEP`` (gymnasium's
own numpy-vectorised envs, e.g. CartPole's, which the launcher uses where they exist because they step ~2.5x
faster): the step *after* an episode ends only resets that copy, ignores its action and returns reward 0.
``SAME_STEP`` (``SyncVectorEnv``): the copy resets within the step that ended it and the last observation comes
in ``info["final_obs"]``. :class:`Rollout` hides the difference: reset steps are marked invalid
(``Segment.valid``), and the observation an episode was cut off at (a time limit, not a terminal state) is in
``Segment.truncated_obs`` for bootstrapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np


def autoreset_next_step(envs: Any) -> bool:
    """Whether ``envs`` resets a finished copy on the step after (``NEXT_STEP``) rather than within it."""
    from gymnasium.vector import AutoresetMode

    mode = getattr(envs, "autoreset_mode", None) or envs.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
    return AutoresetMode(mode) == AutoresetMode.NEXT_STEP


@dataclass
class Segment:
    """``T`` steps of the group's ``K`` envs, time-major.

    Attributes:
        obs: (T, K, *obs_shape): what each step acted on.
        actions: (T, K, ...): what ``act`` returned.
        rewards: (T, K) float32; 0 on invalid rows.
        terminated, truncated: (T, K) bool: the episode ended at this step (a terminal state; a time limit).
        valid: (T, K) bool: the row is a real step (False only for ``NEXT_STEP`` reset rows).
        extras: each per-step array ``act`` returned beside the actions, stacked to (T, K, ...).
        next_obs: (K, *obs_shape): the observations after the last step (bootstrap from them).
        truncated_obs: (t, k) -> the observation copy ``k``'s episode was cut off at by a time limit at step t.
    """

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    valid: np.ndarray
    next_obs: np.ndarray
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    truncated_obs: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    @property
    def dones(self) -> np.ndarray:
        """(T, K) bool: the episode ended at this step, either way."""
        out: np.ndarray = self.terminated | self.truncated
        return out

    @property
    def steps(self) -> int:
        """Real env steps in the segment."""
        return int(np.count_nonzero(self.valid))

    def rows(self, array: np.ndarray) -> np.ndarray:
        """The valid rows of a (T, K, ...) array, flattened time-major: what a payload row field holds."""
        if self.valid.all():
            return array.reshape(-1, *array.shape[2:])
        out: np.ndarray = array[self.valid]
        return out


class Rollout:
    """Steps a vector env with your ``act`` function, ``n_steps`` at a time, carrying the envs' state between
    calls.

    Args:
        envs: the group's vector env (``ctx.envs``).
        seed: seeds the first reset (``ctx.seed``).
    """

    def __init__(self, envs: Any, *, seed: int) -> None:
        self.envs = envs
        self.next_step = autoreset_next_step(envs)
        self.obs, _ = envs.reset(seed=seed)
        self.resetting = np.zeros(envs.num_envs, dtype=bool)  # NEXT_STEP: these copies' next step is a reset

    def run(self, n_steps: int, act: Callable[[np.ndarray], Any]) -> Segment:
        """Play ``n_steps`` steps of every copy. ``act(obs)`` gets the (K, *obs_shape) observations and returns
        the actions to step with, or ``(actions, {name: per-copy array})`` to keep beside them (log-probabilities,
        values, ...). Actions go to the env as returned."""
        k = self.envs.num_envs
        obs_l, act_l, rew_l, term_l, trunc_l, valid_l = [], [], [], [], [], []
        extras_l: dict[str, list[np.ndarray]] = {}
        truncated_obs: dict[tuple[int, int], np.ndarray] = {}
        for t in range(n_steps):
            out = act(self.obs)
            actions, extra = (out if isinstance(out, tuple) else (out, {}))
            obs_l.append(np.asarray(self.obs))
            act_l.append(np.asarray(actions))
            for name, value in (extra or {}).items():
                extras_l.setdefault(name, []).append(np.asarray(value))
            o, r, term, trunc, info = self.envs.step(actions)
            valid = ~self.resetting if self.next_step else np.ones(k, dtype=bool)
            term, trunc = np.asarray(term, bool) & valid, np.asarray(trunc, bool) & valid
            for i in np.flatnonzero(trunc & ~term):
                # NEXT_STEP returns the last observation itself; SAME_STEP already reset the copy.
                final = o[i] if self.next_step else info["final_obs"][i]
                truncated_obs[(t, int(i))] = np.asarray(final)
            rew_l.append(np.where(valid, np.asarray(r, np.float32), np.float32(0)))
            term_l.append(term)
            trunc_l.append(trunc)
            valid_l.append(valid)
            if self.next_step:
                self.resetting = term | trunc
            self.obs = o
        return Segment(obs=np.stack(obs_l), actions=np.stack(act_l), rewards=np.stack(rew_l).astype(np.float32),
                       terminated=np.stack(term_l), truncated=np.stack(trunc_l), valid=np.stack(valid_l),
                       next_obs=np.asarray(self.obs), extras={n: np.stack(v) for n, v in extras_l.items()},
                       truncated_obs=truncated_obs)


def discounted_returns(rewards: np.ndarray, dones: np.ndarray, last_values: np.ndarray | float,
                       gamma: float) -> np.ndarray:
    """Discounted returns over a (T, K) segment, bootstrapped from ``last_values`` (K,) after its last step;
    ``dones[t]`` ends the episode after step t (nothing flows back across it)."""
    ret = np.empty(rewards.shape, np.float32)
    running = np.broadcast_to(np.asarray(last_values, np.float32), rewards.shape[1:]).copy()
    for t in range(rewards.shape[0] - 1, -1, -1):
        running = rewards[t] + gamma * running * (1.0 - dones[t])
        ret[t] = running
    return ret


def gae(rewards: np.ndarray, values: np.ndarray, dones: np.ndarray, last_values: np.ndarray,
        gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over a (T, K) segment.

    ``dones[t]`` ends the episode after step t (no bootstrap across it). Truncated episodes are handled by the
    caller folding ``gamma * V(final_obs)`` into that step's reward. Returns (advantages, returns).
    """
    t_len = rewards.shape[0]
    adv = np.zeros_like(rewards, dtype=np.float32)
    last = np.zeros(rewards.shape[1], dtype=np.float32)
    next_values = last_values.astype(np.float32)
    for t in range(t_len - 1, -1, -1):
        nonterminal = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_values * nonterminal - values[t]
        last = delta + gamma * lam * nonterminal * last
        adv[t] = last
        next_values = values[t]
    return adv, (adv + values).astype(np.float32)


class EpisodeCounter:
    """The launcher's own count of a group's env steps and finished episodes, whatever the actor does: a thin
    wrapper around the group's vector env (``ctx.envs``). Reset steps of ``NEXT_STEP`` envs count as nothing.

    Every attribute the wrapper does not define goes to the wrapped env (``num_envs``, the spaces, ...).

    A collector of the launcher's own that keeps the same count as it steps (the built-in actors'
    :class:`worker.algorithms.rollout.Collector`) takes the wrapped env with :meth:`counted_elsewhere`, steps it
    directly and hands its counts over with :meth:`add`: the count is made once per step instead of twice.
    """

    def __init__(self, envs: Any) -> None:
        self.env = envs
        self.next_step = autoreset_next_step(envs)
        k = envs.num_envs
        self._ret = np.zeros(k, np.float64)
        self._len = np.zeros(k, np.int64)
        self._resetting = np.zeros(k, dtype=bool)
        self._elsewhere = False
        self.steps = 0
        self.returns: list[float] = []
        self.lengths: list[int] = []

    def counted_elsewhere(self) -> Any:
        """The wrapped env, for a collector that counts steps and episodes as this wrapper would and reports
        them with :meth:`add`. From then on, stepping through this wrapper is an error (the two counts would
        mix)."""
        self._elsewhere = True
        return self.env

    def add(self, steps: int, returns: list[float], lengths: list[int]) -> None:
        """Count ``steps`` env steps and these finished episodes (a collector's own count, in step order)."""
        self.steps += steps
        self.returns.extend(returns)
        self.lengths.extend(lengths)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    def reset(self, *args: Any, **kwargs: Any) -> Any:
        out = self.env.reset(*args, **kwargs)
        self._ret[:] = 0.0
        self._len[:] = 0
        self._resetting[:] = False
        return out

    def step(self, actions: Any) -> Any:
        if self._elsewhere:
            raise RuntimeError("this env is counted by its collector (counted_elsewhere()): step the env it "
                               "returned, not the counter")
        o, r, term, trunc, info = self.env.step(actions)
        if self.next_step:
            valid = ~self._resetting
            ended = (np.asarray(term) | np.asarray(trunc)) & valid
            self._resetting = ended
            self._ret += np.where(valid, r, 0.0)
            self._len += valid
            self.steps += int(np.count_nonzero(valid))
        else:
            ended = np.asarray(term) | np.asarray(trunc)
            self._ret += r
            self._len += 1
            self.steps += len(ended)
        if ended.any():
            for i in np.flatnonzero(ended):
                self.returns.append(float(self._ret[i]))
                self.lengths.append(int(self._len[i]))
            self._ret[ended] = 0.0
            self._len[ended] = 0
        return o, r, term, trunc, info

    def take(self) -> tuple[int, list[float], list[int]]:
        """(env steps, episode returns, episode lengths) since the last call."""
        out = (self.steps, self.returns, self.lengths)
        self.steps, self.returns, self.lengths = 0, [], []
        return out
