"""Atari (``ALE/*`` ids from ale-py): made the way DQN and PPO papers train on them.

``gymnasium.make(id, frameskip=1)`` (the wrapper skips frames, so the emulator must not), then gymnasium's
``AtariPreprocessing`` (84x84 grayscale, max-pool of the last two frames, ``frame_skip`` 4, up to
``noop_max`` 30 no-ops at reset) and ``FrameStackObservation`` of the last 4 frames. The stack is moved to the
last axis: observations are ``(84, 84, 4)`` uint8, height x width x channels, the layout every image policy
here takes (:attr:`worker.envs.EnvInfo.image_like`; the Nature CNN in :mod:`worker.models`).

Needs ``ale-py`` (registers ``ALE/*`` on import; ROMs included) and ``opencv-python-headless`` (the resize):
``pip install 'launcher[atari]'`` on a host, ``launcher build --with ale-py --with opencv-python-headless`` for
containers.
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

SCREEN_SIZE = 84
FRAME_SKIP = 4
NOOP_MAX = 30
STACK = 4


def is_atari(env_id: str) -> bool:
    """Whether ``env_id`` (a registered id, without its module) is an ale-py Atari id."""
    return env_id.startswith("ALE/")


class ChannelsLast(gymnasium.ObservationWrapper[Any, Any, Any]):
    """``(stack, h, w)`` observations as ``(h, w, stack)``: a view, no copy until the policy batches it."""

    def __init__(self, env: gymnasium.Env[Any, Any]) -> None:
        super().__init__(env)
        box = env.observation_space
        assert isinstance(box, spaces.Box) and len(box.shape) == 3
        self.observation_space = spaces.Box(np.moveaxis(box.low, 0, -1), np.moveaxis(box.high, 0, -1),
                                            dtype=box.dtype)

    def observation(self, observation: Any) -> Any:
        return np.moveaxis(np.asarray(observation), 0, -1)


def make_atari(env_id: str, render_mode: str | None = None, **kwargs: Any) -> gymnasium.Env[Any, Any]:
    """One preprocessed Atari env (see the module docstring); ``kwargs`` go to ``gymnasium.make``.

    Raises:
        TypeError: ``frameskip`` other than 1 in ``kwargs`` (the preprocessing skips frames itself).
        gymnasium.error.DependencyNotInstalled: opencv is missing.
    """
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    if kwargs.get("frameskip", 1) != 1:
        raise TypeError(f"{env_id}: the frameskip argument must be 1 (got {kwargs['frameskip']!r}): Atari envs "
                        f"skip {FRAME_SKIP} frames in their preprocessing")
    env = gymnasium.make(env_id, render_mode=render_mode, **{**kwargs, "frameskip": 1})
    env = AtariPreprocessing(env, noop_max=NOOP_MAX, frame_skip=FRAME_SKIP, screen_size=SCREEN_SIZE,
                             grayscale_obs=True)
    return ChannelsLast(FrameStackObservation(env, STACK))
