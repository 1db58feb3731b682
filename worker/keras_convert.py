"""From a Keras model to a numpy :class:`~worker.numpy_model.Program`, and the check that both agree.

The master converts the run's model once at start. When every layer has a numpy implementation (Dense,
Conv2D, BatchNormalization in inference, LayerNormalization, pooling, Flatten/Reshape/Permute/Rescaling, the
merge layers, the common activations; Dropout and noise layers are identities at inference) the program is run
on random observations beside Keras and must match; the groups then act in numpy. Anything else (an LSTM, a
custom layer, a Lambda, a nested model, named outputs) keeps the model on TensorFlow in the groups, and
:func:`convert` says which layer decided it.

Reads the model through its public ``get_config()`` (the functional graph: each layer's class, settings and
inbound tensors) and its variables. Imports Keras; the master and the TensorFlow acting path use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np

from worker.numpy_model import ACTIVATIONS, Node, NumpyModel, Program

IDENTITIES = frozenset({"Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D", "GaussianNoise",
                        "GaussianDropout", "AlphaDropout", "ActivityRegularization", "Identity"})
MERGES = frozenset({"Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum", "Concatenate"})
CHECK_RTOL, CHECK_ATOL = 1e-3, 1e-4


class Unsupported(ValueError):
    """The model has a part with no numpy implementation; the message names it."""


@dataclass(frozen=True)
class Conversion:
    """What :func:`convert` found: a checked ``program``, or None and the ``reason`` the groups need TensorFlow."""

    program: Program | None
    reason: str
    max_error: float | None = None


def weight_names(model: Any) -> list[str]:
    """Unique names of ``model.weights`` in their order: each variable's path (``dense/kernel``), with ``#k``
    added to a path seen before (a nested model may repeat one). Weights travel under these names."""
    names, seen = [], set()
    for v in model.weights:
        name = str(getattr(v, "path", None) or v.name)
        k, unique = 1, name
        while unique in seen:
            unique, k = f"{name}#{k}", k + 1
        seen.add(unique)
        names.append(unique)
    return names


def get_weights(model: Any) -> dict[str, np.ndarray]:
    """Every weight of ``model`` (trainable or not: batch-norm statistics act too) as float32 by name."""
    return {n: np.asarray(v.numpy(), dtype=np.float32) for n, v in zip(weight_names(model), model.weights)}


def set_weights(model: Any, weights: Mapping[str, np.ndarray], names: list[str] | None = None) -> None:
    """Assign ``weights`` to ``model`` in ``model.weights`` order under ``names`` (the sender's names, which a
    model built in another process may not share: Keras numbers unnamed layers per process). Raises
    ValueError naming the first weight that is missing or of another shape."""
    names = names if names is not None else weight_names(model)
    if len(names) != len(model.weights):
        raise ValueError(f"the model has {len(model.weights)} weights, the sender named {len(names)}")
    for name, v in zip(names, model.weights):
        if name not in weights:
            raise ValueError(f"weights lack {name!r}")
        w = weights[name]
        if tuple(w.shape) != tuple(v.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(w.shape)}, the model needs {tuple(v.shape)}")
        v.assign(w)


# ------------------------------------------------------------------------------------------ conversion
def _functional(model: Any) -> Any:
    import keras

    if isinstance(model, keras.Sequential):
        return keras.Model(model.inputs, model.outputs)  # the same layers and variables, as a graph
    return model


def _tensors(obj: Any) -> Iterator[tuple[str, int, int]]:
    """The (layer, node index, tensor index) of every Keras tensor in a serialized call's arguments."""
    if isinstance(obj, dict):
        if obj.get("class_name") == "__keras_tensor__":
            layer, node, index = obj["config"]["keras_history"]
            yield str(layer), int(node), int(index)
            return
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _refs(spec: Any) -> list[tuple[str, int, int]]:
    """``input_layers``/``output_layers`` of a functional config as a list of (layer, node, tensor)."""
    if isinstance(spec, dict):
        raise Unsupported("the model has named (dict) outputs; return a list or a tuple of outputs")
    if len(spec) == 3 and isinstance(spec[0], str):
        return [(str(spec[0]), int(spec[1]), int(spec[2]))]
    return [(str(s[0]), int(s[1]), int(s[2])) for s in spec]


def _activation(value: Any, where: str) -> str:
    if isinstance(value, str) and value in ACTIVATIONS:
        return value
    raise Unsupported(f"{where}: activation {value!r} has no numpy implementation")


def _pair(v: Any) -> list[int]:
    return [int(v), int(v)] if isinstance(v, int) else [int(x) for x in v]


