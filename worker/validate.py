"""What the master accepts from a worker group: one pure check of a payload frame against the launcher's own
fields and the algorithm's schema, returning a :class:`Refusal` or None.

Why a separate module: the learner trusts whatever passes here (it feeds it to code that may fail the whole
run on a wrong dtype), so every rule sits in one place that a reader can check against the protocol, and the
master's loop only asks "use it or refuse it". A refusal becomes the ``rejected.<reason>`` counter in
``status.json`` (schema refusals name the field: ``rejected.schema:<field>``) and one log line.

Sizes are tied to the run spec, so a group that holds the secret (a compromised one) still cannot make the
master allocate, count or write more than an honest group would: a payload has at most
:meth:`worker.api.Algorithm.max_rows` rows and env steps for the group's workers (as the spec says), finished
episodes are at most its env steps, and every array is named in the schema with its dtype and shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from worker.api import Field
from worker.protocol import Message, MsgType, all_finite

# The launcher's own entries of every payload frame: what the group's episode counter saw.
EP_RETURNS, EP_LENGTHS = "ep_returns", "ep_lengths"
RESERVED = frozenset({EP_RETURNS, EP_LENGTHS})

# A peer that gets these wrong will not get them right next time (the launcher's own code wrote them): its
# connection is closed. Anything else (a schema refusal, a NaN) only drops the payload and the group goes on
# with the current weights.
CLOSING_REASONS = frozenset({"unexpected_type", "malformed", "over_limit", "bad_shape"})


@dataclass(frozen=True)
class Refusal:
    """Why a payload is refused: ``reason`` (the counter's key) and ``detail`` (a sentence for the log)."""

    reason: str
    detail: str

    @property
    def counter(self) -> str:
        return f"rejected.{self.reason}"

    @property
    def closes(self) -> bool:
        return self.reason in CLOSING_REASONS


def check_schema(schema: Mapping[str, Field]) -> None:
    """Raise ValueError when an algorithm's payload schema cannot be enforced (a reserved or bad name)."""
    for name, f in schema.items():
        if name in RESERVED:
            raise ValueError(f"payload field {name!r} is the launcher's own; choose another name")
        if not name or len(name) > 128 or not name.isprintable():
            raise ValueError(f"payload field name {name!r} must be 1-128 printable characters")
        if not isinstance(f, Field):
            raise ValueError(f"payload field {name!r}: {f!r} is not a worker.api.Field")


def check_payload(msg: Message, *, schema: Mapping[str, Field], max_steps: int) -> Refusal | None:
    """Return why ``msg`` must be refused, or None when the learner may use it.

    Args:
        msg: a decoded frame from an authenticated group.
        schema: the algorithm's payload schema (:meth:`worker.api.Algorithm.payload`).
        max_steps: the most rows and env steps one payload of this group may hold.
    """
    if msg.type != MsgType.TRAJ:
        return Refusal("unexpected_type", f"a {msg.type.name} frame where a payload belongs")
    fields, a = msg.fields, msg.arrays
    version, steps = fields.get("version"), fields.get("env_steps")
    if not isinstance(version, int) or isinstance(version, bool) or not isinstance(steps, int) \
            or isinstance(steps, bool) or steps < 0:
        return Refusal("malformed", "version and env_steps must be integers, env_steps >= 0")
    rets, lens = a.get(EP_RETURNS), a.get(EP_LENGTHS)
    if rets is None or lens is None or rets.ndim != 1 or lens.shape != rets.shape:
        return Refusal("bad_shape", "ep_returns and ep_lengths must be 1-D arrays of one length")
    if steps > max_steps or rets.size > steps:
        return Refusal("over_limit", f"{steps} env steps and {rets.size} episodes; at most {max_steps} steps, "
                                     "and no more episodes than steps")
    if not all_finite({EP_RETURNS: rets}) or lens.dtype.kind not in "iu":
        return Refusal("non_finite", "episode returns must be finite and lengths integers")
    names = set(a) - RESERVED
    for name in sorted(names - set(schema)):
        return Refusal(f"schema:{_short(name)}", f"payload field {name!r} is not in the algorithm's schema")
    rows = None
    for name, f in schema.items():
        value = a.get(name)
        if value is None:
            if f.optional:
                continue
            return Refusal(f"schema:{_short(name)}", f"payload field {name!r} is missing")
        problem = f.problem(name, value)
        if problem is not None:
            return Refusal(f"schema:{_short(name)}", problem)
        if f.rows:
            n = int(value.shape[0])
            if rows is not None and n != rows:
                return Refusal(f"schema:{_short(name)}", f"payload field {name!r} has {n} rows, the others {rows}")
            rows = n
    if rows is not None and rows > max_steps:
        return Refusal("over_limit", f"{rows} rows; at most {max_steps}")
    return None


def _short(name: str) -> str:
    """A field name as a counter key: printable, at most 48 characters."""
    clean = "".join(c if c.isalnum() or c in "/_-." else "_" for c in name)
    return clean[:48]


def arrays_of(msg: Message) -> dict[str, np.ndarray]:
    """The algorithm's arrays of an accepted payload frame (the launcher's own entries left out)."""
    return {k: v for k, v in msg.arrays.items() if k not in RESERVED}
