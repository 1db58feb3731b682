"""Checkpoints of the learner: what its :meth:`worker.api.Learner.checkpoint` names (the model, optimisers,
statistics) and the run's counters and recent returns, via ``tf.train.CheckpointManager``.

TensorFlow writes a checkpoint's data and index files first and only then replaces the ``checkpoint``
state file, atomically; a crash mid-write therefore leaves the previous checkpoint as the latest. On
restore we still try the newest first and fall back to older ones if a file is damaged.

TensorFlow is imported where it is used, so :class:`Counters` costs nothing to import (the master's
reporting uses it before the learner exists).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np


log = logging.getLogger(__name__)

COUNTERS = ("env_steps", "updates", "episodes", "version")


@dataclass
class Counters:
    env_steps: int = 0
    updates: int = 0
    episodes: int = 0
    version: int = 0


class Checkpointer:
    """Saves and restores the learner's parts and the run's counters and recent returns under ``directory``.

    Args:
        directory: the run's ``checkpoints/`` directory.
        parts: the learner's :meth:`worker.api.Learner.checkpoint` (name -> TensorFlow trackable: the model,
            optimisers, variables).
        window: how many recent episode returns are kept (the ``--until-return`` window).
        max_to_keep: checkpoints kept on disk.
    """

    def __init__(self, directory: Path, parts: Mapping[str, Any], *, window: int, max_to_keep: int = 3) -> None:
        import tensorflow as tf

        self.directory = directory
        self._counters = tf.Variable(np.zeros(len(COUNTERS), np.int64), trainable=False, name="counters")
        self._returns = tf.Variable(np.zeros(window, np.float64), trainable=False, name="recent_returns")
        self._n_returns = tf.Variable(0, dtype=tf.int64, trainable=False, name="n_recent_returns")
        own = {"counters": self._counters, "recent_returns": self._returns, "n_recent_returns": self._n_returns}
        clash = sorted(set(own) & set(parts))
        if clash:
            raise ValueError(f"the learner's checkpoint names {clash} are the launcher's own; choose others")
        self.checkpoint = tf.train.Checkpoint(**own, **parts)
        self.manager = tf.train.CheckpointManager(self.checkpoint, str(directory), max_to_keep=max_to_keep)

    def save(self, counters: Counters, recent_returns: list[float]) -> str:
        self._counters.assign(np.array([getattr(counters, k) for k in COUNTERS], np.int64))
        window = self._returns.shape[0]
        recent = np.asarray(recent_returns[-window:], np.float64)
        buf = np.zeros(window, np.float64)
        buf[: len(recent)] = recent
        self._returns.assign(buf)
        self._n_returns.assign(len(recent))
        return str(self.manager.save(checkpoint_number=counters.updates))

    def restore_latest(self) -> tuple[Counters, list[float], str] | None:
        """Restore the newest readable checkpoint; None when there is none.

        Every tensor of a candidate is read first (each read checks its CRC32C): ``restore`` alone reads
        only the variables that exist now, so damage in, say, the optimiser's slots would surface at the
        first update instead, and a truncated data file raises IndexError, not an OpError.
        """
        import tensorflow as tf

        for path in reversed(self.manager.checkpoints):
            try:
                damage_check(path)
                self.checkpoint.restore(path).expect_partial()
            except (tf.errors.OpError, ValueError, AssertionError, IndexError) as exc:
                log.warning("checkpoint %s is unreadable (%s: %s); trying an older one", path,
                            type(exc).__name__, exc)
                continue
            values = self._counters.numpy().tolist()
            counters = Counters(**dict(zip(COUNTERS, (int(v) for v in values))))
            n = int(self._n_returns.numpy())
            return counters, self._returns.numpy()[:n].tolist(), path
        return None


def damage_check(path: str) -> None:
    """Read every tensor of the checkpoint at ``path``; raises (OpError, IndexError, ...) if any is damaged."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(path)
    for name in reader.get_variable_to_shape_map():
        reader.get_tensor(name)
