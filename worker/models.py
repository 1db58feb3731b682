"""The built-in algorithms' default networks: one architecture description per kind of env, built as a
Keras model (observations -> (policy logits or action mean, value)).

Only the Keras model is written here. Groups act with the numpy program converted from it
(:mod:`worker.keras_convert`), so a network is written once; ``--model`` replaces it with any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

NATURE_MIN_SIDE = 36  # the smallest side the Nature CNN's three convolutions fit (36 -> 8 -> 3 -> 1)
MAX_CHANNELS = 16  # a rank-3 observation's channel axis is the one no longer than this (last one first)


@dataclass(frozen=True)
class Architecture:
    """Framework-neutral description of the actor-critic network.

    kind: ``mlp`` (vector observations: separate 2-layer tanh towers for policy and value), ``cnn`` (small
    grids such as Snake's: conv 4x4 -> conv 3x3 -> dense, stride 1, shared by the policy and value heads)
    or ``nature`` (Atari-style frames, 36 pixels a side or more: the DQN paper's "Nature CNN", conv 32 8x8
    stride 4 -> conv 64 4x4 stride 2 -> conv 64 3x3 -> dense 512, shared).
    channels_first: image observations come as (C, H, W) (gymnasium's ``FrameStackObservation`` over
    ``AtariPreprocessing`` gives (4, 84, 84)); the network moves the channels last itself.
    obs_scale: observations are multiplied by this first (1/255 for uint8 images).
    """

    kind: str
    obs_shape: tuple[int, ...]
    continuous: bool
    n_outputs: int  # logits for Discrete(n), action dims for Box
    hidden: tuple[int, ...] = (64, 64)
    # Small on purpose: actors run this in numpy on CPU (~0.26 M multiply-adds per 10x10 observation).
    conv_filters: tuple[int, int] = (16, 32)
    dense_units: int = 128
    action_low: tuple[float, ...] = ()
    action_high: tuple[float, ...] = ()
    channels_first: bool = False
    obs_scale: float = 1.0
    # "uint8" for image frames: they travel and are batched as bytes (a quarter of float32's size), and the
    # network converts them (scaling by obs_scale) itself.
    obs_dtype: str = "float32"

    @classmethod
    def for_spaces(cls, observation_space: Any, action_space: Any, hparams: Mapping[str, Any] | None = None) -> "Architecture":
        """Pick the network for a gymnasium env's spaces: vectors get the MLP, rank-3 observations a CNN
        (the Nature CNN when both sides are at least 36 pixels, else the small stride-1 one)."""
        import gymnasium.spaces as spaces

        hp = dict(hparams or {})
        obs_shape = tuple(int(d) for d in observation_space.shape)
        low: tuple[float, ...]
        high: tuple[float, ...]
        if isinstance(action_space, spaces.Discrete):
            continuous, n_out, low, high = False, int(action_space.n), (), ()
        elif isinstance(action_space, spaces.Box) and len(action_space.shape) == 1:
            continuous, n_out = True, int(action_space.shape[0])
            low = tuple(float(x) for x in action_space.low)
            high = tuple(float(x) for x in action_space.high)
        else:
            raise ValueError(f"action space {action_space} is not supported: use Discrete or a 1-D Box")
        if len(obs_shape) not in (1, 3):
            raise ValueError(f"observation shape {obs_shape} is not supported: use a vector or an HxWxC grid")
        extra: dict[str, Any] = {}
        kind = "mlp"
        if len(obs_shape) == 3:
            channels_first = obs_shape[-1] > MAX_CHANNELS and obs_shape[0] <= MAX_CHANNELS
            h, w = obs_shape[1:] if channels_first else obs_shape[:2]
            kind = "nature" if min(h, w) >= NATURE_MIN_SIDE else "cnn"
            extra["channels_first"] = channels_first
            if np.dtype(observation_space.dtype) == np.uint8:
                extra["obs_scale"] = 1.0 / 255.0
                extra["obs_dtype"] = "uint8"
            if kind == "nature":
                extra["dense_units"] = 512
        return cls(kind=kind, obs_shape=obs_shape, continuous=continuous, n_outputs=n_out,
                   hidden=tuple(hp.get("hidden", (64, 64))), action_low=low, action_high=high, **extra)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of an image observation, whatever its layout on the wire."""
        if self.channels_first:
            c, h, w = self.obs_shape
            return h, w, c
        h, w, c = self.obs_shape
        return h, w, c

    def conv_layers(self) -> list[tuple[str, int, int, int]]:
        """The convolutions of an image kind: (name, kernel side, filters, stride)."""
        if self.kind == "nature":
            return [("conv0", 8, 32, 4), ("conv1", 4, 64, 2), ("conv2", 3, 64, 1)]
        f1, f2 = self.conv_filters
        return [("conv0", 4, f1, 1), ("conv1", 3, f2, 1)]


def env_kind(observation_space: Any, action_space: Any) -> str:
    """The kind of environment, for the hyper-parameter defaults of :mod:`worker.algorithms.hparams`:
    ``image`` (rank-3 observations), ``continuous`` (a Box action space) or ``discrete``."""
    import gymnasium.spaces as spaces

    if len(getattr(observation_space, "shape", None) or ()) == 3:
        return "image"
    return "continuous" if isinstance(action_space, spaces.Box) else "discrete"


def action_centre(arch: Architecture) -> list[float]:
    """Where a Box policy's mean starts: the middle of each bounded action dimension (0 where a bound is
    infinite). Sampled actions are clipped to the bounds for the env (their log-probability is the
    unclipped sample's, as in SB3 and cleanrl), so a mean that started at 0 for bounds such as [0, 1]
    would have half its actions clipped to one edge before learning began; for symmetric bounds
    (Pendulum's [-2, 2]) this is 0, as before."""
    low, high = np.asarray(arch.action_low, np.float64), np.asarray(arch.action_high, np.float64)
    if low.shape != (arch.n_outputs,) or high.shape != (arch.n_outputs,):
        return [0.0] * arch.n_outputs
    bounded = np.isfinite(low) & np.isfinite(high)
    centre = np.where(bounded, (np.where(bounded, low, 0.0) + np.where(bounded, high, 0.0)) / 2, 0.0)
    return [float(c) for c in centre]


def build_keras_model(arch: Architecture) -> Any:
    """Build the Keras model: input obs -> (policy logits or action mean, value). Imports TensorFlow; the caller
    seeds Keras (``keras.utils.set_random_seed``) first."""
    import keras

    obs = keras.Input(shape=arch.obs_shape, name="obs", dtype=arch.obs_dtype)
    ortho = keras.initializers.Orthogonal
    pi_bias = keras.initializers.Constant(action_centre(arch)) if arch.continuous else "zeros"
    if arch.kind == "mlp":
        x = obs
        for i, units in enumerate(arch.hidden):
            x = keras.layers.Dense(units, activation="tanh", kernel_initializer=ortho(np.sqrt(2)), name=f"pi_h{i}")(x)
        pi = keras.layers.Dense(arch.n_outputs, kernel_initializer=ortho(0.01), bias_initializer=pi_bias,
                                name="pi_out")(x)
        y = obs
        for i, units in enumerate(arch.hidden):
            y = keras.layers.Dense(units, activation="tanh", kernel_initializer=ortho(np.sqrt(2)), name=f"v_h{i}")(y)
        v = keras.layers.Dense(1, kernel_initializer=ortho(1.0), name="v_out")(y)
    else:
        x = obs
        if arch.channels_first:
            x = keras.layers.Permute((2, 3, 1), name="channels_last")(x)
        if arch.obs_scale != 1.0:
            x = keras.layers.Rescaling(arch.obs_scale, name="obs_scale")(x)
        for name, side, filters, stride in arch.conv_layers():
            x = keras.layers.Conv2D(filters, side, strides=stride, activation="relu",
                                    kernel_initializer=ortho(np.sqrt(2)), name=name)(x)
        x = keras.layers.Flatten(name="flatten")(x)
        x = keras.layers.Dense(arch.dense_units, activation="relu", kernel_initializer=ortho(np.sqrt(2)), name="dense0")(x)
        pi = keras.layers.Dense(arch.n_outputs, kernel_initializer=ortho(0.01), bias_initializer=pi_bias,
                                name="pi_out")(x)
        v = keras.layers.Dense(1, kernel_initializer=ortho(1.0), name="v_out")(x)
    v = keras.layers.Reshape((), name="value")(v)
    return keras.Model(obs, [pi, v], name=f"actor_critic_{arch.kind}")


def with_normalization(model: Any, obs_mean: np.ndarray | None, obs_var: np.ndarray | None) -> Any:
    """``model`` behind the observation normalisation the actors applied (for the exported Keras model):
    raw observations in, the same outputs as the actors' policy out. Built from stock layers only, so
    ``keras.models.load_model`` needs no custom objects: ``clip((x - mean) / sqrt(var + eps), -10, 10)`` is
    ``Rescaling`` (the affine part, shifted by +10), ``ReLU(max_value=20)`` (the clip) and ``Rescaling`` by -10.
    Without statistics the model is returned as it is."""
    if obs_mean is None or obs_var is None:
        return model
    import keras

    from worker.normalize import CLIP_OBS, EPS

    inv = 1.0 / np.sqrt(np.asarray(obs_var, np.float64) + EPS)
    offset = CLIP_OBS - np.asarray(obs_mean, np.float64) * inv
    raw = keras.Input(shape=np.shape(obs_mean), name="raw_obs", dtype="float32")
    x = keras.layers.Rescaling(inv.astype(np.float32).tolist(), offset.astype(np.float32).tolist(), name="obs_norm")(raw)
    x = keras.layers.ReLU(max_value=2 * CLIP_OBS, name="obs_clip")(x)
    x = keras.layers.Rescaling(1.0, -CLIP_OBS, name="obs_unshift")(x)
    return keras.Model(raw, model(x), name=f"{model.name}_normalized")


