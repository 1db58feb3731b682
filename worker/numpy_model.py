"""A Keras model's inference pass in plain numpy: what worker groups act with when every layer has a numpy
implementation, and what ``launcher eval`` plays a saved policy with. No TensorFlow or Keras here.

Why: a Python call into TensorFlow costs >= 0.4 ms of fixed overhead and an eager ``model(x)`` 2.7-4.2 ms for
a small MLP, while the same forward pass in numpy takes 0.01-0.07 ms (shared/MEASURED.md); and a group that
never imports TensorFlow starts seconds earlier and holds ~260 MiB less.

A :class:`Program` is plain data (JSON): the model's layers in topological order, each with the few settings
its numpy implementation needs, the names of the weights it reads, and which of its outputs feed which layer.
The master makes it from the user's Keras model (:mod:`worker.keras_convert`), checks it against Keras on random
inputs, and sends it to the groups; they run it with :class:`NumpyModel` over weights that arrive by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

PROGRAM_VERSION = 1

# ------------------------------------------------------------------------------------------ activations
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = x - x.max(axis=axis, keepdims=True)
    e = np.exp(z)
    out: np.ndarray = e / e.sum(axis=axis, keepdims=True)
    return out


def _erf(x: np.ndarray) -> np.ndarray:
    """Vectorised erf (numpy has none; ``math.erf`` per element would be slow on big batches)."""
    # Abramowitz-Stegun 7.1.26 is too coarse for the 1e-5 check; use the float64 math.erf through frompyfunc
    # only for small arrays, which is what acting sees, and np.vectorize keeps the dtype right.
    return np.vectorize(math.erf, otypes=[np.float64])(x.astype(np.float64)).astype(x.dtype)


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "linear": lambda x: x,
    "relu": lambda x: np.maximum(x, 0),
    "relu6": lambda x: np.clip(x, 0, 6),
    "tanh": np.tanh,
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "hard_sigmoid": lambda x: np.clip(x / 6.0 + 0.5, 0.0, 1.0),
    "softmax": _softmax,
    "softplus": lambda x: np.logaddexp(x, 0).astype(x.dtype),
    "softsign": lambda x: x / (1.0 + np.abs(x)),
    "elu": lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0))),
    "selu": lambda x: 1.0507009873554805 * np.where(x > 0, x, 1.6732632423543772 * np.expm1(np.minimum(x, 0))),
    "leaky_relu": lambda x: np.where(x > 0, x, 0.2 * x),
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "swish": lambda x: x / (1.0 + np.exp(-x)),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "gelu_approximate": lambda x: 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3))),
    "exponential": np.exp,
    "mish": lambda x: x * np.tanh(np.logaddexp(x, 0)),
}


# --------------------------------------------------------------------------------------------- program
@dataclass(frozen=True)
class Node:
    """One layer call: ``op`` (a key of :data:`OPS`), its settings, the weights it reads (by name, in the
    order its implementation takes them) and its inputs as (node index, output index) pairs; index -1 is the
    model's input."""

    op: str
    name: str
    config: Mapping[str, Any] = field(default_factory=dict)
    weights: tuple[str, ...] = ()
    inputs: tuple[tuple[int, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "name": self.name, "config": dict(self.config), "weights": list(self.weights),
                "inputs": [list(i) for i in self.inputs]}


@dataclass(frozen=True)
class Program:
    """A model's inference pass as data (see the module doc).

    Attributes:
        input_shape: one observation's shape; input_dtype: its dtype as the model declares it.
        nodes: in an order where every node's inputs come first.
        outputs: (node index, output index) of each model output, in the model's output order.
        weights: every weight of the model (trainable or not) as (name, shape), in ``model.weights`` order:
            the order a group's own Keras model (TensorFlow acting path) takes them in.
    """

    input_shape: tuple[int, ...]
    input_dtype: str
    nodes: tuple[Node, ...]
    outputs: tuple[tuple[int, int], ...]
    weights: tuple[tuple[str, tuple[int, ...]], ...]
    version: int = PROGRAM_VERSION

    @property
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, shape in self.weights}

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "input_shape": list(self.input_shape), "input_dtype": self.input_dtype,
                "nodes": [n.to_dict() for n in self.nodes], "outputs": [list(o) for o in self.outputs],
                "weights": [[name, list(shape)] for name, shape in self.weights]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Program":
        """Read a program sent by the master or saved with a model. Raises ValueError (never anything else)
        on a document that is not one: it comes over the network or from a results directory."""
        try:
            if d.get("version") != PROGRAM_VERSION:
                raise ValueError(f"program version {d.get('version')!r} is not {PROGRAM_VERSION}")
            nodes = tuple(Node(op=str(n["op"]), name=str(n["name"]), config=dict(n.get("config") or {}),
                               weights=tuple(str(w) for w in n.get("weights", ())),
                               inputs=tuple((int(a), int(b)) for a, b in n.get("inputs", ())))
                          for n in d["nodes"])
            prog = cls(input_shape=tuple(int(x) for x in d["input_shape"]), input_dtype=str(d["input_dtype"]),
                       nodes=nodes, outputs=tuple((int(a), int(b)) for a, b in d["outputs"]),
                       weights=tuple((str(name), tuple(int(x) for x in shape)) for name, shape in d["weights"]))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a model program: {type(exc).__name__}: {exc}") from None
        prog.check()
        return prog

    def check(self) -> None:
        """Raise ValueError unless every op is known, every input comes earlier and every weight is declared."""
        known = self.weight_shapes
        for i, n in enumerate(self.nodes):
            if n.op not in OPS:
                raise ValueError(f"layer {n.name!r}: no numpy implementation of {n.op!r}")
            for src, _ in n.inputs:
                if not -1 <= src < i:
                    raise ValueError(f"layer {n.name!r} reads node {src}, which does not come before it")
            for w in n.weights:
                if w not in known:
                    raise ValueError(f"layer {n.name!r} reads weight {w!r}, which the program does not declare")
        for src, _ in self.outputs:
            if not -1 <= src < len(self.nodes):
                raise ValueError(f"an output reads node {src}, which does not exist")


