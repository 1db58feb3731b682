"""Policy/value networks: one architecture description, built as a Keras model for learning and run
as plain numpy for acting.

Why numpy for acting: a Python call into TF costs >= 0.4 ms of fixed overhead and an eager ``model(x)``
2.7-4.2 ms for a small MLP, while the same forward pass in numpy takes 0.01-0.07 ms (shared/MEASURED.md).
Worker groups therefore act with :class:`NumpyPolicy` and never import TensorFlow for PPO; only the
master (and A3C groups, which compute gradients) build the Keras model.

Weights travel by name (the Keras variable path, e.g. ``pi_h0/kernel``), so both sides check that they
agree on every shape before a single step is played.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

LOG_STD_NAME = "log_std"


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
    log_std_init: float = -0.5
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
        if "log_std_init" in hp:
            extra["log_std_init"] = float(hp["log_std_init"])
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


def build_keras_model(arch: Architecture, seed: int = 0) -> Any:
    """Build the Keras model: input obs -> (policy logits or action mean, value). Imports TensorFlow."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(seed)
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
    model = keras.Model(obs, [pi, v], name=f"actor_critic_{arch.kind}")
    if arch.continuous:
        # A state-independent log standard deviation, trained with the rest.
        model.log_std = tf.Variable(np.full(arch.n_outputs, arch.log_std_init, np.float32), name=LOG_STD_NAME,
                                    trainable=True)
    return model


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


def trainable_variables(model: Any) -> list[Any]:
    vs = list(model.trainable_variables)
    if getattr(model, "log_std", None) is not None:
        vs.append(model.log_std)
    return vs


def variable_name(v: Any) -> str:
    return LOG_STD_NAME if v.name.startswith(LOG_STD_NAME) and "/" not in getattr(v, "path", v.name) else v.path


def get_named_weights(model: Any) -> dict[str, np.ndarray]:
    """The model's trainable weights as ``{name: array}`` (the order is the wire order)."""
    return {variable_name(v): np.asarray(v.numpy(), dtype=np.float32) for v in trainable_variables(model)}


def set_named_weights(model: Any, weights: Mapping[str, np.ndarray]) -> None:
    """Assign weights by name; raises ValueError naming the first missing or mis-shaped one."""
    for v in trainable_variables(model):
        name = variable_name(v)
        if name not in weights:
            raise ValueError(f"weights lack {name!r}")
        w = weights[name]
        if tuple(w.shape) != tuple(v.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(w.shape)}, the model needs {tuple(v.shape)}")
        v.assign(w)


def expected_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Weight names and shapes of the architecture, computed without TensorFlow."""
    shapes: dict[str, tuple[int, ...]] = {}
    if arch.kind == "mlp":
        for tower, out in (("pi", arch.n_outputs), ("v", 1)):
            fan_in = arch.obs_shape[0]
            for i, units in enumerate(arch.hidden):
                shapes[f"{tower}_h{i}/kernel"] = (fan_in, units)
                shapes[f"{tower}_h{i}/bias"] = (units,)
                fan_in = units
            shapes[f"{tower}_out/kernel"] = (fan_in, out)
            shapes[f"{tower}_out/bias"] = (out,)
    else:
        h, w, c = arch.image_shape
        for name, side, filters, stride in arch.conv_layers():
            shapes[f"{name}/kernel"], shapes[f"{name}/bias"] = (side, side, c, filters), (filters,)
            h, w, c = (h - side) // stride + 1, (w - side) // stride + 1, filters
        flat = h * w * c
        shapes["dense0/kernel"], shapes["dense0/bias"] = (flat, arch.dense_units), (arch.dense_units,)
        shapes["pi_out/kernel"], shapes["pi_out/bias"] = (arch.dense_units, arch.n_outputs), (arch.n_outputs,)
        shapes["v_out/kernel"], shapes["v_out/bias"] = (arch.dense_units, 1), (1,)
    if arch.continuous:
        shapes[LOG_STD_NAME] = (arch.n_outputs,)
    return shapes


def check_weights(arch: Architecture, weights: Mapping[str, np.ndarray]) -> None:
    """Raise ValueError unless ``weights`` has exactly the architecture's names and shapes."""
    want = expected_shapes(arch)
    if set(want) != set(weights):
        missing, extra = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
        raise ValueError(f"weight names differ: missing {missing[:4]}, unexpected {extra[:4]}")
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")


def _conv_valid(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray, stride: int = 1, *,
                channels_first: bool = False) -> np.ndarray:
    """'valid' convolution of NHWC (or NCHW, ``channels_first``) input to NHWC output, as one matmul over
    the (strided) sliding windows: the windows are a view, and the one copy is the (B*H'*W', kh*kw*C)
    patch matrix the matmul needs (channels-first input is reordered in that same copy)."""
    kh, kw, c, f = kernel.shape
    if channels_first:
        win = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))[:, :, ::stride, ::stride]
        b, _, ho, wo = win.shape[:4]  # B,C,H',W',kh,kw
        patches = win.transpose(0, 2, 3, 4, 5, 1).reshape(b * ho * wo, kh * kw * c)
        out: np.ndarray = (patches @ kernel.reshape(kh * kw * c, f) + bias).reshape(b, ho, wo, f)
        return out
    win = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(1, 2))  # B,H',W',C,kh,kw
    if stride != 1:
        win = win[:, ::stride, ::stride]
    b, ho, wo = win.shape[:3]
    patches = win.transpose(0, 1, 2, 4, 5, 3).reshape(b * ho * wo, kh * kw * c)
    out = (patches @ kernel.reshape(kh * kw * c, f) + bias).reshape(b, ho, wo, f)
    return out


