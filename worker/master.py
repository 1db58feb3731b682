"""The master (learner): a lifecycle that owns the TF2 model, serves worker groups and writes the results.

Lifecycle (``MasterState``): STARTING -> RUNNING -> STOPPING -> FINISHED | FAILED. ``run`` reads top to
bottom: build the learner (restoring the newest intact checkpoint), listen, loop until a stop condition,
and always end in ``_shutdown``: STOP to every group, a last checkpoint, the exported model, the curve,
``summary.json``.

The parts live beside it: :mod:`worker.links` (sockets and threads), :mod:`worker.validate` (what may be
used), :mod:`worker.rounds` (when to update), :mod:`worker.reporting` (what is counted and written).
"""

from __future__ import annotations

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

from worker.algorithms import hparams as hparams_mod
from worker.contract import LISTEN_FD_ENV, TF_THREADS_ENV, RunFiles, RunSpec, plain_env_id
from worker.envs import make_env
from worker.inbox import ByteBoundedInbox
from worker.links import Counters, GroupLink, LinkServer
from worker.models import Architecture, check_weights, env_kind, expected_shapes, get_named_weights
from worker.normalize import RunningNorm, normalization
from worker.protocol import Message, MsgType, all_finite, encode_parts
from worker.reporting import Tally, episodes_record, export_model, save_best
from worker.results import MetricsLog, atomic_write_json, atomic_write_text, plot_learning_curve
from worker.rounds import PpoRounds, a3c_is_stale, numeric_losses, ppo_batch
from worker.validate import CLOSING_REASONS, check_message, check_norm, max_steps_per_message

log = logging.getLogger("worker.master")


def inbox_budget(spec: RunSpec) -> int:
    """Bytes the learner's inbox may hold: four of the largest frames, at most 1 GiB (but one frame always)."""
    return max(spec.max_frame_bytes, min(4 * spec.max_frame_bytes, 1 << 30))


class MasterState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    FINISHED = "finished"
    FAILED = "failed"


