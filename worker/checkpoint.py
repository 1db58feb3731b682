"""Checkpoints of the learner: what its :meth:`worker.api.Learner.checkpoint` names (the model, optimisers,
statistics) and the run's counters and recent returns, as TensorFlow checkpoints ``ckpt-<updates>`` listed in
the ``checkpoint`` state file that ``tf.train.CheckpointManager`` and ``tf.train.latest_checkpoint`` read.

A checkpoint's data and index files are written first (TensorFlow writes its shards to a temporary directory
and merges them into place) and only then is the state file replaced, atomically, naming the newest
``max_to_keep``; the files of older ones are deleted after that. A crash mid-write therefore leaves the
previous checkpoint as the latest. On restore we still try the newest first and fall back to older ones if a
file is damaged.

The write is a ``tf.function`` traced once (:class:`TracedWrite`): an eager ``Checkpoint.write`` walks and
serialises the whole object graph on every save, which cost ~5 of the ~8 ms that ``CheckpointManager.save``
took per checkpoint of the CartPole learner (1.5 ms traced), time in which the master answered nobody. A traced
write saves the objects that existed when it was traced, so every save first lists the object graph (0.2 ms)
and traces again when it changed: a variable the learner makes later is never left out.

TensorFlow is imported where it is used, so :class:`Counters` costs nothing to import (the master's
reporting uses it before the learner exists).
"""

from __future__ import annotations

import logging
import os
import time
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
        self.max_to_keep = max_to_keep
        # A resumed run's state file: what it restores from, then keeps rotating.
        state = tf.train.get_checkpoint_state(str(directory))
        paths = list(state.all_model_checkpoint_paths) if state is not None else []
        stamps = list(state.all_model_checkpoint_timestamps) if state is not None else []
        self._since = state.last_preserved_timestamp if state is not None else time.time()
        # The listed checkpoints, oldest first, each with the time it was saved.
        self._kept = dict(zip(paths, stamps if len(stamps) == len(paths) else [self._since] * len(paths)))
        self._write = TracedWrite(self.checkpoint)

    @property
    def checkpoints(self) -> list[str]:
        """The checkpoints the state file lists, oldest first."""
        return list(self._kept)

    def save(self, counters: Counters, recent_returns: list[float]) -> str:
        """Write ``ckpt-<updates>``, then name it in the state file, then delete what falls out of it."""
        import tensorflow as tf

        self._counters.assign(np.array([getattr(counters, k) for k in COUNTERS], np.int64))
        window = self._returns.shape[0]
        recent = np.asarray(recent_returns[-window:], np.float64)
        buf = np.zeros(window, np.float64)
        buf[: len(recent)] = recent
        self._returns.assign(buf)
        self._n_returns.assign(len(recent))
        path = str(self.directory / f"ckpt-{counters.updates}")
        # TensorFlow's traced write does not make the directory; its eager write did, as this does (and fails the
        # same way when something else is in its place).
        tf.io.gfile.makedirs(str(self.directory))
        self._write(path)
        self._kept.pop(path, None)  # saved again (the same number): now the newest
        self._kept[path] = time.time()
        dropped = list(self._kept)[:-self.max_to_keep]
        for old in dropped:
            del self._kept[old]
        write_state(self.directory, list(self._kept.items()), self._since)
        for old in dropped:
            delete_checkpoint(old)
        return path

    def restore_latest(self) -> tuple[Counters, list[float], str] | None:
        """Restore the newest readable checkpoint; None when there is none.

        Every tensor of a candidate is read first (each read checks its CRC32C): ``restore`` alone reads
        only the variables that exist now, so damage in, say, the optimiser's slots would surface at the
        first update instead, and a truncated data file raises IndexError, not an OpError.
        """
        import tensorflow as tf

        for path in reversed(self.checkpoints):
            try:
                damage_check(path)
                self.checkpoint.restore(path).expect_partial()
            except (tf.errors.OpError, ValueError, AssertionError, IndexError) as exc:
                log.warning("checkpoint %s is unreadable (%s: %s); trying an older one", path,
                            type(exc).__name__, exc)
                # No longer listed from the next save on (its files stay, for a look): the state file then names
                # only checkpoints that restore, even when this run's next save reuses an older number.
                del self._kept[path]
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


