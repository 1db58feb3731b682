"""What the master accepts from a worker group: one pure check per message kind, returning a reason.

Why a separate module: the learner trusts whatever passes here (it feeds it to a ``tf.function`` that
fails the whole run on a wrong dtype), so every rule sits in one place that a reader can check against
the protocol, and the master's loop only asks "use it or refuse it". A reason becomes the
``rejected.<reason>`` counter in ``status.json``.

Sizes are tied to the run spec, so a group that holds the secret (a compromised one) still cannot make
the master allocate, count or write more than an honest group would: a segment has at most
``n_steps × workers`` rows and env steps (the group's workers as the spec says), finished episodes are
at most its env steps, and A3C ``losses`` are a small object of numbers.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from worker.models import Architecture, check_weights
from worker.normalize import RET_SHAPE, check_moments
from worker.protocol import Message, MsgType, all_finite

MAX_LOSS_ENTRIES = 32

# A peer that gets these wrong will not get them right next time: its connection is closed.
# Anything else (a NaN, say) only drops the message and the group goes on with the current weights.
CLOSING_REASONS = frozenset({"bad_shape", "bad_dtype", "wrong_message_for_algo", "malformed", "bad_action",
                             "over_limit", "bad_norm"})


def max_steps_per_message(n_steps: int, workers: int) -> int:
    """The env steps (and segment rows) one message of a group of ``workers`` envs can hold."""
    return max(1, int(n_steps)) * max(1, int(workers))


def check_message(msg: Message, *, algo: str, arch: Architecture, max_steps: int,
                  normalize: tuple[bool, bool] = (False, False)) -> str | None:
    """Return why ``msg`` must be refused, or None when the learner may use it.

    Args:
        msg: a decoded TRAJ (PPO) or GRADS (A3C) frame from an authenticated group.
        algo: the run's algorithm; the other algorithm's message is refused.
        arch: the model's architecture; shapes, dtypes and action ranges are checked against it.
        max_steps: :func:`max_steps_per_message` for the sending group; more env steps, rows or
            finished episodes than this is ``over_limit``.
        normalize: (observations, returns) normalised in this run: the message must then carry the moments
            of the raw observations / discounted returns it saw (``bad_norm`` otherwise; see :func:`check_norm`).
    """
    expected = MsgType.TRAJ if algo == "ppo" else MsgType.GRADS
    if msg.type != expected:
        return "wrong_message_for_algo"
    a = msg.arrays
    rets, lens = a.get("ep_returns"), a.get("ep_lengths")
    if rets is None or lens is None or rets.ndim != 1 or lens.shape != rets.shape:
        return "bad_shape"
    if not isinstance(msg.fields.get("version"), int) or not isinstance(msg.fields.get("env_steps"), int):
        return "malformed"
    if msg.fields["env_steps"] < 0:
        return "malformed"
    if msg.fields["env_steps"] > max_steps or rets.size > msg.fields["env_steps"]:
        return "over_limit"  # more steps than the segment holds, or more episodes ended than steps taken
    if msg.type == MsgType.GRADS:
        reason = _check_losses(msg.fields.get("losses", {})) or _check_grads(a, arch)
    else:
        reason = _check_segment(a, arch, max_steps)
    if reason is not None:
        return reason
    if check_norm(msg, arch, normalize) is not None:
        return "bad_norm"
    if not all_finite(a):
        return "non_finite"
    return None


def check_norm(msg: Message, arch: Architecture, normalize: tuple[bool, bool]) -> str | None:
    """Why a message's normalisation moments are unusable (a sentence for the log), or None.

    Each count is at most the message's env steps (the master weighs a group's statistics by it, so a peer
    must not claim more data than it sent); mean and M2 have the observation's shape (``(1,)`` for
    returns), float64, and M2 is not negative. A message of a run without normalisation may carry none.
    """
    steps = int(msg.fields["env_steps"])
    obs, ret = normalize
    for prefix, on, shape in (("obs", obs, arch.obs_shape), ("ret", ret, RET_SHAPE)):
        if on:
            problem = check_moments(prefix, msg.fields, msg.arrays, tuple(shape), steps)
            if problem is not None:
                return problem
        elif f"{prefix}_count" in msg.fields or f"{prefix}_mean" in msg.arrays or f"{prefix}_m2" in msg.arrays:
            return f"{prefix} moments sent, but this run does not normalise them"
    return None


def _check_grads(a: Mapping[str, np.ndarray], arch: Architecture) -> str | None:
    grads = {k[2:]: v for k, v in a.items() if k.startswith("g/")}
    try:
        check_weights(arch, grads)
    except ValueError:
        return "bad_shape"
    if any(g.dtype != np.float32 for g in grads.values()):
        return "bad_dtype"  # float64 gradients for float32 variables fail inside apply_gradients
    return None


def _check_losses(losses: Any) -> str | None:
    """A3C groups report their losses: a small object of finite numbers (anything else ends a run later)."""
    if not isinstance(losses, dict) or len(losses) > MAX_LOSS_ENTRIES:
        return "malformed"
    for k, v in losses.items():
        if len(k) > 64 or isinstance(v, bool) or not isinstance(v, (int, float)):
            return "malformed"
        if (isinstance(v, int) and abs(v) > 1 << 53) or (isinstance(v, float) and not math.isfinite(v)):
            return "malformed"  # JSON's 1e999 is inf; a 400-digit int overflows float()
    return None


def _check_segment(a: Mapping[str, np.ndarray], arch: Architecture, max_rows: int) -> str | None:
    n = a.get("logp")
    if n is None or n.ndim != 1 or n.size == 0:
        return "bad_shape"
    if n.size > max_rows:
        return "over_limit"
    size = n.size
    obs, act = a.get("obs"), a.get("actions")
    want_act = (size, arch.n_outputs) if arch.continuous else (size,)
    if obs is None or act is None or tuple(obs.shape) != (size, *arch.obs_shape) or tuple(act.shape) != want_act:
        return "bad_shape"
    for k in ("advantages", "returns"):
        if k not in a or a[k].shape != (size,):
            return "bad_shape"
    # The learner's tf.function takes float32 (a float64 segment makes the update raise and the master
    # fail), observations as the architecture says (uint8 image frames) and integer actions for discrete
    # spaces (two int kinds could concatenate to float64).
    floats = [n, a["advantages"], a["returns"]] + ([act] if arch.continuous else [])
    if any(x.dtype != np.float32 for x in floats) or obs.dtype != np.dtype(arch.obs_dtype) or \
            (not arch.continuous and act.dtype not in (np.dtype(np.int32), np.dtype(np.int64))):
        return "bad_dtype"
    if not arch.continuous and (act.dtype.kind not in "iu" or act.min() < 0 or act.max() >= arch.n_outputs):
        return "bad_action"
    return None
