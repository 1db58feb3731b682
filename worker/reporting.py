"""What the master counts and what it writes about it: status, metrics records, summary, exported model.

Why apart from the master's loop: these are the documents other programs read (``status.json`` every
second, ``metrics.jsonl``, ``summary.json``, ``model/``; their schemas are in ``launcher/schemas``), so
their shape is kept in one module, built from one :class:`Tally` of the run's numbers.
"""

from __future__ import annotations

import collections
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from worker.checkpoint import Counters as CkptCounters
from worker.contract import (BEST_FILE, BEST_POLICY_FILE, EXTRA_PREFIX, KERAS_MODEL_FILE, POLICY_DOC_FILE, POLICY_FILE,
                             RunFiles, RunSpec)
from worker.results import atomic_write_json


class RateMeter:
    """Events per second over a sliding window of ~10 s."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.points: collections.deque[tuple[float, int]] = collections.deque()
        self.total = 0

    def add(self, n: int) -> None:
        self.total += n
        self.points.append((time.monotonic(), self.total))

    def rate(self) -> float:
        now = time.monotonic()
        while self.points and now - self.points[0][0] > self.window_s:
            self.points.popleft()
        if len(self.points) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self.points[0], self.points[-1]
        return (n1 - n0) / max(t1 - t0, 1e-6)


class GroupStats:
    """One worker group's numbers as the master sees them."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.env_steps = 0
        self.returns: collections.deque[float] = collections.deque(maxlen=100)
        self.connected = False
        self.connects = 0
        self.yields = 0  # times it left because its elastic run gave its GPUs to a queued run
        self.rate = RateMeter()


