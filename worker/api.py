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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

import numpy as np

from worker.algorithms.hparams import HParam
from worker.segments import Rollout, Segment, discounted_returns, gae

if TYPE_CHECKING:  # numpy-only at run time: gymnasium's spaces come from the caller
    import gymnasium

API_VERSION = 1

__all__ = ["API_VERSION", "Actor", "ActorContext", "Algorithm", "Field", "HParam", "Learner", "LearnerContext",
           "Payload", "Reject", "Rollout", "Schedule", "Segment", "Spaces", "discounted_returns", "gae",
           "log_softmax", "sample_categorical"]

FLOAT_DTYPES = ("float16", "float32", "float64")
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8")  # what the wire carries (worker.protocol.frames.DTYPES)
BOOL_DTYPES = ("bool",)


# ------------------------------------------------------------------------------------------------ spaces
@dataclass(frozen=True)
class Spaces:
    """The env's single-copy observation and action spaces (gymnasium spaces), with the figures code asks for."""

    observation: "gymnasium.Space[Any]"
    action: "gymnasium.Space[Any]"

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in (self.observation.shape or ()))

    @property
    def obs_dtype(self) -> np.dtype[Any]:
        return np.dtype(self.observation.dtype)

    @property
    def discrete(self) -> bool:
        """Whether actions are one integer in ``range(n_actions)`` (a ``Discrete`` space)."""
        return hasattr(self.action, "n")

    @property
    def n_actions(self) -> int:
        """``Discrete(n)``: n; a 1-D ``Box``: its dimension."""
        shape = self.action.shape or (0,)
        return int(self.action.n) if self.discrete else int(shape[0])  # type: ignore[attr-defined]

    @property
    def action_low(self) -> np.ndarray:
        return np.asarray(getattr(self.action, "low", ()), np.float32)

    @property
    def action_high(self) -> np.ndarray:
        return np.asarray(getattr(self.action, "high", ()), np.float32)


