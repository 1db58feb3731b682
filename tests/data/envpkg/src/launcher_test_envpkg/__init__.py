"""Registers ``TinyPkg-v0`` on import: guess the sign of a hidden coin from a noisy reading of it."""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

ENV_ID = "TinyPkg-v0"


class TinyEnv(gymnasium.Env[np.ndarray, int]):
    """Observation: 4 floats, the first a noisy reading of the coin; action 0/1; reward 1 for the coin's side.
    Episodes last ``length`` steps (an env argument: ``--env-arg length=10``)."""

    def __init__(self, length: int = 25, noise: float = 0.5, render_mode: str | None = None) -> None:
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        self.length, self.noise, self.render_mode = int(length), float(noise), render_mode
        self.observation_space = spaces.Box(-5.0, 5.0, (4,), np.float32)
        self.action_space = spaces.Discrete(2)
        self._t, self._coin = 0, 1

    def _obs(self) -> np.ndarray:
        obs = self.np_random.normal(0.0, self.noise, 4).astype(np.float32)
        obs[0] += 1.0 if self._coin else -1.0
        return np.clip(obs, -5.0, 5.0)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._t, self._coin = 0, int(self.np_random.integers(2))
        return self._obs(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        reward = 1.0 if int(action) == self._coin else 0.0
        self._t += 1
        self._coin = int(self.np_random.integers(2))
        return self._obs(), reward, self._t >= self.length, False, {}


if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point=TinyEnv)
