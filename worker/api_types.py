"""The public API's value types (version 1): the plain data an algorithm declares and its two roles pass.

* :class:`Spaces`: the env's single-copy observation and action spaces, with the figures code asks for;
* the payload and its schema: :class:`Field` (one array's dtype, per-row shape and bounds, as the master checks
  it), :class:`Payload` (what one group sent, with where it came from) and :class:`Reject` (a learner's or an
  actor's refusal);
* :class:`Schedule`: when the learner updates and what the groups do meanwhile.

Numpy only. User code imports these from :mod:`worker.api`, which re-exports every one of them; the roles
(:class:`worker.api.Actor`, :class:`worker.api.Learner`, :class:`worker.api.Algorithm`) and their contexts live
there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

if TYPE_CHECKING:  # numpy-only at run time: gymnasium's spaces come from the caller
    import gymnasium

__all__ = ["BOOL_DTYPES", "FLOAT_DTYPES", "INT_DTYPES", "SCHEDULE_KINDS", "Field", "Payload", "Reject", "Schedule",
           "Spaces"]

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