# ------------------------------------------------------------------------------------------------ ops
# Each op: (config, weights, inputs) -> list of outputs. Inputs are float32 arrays with a leading batch axis.
Op = Callable[[Mapping[str, Any], Sequence[np.ndarray], Sequence[np.ndarray]], list[np.ndarray]]


def _act(name: str | None) -> Callable[[np.ndarray], np.ndarray]:
    return ACTIVATIONS[name or "linear"]


def _dense(cfg: Mapping[str, Any], w: Sequence[np.ndarray], x: Sequence[np.ndarray]) -> list[np.ndarray]:
    y = x[0] @ w[0]
    if len(w) > 1:
        y = y + w[1]
    return [_act(cfg.get("activation"))(y)]


def _pad_same(x: np.ndarray, kh: int, kw: int, sh: int, sw: int) -> np.ndarray:
    """Zero-pad NHWC ``x`` as TensorFlow's 'same' padding does (the extra row/column at the end)."""
    h, w = x.shape[1:3]
    out_h, out_w = -(-h // sh), -(-w // sw)
    ph = max((out_h - 1) * sh + kh - h, 0)
    pw = max((out_w - 1) * sw + kw - w, 0)
    return np.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))


def _windows(x: np.ndarray, kh: int, kw: int, sh: int, sw: int) -> np.ndarray:
    """(B, H', W', C, kh, kw) strided windows of NHWC ``x`` (a view)."""
    win = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(1, 2))
    if sh != 1 or sw != 1:
        win = win[:, ::sh, ::sw]
    return win


def _conv2d(cfg: Mapping[str, Any], w: Sequence[np.ndarray], x: Sequence[np.ndarray]) -> list[np.ndarray]:
    kernel = w[0]
    kh, kw, c, f = kernel.shape
    sh, sw = cfg["strides"]
    inp = _pad_same(x[0], kh, kw, sh, sw) if cfg["padding"] == "same" else x[0]
    win = _windows(inp, kh, kw, sh, sw)
    b, ho, wo = win.shape[:3]
    # One matmul over the (B*H'*W', kh*kw*C) patch matrix: the windows are a view, the patches the one copy.
    patches = win.transpose(0, 1, 2, 4, 5, 3).reshape(b * ho * wo, kh * kw * c)
    y = (patches @ kernel.reshape(kh * kw * c, f)).reshape(b, ho, wo, f)
    if len(w) > 1:
        y = y + w[1]
    return [_act(cfg.get("activation"))(y)]


