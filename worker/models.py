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


@dataclass(frozen=True)
class Architecture:
    """Framework-neutral description of the actor-critic network.

    kind: ``mlp`` (vector observations: separate 2-layer tanh towers for policy and value) or ``cnn``
    (grid/image observations: conv 4x4 -> conv 3x3 -> dense, shared by the policy and value heads).
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

    @classmethod
    def for_spaces(cls, observation_space: Any, action_space: Any, hparams: Mapping[str, Any] | None = None) -> "Architecture":
        """Pick the network for a gymnasium env's spaces (rank-3 observations get the CNN)."""
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
        kind = "cnn" if len(obs_shape) == 3 else "mlp"
        if len(obs_shape) not in (1, 3):
            raise ValueError(f"observation shape {obs_shape} is not supported: use a vector or an HxWxC grid")
        return cls(kind=kind, obs_shape=obs_shape, continuous=continuous, n_outputs=n_out,
                   hidden=tuple(hp.get("hidden", (64, 64))), action_low=low, action_high=high)


def build_keras_model(arch: Architecture, seed: int = 0) -> Any:
    """Build the Keras model: input obs -> (policy logits or action mean, value). Imports TensorFlow."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(seed)
    obs = keras.Input(shape=arch.obs_shape, name="obs", dtype="float32")
    ortho = keras.initializers.Orthogonal
    if arch.kind == "mlp":
        x = obs
        for i, units in enumerate(arch.hidden):
            x = keras.layers.Dense(units, activation="tanh", kernel_initializer=ortho(np.sqrt(2)), name=f"pi_h{i}")(x)
        pi = keras.layers.Dense(arch.n_outputs, kernel_initializer=ortho(0.01), name="pi_out")(x)
        y = obs
        for i, units in enumerate(arch.hidden):
            y = keras.layers.Dense(units, activation="tanh", kernel_initializer=ortho(np.sqrt(2)), name=f"v_h{i}")(y)
        v = keras.layers.Dense(1, kernel_initializer=ortho(1.0), name="v_out")(y)
    else:
        f1, f2 = arch.conv_filters
        x = keras.layers.Conv2D(f1, 4, activation="relu", kernel_initializer=ortho(np.sqrt(2)), name="conv0")(obs)
        x = keras.layers.Conv2D(f2, 3, activation="relu", kernel_initializer=ortho(np.sqrt(2)), name="conv1")(x)
        x = keras.layers.Flatten(name="flatten")(x)
        x = keras.layers.Dense(arch.dense_units, activation="relu", kernel_initializer=ortho(np.sqrt(2)), name="dense0")(x)
        pi = keras.layers.Dense(arch.n_outputs, kernel_initializer=ortho(0.01), name="pi_out")(x)
        v = keras.layers.Dense(1, kernel_initializer=ortho(1.0), name="v_out")(x)
    v = keras.layers.Reshape((), name="value")(v)
    model = keras.Model(obs, [pi, v], name=f"actor_critic_{arch.kind}")
    if arch.continuous:
        # A state-independent log standard deviation, trained with the rest.
        model.log_std = tf.Variable(np.full(arch.n_outputs, -0.5, np.float32), name=LOG_STD_NAME, trainable=True)
    return model


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
        h, w, c = arch.obs_shape
        f1, f2 = arch.conv_filters
        shapes["conv0/kernel"], shapes["conv0/bias"] = (4, 4, c, f1), (f1,)
        shapes["conv1/kernel"], shapes["conv1/bias"] = (3, 3, f1, f2), (f2,)
        flat = (h - 3 - 2) * (w - 3 - 2) * f2
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


def _conv_valid(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """NHWC 'valid' convolution, stride 1, as one matmul over sliding windows."""
    kh, kw, c, f = kernel.shape
    win = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(1, 2))  # B,H',W',C,kh,kw
    b, ho, wo = win.shape[:3]
    patches = win.transpose(0, 1, 2, 4, 5, 3).reshape(b * ho * wo, kh * kw * c)
    return (patches @ kernel.reshape(kh * kw * c, f) + bias).reshape(b, ho, wo, f)


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
            h = np.maximum(_conv_valid(x, w["conv0/kernel"], w["conv0/bias"]), 0)
            h = np.maximum(_conv_valid(h, w["conv1/kernel"], w["conv1/bias"]), 0)
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
        return np.clip(actions, self.arch.action_low, self.arch.action_high)

    def env_action(self, action: np.ndarray) -> Any:
        """What to pass to ``env.step`` for one sampled action (Box actions are clipped to bounds)."""
        if not self.arch.continuous:
            return int(action)
        return np.clip(action, self.arch.action_low, self.arch.action_high)
