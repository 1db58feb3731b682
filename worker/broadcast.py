"""What the master sends every group after an update: the model's weights and the learner's extras as one
WEIGHTS frame per version, encoded and hashed once and shared by every send, or a small "unchanged" frame for a
group that already has this version. The same arrays (weights by name, extras under
:data:`worker.contract.EXTRA_PREFIX`) are what checkpoints' and the final model's ``policy.npz`` hold.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from worker.contract import EXTRA_PREFIX
from worker.protocol import MsgType, all_finite, encode_parts


def policy_arrays(model: Any, learner: Any) -> dict[str, Any]:
    """The model's weights by name and ``learner.extras()`` under :data:`EXTRA_PREFIX`."""
    from worker.keras_convert import get_weights

    return with_extras(get_weights(model), learner.extras())


def with_extras(weights: Mapping[str, Any], extras: Mapping[str, Any]) -> dict[str, Any]:
    """Weights by name and the learner's extras under :data:`EXTRA_PREFIX`: what a WEIGHTS frame carries."""
    return {**weights, **{EXTRA_PREFIX + k: v for k, v in extras.items()}}


def first_non_finite(arrays: dict[str, Any]) -> str | None:
    """The name of the first array holding a NaN or an infinity; None when all are finite."""
    if all_finite(arrays):
        return None
    return next(k for k, v in arrays.items() if not all_finite({k: v}))


class VersionFrames:
    """The frames of the newest weights version, each encoded once (not once per group)."""

    def __init__(self) -> None:
        self._weights: tuple[int, list[Any]] | None = None
        self._unchanged: tuple[int, list[Any]] | None = None

    def weights(self, version: int, arrays: Callable[[], dict[str, Any]],
                check: Callable[[dict[str, Any]], None]) -> list[Any]:
        """WEIGHTS of ``version``: ``arrays()`` passed to ``check`` (which raises to refuse them) and encoded, the
        first time this version is asked for."""
        cache = self._weights
        if cache is None or cache[0] != version:
            values = arrays()
            check(values)
            frame = encode_parts(MsgType.WEIGHTS, {"version": version}, values)
            _ = frame.digest  # hashed once here for every group's MAC, not once per group in its writer thread
            cache = (version, frame)
            self._weights = cache
        return cache[1]

    def unchanged(self, version: int) -> list[Any]:
        """WEIGHTS of ``version`` with ``unchanged``: the group already has them."""
        if self._unchanged is None or self._unchanged[0] != version:
            self._unchanged = (version, encode_parts(MsgType.WEIGHTS, {"version": version, "unchanged": True}))
        return self._unchanged[1]
