"""How a worker group runs the model: the master's SETUP says numpy (a :class:`~worker.numpy_model.Program`
converted from the Keras model and checked against it) or TensorFlow (the group builds the model itself, one
runtime per group, and calls it compiled and batched). Either way ``policy(obs)`` gives the model's outputs
and weights arrive by name.

Weights land straight in spare arrays (the frame decoder writes into them), then are swapped in at a payload
boundary; on the TensorFlow path they are assigned to the group's variables from there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from worker.numpy_model import NumpyModel, Program, check_shapes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Setup:
    """What the master's SETUP frame says (validated: it came over the network)."""

    acting: str
    reason: str
    weights: tuple[tuple[str, tuple[int, ...]], ...]
    trainable: tuple[str, ...]
    groups_wait: bool
    program: Program | None

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> "Setup":
        """Raises ValueError on anything that is not a well-formed SETUP."""
        try:
            acting = str(fields["acting"])
            if acting not in ("numpy", "tensorflow"):
                raise ValueError(f"acting {acting!r}")
            weights = tuple((str(n), tuple(int(d) for d in s)) for n, s in fields["weights"])
            trainable = tuple(str(n) for n in fields.get("trainable", ()))
            program = Program.from_dict(fields["program"]) if fields.get("program") is not None else None
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"SETUP: {type(exc).__name__}: {exc}") from None
        if acting == "numpy" and program is None:
            raise ValueError("SETUP says numpy but sends no program")
        if program is not None and program.weights != weights:
            raise ValueError("SETUP's program names other weights than the SETUP itself")
        return cls(acting, str(fields.get("reason", "")), weights, trainable, bool(fields.get("groups_wait")), program)


def decide_acting(conversion: Any, want: str, shapes: Mapping[str, tuple[int, ...]], trainable: tuple[str, ...], *,
                  groups_wait: bool) -> tuple[Program | None, dict[str, Any], dict[str, Any]]:
    """How the groups act (the master's decision), from the model's :class:`worker.keras_convert.Conversion` and
    ``--acting`` (``want``): numpy when the model converted and matched Keras (unless ``tensorflow`` is asked
    for), else TensorFlow. Returns (the program, the ``acting`` document for status and summary, the SETUP
    frame's fields).

    Raises:
        ValueError: ``--acting numpy`` with a model that does not convert (the message names the layer).
    """
    if want == "numpy" and conversion.program is None:
        raise ValueError(f"--acting numpy, but the model cannot act in numpy: {conversion.reason}")
    path = "numpy" if conversion.program is not None and want != "tensorflow" else "tensorflow"
    reason = conversion.reason if want == "auto" or (path == "tensorflow" and conversion.program is None) \
        else f"--acting {want}"
    acting: dict[str, Any] = {"path": path, "reason": reason}
    if conversion.max_error is not None:
        acting["max_error"] = round(conversion.max_error, 6)
    setup = {"acting": path, "reason": reason, "weights": [[n, list(s)] for n, s in shapes.items()],
             "trainable": list(trainable), "groups_wait": groups_wait,
             "program": conversion.program.to_dict() if path == "numpy" and conversion.program is not None else None}
    return conversion.program, acting, setup


class ActingRuntime:
    """The group's model: numpy or TensorFlow per :class:`Setup`, the current weights and their version.

    Args:
        setup: the master's SETUP.
        build_keras: makes the run's Keras model in this process (imports TensorFlow); used on the TensorFlow
            path, and by :meth:`keras_model` for actors that compute gradients.
    """

    def __init__(self, setup: Setup, build_keras: Any) -> None:
        self.setup = setup
        self.path = setup.acting
        self.shapes = dict(setup.weights)
        self.names = [n for n, _ in setup.weights]
        self.version = -1
        self._build_keras = build_keras
        self._keras: Any = None
        self._call: Any = None
        self.numpy = NumpyModel(setup.program) if setup.program is not None else None
        self._w: dict[str, np.ndarray] = {}
        self._spare: dict[str, np.ndarray] | None = None
        if self.path == "tensorflow":
            self._make_tf_policy()

    # -- weights
    def check(self, weights: Mapping[str, np.ndarray]) -> None:
        """Raise ValueError unless ``weights`` has exactly the SETUP's names and shapes."""
        check_shapes(self.shapes, weights)

    def spare(self) -> dict[str, np.ndarray]:
        """Arrays (not the live weights) that the next weights frame may be received into."""
        if self.numpy is not None:
            return self.numpy.spare()
        if self._spare is None:
            self._spare = {k: np.empty(s, np.float32) for k, s in self.shapes.items()}
        return self._spare

    def swap_in(self, weights: dict[str, np.ndarray], version: int) -> None:
        """Make ``weights`` (checked with :meth:`check`) the live ones, as version ``version``."""
        if self.numpy is not None:
            self.numpy.swap_in(weights, version)
            self._w = self.numpy.w
        else:
            self._w = {k: np.array(v, np.float32, copy=True) for k, v in weights.items()}
        if self._keras is not None:
            self._assign_keras()
        self.version = version

    def weights(self) -> dict[str, np.ndarray]:
        return self._w

    # -- acting
    def policy(self, obs: np.ndarray) -> tuple[np.ndarray, ...]:
        """The model's outputs for a batch of observations, with the current weights."""
        if self.numpy is not None and self.path == "numpy":
            return self.numpy(obs)
        out = self._call(obs)
        return tuple(np.asarray(o) for o in (out if isinstance(out, (list, tuple)) else (out,)))

    def keras_model(self) -> Any:
        """The run's Keras model in this group (built on first use; TensorFlow is imported then), holding the
        current weights from now on."""
        if self._keras is None:
            model = self._build_keras()
            if len(model.weights) != len(self.names):
                raise ValueError(f"the model built in this group has {len(model.weights)} weights, the master's "
                                 f"{len(self.names)}: the model function must build the same model everywhere")
            for name, v in zip(self.names, model.weights):
                if tuple(v.shape) != self.shapes[name]:
                    raise ValueError(f"the model built in this group differs from the master's at {name!r}: "
                                     f"shape {tuple(v.shape)}, the master's {self.shapes[name]}")
            self._keras = model
            if self._w:
                self._assign_keras()
        return self._keras

    def variables(self) -> dict[str, Any]:
        """The group's Keras variables under the master's names (the names payload fields and the learner use)."""
        return dict(zip(self.names, self.keras_model().weights))

    def _assign_keras(self) -> None:
        for name, v in zip(self.names, self._keras.weights):
            v.assign(self._w[name])

    def _make_tf_policy(self) -> None:
        import tensorflow as tf

        model = self.keras_model()
        spec = tf.TensorSpec((None, *model.inputs[0].shape[1:]), model.inputs[0].dtype)

        @tf.function(input_signature=[spec], reduce_retracing=True)
        def call(obs: Any) -> Any:
            return model(obs, training=False)

        dtype = model.inputs[0].dtype
        self._call = lambda obs: call(np.asarray(obs, dtype=getattr(dtype, "as_numpy_dtype", dtype)))