class Master:
    """Serve one run. ``run()`` returns the process exit code (0: finished, 1: failed).

    Args:
        spec: the run spec.
        secret: the run secret (never logged, never written).
        listen_sock: an already-listening socket (tests); else the inherited one or a new one.
    """

    def __init__(self, spec: RunSpec, secret: bytes, *, listen_sock: socket.socket | None = None) -> None:
        self.spec = spec
        self.secret = secret
        self.files = RunFiles(Path(spec.results_dir))
        env = make_env(spec.env_id, seed=spec.seed, **spec.env_args)
        self.hp = hparams_mod.resolve(spec.algo, spec.env_id, spec.hparams,
                                      kind=env_kind(env.observation_space, env.action_space))
        self.arch = Architecture.for_spaces(env.observation_space, env.action_space, self.hp)
        env.close()
        # Running statistics of what every group saw (observations, discounted returns): merged from each
        # accepted message, checkpointed, shipped with the weights (worker/normalize.py).
        self.normalize = normalization(self.arch, self.hp)
        self.norm = RunningNorm(self.arch.obs_shape if self.normalize[0] else None, self.normalize[1])
        self.shapes = expected_shapes(self.arch)
        self.state = MasterState.STARTING
        self.counters_net = Counters()
        self.inbox: ByteBoundedInbox[tuple[GroupLink, Message]] = ByteBoundedInbox(inbox_budget(spec))
        self.stop_reason: str | None = None
        self.outcome: str | None = None
        self._stop = threading.Event()
        self._listen_sock = listen_sock
        self.tally = Tally(spec)
        # PPO's round barrier (A3C has no rounds and no such hyper-parameters; its rounds stay empty).
        self.rounds = PpoRounds(max_queue=int(self.hp.get("max_queue", 1)),
                                update_wait_s=float(self.hp.get("update_wait_s", 0.0)),
                                max_staleness=int(self.hp["max_staleness"]))
        self._weights_cache: tuple[int, list[Any]] | None = None
        # Set once the learner is built and restored: only then may shutdown save a checkpoint or export.
        self._learner_ready = False

    # ---------------------------------------------------------------------------------------------- run
    def run(self) -> int:
        self.files.root.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLog(self.files.metrics)
        try:
            self._build_learner()
            self._serve()
            self.state = MasterState.RUNNING
            self._check_done()  # a resumed run may already be done
            next_report = 0.0
            while not self._stop.is_set():
                self._drain_inbox()
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

    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            self._stop.set()

    # ------------------------------------------------------------------------------------------ starting
    def _build_learner(self) -> None:
        import tensorflow as tf

        threads = int(os.environ.get(TF_THREADS_ENV, "0"))
        if threads:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        from worker.checkpoint import Checkpointer

        if self.spec.algo == "ppo":
            from worker.algorithms.ppo import PPOLearner

            self.learner: Any = PPOLearner(self.arch, self.hp, self.spec.seed)
        else:
            from worker.algorithms.a3c import A3CLearner

            self.learner = A3CLearner(self.arch, self.hp, self.spec.seed)
        self.ckpt = Checkpointer(self.files.checkpoints, self.learner.model, self.learner.optimizer,
                                 window=self.spec.return_window, norm=self.norm)
        restored = self.ckpt.restore_latest()
        if restored:
            c, recent, path = restored
            self.tally.c = c
            self.tally.recent.extend(recent)
            self.tally.last_ckpt = (c.updates, time.monotonic(), path)
            log.info("resumed from %s: env_steps=%d updates=%d episodes=%d", path, c.env_steps, c.updates, c.episodes)
        check_weights(self.arch, get_named_weights(self.learner.model))
        from worker.results import TensorBoardWriter

        self.tb = TensorBoardWriter(self.files.tensorboard)
        self._learner_ready = True

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

    def _serve(self) -> None:
        spec = self.spec
        sock = self._listen()
        host, port = sock.getsockname()[:2]
        atomic_write_text(self.files.master_addr, f"{host}:{port}\n")
        self.server = LinkServer(
            sock, secret=self.secret, run_id=spec.run_id, max_frame_bytes=spec.max_frame_bytes,
            heartbeat_interval_s=spec.heartbeat_interval_s, heartbeat_timeout_s=spec.heartbeat_timeout_s,
            handshake_timeout_s=spec.handshake_timeout_s, max_connections=spec.max_connections,
            counters=self.counters_net, on_join=self._on_join, on_message=self._on_message, on_leave=self._on_leave)
        self.server.start()
        log.info("master of run %s listening on %s:%d (%s on %s, %d workers in %d groups)", spec.run_id,
                 host, port, spec.algo, spec.env_id, spec.total_workers, len(spec.groups))
        self.metrics.write({"type": "event", "t": time.time(), "event": "master_started",
                            "env_steps": self.tally.c.env_steps, "updates": self.tally.c.updates})

    # ---------------------------------------------------------------------- network callbacks (link threads)
    def _on_join(self, link: GroupLink) -> tuple[dict[str, Any], list[Any]]:
        if self.spec.groups:
            assigned = next((g for g in self.spec.groups if g.index == link.group), None)
            if assigned is None:
                raise ValueError(f"group {link.group} is not part of this run")
            if link.workers != assigned.workers:
                raise ValueError(f"group {link.group} has {assigned.workers} workers in the run spec, "
                                 f"the peer claims {link.workers}")
        connects = self.tally.joined(link.group, link.workers)
        log.info("group %d joined with %d workers from %s", link.group, link.workers, link.conn.peer)
        self.metrics.write({"type": "event", "t": time.time(), "event": "group_joined", "group": link.group,
                            "workers": link.workers, "connects": connects})
        info = {"run_id": self.spec.run_id, "algo": self.spec.algo, "env_id": self.spec.env_id}
        return info, [self.weights_frame()]

    def _on_message(self, link: GroupLink, msg: Message) -> None:
        # Waits while the inbox's byte budget is spent: the sender's TCP stalls, not the master's memory.
        while not self.inbox.put((link, msg), msg.nbytes, timeout=1.0):
            if self._stop.is_set() or not link.alive:
                return

    def _on_leave(self, link: GroupLink, reason: str) -> None:
        self.tally.left(link.group)
        if not self._stop.is_set():
            log.info("group %d left: %s", link.group, reason)
            self.metrics.write({"type": "event", "t": time.time(), "event": "group_left", "group": link.group,
                                "reason": reason})

    # ------------------------------------------------------------------------------ learning (main thread)
    def _drain_inbox(self) -> None:
        try:
            link, msg = self.inbox.get(timeout=0.05)
            self._handle(link, msg)
            while True:  # drain what queued up meanwhile before deciding on an update
                link, msg = self.inbox.get_nowait()
                self._handle(link, msg)
        except queue.Empty:
            pass

    def _handle(self, link: GroupLink, msg: Message) -> None:
        reason = check_message(msg, algo=self.spec.algo, arch=self.arch, max_steps=self._max_steps(link),
                               normalize=self.normalize)
        if reason is not None:
            self.counters_net.add(f"rejected.{reason}")
            detail = check_norm(msg, self.arch, self.normalize) if reason == "bad_norm" else None
            log.warning("rejected a %s from group %d: %s%s", msg.type.name, link.group, reason,
                        f" ({detail})" if detail else "")
            if reason in CLOSING_REASONS:
                link.close()
            else:
                link.post(self.weights_frame())  # e.g. a NaN: drop it, let the group go on
            return
        self._record_experience(link, msg)
        # Raw-observation and return statistics are good whatever the policy's age: merged even if the
        # segment or gradient itself turns out too stale to use.
        self.norm.add(msg.fields, msg.arrays)
        if msg.type == MsgType.GRADS:
            self._apply_grads(link, msg)
        else:
            self.rounds.add(link.group, link, msg.fields, msg.arrays)

    def _max_steps(self, link: GroupLink) -> int:
        """What one message of this group may hold: n_steps × its workers in the spec (as it claimed, if
        the spec lists no groups: the HELLO's claim was checked against the spec at join otherwise)."""
        workers = next((g.workers for g in self.spec.groups if g.index == link.group), link.workers)
        return max_steps_per_message(int(self.hp["n_steps"]), workers)

    def _record_experience(self, link: GroupLink, msg: Message) -> None:
        steps = int(msg.fields["env_steps"])
        rets = msg.arrays["ep_returns"].astype(float).tolist()
        self.tally.experience(link.group, link.workers, steps, rets)
        if rets:
            self.metrics.write(episodes_record(link.group, self.tally.c.env_steps, steps, rets,
                                               msg.arrays["ep_lengths"].astype(int).tolist()))

    def _apply_grads(self, link: GroupLink, msg: Message) -> None:
        """A3C: apply a group's gradient at once (unless stale) and answer that group alone."""
        stale, staleness = a3c_is_stale(self.tally.c.version, int(msg.fields["version"]), int(self.hp["max_staleness"]))
        self.tally.lagged([] if stale else [staleness], int(stale))
        if stale:
            self.counters_net.add("dropped.stale")
        else:
            lr = self.learner.set_progress(self._progress())
            norm = self.learner.apply({k[2:]: v for k, v in msg.arrays.items() if k.startswith("g/")})
            self.tally.losses = {**numeric_losses(msg.fields.get("losses", {})), "grad_norm": norm, "lr": lr}
            self._after_update()
        link.post(self.weights_frame())

    def _maybe_ppo_update(self) -> None:
        """PPO: when the round is complete, one update on every fresh segment, then weights to every waiter."""
        # Normally every connected group has sent its segment; a group that is connected but silent
        # (stuck, or just restarted and still warming up) must not stall the others for long.
        live = {link.group for link in self.server.live_links()}
        waiting = {g for g, (link, _, _) in self.rounds.pending.items() if link.alive}
        if not self.rounds.due(live, waiting):
            return
        links, parts, stale = self.rounds.take(self.tally.c.version)
        if stale:
            self.counters_net.add("dropped.stale", stale)
        self.tally.lagged(self.rounds.lags, stale)
        if parts:
            lr = self.learner.set_progress(self._progress())
            self.tally.losses = {**self.learner.update(ppo_batch(parts, continuous=self.arch.continuous)), "lr": lr}
            self._after_update()
        frame = self.weights_frame()
        for link in links:
            link.post(frame)

    def _progress(self) -> float:
        """How far the run is toward --max-steps (0 without a limit): the learning-rate schedule's clock."""
        return self.tally.c.env_steps / self.spec.max_steps if self.spec.max_steps else 0.0

    def _after_update(self) -> None:
        self.tally.updated()
        if self.tally.c.updates % self.spec.checkpoint_every == 0:
            self._checkpoint()

    def weights_frame(self) -> list[Any]:
        """The current weights encoded once per version and shared by every send."""
        cache, version = self._weights_cache, self.tally.c.version
        if cache is None or cache[0] != version:
            weights = get_named_weights(self.learner.model)
            # Checked once here, at the source, rather than by every group on every broadcast.
            if not all_finite(weights):
                raise FloatingPointError(f"training diverged: non-finite weights after update {self.tally.c.updates}; "
                                         f"lower the learning rate (--set lr=...) and resume from the last checkpoint")
            # The normalisation statistics as of this version travel with it: a group swaps both in at once.
            frame = encode_parts(MsgType.WEIGHTS, {"version": version}, {**weights, **self.norm.stats().arrays()})
            _ = frame.digest  # hashed once here for every group's MAC, not once per group in its writer thread
            cache = (version, frame)
            self._weights_cache = cache
        return cache[1]

    def _checkpoint(self) -> None:
        path = self.ckpt.save(self.tally.c, list(self.tally.recent))
        self.tally.last_ckpt = (self.tally.c.updates, time.monotonic(), path)
        log.debug("checkpoint %s", path)

    def _check_done(self) -> None:
        spec, tally = self.spec, self.tally
        mean = tally.mean_return()
        if spec.until_return is not None and mean is not None and len(tally.recent) >= spec.return_window \
                and mean >= spec.until_return:
            self.request_stop("target_reached")
        elif spec.max_steps is not None and tally.c.env_steps >= spec.max_steps:
            self.request_stop("max_steps")

    # ------------------------------------------------------------------------------------------ reporting
    def status(self) -> dict[str, Any]:
        return self.tally.status(state=self.state.value, queue_depth=len(self.rounds) + self.inbox.qsize(),
                                 network=self.counters_net.snapshot(), stop_reason=self.stop_reason)

    def _report(self) -> None:
        best = self.tally.new_best()
        if best is not None and hasattr(self, "learner"):
            c = self.tally.c
            save_best(self.files, {**get_named_weights(self.learner.model), **self.norm.stats().arrays()},
                      {"mean_return": best, "episodes_in_window": len(self.tally.recent), "env_steps": c.env_steps,
                       "updates": c.updates, "version": c.version})
        st = self.status()
        atomic_write_json(self.files.status, st)
        self.metrics.write(self.tally.progress_record(st))
        self.tb.write(self.tally.c.env_steps, self.tally.scalars(st))

    # ---------------------------------------------------------------------------------------------- stop
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
                arch = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.arch.__dict__.items()}
                export_model(self.files, self.learner.model, get_named_weights(self.learner.model), arch, self.spec,
                             self.tally.c.version, norm=self.norm.stats())
                self._report()
        except Exception:
            log.exception("final checkpoint/export failed")
            failed = True
        if server is not None:
            server.close()
        spec, tally = self.spec, self.tally
        title = f"{plain_env_id(spec.env_id)} · {spec.algo} · {spec.total_workers} workers · {spec.run_id}"
        try:
            plot_learning_curve(self.files.metrics, self.files.curve, title=title, window=spec.return_window,
                                target=spec.until_return)
        except Exception:
            log.exception("plotting the learning curve failed")
        self.outcome = "failed" if failed else reason
        atomic_write_json(self.files.summary, tally.summary(outcome=self.outcome, reason=reason, root=self.files.root,
                                                            network=self.counters_net.snapshot()))
        self.state = MasterState.FAILED if failed else MasterState.FINISHED
        atomic_write_json(self.files.status, {**self.status(), "state": self.state.value})
        self.metrics.write({"type": "event", "t": time.time(), "event": "master_stopped", "outcome": self.outcome})
        self.metrics.close()
        mean = tally.mean_return()
        log.info("run %s %s: mean return %s over %d episodes, %d env steps, %d updates", spec.run_id, self.outcome,
                 None if mean is None else round(mean, 2), len(tally.recent), tally.c.env_steps, tally.c.updates)
        return 1 if failed else 0


def install_signal_handlers(master: Master) -> None:
    def handler(signum: int, _frame: Any) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        master.request_stop("interrupted")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
