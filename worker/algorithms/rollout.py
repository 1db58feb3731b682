"""Experience collection for a worker group: K envs stepped in lock-step with one batched forward pass.

Shared by PPO and A3C. Pure numpy: the group process never needs TensorFlow to act.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from worker.models import NumpyPolicy


@dataclass
class Segment:
    """T steps of K envs, time-major, with advantages and returns already computed."""

    obs: np.ndarray  # (T, K, *obs_shape) float32
    actions: np.ndarray  # (T, K) int64 or (T, K, A) float32
    logp: np.ndarray  # (T, K) float32
    values: np.ndarray  # (T, K) float32
    advantages: np.ndarray  # (T, K) float32
    returns: np.ndarray  # (T, K) float32
    version: int  # weights version the actions were taken with
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return int(self.logp.size)

    def flat(self) -> dict[str, np.ndarray]:
        n = self.steps
        return {
            "obs": self.obs.reshape(n, *self.obs.shape[2:]),
            "actions": self.actions.reshape(n, *self.actions.shape[2:]),
            "logp": self.logp.reshape(n),
            "advantages": self.advantages.reshape(n),
            "returns": self.returns.reshape(n),
        }


def gae(rewards: np.ndarray, values: np.ndarray, dones: np.ndarray, last_values: np.ndarray,
        gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over a (T, K) segment.

    ``dones[t]`` ends the episode after step t (no bootstrap across it). Truncated episodes are handled
    by the caller folding ``gamma * V(final_obs)`` into that step's reward. Returns (advantages, returns).
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


class Collector:
    """Steps K gymnasium envs with a numpy policy and cuts the stream into :class:`Segment` s."""

    def __init__(self, envs: list[Any], policy: NumpyPolicy, *, gamma: float, lam: float, seed: int) -> None:
        self.envs = envs
        self.policy = policy
        self.gamma = gamma
        self.lam = lam
        self.rng = np.random.default_rng(seed)
        self.k = len(envs)
        first = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
        self.obs = np.stack(first).astype(np.float32)
        self.ep_return = np.zeros(self.k, dtype=np.float64)
        self.ep_length = np.zeros(self.k, dtype=np.int64)
        self.total_steps = 0

    def collect(self, n_steps: int) -> Segment:
        k, pol = self.k, self.policy
        obs_buf = np.empty((n_steps, k, *self.obs.shape[1:]), dtype=np.float32)
        logp_buf = np.empty((n_steps, k), dtype=np.float32)
        val_buf = np.empty((n_steps, k), dtype=np.float32)
        rew_buf = np.empty((n_steps, k), dtype=np.float32)
        done_buf = np.empty((n_steps, k), dtype=np.float32)
        act_buf: np.ndarray | None = None
        ep_returns: list[float] = []
        ep_lengths: list[int] = []
        truncated_obs: list[tuple[int, int, np.ndarray]] = []
        for t in range(n_steps):
            obs_buf[t] = self.obs
            actions, logp, values = pol.act(self.obs, self.rng)
            if act_buf is None:
                act_buf = np.empty((n_steps, *actions.shape), dtype=actions.dtype)
            act_buf[t] = actions
            logp_buf[t] = logp
            val_buf[t] = values
            for i, env in enumerate(self.envs):
                o, r, term, trunc, _ = env.step(pol.env_action(actions[i]))
                self.ep_return[i] += r
                self.ep_length[i] += 1
                rew_buf[t, i] = r
                done_buf[t, i] = 1.0 if (term or trunc) else 0.0
                if term or trunc:
                    if trunc and not term:
                        truncated_obs.append((t, i, np.asarray(o, dtype=np.float32)))
                    ep_returns.append(float(self.ep_return[i]))
                    ep_lengths.append(int(self.ep_length[i]))
                    self.ep_return[i] = 0.0
                    self.ep_length[i] = 0
                    o, _ = env.reset()
                self.obs[i] = o
        if truncated_obs:
            # A time limit is not a terminal state: bootstrap from the value of the state it cut off.
            _, boot = pol.forward(np.stack([o for _, _, o in truncated_obs]))
            for (t, i, _), v in zip(truncated_obs, boot):
                rew_buf[t, i] += self.gamma * v
        _, last_values = pol.forward(self.obs)
        adv, ret = gae(rew_buf, val_buf, done_buf, last_values, self.gamma, self.lam)
        self.total_steps += n_steps * k
        assert act_buf is not None
        return Segment(obs=obs_buf, actions=act_buf, logp=logp_buf, values=val_buf, advantages=adv,
                       returns=ret, version=pol.version, episode_returns=ep_returns, episode_lengths=ep_lengths)
