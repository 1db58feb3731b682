"""The run's results directory: its layout (names in :mod:`worker.contract`), atomic writes, metrics, TensorBoard and the learning curve.

Layout (``<results root>/<run id>/``)::

    config.json       resolved launcher configuration (no secret)      a copy, by the launcher (*)
    plan.json         placement plan                                    a copy, by the launcher (*)
    spec.json         the run spec every process started from           a copy, by the launcher (*)
    run.json          the launcher's run record                         a copy, by the launcher (*)
    status.json       live status, rewritten atomically every second    master
    metrics.jsonl     one JSON object per line: "episodes" and "progress" records   master
    summary.json      the outcome, written once at the end              master
    tensorboard/      TensorBoard event files                           master
    checkpoints/      TensorFlow checkpoints (ckpt-N, the state file)   master
    model/            final_model.keras, policy.npz, policy.json       master
    learning_curve.png                                                  master
    logs/             master.log, group-<N>.log (process backend)       launcher

(*) The launcher's own records are in ``<results root>/.launcher/<run id>/`` (:mod:`launcher.runs`), which no
container of the run is given; these copies are for the user's tools and never read back by the host.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterable

from worker.contract import RunFiles

__all__ = ["RunFiles", "atomic_write_text", "atomic_write_json", "read_json", "MetricsLog", "read_metrics",
           "episode_series", "plot_learning_curve", "TensorBoardWriter"]


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` so readers see the old file or the whole new one, never a torn write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; results are meant to be read by the user's tools
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def read_json(path: Path) -> Any | None:
    """Read a JSON file; None when it is missing or (being replaced) unreadable."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class MetricsLog:
    """Appends JSON lines; each line is flushed whole so a crash leaves at most one torn last line.

    The master writes from its main thread and from every group's link thread (joins, leaves): a lock keeps
    each record one whole line, since a text file's ``write`` is not atomic across threads.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"), default=_json_default) + "\n"
        with self._lock:
            self._fh.write(line)

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: Path) -> Iterable[dict[str, Any]]:
    """Yield the records of a metrics.jsonl, skipping a torn last line."""
    try:
        fh = open(path)
    except FileNotFoundError:
        return
    with fh:
        for line in fh:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def episode_series(path: Path) -> tuple[list[int], list[float]]:
    """(env steps, return) of every episode recorded in a metrics.jsonl."""
    steps: list[int] = []
    returns: list[float] = []
    for rec in read_metrics(path):
        if rec.get("type") == "episodes":
            n = len(rec["returns"])
            for i, r in enumerate(rec["returns"]):
                # Episodes in one record ended during the segment; spread them over its steps.
                steps.append(int(rec["env_steps"] - rec.get("segment_steps", 0) * (n - 1 - i) / max(n, 1)))
                returns.append(float(r))
    return steps, returns


def plot_learning_curve(metrics_path: Path, out: Path, *, title: str, window: int = 100,
                        target: float | None = None) -> bool:
    """Draw episode returns and their rolling mean against env steps. Returns False with no episodes."""
    steps, returns = episode_series(metrics_path)
    if not returns:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    r = np.asarray(returns)
    c = np.cumsum(np.insert(r, 0, 0.0))
    w = np.minimum(np.arange(1, len(r) + 1), window)
    rolling = (c[1:] - c[np.arange(1, len(r) + 1) - w]) / w
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(steps, r, ".", ms=2, alpha=0.3, color="tab:blue", label="episode return")
    ax.plot(steps, rolling, color="tab:red", lw=2, label=f"mean of last {window}")
    if target is not None:
        ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:g}")
    ax.set_xlabel("env steps")
    ax.set_ylabel("return")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.{os.getpid()}.{os.urandom(4).hex()}.tmp.png")  # never another master's
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out)
    return True


class TensorBoardWriter:
    """Scalar summaries in TensorBoard's event format, written with TensorFlow alone.

    ``tf.summary.scalar`` needs the ``tensorboard`` package at write time; the scalar plugin is only a
    metadata tag, so we write the same records with ``tf.summary.write`` and keep TensorBoard a viewer
    the user installs where they look at the logs.
    """

    def __init__(self, directory: Path) -> None:
        import tensorflow as tf
        from tensorflow.core.framework import summary_pb2

        self._tf = tf
        self._writer = tf.summary.create_file_writer(str(directory))
        self._meta = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")).SerializeToString()

    def write(self, step: int, scalars: dict[str, float | int | None]) -> None:
        tf = self._tf
        with self._writer.as_default(step=int(step)):
            for tag, value in scalars.items():
                if value is not None:
                    tf.summary.write(tag, tf.constant(float(value), tf.float32), metadata=self._meta)
        self._writer.flush()
