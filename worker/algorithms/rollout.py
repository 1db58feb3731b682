"""Experience collection for a worker group: K envs stepped as one vector env with one batched forward pass.

Shared by PPO and A3C. Pure numpy: the group process never needs TensorFlow to act.

The K envs are one gymnasium vector env (:func:`worker.envs.make_vector_env`). Two autoreset modes are
handled, because the fastest implementations differ: ``SAME_STEP`` (``SyncVectorEnv``: a finished
episode's last observation comes in ``info["final_obs"]``) and ``NEXT_STEP`` (gymnasium's own
vectorised envs such as CartPole's: the step *after* an episode ends only resets that copy, its action is
ignored and its reward is 0). Those reset steps are no experience: they are masked out of the segment
(``Segment.valid``) and not counted as env steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from worker.normalize import Moments, NormStats, ReturnTracker
from worker.segments import EpisodeCounter, gae


@dataclass
class Segment:
    """T steps of K envs, time-major, with advantages and returns already computed.

    ``valid`` (T, K) marks the rows that are experience; None means all of them (see the module doc).
    """

    obs: np.ndarray  # (T, K, *obs_shape) float32
    actions: np.ndarray  # (T, K) int64 or (T, K, A) float32
    logp: np.ndarray  # (T, K) float32: log-probabilities under the behaviour policy (``version``)
    values: np.ndarray  # (T, K) float32
    advantages: np.ndarray  # (T, K) float32
    returns: np.ndarray  # (T, K) float32
    version: int  # weights version the actions were taken with (the behaviour policy)
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    valid: np.ndarray | None = None  # (T, K) bool, or None when every row is experience
    # Moments of the raw observations acted on and of the discounted returns (None: that normalisation is off).
    obs_moments: Moments | None = None
    ret_moments: Moments | None = None

    @property
    def steps(self) -> int:
        return int(self.logp.size if self.valid is None else np.count_nonzero(self.valid))

    def flat(self) -> dict[str, np.ndarray]:
        """The experience rows, flattened (time-major), as the TRAJ frame and the learners take them."""
        arrays = {"obs": self.obs, "actions": self.actions, "logp": self.logp, "advantages": self.advantages,
                  "returns": self.returns}
        if self.valid is None or self.valid.all():
            n = self.logp.size
            return {k: v.reshape(n, *v.shape[2:]) for k, v in arrays.items()}
        return {k: v[self.valid] for k, v in arrays.items()}


def as_vector_env(envs: Any) -> gymnasium.vector.VectorEnv[Any, Any, Any]:
    """A vector env (or a wrapper of one) as is; a list of single envs as a
    ``SyncVectorEnv`` (``SAME_STEP``) over them."""
    if isinstance(envs, gymnasium.vector.VectorEnv) or hasattr(envs, "num_envs"):
        return envs
    return SyncVectorEnv([_returning(e) for e in envs], autoreset_mode=AutoresetMode.SAME_STEP)


def _returning(env: Any) -> Callable[[], Any]:
    """An env factory for ``SyncVectorEnv`` that hands back an env already built."""
    return lambda: env


def autoreset_mode(vec: Any) -> AutoresetMode:
    """How ``vec`` resets finished copies (``SyncVectorEnv`` says on the instance, others in metadata)."""
    mode = getattr(vec, "autoreset_mode", None) or vec.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
    return AutoresetMode(mode)


class Collector:
    """Steps K envs (one vector env, or a list of envs) with a numpy policy and cuts the stream into
    :class:`Segment` s. The built-in actor-critic actor's collector; ``policy`` has ``act(obs, rng)`` ->
    (actions, log-probabilities, values), ``forward(obs)`` -> (policy output, values), ``env_actions``,
    ``version`` and ``obs_dtype`` (:class:`worker.algorithms.actor_critic.ActorCriticPolicy`).

    With ``normalize_obs`` the policy acts on (and the segment holds) observations normalised with
    :attr:`norm` (set with each weights version), and the segment carries the moments of the raw ones;
    with ``normalize_reward`` GAE runs on rewards scaled by :attr:`norm`'s return variance and the segment
    carries the moments of each copy's discounted return (:mod:`worker.normalize`). Episode returns
    reported stay raw.

    Given the group's :class:`worker.segments.EpisodeCounter`, it steps the env inside and hands the counter
    the steps and episodes it counted itself, once per segment (the same figures, one count per step).

    Raises:
        ValueError: for a vector env whose autoreset is disabled (nothing would reset finished copies).
    """

    def __init__(self, envs: Any, policy: Any, *, gamma: float, lam: float, seed: int,
                 normalize_obs: bool = False, normalize_reward: bool = False) -> None:
        self.counter = envs if isinstance(envs, EpisodeCounter) else None
        self.vec = as_vector_env(self.counter.counted_elsewhere() if self.counter is not None else envs)
        self.mode = autoreset_mode(self.vec)
        if self.mode not in (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP):
            raise ValueError(f"vector env autoreset mode {self.mode.value!r} is not supported; use next_step or same_step")
        self.policy = policy
        self.gamma = gamma
        self.lam = lam
        self.rng = np.random.default_rng(seed)
        self.k = self.vec.num_envs
        first, _ = self.vec.reset(seed=seed)
        # Image frames stay bytes (the network scales them); everything else is float32.
        self.obs_dtype = np.dtype(policy.obs_dtype)
        self.obs = np.asarray(first, dtype=self.obs_dtype)
        self.ep_return = np.zeros(self.k, dtype=np.float64)
        self.ep_length = np.zeros(self.k, dtype=np.int64)
        self.resetting = np.zeros(self.k, dtype=bool)  # NEXT_STEP: these copies' next step is a reset
        self.total_steps = 0
        self.normalize_obs = normalize_obs
        self.returns = ReturnTracker(self.k, gamma) if normalize_reward else None
        self.norm = NormStats(np.zeros(self.obs.shape[1:]), np.ones(self.obs.shape[1:]), 1.0)

    def close(self) -> None:
        self.vec.close()

    def collect(self, n_steps: int) -> Segment:
        k, pol, next_step = self.k, self.policy, self.mode == AutoresetMode.NEXT_STEP
        obs_buf = np.empty((n_steps, k, *self.obs.shape[1:]), dtype=self.obs_dtype)
        logp_buf = np.empty((n_steps, k), dtype=np.float32)
        val_buf = np.empty((n_steps, k), dtype=np.float32)
        rew_buf = np.empty((n_steps, k), dtype=np.float32)
        done_buf = np.empty((n_steps, k), dtype=np.float32)
        valid_buf = np.ones((n_steps, k), dtype=bool)
        act_buf: np.ndarray | None = None
        ep_returns: list[float] = []
        ep_lengths: list[int] = []
        truncated_obs: list[tuple[int, int, np.ndarray]] = []
        norm = self.norm if self.normalize_obs else NormStats()
        scale = self.norm if self.returns is not None else NormStats()
        raw_buf = np.empty((n_steps, k, *self.obs.shape[1:]), np.float64) if self.normalize_obs else None
        ret_seen: list[np.ndarray] = []
        for t in range(n_steps):
            if raw_buf is not None:
                raw_buf[t] = self.obs
            obs_buf[t] = norm.obs(self.obs) if self.normalize_obs else self.obs
            actions, logp, values = pol.act(obs_buf[t], self.rng)
            if act_buf is None:
                act_buf = np.empty((n_steps, *actions.shape), dtype=actions.dtype)
            act_buf[t] = actions
            logp_buf[t] = logp
            val_buf[t] = values
            o, r, term, trunc, info = self.vec.step(pol.env_actions(actions))
            valid = ~self.resetting if next_step else valid_buf[t]
            ended = (np.asarray(term) | np.asarray(trunc)) & valid
            raw_r = np.where(valid, r, 0.0)
            rew_buf[t] = scale.reward(raw_r)
            done_buf[t] = ended
            valid_buf[t] = valid
            if self.returns is not None:
                ret_seen.append(self.returns.step(raw_r, ended, valid))
            self.ep_return += raw_r
            self.ep_length += valid
            for i in np.flatnonzero(ended):
                if trunc[i] and not term[i]:
                    # NEXT_STEP returns the last observation itself; SAME_STEP already reset the copy.
                    final = o[i] if next_step else info["final_obs"][i]
                    truncated_obs.append((t, int(i), np.asarray(final, dtype=np.float32)))
                ep_returns.append(float(self.ep_return[i]))
                ep_lengths.append(int(self.ep_length[i]))
            self.ep_return[ended] = 0.0
            self.ep_length[ended] = 0
            if next_step:
                self.resetting = ended
            self.obs = np.asarray(o, dtype=self.obs_dtype)
        if truncated_obs:
            # A time limit is not a terminal state: bootstrap from the value of the state it cut off.
            _, boot = pol.forward(norm.obs(np.stack([o for _, _, o in truncated_obs])))
            for (step, copy, _), v in zip(truncated_obs, boot):
                rew_buf[step, copy] += self.gamma * v
        # After an episode's last step (NEXT_STEP) self.obs is that final observation; its done flag stops
        # the bootstrap, and the reset row that follows is masked out of the next segment.
        _, last_values = pol.forward(norm.obs(self.obs))
        adv, ret = gae(rew_buf, val_buf, done_buf, last_values, self.gamma, self.lam)
        all_valid = bool(valid_buf.all())
        played = int(valid_buf.sum())
        self.total_steps += played
        if self.counter is not None:
            self.counter.add(played, ep_returns, ep_lengths)
        assert act_buf is not None
        obs_m = None if raw_buf is None else Moments.of(raw_buf[valid_buf])
        ret_m = None if self.returns is None else Moments.of(np.concatenate(ret_seen))
        return Segment(obs=obs_buf, actions=act_buf, logp=logp_buf, values=val_buf, advantages=adv,
                       returns=ret, version=pol.version, episode_returns=ep_returns, episode_lengths=ep_lengths,
                       valid=None if all_valid else valid_buf, obs_moments=obs_m, ret_moments=ret_m)
