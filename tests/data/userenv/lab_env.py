"""A lab's own env module, not installed anywhere: ``--env-dir tests/data/userenv --env lab_env:LabTiny-v0``.

Registers ``LabTiny-v0`` on import: steer a point on a line back to 0 (observation: position and step count).
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

ENV_ID = "LabTiny-v0"


class LabTiny(gymnasium.Env[np.ndarray, int]):
    def __init__(self, length: int = 20, render_mode: str | None = None) -> None:
        self.length, self.render_mode = int(length), render_mode
        self.observation_space = spaces.Box(-50.0, 50.0, (2,), np.float32)
        self.action_space = spaces.Discrete(2)
        self._x, self._t = 0.0, 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._x, self._t = float(self.np_random.uniform(-5, 5)), 0
        return np.array([self._x, 0.0], np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self._x += 1.0 if int(action) == 1 else -1.0
        self._t += 1
        return np.array([self._x, self._t], np.float32), -abs(self._x) / 10.0, self._t >= self.length, False, {}


if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point=LabTiny)
