"""The public API of launcher, version 1: what an algorithm or a model of your own imports, and nothing else of ours.

A run has two sides, and an algorithm is one class that names both:

* an :class:`Actor` in every worker group: it steps the group's K envs (one vector env, ``ctx.envs``) with the
  current policy (``ctx.policy``) and returns a **payload**: named numpy arrays (a trajectory segment, or a
  gradient it computed itself);
* a :class:`Learner` in the master: it consumes payloads (``update``) and trains the Keras model
  (``ctx.model``); the launcher then hands the model's weights, versioned, to every group.

The :class:`Algorithm` declares its hyper-parameters (:class:`HParam`: default and a one-line doc), the schema
of its payload (:class:`Field` per array: dtype, per-row shape, bounds), which :class:`Schedule` the launcher
runs (a synchronous barrier, overlapped collection with a bounded policy lag, asynchronous updates with a
staleness bound, or a queue threshold), and the Keras model (:meth:`Algorithm.model`; ``--model`` swaps in
another). The launcher owns everything else: processes or containers, GPUs, sockets, validation (a payload
that breaks its schema is refused and counted, naming the field), episode statistics, checkpoints,
``--resume``, TensorBoard, metrics, the exported model, ``launcher eval``.

Acting: when every layer of the model has a numpy implementation the groups act in numpy (no TensorFlow in
the group); otherwise with TensorFlow (one runtime per group, batched and compiled). ``ctx.policy(obs)``
returns the model's outputs either way. See docs/algorithms.md for the guide and the reference.

Run one: ``launcher up --algo path/to/file.py:ClassName`` (or ``--algo package.module:ClassName``).

The value types (:class:`Spaces`, :class:`Field`, :class:`Payload`, :class:`Reject`, :class:`Schedule`) are
defined in :mod:`worker.api_types`; import them from here, as everything else of the API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np

from worker import api_types as _types
from worker.algorithms.hparams import HParam
from worker.api_types import Field, Payload, Reject, Schedule, Spaces
from worker.segments import Rollout, Segment, discounted_returns, gae

API_VERSION = 1

__all__ = ["API_VERSION", "Actor", "ActorContext", "Algorithm", "Field", "HParam", "Learner", "LearnerContext",
           "Payload", "Reject", "Rollout", "Schedule", "Segment", "Spaces", "discounted_returns", "gae",
           "log_softmax", "sample_categorical"]

# Importable from here as ever, though not in __all__ (so not in `import *`): a Field's dtypes, the schedule kinds.
FLOAT_DTYPES, INT_DTYPES, BOOL_DTYPES = _types.FLOAT_DTYPES, _types.INT_DTYPES, _types.BOOL_DTYPES
SCHEDULE_KINDS = _types.SCHEDULE_KINDS


# --------------------------------------------------------------------------------------------- contexts
@dataclass
class ActorContext:
    """What an :class:`Actor` gets, in a worker group.

    Attributes:
        spaces: the env's spaces; hparams: the run's resolved hyper-parameters; seed: this group's seed.
        envs: the group's K envs as one gymnasium vector env (``num_envs`` copies, already reset by
            :class:`Rollout` when you use it; otherwise call ``envs.reset(seed=seed)`` first). Episode returns
            and env steps are counted by the launcher as you step it.
        group: this group's index; num_envs: K.
        policy: ``policy(obs_batch)`` -> the model's outputs (a tuple of numpy arrays) with the current weights.
        rng: a numpy generator seeded for this group.
        algorithm: the run's :class:`Algorithm` instance.
    """

    spaces: Spaces
    hparams: Mapping[str, Any]
    envs: Any
    num_envs: int
    group: int
    seed: int
    policy: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    rng: np.random.Generator
    algorithm: "Algorithm"
    _runtime: Any = field(default=None, repr=False)

    @property
    def version(self) -> int:
        """The version of the weights now acting (set by the launcher between two ``collect`` calls)."""
        return int(self._runtime.version)

    @property
    def acting(self) -> str:
        """``numpy`` or ``tensorflow``: how ``policy`` runs in this group."""
        return str(self._runtime.path)

    def weights(self) -> dict[str, np.ndarray]:
        """The current weights by name (the names the learner's :attr:`LearnerContext.variables` use)."""
        return dict(self._runtime.weights())

    def keras_model(self) -> Any:
        """The run's Keras model in this group, holding the current weights (kept so after every swap), for
        actors that compute gradients themselves. Imports TensorFlow in the group on first use."""
        return self._runtime.keras_model()

    def variables(self) -> dict[str, Any]:
        """``keras_model()``'s variables by name (trainable and not), as :attr:`LearnerContext.variables`."""
        return dict(self._runtime.variables())


@dataclass
class LearnerContext:
    """What a :class:`Learner` gets, in the master.

    Attributes:
        spaces, hparams, seed: as for the actor; num_workers: envs over all groups.
        model: the Keras model (built by :meth:`Algorithm.model`, or ``--model``); the launcher sends its
            weights (every variable, trainable or not) to the groups after each update.
        variables: the model's variables by name, the names payload fields can refer to (``dense/kernel``).
        trainable: the names of the trainable ones, in the model's order.
        algorithm: the run's :class:`Algorithm` instance.
    """

    spaces: Spaces
    hparams: Mapping[str, Any]
    model: Any
    variables: Mapping[str, Any]
    trainable: tuple[str, ...]
    seed: int
    num_workers: int
    algorithm: "Algorithm"
    _progress: Callable[[], float] = field(default=lambda: 0.0, repr=False)

    def progress(self) -> float:
        """How far the run is toward ``--max-steps``, in [0, 1] (0 without a step limit): for schedules."""
        return float(self._progress())


# ---------------------------------------------------------------------------------------------- roles
class Actor:
    """The group side. Subclass it and write :meth:`collect`; ``self.ctx`` is the :class:`ActorContext`."""

    def __init__(self, ctx: ActorContext) -> None:
        self.ctx = ctx

    def collect(self) -> Mapping[str, np.ndarray]:
        """Step ``ctx.envs`` with ``ctx.policy`` and return one payload (arrays as the schema says).
        New weights are swapped in only between two calls."""
        raise NotImplementedError(f"{type(self).__name__}.collect")

    def on_weights(self, extras: Mapping[str, np.ndarray]) -> None:
        """Called with the learner's :meth:`Learner.extras` of a new weights version just before its weights are
        swapped in (between two ``collect`` calls). Raise :class:`Reject` to refuse the whole frame: nothing of
        it is taken, the refusal is counted and the group reconnects."""


class Learner:
    """The master side. Subclass it and write :meth:`update`; ``self.ctx`` is the :class:`LearnerContext`."""

    def __init__(self, ctx: LearnerContext) -> None:
        self.ctx = ctx

    def update(self, payloads: Sequence[Payload]) -> Mapping[str, float]:
        """Learn from the payloads the schedule gathered (one for :meth:`Schedule.asynchronous`). Returns
        scalars for the status and TensorBoard (``loss/<name>``). The weights version goes up by one."""
        raise NotImplementedError(f"{type(self).__name__}.update")

    def check(self, payload: Payload) -> None:
        """Refuse a payload the schema cannot judge by raising :class:`Reject` (called before :meth:`observe`)."""

    def observe(self, payload: Payload) -> None:
        """Called for every accepted payload, even one too stale for ``update`` (e.g. to merge statistics)."""

    def extras(self) -> Mapping[str, np.ndarray]:
        """Arrays sent to the groups with every weights version besides the model's weights (the actor's
        :meth:`Actor.on_weights` gets them): normalisation statistics, a log standard deviation, ..."""
        return {}

    def checkpoint(self) -> Mapping[str, Any]:
        """What is saved with each checkpoint, by name: TensorFlow trackables (the model, optimisers,
        ``tf.Variable``s). Called before every save; the default saves the model and ``self.optimizer``."""
        parts: dict[str, Any] = {"model": self.ctx.model}
        if getattr(self, "optimizer", None) is not None:
            parts["optimizer"] = self.optimizer  # type: ignore[attr-defined]
        return parts

    def restored(self) -> None:
        """Called after a checkpoint was restored into :meth:`checkpoint`'s objects (``--resume``)."""

    def export_model(self) -> Any:
        """The Keras model saved as the run's final model and played by ``launcher eval``: raw observations
        in, the policy output (:attr:`Algorithm.policy_output`) among its outputs. Default: ``ctx.model``."""
        return self.ctx.model


class Algorithm:
    """An algorithm: its hyper-parameters, its two roles, its payload, its schedule and its model.

    Class attributes:
        hparams: name -> :class:`HParam`; ``launcher up --algo X --set help`` lists them.
        actor, learner: the :class:`Actor` and :class:`Learner` subclasses.
        policy_output: which model output ``launcher eval`` acts greedily on: argmax of it for Discrete
            actions (logits, probabilities or Q-values all work), the output itself clipped to the bounds for
            a Box.
        checkpoint_every: updates between checkpoints unless ``--checkpoint-every`` says otherwise (an update
            per payload, as with :meth:`Schedule.asynchronous`, wants a larger one).

    An instance is made in every process of the run with the resolved hyper-parameters (``self.hp``), the
    env's spaces (``self.spaces``) and the run's number of envs over all groups (``self.num_workers``).
    """

    hparams: ClassVar[Mapping[str, HParam]] = {}
    actor: ClassVar[type[Actor]] = Actor
    learner: ClassVar[type[Learner]] = Learner
    policy_output: ClassVar[int] = 0
    checkpoint_every: ClassVar[int] = 25

    def __init__(self, spaces: Spaces, hp: Mapping[str, Any], *, num_workers: int = 1) -> None:
        self.spaces = spaces
        self.hp = dict(hp)
        self.num_workers = int(num_workers)

    @classmethod
    def tuned(cls, env_id: str, spaces: Spaces) -> Mapping[str, Any]:
        """Defaults for one env, over :attr:`hparams`' own (``--set`` still wins). Default: none."""
        return {}

    @classmethod
    def check_hparams(cls, hp: Mapping[str, Any]) -> list[str]:
        """Problems with resolved hyper-parameters (each a sentence with the value seen); empty when fine."""
        return []

    def model(self) -> Any:
        """The Keras model (functional or Sequential; one input: a batch of observations). Built once in the
        master, and in groups that act with TensorFlow; keep it deterministic given the spaces and ``hp``."""
        raise NotImplementedError(f"{type(self).__name__} builds no model: define model(), or pass --model")

    def schedule(self) -> Schedule:
        """When the learner updates (see :class:`Schedule`). Default: overlapped, lag at most 2."""
        return Schedule.overlapped()

    def payload(self, weights: Mapping[str, tuple[int, ...]], trainable: Sequence[str]) -> Mapping[str, Field]:
        """The payload's schema: array name -> :class:`Field`. ``weights`` are the model's weight shapes by
        name and ``trainable`` the trainable ones' names (for gradient payloads)."""
        raise NotImplementedError(f"{type(self).__name__}.payload")

    def max_rows(self, num_envs: int) -> int:
        """The most rows (and env steps) one payload of a group of ``num_envs`` envs may hold. Default:
        ``n_steps`` x ``num_envs`` when there is an ``n_steps`` hyper-parameter, else 1024 x ``num_envs``."""
        return int(self.hp.get("n_steps", 1024)) * max(1, int(num_envs))


# ----------------------------------------------------------------------------------------------- helpers
def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of ``logits`` (B, n), stable for large values."""
    z = logits - logits.max(axis=-1, keepdims=True)
    out: np.ndarray = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return out


def sample_categorical(logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One action per row of ``logits`` (B, n), drawn from softmax(logits) (Gumbel-max: one draw per batch)."""
    out: np.ndarray = (logits - np.log(-np.log(rng.random(logits.shape)))).argmax(axis=-1).astype(np.int64)
    return out