class NumpyPolicy:
    """The actor-critic forward pass in numpy, for acting in worker groups (no TensorFlow)."""

    def __init__(self, arch: Architecture) -> None:
        self.arch = arch
        self.w: dict[str, np.ndarray] = {}
        self.version = -1
        self._spare: dict[str, np.ndarray] | None = None

    def spare(self) -> dict[str, np.ndarray]:
        """Arrays (not the live weights) that the next weights may be received into; see :meth:`swap_in`."""
        if self._spare is None:
            self._spare = {k: np.empty(shape, np.float32) for k, shape in expected_shapes(self.arch).items()}
        return self._spare

    def swap_in(self, weights: dict[str, np.ndarray], version: int) -> bool:
        """Make ``weights`` live without copying if they are :meth:`spare`'s arrays (the old live set
        becomes the spare); otherwise copy them in. Returns True when no copy was made."""
        spare = self._spare
        if spare is not None and weights.keys() == spare.keys() and all(weights[k] is spare[k] for k in spare):
            self._spare = self.w if set(self.w) == set(spare) else None
            self.w = spare
            self.version = version
            return True
        self.set_weights(weights, version)
        return False

    def set_weights(self, weights: Mapping[str, np.ndarray], version: int) -> None:
        check_weights(self.arch, weights)
        if set(self.w) == set(weights):
            # Copy into the arrays we already have: no allocation, no page faults on big models.
            for k, v in weights.items():
                np.copyto(self.w[k], v, casting="same_kind")
        else:
            self.w = {k: np.array(v, dtype=np.float32, copy=True) for k, v in weights.items()}
        self.version = version

    def forward(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """obs (B, *obs_shape) float32 -> (logits or means (B, n), values (B,))."""
        w, a = self.w, self.arch
        x = obs.astype(np.float32, copy=False)
        if a.kind == "mlp":
            h = x
            for i in range(len(a.hidden)):
                h = np.tanh(h @ w[f"pi_h{i}/kernel"] + w[f"pi_h{i}/bias"])
            pi = h @ w["pi_out/kernel"] + w["pi_out/bias"]
            g = x
            for i in range(len(a.hidden)):
                g = np.tanh(g @ w[f"v_h{i}/kernel"] + w[f"v_h{i}/bias"])
            v = g @ w["v_out/kernel"] + w["v_out/bias"]
        else:
            h = x * np.float32(a.obs_scale) if a.obs_scale != 1.0 else x
            for i, (name, _, _, stride) in enumerate(a.conv_layers()):
                h = np.maximum(_conv_valid(h, w[f"{name}/kernel"], w[f"{name}/bias"], stride,
                                           channels_first=a.channels_first and i == 0), 0)
            h = h.reshape(h.shape[0], -1)
            h = np.maximum(h @ w["dense0/kernel"] + w["dense0/bias"], 0)
            pi = h @ w["pi_out/kernel"] + w["pi_out/bias"]
            v = h @ w["v_out/kernel"] + w["v_out/bias"]
        return pi, v[:, 0]

    def act(self, obs: np.ndarray, rng: np.random.Generator, *, greedy: bool = False
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sample actions. Returns (actions, log-probabilities, values)."""
        out, values = self.forward(obs)
        if not self.arch.continuous:
            z = out - out.max(axis=1, keepdims=True)
            logp_all = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
            if greedy:
                actions = out.argmax(axis=1)
            else:
                # Gumbel-max: one vectorised draw for the whole batch.
                actions = (logp_all - np.log(-np.log(rng.random(out.shape)))).argmax(axis=1)
            logp = logp_all[np.arange(len(actions)), actions]
            return actions.astype(np.int64), logp.astype(np.float32), values.astype(np.float32)
        log_std = self.w[LOG_STD_NAME]
        std = np.exp(log_std)
        noise = np.zeros_like(out) if greedy else rng.standard_normal(out.shape).astype(np.float32)
        actions = out + std * noise
        logp = (-0.5 * noise**2 - log_std - 0.5 * np.log(2 * np.pi)).sum(axis=1)
        return actions.astype(np.float32), logp.astype(np.float32), values.astype(np.float32)

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        """What to pass to a vector env's ``step`` for a batch of sampled actions (Box actions clipped)."""
        if not self.arch.continuous:
            return actions
        clipped: np.ndarray = np.clip(actions, self.arch.action_low, self.arch.action_high)
        return clipped

    def env_action(self, action: np.ndarray) -> Any:
        """What to pass to ``env.step`` for one sampled action (Box actions are clipped to bounds)."""
        if not self.arch.continuous:
            return int(action)
        return np.clip(action, self.arch.action_low, self.arch.action_high)
