"""When the learner updates: the PPO round barrier and the A3C staleness rule, apart from the learner.

PPO: segments wait until every connected group has sent one, or ``max_queue`` are waiting, or the first
has waited ``update_wait_s``; then one update uses them all and every waiting group gets the new weights.
Groups collect their next segment meanwhile (:mod:`worker.group`), so a segment is normally one version
behind the learner when it is used: its *policy lag*. A segment more than ``max_staleness`` versions
behind is dropped and counted, never applied. With ``sync=true`` groups wait for the weights and the lag
is 0 (DPPO's synchronous round). A3C: each gradient is applied at once unless it was computed on weights
more than ``max_staleness`` versions old.

Why apart from the master: this is the policy a reader wants to change (how long to wait, what is too
stale), and it only needs plain values, so it is tested without sockets or TensorFlow.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np

SEGMENT_KEYS = ("obs", "actions", "logp", "advantages", "returns")


class PpoRounds:
    """The segments of the current PPO round, one per group (a newer one from the same group replaces it).

    Args:
        max_queue: update once this many groups are waiting, even if other connected groups are silent.
        update_wait_s: update once the first segment has waited this long (a stuck group must not stall
            the others).
        max_staleness: a segment computed on weights more than this many versions old is dropped.
    """

    def __init__(self, *, max_queue: int, update_wait_s: float, max_staleness: int) -> None:
        self.max_queue = max_queue
        self.update_wait_s = update_wait_s
        self.max_staleness = max_staleness
        self.pending: dict[int, tuple[Any, Mapping[str, Any], Mapping[str, np.ndarray]]] = {}
        self._first_at = 0.0
        self.lags: list[int] = []  # the policy lag of each segment the last :meth:`take` returned

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, group: int, link: Any, fields: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        """Queue group ``group``'s segment; ``link`` is whatever gets the new weights afterwards."""
        if not self.pending:
            self._first_at = time.monotonic()
        self.pending[group] = (link, fields, arrays)

    def due(self, live: set[int], waiting: set[int]) -> bool:
        """Whether to update now, given the groups connected (``live``) and those whose link still waits."""
        if not self.pending:
            return False
        waited = time.monotonic() - self._first_at
        return live <= waiting or len(self.pending) >= self.max_queue or waited >= self.update_wait_s

    def take(self, version: int) -> tuple[list[Any], list[Mapping[str, np.ndarray]], int]:
        """End the round at learner version ``version``: (links to answer, segments to learn from, number
        dropped as stale). The lags of the segments returned are left in :attr:`lags`."""
        links, parts, stale, lags = [], [], 0, []
        for link, fields, arrays in self.pending.values():
            links.append(link)
            lag = policy_lag(version, int(fields["version"]))
            if lag > self.max_staleness:
                stale += 1
            else:
                parts.append(arrays)
                lags.append(lag)
        self.pending.clear()
        self.lags = lags
        return links, parts, stale


def policy_lag(learner_version: int, behaviour_version: int) -> int:
    """Versions between the policy that collected a segment and the learner's (0: on-policy).

    A version from the future (a group that kept weights across a master restart that resumed from an
    older checkpoint) counts as 0: its data is as good as on-policy for the learner's purposes.
    """
    return max(0, learner_version - behaviour_version)


def ppo_batch(parts: Sequence[Mapping[str, np.ndarray]], *, continuous: bool) -> dict[str, np.ndarray]:
    """One training batch from the round's segments (concatenated rows)."""
    batch = {k: np.concatenate([p[k] for p in parts]) for k in SEGMENT_KEYS}
    if not continuous:
        batch["actions"] = batch["actions"].astype(np.int64, copy=False)  # int32 and int64 may mix
    return batch


def a3c_is_stale(version_now: int, grads_version: int, max_staleness: int) -> tuple[bool, int]:
    """(drop it, staleness): a gradient on weights more than ``max_staleness`` versions old is dropped."""
    staleness = version_now - grads_version
    return staleness > max_staleness, staleness


def numeric_losses(losses: Any) -> dict[str, float]:
    """The numeric entries of a group's reported losses (anything else is ignored)."""
    if not isinstance(losses, dict):
        return {}
    return {k: float(v) for k, v in losses.items() if isinstance(v, (int, float))}