class Tally:
    """The run's running numbers: counters (checkpointed), returns, rates, losses, per-group stats.

    Group stats are touched from link threads (join/leave) and the learner thread, hence the lock.
    """

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.c = CkptCounters()  # env_steps, updates, episodes, version: saved with every checkpoint
        self.recent: collections.deque[float] = collections.deque(maxlen=spec.return_window)
        self.best_mean: float | None = None
        self.rate = RateMeter()
        self.update_rate = RateMeter()
        self.losses: dict[str, float] = {}
        # Policy lag (versions between the weights that collected a segment or gradient and the learner's
        # when it was used) of the last 1000 used, the largest seen, and how many were dropped as too old.
        self.staleness: collections.deque[int] = collections.deque(maxlen=1000)
        self.lag_max = 0
        self.lag_dropped = 0
        self.last_ckpt: tuple[int, float, str] | None = None
        self.recoveries: list[dict[str, Any]] = []  # masters of this run that died and were replaced (recovery)
        self.started = time.time()
        self.groups: dict[int, GroupStats] = {g.index: GroupStats(g.workers) for g in spec.groups}
        self._lock = threading.Lock()

    # -- counting
    def joined(self, group: int, workers: int) -> int:
        """Mark ``group`` connected; return how many times it has connected."""
        with self._lock:
            st = self.groups.setdefault(group, GroupStats(workers))
            st.connected, st.workers = True, workers
            st.connects += 1
            return st.connects

    def left(self, group: int, *, yielded: bool = False) -> None:
        with self._lock:
            st = self.groups.get(group)
            if st:
                st.connected = False
                st.yields += int(yielded)

    def experience(self, group: int, workers: int, steps: int, returns: list[float]) -> None:
        """Count a segment's env steps and finished episodes."""
        self.c.env_steps += steps
        self.c.episodes += len(returns)
        self.rate.add(steps)
        self.recent.extend(returns)
        with self._lock:
            st = self.groups.setdefault(group, GroupStats(workers))
            st.env_steps += steps
            st.rate.add(steps)
            st.returns.extend(returns)

    def lagged(self, lags: list[int], dropped: int) -> None:
        """Record the policy lag of what the learner used and how many it dropped as too old."""
        self.staleness.extend(lags)
        self.lag_max = max([self.lag_max, *lags])
        self.lag_dropped += dropped

    def policy_lag(self) -> dict[str, Any]:
        """``status.json``'s ``policy_lag``: mean of the last 1000 used, max and dropped since start."""
        mean = round(float(np.mean(self.staleness)), 3) if self.staleness else None
        return {"mean": mean, "max": self.lag_max, "dropped": self.lag_dropped}

    def updated(self) -> None:
        self.c.updates += 1
        self.c.version += 1
        self.update_rate.add(1)

    def mean_return(self) -> float | None:
        return float(np.mean(self.recent)) if self.recent else None

    def new_best(self) -> float | None:
        """The mean return when it beats the best so far over a full enough window, else None."""
        mean = self.mean_return()
        better = None
        if mean is not None and len(self.recent) >= min(self.spec.return_window, 10):
            if self.best_mean is None or mean > self.best_mean:
                better = mean
            self.best_mean = mean if self.best_mean is None else max(self.best_mean, mean)
        return better

    # -- documents
    def status(self, *, state: str, queue_depth: int, network: dict[str, int], stop_reason: str | None,
               acting: Mapping[str, Any] | None = None, error: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``status.json`` (schema ``launcher.status/v1``)."""
        spec = self.spec
        with self._lock:
            groups = {str(g): {"workers": st.workers, "connected": st.connected, "connects": st.connects,
                               "yields": st.yields,
                               "env_steps": st.env_steps, "env_steps_per_s": round(st.rate.rate(), 1),
                               "mean_return": float(np.mean(st.returns)) if st.returns else None}
                      for g, st in sorted(self.groups.items())}
        ck = self.last_ckpt
        return {
            "schema": "launcher.status/v1", "run_id": spec.run_id, "state": state,
            "algo": spec.algo, "env_id": spec.env_id, "t": time.time(),
            "wall_s": round(time.time() - self.started, 2), "env_steps": self.c.env_steps,
            "updates": self.c.updates, "episodes": self.c.episodes, "version": self.c.version,
            "mean_return": self.mean_return(), "return_window": spec.return_window,
            "episodes_in_window": len(self.recent), "best_mean_return": self.best_mean,
            "env_steps_per_s": round(self.rate.rate(), 1), "updates_per_s": round(self.update_rate.rate(), 2),
            "queue_depth": queue_depth,
            "staleness_mean": float(np.mean(self.staleness)) if self.staleness else None,
            "policy_lag": self.policy_lag(),
            "checkpoint": None if ck is None else {"updates": ck[0], "age_s": round(time.monotonic() - ck[1], 1),
                                                   "path": os.path.basename(ck[2])},
            "losses": self.losses, "network": network, "groups": groups,
            "target": {"until_return": spec.until_return, "max_steps": spec.max_steps},
            "stop_reason": stop_reason, "pid": os.getpid(),
            "acting": dict(acting) if acting else None, "error": dict(error) if error else None,
            "recoveries": list(self.recoveries),
        }

    def progress_record(self, st: Mapping[str, Any]) -> dict[str, Any]:
        """The once-a-second ``progress`` line of ``metrics.jsonl``, from a :meth:`status` document."""
        return {"type": "progress", "t": round(st["t"], 3), "wall_s": st["wall_s"],
                "env_steps": st["env_steps"], "updates": st["updates"], "episodes": st["episodes"],
                "mean_return": st["mean_return"], "env_steps_per_s": st["env_steps_per_s"],
                "losses": self.losses, "network": st["network"], "policy_lag": st["policy_lag"],
                "groups": {g: {k: v[k] for k in ("env_steps", "env_steps_per_s", "mean_return", "connected")}
                           for g, v in st["groups"].items()}}

    def scalars(self, st: Mapping[str, Any]) -> dict[str, float | int | None]:
        """TensorBoard scalars, from a :meth:`status` document."""
        return {"return/mean": st["mean_return"], "throughput/env_steps_per_s": st["env_steps_per_s"],
                "throughput/updates": self.c.updates,
                **{f"policy_lag/{k}": v for k, v in st["policy_lag"].items()},
                **{f"loss/{k}": v for k, v in self.losses.items()},
                **{f"network/{k}": v for k, v in st["network"].items()},
                "recovery/count": len(self.recoveries)}

    def summary(self, *, outcome: str, reason: str, root: Path, network: dict[str, int],
                error: Mapping[str, str] | None = None, acting: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``summary.json`` (schema ``launcher.summary/v1``), written once at the end."""
        spec = self.spec
        return {
            "schema": "launcher.summary/v1", "run_id": spec.run_id, "outcome": outcome,
            "target_reached": reason == "target_reached", "until_return": spec.until_return,
            "max_steps": spec.max_steps, "mean_return": self.mean_return(), "best_mean_return": self.best_mean,
            "episodes_in_window": len(self.recent), "env_steps": self.c.env_steps, "updates": self.c.updates,
            "episodes": self.c.episodes, "wall_s": round(time.time() - self.started, 2),
            # Relative to the results directory: the same file seen from the host or a container.
            "checkpoint": os.path.relpath(self.last_ckpt[2], root) if self.last_ckpt else None,
            "network": network, "algo": spec.algo, "env_id": spec.env_id, "workers": spec.total_workers,
            # What ended a failed run: the exception's type and message and where (the learner's update, group 2,
            # ...); the full traceback is in the master's or the group's log.
            "error": dict(error) if error else None,
            "acting": None if not acting else acting.get("path"),
            "recoveries": list(self.recoveries),
        }


def numeric(scalars: Any) -> dict[str, float]:
    """The numeric entries of what the learner reported (anything else is ignored)."""
    if not isinstance(scalars, dict):
        try:
            scalars = dict(scalars or {})
        except (TypeError, ValueError):
            return {}
    out = {}
    for k, v in scalars.items():
        try:
            out[str(k)[:64]] = float(v)
        except (TypeError, ValueError):
            continue
    return out


def episodes_record(group: int, env_steps: int, segment_steps: int, returns: list[float],
                    lengths: list[int]) -> dict[str, Any]:
    """The ``episodes`` line of ``metrics.jsonl`` for one segment's finished episodes."""
    return {"type": "episodes", "t": round(time.time(), 3), "group": group, "env_steps": env_steps,
            "segment_steps": segment_steps, "returns": returns, "lengths": lengths}


def aside(path: Path) -> Path:
    """A temp name beside ``path`` no other process picks (pid and random bits; the suffix kept, numpy and
    Keras go by it): two masters on one run directory never write into each other's half-written file."""
    return path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp{path.suffix}")


def save_best(files: RunFiles, weights: Mapping[str, np.ndarray], info: Mapping[str, Any]) -> None:
    """Keep the weights of the best mean return so far as ``model/best_policy.npz`` (``launcher eval
    --checkpoint best``); ``best.json`` says when. The mean covers the last window of episodes, so these
    are the weights at the end of the best window, not a per-episode optimum."""
    d = files.model_dir
    d.mkdir(parents=True, exist_ok=True)
    tmp = aside(d / BEST_POLICY_FILE)
    arrays: dict[str, Any] = dict(weights)  # (numpy's stub would match a value to savez's allow_pickle)
    np.savez(tmp, **arrays)
    os.replace(tmp, d / BEST_POLICY_FILE)
    atomic_write_json(d / BEST_FILE, {**info, "t": time.time()})


def save_checkpoint_policy(files: RunFiles, number: int, arrays: Mapping[str, np.ndarray], kept: list[str]) -> None:
    """Beside checkpoint ``ckpt-<number>``, its policy as ``policy-<number>.npz`` (what ``launcher eval
    --checkpoint latest`` plays, with no TensorFlow); policies of checkpoints no longer ``kept`` are removed."""
    d = files.checkpoints
    tmp = aside(d / f"policy-{number}.npz")
    saved: dict[str, Any] = dict(arrays)  # (numpy's stub would match a value to savez's allow_pickle)
    np.savez(tmp, **saved)
    os.replace(tmp, d / f"policy-{number}.npz")
    keep = {f"policy-{Path(p).name.rpartition('-')[2]}.npz" for p in kept} | {f"policy-{number}.npz"}
    for old in d.glob("policy-*.npz"):
        if old.name not in keep:
            old.unlink(missing_ok=True)


def policy_doc(*, env_id: str, algo: str, version: int, policy_output: int, spaces: Any, names: Sequence[str],
               program: Any, acting: Mapping[str, Any]) -> dict[str, Any]:
    """``model/policy.json``: how ``launcher eval`` acts with ``policy.npz``: the model's weight names, its numpy
    program (None: it acts with TensorFlow, from ``final_model.keras``), which output is the policy, and the
    action space (``spaces``: a :class:`worker.api.Spaces`)."""
    return {"schema": "launcher.policy/v1", "env_id": env_id, "algo": algo, "version": version,
            "policy_output": int(policy_output),
            "action": {"discrete": spaces.discrete, "n": spaces.n_actions,
                       "low": spaces.action_low.tolist(), "high": spaces.action_high.tolist()},
            "weights": list(names), "extra_prefix": EXTRA_PREFIX,
            "program": None if program is None else program.to_dict(), "acting": dict(acting)}


def write_policy_doc(files: RunFiles, doc: Mapping[str, Any]) -> None:
    """``model/policy.json``: how ``launcher eval`` acts with the run's weights (written when the run starts)."""
    files.model_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(files.model_dir / POLICY_DOC_FILE, dict(doc))


def export_model(files: RunFiles, model: Any, arrays: Mapping[str, np.ndarray], policy: Mapping[str, Any]) -> None:
    """Write ``model/``: ``policy.npz`` (the model's weights by name and the learner's extras, for ``launcher
    eval``), ``policy.json`` (how to act with them: the numpy program, the policy output and the action space;
    see :func:`write_policy_doc`) and the Keras model (the learner's :meth:`worker.api.Learner.export_model`: the built-ins' takes raw
    observations, their normalisation being its first layers). Each file appears whole or not at all
    (written aside, then renamed)."""
    d = files.model_dir
    d.mkdir(parents=True, exist_ok=True)
    tmp = aside(d / POLICY_FILE)
    saved: dict[str, Any] = dict(arrays)
    np.savez(tmp, **saved)
    os.replace(tmp, d / POLICY_FILE)
    write_policy_doc(files, policy)
    tmpk = aside(d / KERAS_MODEL_FILE)
    model.save(tmpk)
    os.replace(tmpk, d / KERAS_MODEL_FILE)
