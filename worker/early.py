"""The groups' first policy before the master has loaded TensorFlow (issue 28 item 2).

A master spends its first seconds importing TensorFlow (~2 s here) and building and tracing the learner (~1 s),
while the groups, which need no TensorFlow, are ready to play after ~1 s. For the built-in algorithms on their
built-in networks (:mod:`worker.models`) the master does not make them wait: it makes the network's numpy
program and its initial weights here, in numpy, from the same :class:`~worker.models.Architecture` and seed
(orthogonal kernels with the Keras model's gains, its biases), with the learner's initial extras (the empty
normalisation statistics, a Box policy's initial log standard deviation), serves the groups with them as weights
version 0, and only then imports TensorFlow. Their first segments wait in the inbox and are used by the normal
lag rule once the learner is ready.

The Keras model is then built and given exactly these weights, and :func:`verify` checks that both agree: the
same weight names, shapes and order as the model's own conversion, the numpy program matching Keras on random
observations, and the same extras as the learner's. A disagreement is a bug in this module: the run fails naming
it (``WORKER_EARLY_START=0`` in the environment starts the old way: TensorFlow first).

Not used (the master starts TensorFlow first, as before) for a user's algorithm or ``--model``, ``--acting
tensorflow``, a run with checkpoints to restore (``--resume``) and a master that recovers a run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from worker.models import Architecture, action_centre
from worker.numpy_model import Node, Program

EARLY_START_ENV = "WORKER_EARLY_START"  # "0": build TensorFlow first (for comparisons); anything else: early


@dataclass(frozen=True)
class EarlyStart:
    """The policy the groups start with: the program, its weights by name (in the Keras model's order), the
    learner's initial extras, and why the master could start early."""

    program: Program
    weights: dict[str, np.ndarray]
    extras: dict[str, np.ndarray]
    reason: str


def early_start(algo: Any, model_ref: str | None, acting: str, seed: int, checkpoints: Path,
                recovering: bool, environ: Mapping[str, str] | None = None) -> EarlyStart | None:
    """The numpy-made start of a built-in algorithm on its built-in network, or None when this run must build
    TensorFlow first (see the module doc)."""
    from worker.algorithms.actor_critic import ActorCritic

    env = os.environ if environ is None else environ
    if env.get(EARLY_START_ENV, "1") == "0" or model_ref or acting == "tensorflow" or recovering:
        return None
    if not isinstance(algo, ActorCritic) or type(algo).model is not ActorCritic.model:
        return None
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return None  # the learner restores a checkpoint: its weights, not these, are the start
    try:
        arch = Architecture.for_spaces(algo.spaces.observation, algo.spaces.action, algo.hp)
    except ValueError:
        return None  # the normal path says why the spaces are not supported
    program, weights = numpy_network(arch, seed)
    return EarlyStart(program, weights, initial_extras(algo), "the built-in network, made in numpy before "
                      "TensorFlow loaded (checked against Keras once it had)")


def initial_extras(algo: Any) -> dict[str, np.ndarray]:
    """What an :class:`~worker.algorithms.actor_critic.ActorCriticLearner`'s ``extras()`` gives before its first
    update: the empty normalisation statistics and a Box policy's initial log standard deviation."""
    from worker.algorithms.actor_critic import LOG_STD
    from worker.normalize import RunningNorm

    obs, ret = algo.normalize
    extras = dict(RunningNorm(algo.spaces.obs_shape if obs else None, ret).stats().arrays())
    if not algo.spaces.discrete:  # a Box policy, as ActorCriticPolicy decides
        extras[LOG_STD] = np.full(algo.spaces.n_actions, float(algo.hp.get("log_std_init", -0.5)), np.float32)
    return extras


# ------------------------------------------------------------------------------------------ the network
def orthogonal(shape: tuple[int, ...], gain: float, rng: np.random.Generator) -> np.ndarray:
    """A kernel drawn as ``keras.initializers.Orthogonal(gain)`` draws it: the QR of a normal matrix over the
    kernel flattened to (fan-in, units), signs fixed by R's diagonal."""
    rows, cols = int(np.prod(shape[:-1])), int(shape[-1])
    a = rng.standard_normal((max(rows, cols), min(rows, cols)))
    q, r = np.linalg.qr(a)
    q *= np.sign(np.diag(r))
    if rows < cols:
        q = q.T
    return (gain * q[:rows, :cols]).reshape(shape).astype(np.float32)


def numpy_network(arch: Architecture, seed: int) -> tuple[Program, dict[str, np.ndarray]]:
    """The program of :func:`worker.models.build_keras_model` for ``arch`` and initial weights for it, in numpy.

    The nodes, their settings, the weight names and their order are those :func:`worker.keras_convert.to_program`
    reads from the Keras model (:func:`verify` checks it on every early start; tests check every kind)."""
    rng = np.random.default_rng(seed)
    nodes: list[Node] = []
    order: list[tuple[str, tuple[int, ...]]] = []
    weights: dict[str, np.ndarray] = {}

    def dense(name: str, src: int, fan_in: int, units: int, activation: str, gain: float,
              bias: list[float] | None = None) -> int:
        kernel, b = f"{name}/kernel", f"{name}/bias"
        weights[kernel] = orthogonal((fan_in, units), gain, rng)
        weights[b] = np.asarray(bias if bias is not None else np.zeros(units), np.float32)
        order.extend([(kernel, (fan_in, units)), (b, (units,))])
        nodes.append(Node("Dense", name, {"activation": activation}, (kernel, b), ((src, 0),)))
        return len(nodes) - 1

    pi_bias = action_centre(arch) if arch.continuous else None
    sqrt2 = float(np.sqrt(2))
    if arch.kind == "mlp":
        # Keras lists each depth's value layer before its policy layer (the order of model.weights).
        fan, v, pi = arch.obs_shape[0], -1, -1
        for i, units in enumerate(arch.hidden):
            v = dense(f"v_h{i}", v, fan, units, "tanh", sqrt2)
            pi = dense(f"pi_h{i}", pi, fan, units, "tanh", sqrt2)
            fan = units
        v = dense("v_out", v, fan, 1, "linear", 1.0)
        pi = dense("pi_out", pi, fan, arch.n_outputs, "linear", 0.01, pi_bias)
    else:
        x = -1
        h, w, c = arch.image_shape
        if arch.channels_first:
            nodes.append(Node("Permute", "channels_last", {"dims": [2, 3, 1]}, (), ((x, 0),)))
            x = len(nodes) - 1
        if arch.obs_scale != 1.0:
            nodes.append(Node("Rescaling", "obs_scale", {"scale": arch.obs_scale, "offset": 0.0}, (), ((x, 0),)))
            x = len(nodes) - 1
        for name, side, filters, stride in arch.conv_layers():
            kernel, b = f"{name}/kernel", f"{name}/bias"
            weights[kernel] = orthogonal((side, side, c, filters), sqrt2, rng)
            weights[b] = np.zeros(filters, np.float32)
            order.extend([(kernel, (side, side, c, filters)), (b, (filters,))])
            nodes.append(Node("Conv2D", name, {"strides": [stride, stride], "padding": "valid",
                                               "activation": "relu"}, (kernel, b), ((x, 0),)))
            x = len(nodes) - 1
            h, w, c = (h - side) // stride + 1, (w - side) // stride + 1, filters
        nodes.append(Node("Flatten", "flatten", {}, (), ((x, 0),)))
        x = dense("dense0", len(nodes) - 1, h * w * c, arch.dense_units, "relu", sqrt2)
        v = dense("v_out", x, arch.dense_units, 1, "linear", 1.0)
        pi = dense("pi_out", x, arch.dense_units, arch.n_outputs, "linear", 0.01, pi_bias)
    nodes.append(Node("Reshape", "value", {"target_shape": []}, (), ((v, 0),)))
    program = Program(input_shape=tuple(arch.obs_shape), input_dtype=arch.obs_dtype, nodes=tuple(nodes),
                      outputs=((pi, 0), (len(nodes) - 1, 0)), weights=tuple(order))
    program.check()
    return program, weights


# ------------------------------------------------------------------------------------------ the check
def verify(early: EarlyStart, model: Any, learner_extras: Mapping[str, np.ndarray], observation_space: Any, *,
           seed: int = 0) -> float:
    """Check that the Keras model, holding ``early.weights``, and the learner agree with what the groups were
    given; return the largest error of the numpy program against Keras (relative to float32 rounding).

    Raises:
        RuntimeError: naming the first disagreement (a weight's name, shape or place; an output; an extra).
    """
    from worker.keras_convert import Unsupported, check_program, to_program

    try:
        keras_weights = to_program(model).weights
    except Unsupported as exc:
        raise RuntimeError(f"early start: the built-in Keras model no longer converts to numpy ({exc})") from None
    if tuple(keras_weights) != tuple(early.program.weights):
        diff = next(((a, b) for a, b in zip(keras_weights, early.program.weights) if a != b),
                    (keras_weights[len(early.program.weights):], early.program.weights[len(keras_weights):]))
        raise RuntimeError(f"early start: the Keras model's weights differ from the numpy-made ones at {diff[0]!r} "
                           f"(numpy: {diff[1]!r})")
    try:
        error = check_program(model, early.program, observation_space, seed=seed)
    except Unsupported as exc:
        raise RuntimeError(f"early start: the numpy-made program disagrees with Keras: {exc}") from None
    if set(learner_extras) != set(early.extras):
        raise RuntimeError(f"early start: the learner's extras are {sorted(learner_extras)}, the groups were given "
                           f"{sorted(early.extras)}")
    for k, v in early.extras.items():
        got = np.asarray(learner_extras[k])
        if got.shape != v.shape or not np.array_equal(got.astype(np.float64), v.astype(np.float64)):
            raise RuntimeError(f"early start: the learner's initial {k} differs from the one the groups were given")
    return error