class TracedWrite:
    """``checkpoint.write(prefix)`` as a ``tf.function``, traced again whenever the object graph changed.

    The graph's fingerprint is the identity of every object reachable from the checkpoint, in TensorFlow's own
    breadth-first order. The traced function holds the variables it saves, so none of their identities can be
    reused by a new object while it lives: a variable added, removed or replaced always changes the fingerprint.
    A graph holding Python state is written eagerly instead.
    """

    def __init__(self, checkpoint: Any) -> None:
        self.checkpoint = checkpoint
        self.traces = 0  # how many times the write was traced (tests read it)
        self._fn: Any = None
        self._graph: tuple[int, ...] = ()

    def __call__(self, prefix: str) -> None:
        import tensorflow as tf

        objects = tf.train.TrackableView(self.checkpoint).descendants()
        graph = tuple(id(obj) for obj in objects)
        if not self._graph or graph != self._graph:
            # Python state (``tf.train.experimental.PythonState``) is serialised by Python code, which a trace would
            # run once and freeze: a graph holding any is written eagerly, as ``tf.train.Checkpoint`` does.
            eager = any(isinstance(obj, tf.train.experimental.PythonState) for obj in objects)
            self._fn = None if eager else tf.function(self.checkpoint.write)
            self._graph = graph
            self.traces += 0 if eager else 1
        if self._fn is None:
            self.checkpoint.write(prefix)
            return
        try:
            self._fn(tf.constant(prefix))  # a tensor: a new prefix is not a new trace
        except tf.errors.OpError as exc:
            # A graph's error is TensorFlow's trace of where the op was defined, then the cause: raised again with
            # the cause alone (one line naming the path, as an eager write says it), for summary.json and status.
            try:
                again = type(exc)(exc.node_def, exc.op, graph_error_cause(exc.message))
            except TypeError:
                raise exc from None
            raise again from exc


def graph_error_cause(message: str) -> str:
    """The cause in a ``tf.function``'s error message: its last line that is not part of the "Graph execution
    error: Detected at node ... defined at" trace nor the indented node and op names after it."""
    own = [line for line in message.splitlines() if line.strip() and not line.startswith(
        ("Graph execution error", "Detected at node", " ", "\t"))]
    return own[-1] if own else message


def write_state(directory: Path, saved: list[tuple[str, float]], since: float) -> None:
    """Replace ``directory/checkpoint`` atomically with the state file that ``tf.train.CheckpointManager``
    writes and TensorFlow's readers read: ``saved`` (path, time saved; the newest last) named relative to the
    directory (so it can be mounted elsewhere, as the host and a container see it), and ``since``, the manager's
    ``last_preserved_timestamp`` (it keeps only checkpoints saved after it)."""
    def quoted(path: str) -> str:
        return '"' + os.path.relpath(path, directory).replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = [f"model_checkpoint_path: {quoted(saved[-1][0])}"]
    lines += [f"all_model_checkpoint_paths: {quoted(p)}" for p, _ in saved]
    lines += [f"all_model_checkpoint_timestamps: {t!r}" for _, t in saved]
    lines.append(f"last_preserved_timestamp: {since!r}")
    tmp = directory / f"checkpoint.tmp{os.getpid()}"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, directory / "checkpoint")


def delete_checkpoint(prefix: str) -> None:
    """Delete a checkpoint's index and data files (a file already gone is no error)."""
    directory, name = os.path.split(prefix)
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return
    for entry in entries:
        if entry == f"{name}.index" or entry.startswith(f"{name}.data-"):
            try:
                os.unlink(os.path.join(directory, entry))
            except FileNotFoundError:
                pass