# ------------------------------------------------------------------------------------------------ payload
@dataclass(frozen=True)
class Field:
    """One array of a payload, as the master checks it before the learner sees it.

    Args:
        dtype: its numpy dtype, exactly (``"float32"``; ``"int64"`` and ``"int32"`` are not interchangeable).
        shape: with ``rows=True`` the shape of one row (the leading axis counts rows, the same count in every
            row field of the payload, at most :meth:`Algorithm.max_rows`); with ``rows=False`` the whole shape.
        rows: whether the leading axis is a row (time step) axis.
        low, high: inclusive bounds of every value (e.g. ``Field.action`` for Discrete actions).
        finite: float values must be finite (no NaN or infinity).
        optional: the payload may leave it out.
    """

    dtype: str
    shape: tuple[int, ...] = ()
    rows: bool = True
    low: float | None = None
    high: float | None = None
    finite: bool = True
    optional: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in FLOAT_DTYPES + INT_DTYPES + BOOL_DTYPES:
            raise ValueError(f"Field dtype {self.dtype!r} is not one of {', '.join(FLOAT_DTYPES + INT_DTYPES + BOOL_DTYPES)}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @classmethod
    def observations(cls, spaces: Spaces, dtype: str | None = None) -> "Field":
        """A row per step of observations as the env gives them (or cast to ``dtype``)."""
        return cls(dtype or str(spaces.obs_dtype), spaces.obs_shape)

    @classmethod
    def actions(cls, spaces: Spaces) -> "Field":
        """A row per step of actions: int64 in ``range(n)`` for Discrete, float32 vectors for a Box."""
        if spaces.discrete:
            return cls("int64", (), low=0, high=spaces.n_actions - 1)
        return cls("float32", (spaces.n_actions,))

    def problem(self, name: str, value: Any) -> str | None:
        """Why ``value`` does not fit this field (a sentence naming ``name``), or None. Row counts are checked
        by the caller, across fields."""
        if not isinstance(value, np.ndarray):
            return f"payload field {name!r} is a {type(value).__name__}, not a numpy array"
        if value.dtype != np.dtype(self.dtype):
            return f"payload field {name!r} has dtype {value.dtype}, the schema says {self.dtype}"
        shape = tuple(value.shape[1:]) if self.rows else tuple(value.shape)
        if self.rows and value.ndim < 1:
            return f"payload field {name!r} has no row axis (shape {value.shape})"
        if shape != self.shape:
            what = "rows of shape" if self.rows else "shape"
            return f"payload field {name!r} has {what} {shape}, the schema says {self.shape}"
        if value.size == 0:
            return None
        if self.finite and value.dtype.kind == "f" and not np.isfinite(value).all():
            return f"payload field {name!r} holds NaN or infinity"
        if self.low is not None and value.min() < self.low:
            return f"payload field {name!r} holds {value.min()!r}, below its bound {self.low!r}"
        if self.high is not None and value.max() > self.high:
            return f"payload field {name!r} holds {value.max()!r}, above its bound {self.high!r}"
        return None


class Payload(dict):  # type: ignore[type-arg]
    """What one group sent: named numpy arrays, plus where it came from.

    Attributes:
        group: the worker group that sent it.
        version: the weights version its actor acted with (the behaviour policy).
        lag: learner versions between ``version`` and the learner's when it was used (0: on-policy).
        env_steps: env steps it stands for (counted by the launcher, reset steps excluded).
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], *, group: int = 0, version: int = 0, lag: int = 0,
                 env_steps: int = 0) -> None:
        super().__init__(arrays)
        self.group, self.version, self.lag, self.env_steps = group, version, lag, env_steps

    @property
    def rows(self) -> int:
        """The row count of the payload's row fields (0 if it has none)."""
        return next((int(v.shape[0]) for v in self.values() if getattr(v, "ndim", 0) >= 1), 0)


class Reject(Exception):
    """Raise from :meth:`Learner.check` to refuse a payload (``reason`` becomes the ``rejected.<reason>`` counter
    in the run's status, ``detail`` the log line), or from :meth:`Actor.on_weights` to refuse a weights frame."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


# ---------------------------------------------------------------------------------------------- schedule
SCHEDULE_KINDS = ("sync", "overlapped", "async", "queue")


@dataclass(frozen=True)
class Schedule:
    """When the learner updates and what the groups do meanwhile. Make one with a constructor below.

    * :meth:`sync`: a synchronous barrier. Every connected group sends a payload and waits; one update on all
      of them; new weights to all. Policy lag 0 (DPPO's synchronous round, A2C).
    * :meth:`overlapped`: the same barrier, but groups collect their next payload while the learner learns
      (one payload in flight per group); payloads more than ``max_lag`` versions old are dropped.
    * :meth:`asynchronous`: each payload is used as it comes (``update`` gets one) and only its group gets
      the new weights (A3C's parameter server); gradients more than ``max_lag`` versions old are dropped.
    * :meth:`queue`: payloads queue from every group (each group keeps collecting); the learner updates once
      ``size`` are waiting (DPPO's ``MAX_QSIZE``), on all of them; older than ``max_lag`` are dropped.

    ``max_wait_s`` (barriers): update anyway once the first payload has waited this long, so a stuck group
    cannot stall the others; ``round_size`` (barriers): update once this many groups are waiting.
    """

    kind: str
    max_lag: int = 0
    size: int = 1
    max_wait_s: float = 5.0
    round_size: int = 64

    def __post_init__(self) -> None:
        problems = []
        if self.kind not in SCHEDULE_KINDS:
            problems.append(f"schedule kind must be one of {', '.join(SCHEDULE_KINDS)}, got {self.kind!r}")
        if self.max_lag < 0:
            problems.append(f"max_lag must be >= 0, got {self.max_lag}")
        if self.size < 1 or self.round_size < 1:
            problems.append(f"size and round_size must be >= 1, got {self.size} and {self.round_size}")
        if not self.max_wait_s > 0:
            problems.append(f"max_wait_s must be > 0, got {self.max_wait_s}")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def sync(cls, *, max_lag: int = 0, max_wait_s: float = 5.0, round_size: int = 64) -> "Schedule":
        return cls("sync", max_lag, max_wait_s=max_wait_s, round_size=round_size)

    @classmethod
    def overlapped(cls, *, max_lag: int = 2, max_wait_s: float = 5.0, round_size: int = 64) -> "Schedule":
        return cls("overlapped", max_lag, max_wait_s=max_wait_s, round_size=round_size)

    @classmethod
    def asynchronous(cls, *, max_lag: int = 32) -> "Schedule":
        return cls("async", max_lag)

    @classmethod
    def queue(cls, size: int, *, max_lag: int = 1) -> "Schedule":
        return cls("queue", max_lag, size=size)

    @property
    def groups_wait(self) -> bool:
        """Whether a group waits for new weights after each payload (else it collects the next meanwhile)."""
        return self.kind == "sync"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "max_lag": self.max_lag, "size": self.size, "max_wait_s": self.max_wait_s,
                "round_size": self.round_size}


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
