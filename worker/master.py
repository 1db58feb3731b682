"""The master (learner): owns the TF2 model and optimiser, serves worker groups, writes the results.

Lifecycle (``MasterState``): STARTING -> RUNNING -> STOPPING -> FINISHED | FAILED. ``run`` always ends
in ``_shutdown``: STOP to every group, a last checkpoint, the exported model, the curve, ``summary.json``.

PPO: segments queue up; once every connected group has sent one (or ``max_queue`` are waiting) the
master runs the clipped-PPO epochs and broadcasts the new weights. Groups wait for those weights, so
while an update runs the actors are idle and the learner has the cores (on-policy, as in DPPO).
A3C: each pushed gradient is applied at once and answered with the current weights; staleness (the
versions that passed since the gradient's weights) is tracked and gradients older than
``max_staleness`` are dropped.
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import queue
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from worker.algorithms import hparams as hparams_mod
from worker.envs import make_env
from worker.links import Counters, GroupLink, LinkServer
from worker.models import Architecture, check_weights, expected_shapes, get_named_weights
from worker.protocol import Message, MsgType, all_finite, encode_parts
from worker.results import MetricsLog, RunFiles, atomic_write_json, atomic_write_text, plot_learning_curve
from worker.spec import RunSpec

log = logging.getLogger("worker.master")

LISTEN_FD_ENV = "LAUNCHER_LISTEN_FD"


class MasterState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    FINISHED = "finished"
    FAILED = "failed"


class GroupStats:
    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.env_steps = 0
        self.returns: collections.deque[float] = collections.deque(maxlen=100)
        self.connected = False
        self.connects = 0
        self.rate = RateMeter()


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


class Master:
    """Serve one run. ``run()`` returns the process exit code (0: finished, 1: failed)."""

    def __init__(self, spec: RunSpec, secret: bytes, *, listen_sock: socket.socket | None = None) -> None:
        self.spec = spec
        self.secret = secret
        self.files = RunFiles(Path(spec.results_dir))
        self.hp = hparams_mod.resolve(spec.algo, spec.env_id, spec.hparams)
        env = make_env(spec.env_id, seed=spec.seed)
        self.arch = Architecture.for_spaces(env.observation_space, env.action_space, self.hp)
        env.close()
        self.shapes = expected_shapes(self.arch)
        self.state = MasterState.STARTING
        self.counters_net = Counters()
        self.inbox: "queue.Queue[tuple[GroupLink, Message]]" = queue.Queue(maxsize=1024)
        self.stop_reason: str | None = None
        self.outcome: str | None = None
        self._stop = threading.Event()
        self._listen_sock = listen_sock
        self.group_stats: dict[int, GroupStats] = {g.index: GroupStats(g.workers) for g in spec.groups}
        self.recent: collections.deque[float] = collections.deque(maxlen=spec.return_window)
        self.best_mean: float | None = None
        self.rate = RateMeter()
        self.update_rate = RateMeter()
        self.losses: dict[str, float] = {}
        self.staleness: collections.deque[int] = collections.deque(maxlen=1000)
        self.pending: dict[int, tuple[GroupLink, Message]] = {}  # PPO: group -> waiting segment
        self.last_ckpt: tuple[int, float, str] | None = None
        self._first_pending_at = 0.0
        self.started = time.time()
        self._weights_cache: tuple[int, list[Any]] | None = None
        self._lock = threading.Lock()
        # Set once the learner is built and restored: only then may shutdown save a checkpoint or export.
        self._learner_ready = False

    # ------------------------------------------------------------------------------------ learner setup
    def _build_learner(self) -> None:
        import tensorflow as tf

        threads = int(os.environ.get("LAUNCHER_TF_THREADS", "0"))
        if threads:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        from worker.checkpoint import Checkpointer, Counters as CkptCounters

        if self.spec.algo == "ppo":
            from worker.algorithms.ppo import PPOLearner

            self.learner: Any = PPOLearner(self.arch, self.hp, self.spec.seed)
        else:
            from worker.algorithms.a3c import A3CLearner

            self.learner = A3CLearner(self.arch, self.hp, self.spec.seed)
        self.ckpt = Checkpointer(self.files.checkpoints, self.learner.model, self.learner.optimizer,
                                 window=self.spec.return_window)
        self.c = CkptCounters()
        restored = self.ckpt.restore_latest()
        if restored:
            self.c, recent, path = restored
            self.recent.extend(recent)
            self.last_ckpt = (self.c.updates, time.monotonic(), path)
            log.info("resumed from %s: env_steps=%d updates=%d episodes=%d", path, self.c.env_steps,
                     self.c.updates, self.c.episodes)
        check_weights(self.arch, get_named_weights(self.learner.model))
        from worker.results import TensorBoardWriter

        self.tb = TensorBoardWriter(self.files.tensorboard)
        self._learner_ready = True

    def weights_frame(self) -> list[Any]:
        """The current weights encoded once per version and shared by every send."""
        cache = self._weights_cache
        if cache is None or cache[0] != self.c.version:
            weights = get_named_weights(self.learner.model)
            # Checked once here, at the source, rather than by every group on every broadcast.
            if not all_finite(weights):
                raise FloatingPointError(f"training diverged: non-finite weights after update {self.c.updates}; "
                                         f"lower the learning rate (--set lr=...) and resume from the last checkpoint")
            cache = (self.c.version, encode_parts(MsgType.WEIGHTS, {"version": self.c.version}, weights))
            self._weights_cache = cache
        return cache[1]

    # --------------------------------------------------------------------------------- network callbacks
    def _on_join(self, link: GroupLink) -> tuple[dict[str, Any], list[Any]]:
        if self.spec.groups and link.group not in {g.index for g in self.spec.groups}:
            raise ValueError(f"group {link.group} is not part of this run")
        with self._lock:
            st = self.group_stats.setdefault(link.group, GroupStats(link.workers))
            st.connected, st.workers = True, link.workers
            st.connects += 1
        log.info("group %d joined with %d workers from %s", link.group, link.workers, link.conn.peer)
        self.metrics.write({"type": "event", "t": time.time(), "event": "group_joined", "group": link.group,
                            "workers": link.workers, "connects": st.connects})
        info = {"run_id": self.spec.run_id, "algo": self.spec.algo, "env_id": self.spec.env_id}
        return info, [self.weights_frame()]

    def _on_message(self, link: GroupLink, msg: Message) -> None:
        self.inbox.put((link, msg))

    def _on_leave(self, link: GroupLink, reason: str) -> None:
        with self._lock:
            st = self.group_stats.get(link.group)
            if st:
                st.connected = False
        if not self._stop.is_set():
            log.info("group %d left: %s", link.group, reason)
            self.metrics.write({"type": "event", "t": time.time(), "event": "group_left", "group": link.group,
                                "reason": reason})

    # -------------------------------------------------------------------------------------- validation
    def _validate(self, link: GroupLink, msg: Message) -> str | None:
        """Return a rejection reason for a message, or None when it may be used."""
        expected = MsgType.TRAJ if self.spec.algo == "ppo" else MsgType.GRADS
        if msg.type != expected:
            return "wrong_message_for_algo"
        a = msg.arrays
        rets, lens = a.get("ep_returns"), a.get("ep_lengths")
        if rets is None or lens is None or rets.ndim != 1 or lens.shape != rets.shape:
            return "bad_shape"
        if not isinstance(msg.fields.get("version"), int) or not isinstance(msg.fields.get("env_steps"), int):
            return "malformed"
        if not 0 <= msg.fields["env_steps"] <= 10_000_000:
            return "malformed"
        if msg.type == MsgType.GRADS:
            grads = {k[2:]: v for k, v in a.items() if k.startswith("g/")}
            try:
                check_weights(self.arch, grads)
            except ValueError:
                return "bad_shape"
            if any(g.dtype != np.float32 for g in grads.values()):
                return "bad_dtype"  # float64 gradients for float32 variables fail inside apply_gradients
        else:
            n = a.get("logp")
            if n is None or n.ndim != 1 or n.size == 0:
                return "bad_shape"
            size = n.size
            obs, act = a.get("obs"), a.get("actions")
            want_act = (size, self.arch.n_outputs) if self.arch.continuous else (size,)
            if obs is None or act is None or tuple(obs.shape) != (size, *self.arch.obs_shape) or tuple(act.shape) != want_act:
                return "bad_shape"
            for k in ("advantages", "returns"):
                if k not in a or a[k].shape != (size,):
                    return "bad_shape"
            # The learner's tf.function takes float32 (a float64 segment makes the update raise and the master
            # fail) and integer actions for discrete spaces (two int kinds could concatenate to float64).
            floats = [obs, n, a["advantages"], a["returns"]] + ([act] if self.arch.continuous else [])
            if any(x.dtype != np.float32 for x in floats) or \
                    (not self.arch.continuous and act.dtype not in (np.dtype(np.int32), np.dtype(np.int64))):
                return "bad_dtype"
            if not self.arch.continuous and (act.dtype.kind not in "iu" or act.min() < 0 or act.max() >= self.arch.n_outputs):
                return "bad_action"
        if not all_finite(a):
            return "non_finite"
        return None

    # ------------------------------------------------------------------------------------------ learning
    def _handle(self, link: GroupLink, msg: Message) -> None:
        reason = self._validate(link, msg)
        if reason is not None:
            self.counters_net.add(f"rejected.{reason}")
            log.warning("rejected a %s from group %d: %s", msg.type.name, link.group, reason)
            if reason in ("bad_shape", "bad_dtype", "wrong_message_for_algo", "malformed", "bad_action"):
                link.close()  # a peer that gets shapes wrong will not get them right next time
            else:
                link.post(self.weights_frame())  # e.g. a NaN: drop it, let the group go on
            return
        self._record_experience(link, msg)
        if msg.type == MsgType.GRADS:
            staleness = self.c.version - int(msg.fields["version"])
            self.staleness.append(staleness)
            if staleness > int(self.hp["max_staleness"]):
                self.counters_net.add("dropped.stale")
            else:
                norm = self.learner.apply({k[2:]: v for k, v in msg.arrays.items() if k.startswith("g/")})
                self.losses = {**{k: float(v) for k, v in msg.fields.get("losses", {}).items()
                                  if isinstance(v, (int, float))}, "grad_norm": norm}
                self._after_update()
            link.post(self.weights_frame())
        else:
            if not self.pending:
                self._first_pending_at = time.monotonic()
            self.pending[link.group] = (link, msg)

    def _record_experience(self, link: GroupLink, msg: Message) -> None:
        steps = int(msg.fields["env_steps"])
        rets = msg.arrays["ep_returns"].astype(float).tolist()
        self.c.env_steps += steps
        self.c.episodes += len(rets)
        self.rate.add(steps)
        self.recent.extend(rets)
        with self._lock:
            st = self.group_stats.setdefault(link.group, GroupStats(link.workers))
            st.env_steps += steps
            st.rate.add(steps)
            st.returns.extend(rets)
        if rets:
            self.metrics.write({"type": "episodes", "t": round(time.time(), 3), "group": link.group,
                                "env_steps": self.c.env_steps, "segment_steps": steps, "returns": rets,
                                "lengths": msg.arrays["ep_lengths"].astype(int).tolist()})

    def _maybe_ppo_update(self) -> None:
        if not self.pending:
            return
        live = {link.group for link in self.server.live_links()}
        waiting = {g for g, (link, _) in self.pending.items() if link.alive}
        # Normally every connected group has sent its segment; a group that is connected but silent
        # (stuck, or just restarted and still warming up) must not stall the others for long.
        waited = time.monotonic() - self._first_pending_at
        if not (live <= waiting or len(self.pending) >= int(self.hp["max_queue"])
                or waited >= float(self.hp["update_wait_s"])):
            return
        batch_parts = []
        for g, (link, msg) in list(self.pending.items()):
            if self.c.version - int(msg.fields["version"]) > int(self.hp["max_staleness"]):
                self.counters_net.add("dropped.stale")
                continue
            batch_parts.append(msg.arrays)
        if batch_parts:
            batch = {k: np.concatenate([p[k] for p in batch_parts]) for k in
                     ("obs", "actions", "logp", "advantages", "returns")}
            if not self.arch.continuous:
                batch["actions"] = batch["actions"].astype(np.int64, copy=False)  # int32 and int64 may mix
            self.losses = self.learner.update(batch)
            self._after_update()
        frame = self.weights_frame()
        for g, (link, _) in list(self.pending.items()):
            link.post(frame)
        self.pending.clear()

    def _after_update(self) -> None:
        self.c.updates += 1
        self.c.version += 1
        self.update_rate.add(1)
        if self.c.updates % self.spec.checkpoint_every == 0:
            self._checkpoint()

    def _checkpoint(self) -> None:
        path = self.ckpt.save(self.c, list(self.recent))
        self.last_ckpt = (self.c.updates, time.monotonic(), path)
        log.debug("checkpoint %s", path)

    # ------------------------------------------------------------------------------------------ reporting
    def mean_return(self) -> float | None:
        return float(np.mean(self.recent)) if self.recent else None

    def status(self) -> dict[str, Any]:
        mean = self.mean_return()
        with self._lock:
            groups = {str(g): {"workers": st.workers, "connected": st.connected, "connects": st.connects,
                               "env_steps": st.env_steps, "env_steps_per_s": round(st.rate.rate(), 1),
                               "mean_return": float(np.mean(st.returns)) if st.returns else None}
                      for g, st in sorted(self.group_stats.items())}
        ck = self.last_ckpt
        return {
            "schema": "launcher.status/v1", "run_id": self.spec.run_id, "state": self.state.value,
            "algo": self.spec.algo, "env_id": self.spec.env_id, "t": time.time(),
            "wall_s": round(time.time() - self.started, 2), "env_steps": self.c.env_steps,
            "updates": self.c.updates, "episodes": self.c.episodes, "version": self.c.version,
            "mean_return": mean, "return_window": self.spec.return_window,
            "episodes_in_window": len(self.recent), "best_mean_return": self.best_mean,
            "env_steps_per_s": round(self.rate.rate(), 1), "updates_per_s": round(self.update_rate.rate(), 2),
            "queue_depth": len(self.pending) + self.inbox.qsize(),
            "staleness_mean": float(np.mean(self.staleness)) if self.staleness else None,
            "checkpoint": None if ck is None else {"updates": ck[0], "age_s": round(time.monotonic() - ck[1], 1),
                                                   "path": os.path.basename(ck[2])},
            "losses": self.losses, "network": self.counters_net.snapshot(), "groups": groups,
            "target": {"until_return": self.spec.until_return, "max_steps": self.spec.max_steps},
            "stop_reason": self.stop_reason, "pid": os.getpid(),
        }

    def _report(self) -> None:
        mean = self.mean_return()
        if mean is not None and len(self.recent) >= min(self.spec.return_window, 10):
            if self.best_mean is None or mean > self.best_mean:
                self._save_best(mean)
            self.best_mean = mean if self.best_mean is None else max(self.best_mean, mean)
        st = self.status()
        atomic_write_json(self.files.status, st)
        self.metrics.write({"type": "progress", "t": round(st["t"], 3), "wall_s": st["wall_s"],
                            "env_steps": st["env_steps"], "updates": st["updates"], "episodes": st["episodes"],
                            "mean_return": mean, "env_steps_per_s": st["env_steps_per_s"],
                            "losses": self.losses, "network": st["network"],
                            "groups": {g: {k: v[k] for k in ("env_steps", "env_steps_per_s", "mean_return", "connected")}
                                       for g, v in st["groups"].items()}})
        scalars = {"return/mean": mean, "throughput/env_steps_per_s": st["env_steps_per_s"],
                   "throughput/updates": self.c.updates,
                   **{f"loss/{k}": v for k, v in self.losses.items()},
                   **{f"network/{k}": v for k, v in st["network"].items()}}
        self.tb.write(self.c.env_steps, scalars)

    def _check_done(self) -> None:
        spec = self.spec
        mean = self.mean_return()
        if spec.until_return is not None and mean is not None and len(self.recent) >= spec.return_window \
                and mean >= spec.until_return:
            self.request_stop("target_reached")
        elif spec.max_steps is not None and self.c.env_steps >= spec.max_steps:
            self.request_stop("max_steps")

    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            self._stop.set()

    # ---------------------------------------------------------------------------------------------- run
    def _listen(self) -> socket.socket:
        if self._listen_sock is not None:
            return self._listen_sock
        fd = os.environ.pop(LISTEN_FD_ENV, None)
        if fd is not None:  # the process backend bound it for us, so groups could dial at once
            return socket.socket(fileno=int(fd))
        family = socket.AF_INET6 if ":" in self.spec.master_host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.spec.master_host, self.spec.master_port))
        s.listen(128)
        return s

    def run(self) -> int:
        self.files.root.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLog(self.files.metrics)
        try:
            self._build_learner()
            sock = self._listen()
            host, port = sock.getsockname()[:2]
            atomic_write_text(self.files.root / "master.addr", f"{host}:{port}\n")
            self.server = LinkServer(
                sock, secret=self.secret, run_id=self.spec.run_id, max_frame_bytes=self.spec.max_frame_bytes,
                heartbeat_interval_s=self.spec.heartbeat_interval_s, heartbeat_timeout_s=self.spec.heartbeat_timeout_s,
                handshake_timeout_s=self.spec.handshake_timeout_s, max_connections=self.spec.max_connections,
                counters=self.counters_net, on_join=self._on_join, on_message=self._on_message, on_leave=self._on_leave)
            self.server.start()
            self.state = MasterState.RUNNING
            log.info("master of run %s listening on %s:%d (%s on %s, %d workers in %d groups)", self.spec.run_id,
                     host, port, self.spec.algo, self.spec.env_id, self.spec.total_workers, len(self.spec.groups))
            self.metrics.write({"type": "event", "t": time.time(), "event": "master_started",
                                "env_steps": self.c.env_steps, "updates": self.c.updates})
            self._check_done()  # a resumed run may already be done
            next_report = 0.0
            while not self._stop.is_set():
                try:
                    link, msg = self.inbox.get(timeout=0.05)
                    self._handle(link, msg)
                    while True:  # drain what queued up meanwhile before deciding on an update
                        link, msg = self.inbox.get_nowait()
                        self._handle(link, msg)
                except queue.Empty:
                    pass
                if self.spec.algo == "ppo":
                    self._maybe_ppo_update()
                self._check_done()
                if time.monotonic() >= next_report:
                    self._report()
                    next_report = time.monotonic() + 1.0
            return self._shutdown(failed=False)
        except Exception:
            log.exception("master failed")
            self.stop_reason = self.stop_reason or "error"
            return self._shutdown(failed=True)

    def _shutdown(self, *, failed: bool) -> int:
        self.state = MasterState.STOPPING
        reason = self.stop_reason or "stopped"
        server = getattr(self, "server", None)
        if server is not None:
            server.broadcast_stop(reason)
        try:
            # A learner that failed to build or restore holds fresh weights and zero counters: saving it
            # would push the run's real checkpoints out (max_to_keep) and a resume would start over.
            if self._learner_ready:
                self._checkpoint()
                self._export()
                self._report()
        except Exception:
            log.exception("final checkpoint/export failed")
            failed = True
        if server is not None:
            server.close()
        mean = self.mean_return()
        title = f"{self.spec.env_id} · {self.spec.algo} · {self.spec.total_workers} workers · {self.spec.run_id}"
        try:
            plot_learning_curve(self.files.metrics, self.files.curve, title=title, window=self.spec.return_window,
                                target=self.spec.until_return)
        except Exception:
            log.exception("plotting the learning curve failed")
        self.outcome = "failed" if failed else reason
        summary = {
            "schema": "launcher.summary/v1", "run_id": self.spec.run_id, "outcome": self.outcome,
            "target_reached": reason == "target_reached", "until_return": self.spec.until_return,
            "max_steps": self.spec.max_steps, "mean_return": mean, "best_mean_return": self.best_mean,
            "episodes_in_window": len(self.recent), "env_steps": self.c.env_steps, "updates": self.c.updates,
            "episodes": self.c.episodes, "wall_s": round(time.time() - self.started, 2),
            # Relative to the results directory: the same file seen from the host or a container.
            "checkpoint": os.path.relpath(self.last_ckpt[2], self.files.root) if self.last_ckpt else None,
            "network": self.counters_net.snapshot(), "algo": self.spec.algo, "env_id": self.spec.env_id,
            "workers": self.spec.total_workers,
        }
        atomic_write_json(self.files.summary, summary)
        self.state = MasterState.FAILED if failed else MasterState.FINISHED
        atomic_write_json(self.files.status, {**self.status(), "state": self.state.value})
        self.metrics.write({"type": "event", "t": time.time(), "event": "master_stopped", "outcome": self.outcome})
        self.metrics.close()
        log.info("run %s %s: mean return %s over %d episodes, %d env steps, %d updates", self.spec.run_id,
                 self.outcome, None if mean is None else round(mean, 2), len(self.recent), self.c.env_steps, self.c.updates)
        return 1 if failed else 0

    def _save_best(self, mean: float) -> None:
        """Keep the weights of the best mean return so far as model/best_policy.npz (``launcher eval
        --checkpoint best``); best.json says when. The mean covers the last window of episodes, so these are
        the weights at the end of the best window, not a per-episode optimum."""
        if not hasattr(self, "learner"):
            return
        d = self.files.model_dir
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / ".best_policy.tmp.npz"
        np.savez(tmp, **get_named_weights(self.learner.model))
        os.replace(tmp, d / "best_policy.npz")
        atomic_write_json(d / "best.json", {"mean_return": mean, "episodes_in_window": len(self.recent),
                                            "env_steps": self.c.env_steps, "updates": self.c.updates,
                                            "version": self.c.version, "t": time.time()})

    def _export(self) -> None:
        d = self.files.model_dir
        d.mkdir(parents=True, exist_ok=True)
        weights = get_named_weights(self.learner.model)
        tmp = d / ".policy.tmp.npz"
        np.savez(tmp, **weights)
        os.replace(tmp, d / "policy.npz")
        arch = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.arch.__dict__.items()}
        atomic_write_json(d / "architecture.json", {"architecture": arch, "env_id": self.spec.env_id,
                                                    "algo": self.spec.algo, "version": self.c.version})
        tmpk = d / ".final_model.tmp.keras"
        self.learner.model.save(tmpk)
        os.replace(tmpk, d / "final_model.keras")


def install_signal_handlers(master: Master) -> None:
    def handler(signum: int, _frame: Any) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        master.request_stop("interrupted")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