def _settings(cls: str, cfg: Mapping[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    """(op, the settings its numpy implementation needs) for one layer, or Unsupported."""
    if cfg.get("data_format", "channels_last") != "channels_last":
        raise Unsupported(f"{where}: data_format {cfg.get('data_format')!r}; numpy acting takes channels_last")
    if cls in IDENTITIES:
        return "Identity", {}
    if cls == "Dense":
        if cfg.get("lora_rank"):
            raise Unsupported(f"{where}: LoRA")
        return "Dense", {"activation": _activation(cfg.get("activation"), where)}
    if cls == "Conv2D":
        if _pair(cfg.get("dilation_rate", 1)) != [1, 1] or int(cfg.get("groups", 1)) != 1:
            raise Unsupported(f"{where}: dilated or grouped convolution")
        if cfg.get("padding") not in ("valid", "same"):
            raise Unsupported(f"{where}: padding {cfg.get('padding')!r}")
        return "Conv2D", {"strides": _pair(cfg["strides"]), "padding": cfg["padding"],
                          "activation": _activation(cfg.get("activation"), where)}
    if cls in ("MaxPooling2D", "AveragePooling2D"):
        strides = cfg.get("strides") or cfg["pool_size"]
        if cls == "AveragePooling2D" and cfg.get("padding") == "same":
            raise Unsupported(f"{where}: average pooling with 'same' padding")
        return cls, {"pool_size": _pair(cfg["pool_size"]), "strides": _pair(strides), "padding": cfg["padding"]}
    if cls in ("GlobalAveragePooling2D", "GlobalMaxPooling2D"):
        if cfg.get("keepdims"):
            raise Unsupported(f"{where}: keepdims")
        return cls, {}
    if cls == "BatchNormalization":
        if cfg.get("axis") not in (-1, [-1]) or cfg.get("renorm"):
            raise Unsupported(f"{where}: batch normalisation over axis {cfg.get('axis')!r}; numpy takes the last")
        return cls, {"epsilon": float(cfg["epsilon"]), "center": bool(cfg["center"]), "scale": bool(cfg["scale"])}
    if cls == "LayerNormalization":
        if cfg.get("rms_scaling"):
            raise Unsupported(f"{where}: RMS scaling")
        axis = cfg["axis"]
        return cls, {"axis": [int(a) for a in (axis if isinstance(axis, (list, tuple)) else [axis])],
                     "epsilon": float(cfg["epsilon"]), "center": bool(cfg["center"]), "scale": bool(cfg["scale"])}
    if cls == "Activation":
        return cls, {"activation": _activation(cfg.get("activation"), where)}
    if cls == "ReLU":
        mv = cfg.get("max_value")
        return cls, {"max_value": None if mv is None else float(mv), "negative_slope": float(cfg.get("negative_slope", 0)),
                     "threshold": float(cfg.get("threshold", 0))}
    if cls == "LeakyReLU":
        return cls, {"negative_slope": float(cfg.get("negative_slope", 0.3))}
    if cls == "ELU":
        return cls, {"alpha": float(cfg.get("alpha", 1.0))}
    if cls == "Softmax":
        axis = cfg.get("axis", -1)
        if isinstance(axis, (list, tuple)):
            raise Unsupported(f"{where}: softmax over several axes")
        return cls, {"axis": int(axis)}
    if cls == "Flatten":
        return cls, {}
    if cls == "Reshape":
        target = [int(x) for x in cfg["target_shape"]]
        return cls, {"target_shape": target}
    if cls == "Permute":
        return cls, {"dims": [int(d) for d in cfg["dims"]]}
    if cls == "Rescaling":
        scale, offset = cfg["scale"], cfg["offset"]
        if isinstance(scale, dict) or isinstance(offset, dict):
            raise Unsupported(f"{where}: a tensor-valued scale")
        return cls, {"scale": scale, "offset": offset}
    if cls == "Concatenate":
        return cls, {"axis": int(cfg.get("axis", -1))}
    if cls in MERGES:
        return cls, {}
    raise Unsupported(f"{where}: {cls} has no numpy implementation")


def to_program(model: Any) -> Program:
    """The numpy program of ``model`` (a functional or Sequential Keras model with one input).

    Raises:
        Unsupported: a layer, setting or structure with no numpy implementation (the message names it).
    """
    import keras

    graph = _functional(model)
    try:
        config = graph.get_config()
    except Exception as exc:  # noqa: BLE001 - a subclassed model raises NotImplementedError, others anything
        raise Unsupported(f"the model's graph cannot be read ({type(exc).__name__}: {exc}); "
                          "build it with the functional API or keras.Sequential") from None
    if not isinstance(config, dict) or "layers" not in config:
        raise Unsupported("the model is not a functional or Sequential Keras model (a subclassed model's graph "
                          "cannot be read); build it with the functional API or keras.Sequential")
    inputs = _refs(config["input_layers"])
    if len(inputs) != 1:
        raise Unsupported(f"the model has {len(inputs)} inputs; acting gives it one (the observation)")
    input_name = inputs[0][0]
    names = dict(zip([id(v) for v in graph.weights], weight_names(graph)))
    node_index: dict[tuple[str, int], int] = {}
    nodes: list[Node] = []
    pending = []
    for layer_cfg in config["layers"]:
        cls, name = layer_cfg["class_name"], layer_cfg["config"]["name"]
        if cls == "InputLayer":
            continue
        if layer_cfg.get("module") not in (None, "keras.layers") and cls not in IDENTITIES:
            raise Unsupported(f"layer {name!r}: {cls} from {layer_cfg.get('module')!r} is not a stock Keras layer")
        layer = graph.get_layer(name)
        if isinstance(layer, keras.Model):
            raise Unsupported(f"layer {name!r}: a nested model")
        op, settings = _settings(cls, layer_cfg["config"], f"layer {name!r} ({cls})")
        weights = tuple(names[id(v)] for v in layer.weights)
        for k, call in enumerate(layer_cfg.get("inbound_nodes", [])):
            if call.get("kwargs") and any(True for _ in _tensors(call["kwargs"])):
                raise Unsupported(f"layer {name!r}: tensors passed as keyword arguments")
            pending.append((name, k, op, settings, weights, list(_tensors(call.get("args", ())))))
    # Order the calls so that each comes after what it reads (get_config lists layers, not calls).
    while pending:
        progressed = False
        for item in list(pending):
            name, k, op, settings, weights, srcs = item
            if all(s[0] == input_name or (s[0], s[1]) in node_index for s in srcs):
                ins = tuple((-1, 0) if s[0] == input_name else (node_index[(s[0], s[1])], s[2]) for s in srcs)
                node_index[(name, k)] = len(nodes)
                nodes.append(Node(op=op, name=name, config=settings, weights=weights, inputs=ins))
                pending.remove(item)
                progressed = True
        if not progressed:
            raise Unsupported(f"layer {pending[0][0]!r} reads a tensor that is not in the model's graph")
    outputs = tuple((-1, 0) if o[0] == input_name else (node_index[(o[0], o[1])], o[2])
                    for o in _refs(config["output_layers"]))
    shape = tuple(int(d) for d in graph.inputs[0].shape[1:])
    program = Program(input_shape=shape, input_dtype=str(graph.inputs[0].dtype), nodes=tuple(nodes),
                      outputs=outputs, weights=tuple((n, tuple(int(d) for d in v.shape))
                                                     for n, v in zip(weight_names(graph), graph.weights)))
    program.check()
    return program


def sample_inputs(observation_space: Any, n: int, seed: int) -> np.ndarray:
    """``n`` observations drawn from ``observation_space`` (bounded boxes uniformly, unbounded ones from a
    standard normal), as a batch."""
    low = np.broadcast_to(np.asarray(observation_space.low, np.float64), observation_space.shape)
    high = np.broadcast_to(np.asarray(observation_space.high, np.float64), observation_space.shape)
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal((n, *observation_space.shape))
    bounded = np.isfinite(low) & np.isfinite(high)
    span = np.where(bounded, high - low, 1.0)
    x = np.where(bounded, np.where(bounded, low, 0) + rng.random((n, *observation_space.shape)) * span, normal)
    return x.astype(observation_space.dtype)


def check_program(model: Any, program: Program, observation_space: Any, *, n: int = 16, seed: int = 0) -> float:
    """Run ``program`` and ``model`` (inference) on ``n`` random observations; return the largest error
    relative to the outputs' scale. Raises Unsupported when they disagree beyond float32 rounding."""
    x = sample_inputs(observation_space, n, seed)
    numpy_model = NumpyModel(program)
    numpy_model.set_weights(get_weights(model), 0)
    got = numpy_model(x)
    want = model(x, training=False)
    want = [want] if not isinstance(want, (list, tuple)) else list(want)
    if len(want) != len(got):
        raise Unsupported(f"the numpy pass gave {len(got)} outputs, Keras {len(want)}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, want)):
        b = np.asarray(b, np.float64)
        a = np.asarray(a, np.float64)
        if a.shape != b.shape:
            raise Unsupported(f"output {i}: numpy shape {a.shape}, Keras {b.shape}")
        err = float(np.max(np.abs(a - b) / (CHECK_ATOL + CHECK_RTOL * np.abs(b)))) if a.size else 0.0
        worst = max(worst, err)
        if not err <= 1.0:
            raise Unsupported(f"output {i}: numpy and Keras differ by up to {float(np.max(np.abs(a - b))):.3g} "
                              f"(beyond float32 rounding)")
    return worst


def convert(model: Any, observation_space: Any, *, seed: int = 0) -> Conversion:
    """The checked numpy program of ``model``, or why the groups must act with TensorFlow."""
    try:
        program = to_program(model)
        error = check_program(model, program, observation_space, seed=seed)
    except Unsupported as exc:
        return Conversion(None, str(exc))
    return Conversion(program, "every layer has a numpy implementation and matched Keras on random inputs", error)