def _pool2d(reduce: Callable[..., np.ndarray]) -> Op:
    def pool(cfg: Mapping[str, Any], w: Sequence[np.ndarray], x: Sequence[np.ndarray]) -> list[np.ndarray]:
        kh, kw = cfg["pool_size"]
        sh, sw = cfg["strides"]
        inp = x[0]
        if cfg["padding"] == "same":
            if reduce is np.max:
                h, wd = inp.shape[1:3]
                ph = max((-(-h // sh) - 1) * sh + kh - h, 0)
                pw = max((-(-wd // sw) - 1) * sw + kw - wd, 0)
                inp = np.pad(inp, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)),
                             constant_values=-np.inf)
            else:
                raise ValueError("average pooling with 'same' padding has no numpy implementation")
        return [reduce(_windows(inp, kh, kw, sh, sw), axis=(4, 5)).astype(x[0].dtype, copy=False)]
    return pool


def _batch_norm(cfg: Mapping[str, Any], w: Sequence[np.ndarray], x: Sequence[np.ndarray]) -> list[np.ndarray]:
    # Inference: the moving statistics. Weights come as [gamma?, beta?, moving_mean, moving_variance].
    it = iter(w)
    gamma = next(it) if cfg["scale"] else None
    beta = next(it) if cfg["center"] else None
    mean, var = next(it), next(it)
    inv = 1.0 / np.sqrt(var + np.float32(cfg["epsilon"]))
    if gamma is not None:
        inv = inv * gamma
    y = (x[0] - mean) * inv
    if beta is not None:
        y = y + beta
    return [y]


def _layer_norm(cfg: Mapping[str, Any], w: Sequence[np.ndarray], x: Sequence[np.ndarray]) -> list[np.ndarray]:
    axes = tuple(cfg["axis"])
    mean = x[0].mean(axis=axes, keepdims=True)
    var = x[0].var(axis=axes, keepdims=True)
    y = (x[0] - mean) / np.sqrt(var + np.float32(cfg["epsilon"]))
    it = iter(w)
    if cfg["scale"]:
        y = y * next(it)
    if cfg["center"]:
        y = y + next(it)
    return [y]


def _relu_layer(cfg: Mapping[str, Any], w: Sequence[np.ndarray], x: Sequence[np.ndarray]) -> list[np.ndarray]:
    v = x[0]
    slope, threshold, max_value = cfg.get("negative_slope", 0.0), cfg.get("threshold", 0.0), cfg.get("max_value")
    y = np.where(v >= threshold, v, slope * (v - threshold)) if slope else np.where(v > threshold, v, 0)
    if max_value is not None:
        y = np.minimum(y, max_value)
    return [y.astype(v.dtype, copy=False)]


def _rescaling(cfg: Mapping[str, Any], w: Sequence[np.ndarray], x: Sequence[np.ndarray]) -> list[np.ndarray]:
    scale = np.asarray(cfg["scale"], np.float32)
    offset = np.asarray(cfg["offset"], np.float32)
    return [x[0].astype(np.float32, copy=False) * scale + offset]


def _reshape(cfg: Mapping[str, Any], w: Sequence[np.ndarray], x: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [x[0].reshape(x[0].shape[0], *cfg["target_shape"])]


def _permute(cfg: Mapping[str, Any], w: Sequence[np.ndarray], x: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [x[0].transpose(0, *cfg["dims"])]


def _merge(fn: Callable[[Sequence[np.ndarray]], np.ndarray]) -> Op:
    return lambda cfg, w, x: [fn(x)]


OPS: dict[str, Op] = {
    "Dense": _dense,
    "Conv2D": _conv2d,
    "MaxPooling2D": _pool2d(np.max),
    "AveragePooling2D": _pool2d(np.mean),
    "GlobalAveragePooling2D": lambda cfg, w, x: [x[0].mean(axis=(1, 2))],
    "GlobalMaxPooling2D": lambda cfg, w, x: [x[0].max(axis=(1, 2))],
    "BatchNormalization": _batch_norm,
    "LayerNormalization": _layer_norm,
    "Activation": lambda cfg, w, x: [_act(cfg["activation"])(x[0])],
    "ReLU": _relu_layer,
    "LeakyReLU": lambda cfg, w, x: [np.where(x[0] > 0, x[0], np.float32(cfg["negative_slope"]) * x[0])],
    "ELU": lambda cfg, w, x: [np.where(x[0] > 0, x[0], np.float32(cfg["alpha"]) * np.expm1(np.minimum(x[0], 0)))],
    "Softmax": lambda cfg, w, x: [_softmax(x[0], axis=cfg.get("axis", -1))],
    "Identity": lambda cfg, w, x: [x[0]],  # also Dropout, GaussianNoise, ...: identities at inference
    "Flatten": lambda cfg, w, x: [x[0].reshape(x[0].shape[0], -1)],
    "Reshape": _reshape,
    "Permute": _permute,
    "Rescaling": _rescaling,
    "Cast": lambda cfg, w, x: [x[0].astype(cfg["dtype"], copy=False)],
    "Concatenate": lambda cfg, w, x: [np.concatenate(list(x), axis=cfg["axis"])],
    "Add": _merge(lambda xs: sum(xs[1:], xs[0])),
    "Subtract": _merge(lambda xs: xs[0] - xs[1]),
    "Multiply": _merge(lambda xs: np.prod(np.stack(xs), axis=0)),
    "Average": _merge(lambda xs: np.mean(np.stack(xs), axis=0)),
    "Maximum": _merge(lambda xs: np.max(np.stack(xs), axis=0)),
    "Minimum": _merge(lambda xs: np.min(np.stack(xs), axis=0)),
}


# --------------------------------------------------------------------------------------------- runtime
def check_shapes(shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, np.ndarray]) -> None:
    """Raise ValueError unless ``weights`` has exactly the names of ``shapes``, each of its shape (the message
    names the first that differs)."""
    if set(shapes) != set(weights):
        missing, extra = sorted(set(shapes) - set(weights)), sorted(set(weights) - set(shapes))
        raise ValueError(f"weight names differ: missing {missing[:4]}, unexpected {extra[:4]}")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")


class NumpyModel:
    """Runs a :class:`Program` over weights held by name: ``model(obs)`` returns the model's outputs as a
    tuple of arrays, as the Keras model would in inference.

    Weights arrive by name (:meth:`set_weights`), or are received straight into spare arrays and swapped in
    without a copy (:meth:`spare`, :meth:`swap_in`): a group's weight frames land in memory the policy can use.
    """

    def __init__(self, program: Program) -> None:
        self.program = program
        self.shapes = program.weight_shapes
        self.w: dict[str, np.ndarray] = {}
        self.version = -1
        self._spare: dict[str, np.ndarray] | None = None
        self._steps = [(OPS[n.op], n.config, n.weights, n.inputs) for n in program.nodes]

    # -- weights
    def check_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Raise ValueError unless ``weights`` has exactly the program's names and shapes."""
        check_shapes(self.shapes, weights)

    def spare(self) -> dict[str, np.ndarray]:
        """Arrays (not the live weights) that the next weights may be received into; see :meth:`swap_in`."""
        if self._spare is None:
            self._spare = {k: np.empty(shape, np.float32) for k, shape in self.shapes.items()}
        return self._spare

    def swap_in(self, weights: dict[str, np.ndarray], version: int) -> bool:
        """Make ``weights`` live without copying if they are :meth:`spare`'s arrays (the old live set becomes
        the spare); otherwise copy them in. Returns True when no copy was made."""
        spare = self._spare
        if spare is not None and weights.keys() == spare.keys() and all(weights[k] is spare[k] for k in spare):
            self._spare = self.w if set(self.w) == set(spare) else None
            self.w = spare
            self.version = version
            return True
        self.set_weights(weights, version)
        return False

    def set_weights(self, weights: Mapping[str, np.ndarray], version: int) -> None:
        self.check_weights(weights)
        if set(self.w) == set(weights):
            for k, v in weights.items():  # into the arrays we have: no allocation, no page faults on big models
                np.copyto(self.w[k], v, casting="same_kind")
        else:
            self.w = {k: np.array(v, dtype=np.float32, copy=True) for k, v in weights.items()}
        self.version = version

    # -- inference
    def __call__(self, obs: np.ndarray) -> tuple[np.ndarray, ...]:
        """The model's outputs for a batch of observations ``obs`` (B, *input_shape)."""
        x = obs.astype(np.float32, copy=False)  # as Keras casts integer frames (uint8 images) for float layers
        values: list[list[np.ndarray]] = []
        w = self.w
        for op, cfg, names, inputs in self._steps:
            args = [x if src < 0 else values[src][k] for src, k in inputs]
            values.append(op(cfg, [w[n] for n in names], args))
        return tuple(x if src < 0 else values[src][k] for src, k in self.program.outputs)
