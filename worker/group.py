"""A worker group: one process running K workers (env instances) with batched policy inference.

Lifecycle (``GroupState``): CONNECTING -> PLAYING -> (disconnected: CONNECTING with backoff) ... ->
STOPPED (the master said the run is over) | FAILED (auth refused, or the master stayed away past the
reconnect deadline).

Acting uses :class:`worker.models.NumpyPolicy` over all K envs at once (the K envs are one vector env);
PPO groups never import TensorFlow. A3C groups import it once per group (not per worker) to compute
gradients.

Collection overlaps learning (the default; double-buffered, as Sample Factory's sampler and APPO): a
group sends a segment tagged with its behaviour policy's version and log-probabilities and at once
collects the next one with the weights it has, while the master learns. At the segment boundary it takes
the weights that arrived meanwhile; with one segment already in flight it waits for that segment's reply
before sending the next, so at most one segment is in flight and a segment is at most one round old when
the master uses it (the master's learner corrects for that lag, and drops what is older than its bound).
``sync=true`` (a hyper-parameter) restores the strictly synchronous round: send, wait for the new
weights, then collect; the policy lag is then 0.

A master (or an impostor on the network) that sends anything malformed gets the same treatment as a
bad peer gets from the master: a ``rejected.<reason>`` count in :attr:`WorkerGroup.rejected`, one log
line, and a reconnect with backoff, never a traceback and never an exit from the reconnect loop (only a
refused secret ends the group at once).
"""

from __future__ import annotations

import collections
import enum
import logging
import random
import signal
import socket
import threading
import time
from typing import Any

import numpy as np

from worker.algorithms import hparams as hparams_mod
from worker.algorithms.rollout import Collector, Segment
from worker.envs import make_vector_env
from worker.models import Architecture, NumpyPolicy, check_weights, env_kind
from worker.normalize import NormStats, check_stats, moments_fields, normalization
from worker.protocol import Connection, Message, MsgType, PeerClosed, ProtocolError, client_handshake
from worker.contract import RunSpec

log = logging.getLogger("worker.group")

EXIT_STOPPED = 0
EXIT_MASTER_GONE = 3
EXIT_AUTH = 4


class GroupState(str, enum.Enum):
    CONNECTING = "connecting"
    PLAYING = "playing"
    STOPPED = "stopped"
    FAILED = "failed"


class MasterGone(Exception):
    pass


class WorkerGroup:
    """Run group ``index`` of ``spec`` until the master stops the run.

    Args:
        spec: the run spec.
        index: which group this process is.
        secret: the run secret.
        master_addr: (host, port) to dial.
        reconnect_deadline_s: give up after the master has been unreachable this long.
    """

    def __init__(self, spec: RunSpec, index: int, secret: bytes, master_addr: tuple[str, int], *,
                 reconnect_deadline_s: float = 60.0) -> None:
        self.spec = spec
        self.assign = spec.group(index)
        self.index = index
        self.secret = secret
        self.master_addr = master_addr
        self.reconnect_deadline_s = reconnect_deadline_s
        # Worker w of group g plays copy w of one vector env, seeded seed + 1000 g + w.
        self.envs = make_vector_env(spec.env_id, self.assign.workers, **spec.env_args)
        obs_space, act_space = self.envs.single_observation_space, self.envs.single_action_space
        self.hp = hparams_mod.resolve(spec.algo, spec.env_id, spec.hparams, kind=env_kind(obs_space, act_space))
        self.arch = Architecture.for_spaces(obs_space, act_space, self.hp)
        self.policy = NumpyPolicy(self.arch)
        self.norm_obs, self.norm_ret = normalization(self.arch, self.hp)
        self.collector = Collector(self.envs, self.policy, gamma=float(self.hp["gamma"]),
                                   lam=float(self.hp["gae_lambda"]), seed=spec.seed + 1000 * index,
                                   normalize_obs=self.norm_obs, normalize_reward=self.norm_ret)
        self.sync = bool(self.hp["sync"])
        self.grads: Any = None
        if spec.algo == "a3c":
            from worker.gpu_setup import configure_tf_devices

            configure_tf_devices(self.assign.memory_limit_bytes)
            from worker.algorithms.a3c import A3CGradients

            self.grads = A3CGradients(self.arch, self.hp, spec.seed)
        self.state = GroupState.CONNECTING
        self._stop = threading.Event()
        self.connects = 0
        self.rejected: collections.Counter[str] = collections.Counter()  # what this group refused, by reason

    def request_stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------------------------------ connect
    def _connect(self) -> Connection:
        delay, first_fail = 0.1, None
        while not self._stop.is_set():
            try:
                s = socket.create_connection(self.master_addr, timeout=self.spec.handshake_timeout_s)
                conn = Connection(s, max_frame_bytes=self.spec.max_frame_bytes, timeout_s=self.spec.heartbeat_timeout_s)
                # The kernel accepts into the backlog before the master (still importing TensorFlow) calls
                # accept(); wait for its challenge as long as we would wait for a heartbeat.
                wait = max(self.spec.handshake_timeout_s, self.spec.heartbeat_timeout_s)
                client_handshake(conn, self.secret, run_id=self.spec.run_id, group=self.index,
                                 workers=self.assign.workers, deadline=time.monotonic() + wait)
                self.connects += 1
                return conn
            except ProtocolError as exc:
                if exc.reason in ("bad_auth", "rejected"):
                    raise
                self.rejected[exc.reason] += 1
                err: Exception = exc
            except (OSError, TimeoutError, PeerClosed) as exc:
                err = exc
            except (ValueError, KeyError, TypeError) as exc:  # a decode path missed a case: still retried
                self.rejected["malformed"] += 1
                err = exc
            now = time.monotonic()
            first_fail = first_fail or now
            if now - first_fail > self.reconnect_deadline_s:
                raise MasterGone(f"master {self.master_addr[0]}:{self.master_addr[1]} unreachable for "
                                 f"{self.reconnect_deadline_s:.0f} s (last error: {err})")
            log.info("group %d: master not reachable (%s); retrying in %.1f s", self.index, err, delay)
            self._stop.wait(delay * (0.5 + random.random()))
            # While the run starts (never connected yet) the master is seconds away: poll every second at
            # most. After losing an established master, back off further to 5 s.
            delay = min(delay * 2, 1.0 if self.connects == 0 else 5.0)
        raise MasterGone("stopping")

    def _heartbeats(self, conn: Connection, done: threading.Event) -> None:
        while not done.wait(self.spec.heartbeat_interval_s):
            try:
                conn.send(MsgType.HEARTBEAT, {})
            except (OSError, TimeoutError):
                return

    def _await(self, conn: Connection) -> Message:
        """Wait for WEIGHTS or STOP, skipping heartbeats."""
        while True:
            # Weights land straight in the policy's spare arrays (no copy); other frames are consumed
            # before the next recv, so one reusable buffer serves them.
            try:
                msg = conn.recv(reuse_buffer=True, into=self._weights_target)
            except (ValueError, KeyError, TypeError, OverflowError) as exc:  # a decode path missed a case
                raise ProtocolError("malformed", f"{type(exc).__name__}: {str(exc)[:120]}") from None
            if msg.type in (MsgType.WEIGHTS, MsgType.STOP):
                return msg
            if msg.type != MsgType.HEARTBEAT:
                raise ProtocolError("unexpected_type", f"master sent {msg.type.name}")

    def _weights_target(self, mtype: MsgType, fields: dict[str, Any]) -> dict[str, np.ndarray] | None:
        return self.policy.spare() if mtype == MsgType.WEIGHTS else None

    def _take_weights(self, msg: Message) -> None:
        # Shapes and names are checked before the swap; a frame that did not fit the spare arrays is copied.
        # The normalisation statistics (``norm/*``) travel with the weights and are swapped in with them.
        version = msg.fields.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ProtocolError("malformed", "WEIGHTS without an integer version")
        weights = {k: v for k, v in msg.arrays.items() if not k.startswith("norm/")}
        try:
            check_weights(self.arch, weights)
        except ValueError as exc:
            raise ProtocolError("bad_shape", f"the master's weights do not fit this model: {exc}") from None
        problem = check_stats(msg.arrays, self.arch.obs_shape, obs=self.norm_obs, ret=self.norm_ret)
        if problem is not None:
            raise ProtocolError("bad_norm", f"the master's normalisation statistics: {problem}")
        self.policy.swap_in(weights, version)
        self.collector.norm = NormStats.from_arrays(msg.arrays)

    # --------------------------------------------------------------------------------------------- play
    def run(self) -> int:
        while not self._stop.is_set():
            self.state = GroupState.CONNECTING
            try:
                conn = self._connect()
            except ProtocolError as exc:
                log.error("group %d: the master refused us (%s); check the run secret", self.index, exc.detail)
                self.state = GroupState.FAILED
                return EXIT_AUTH
            except MasterGone as exc:
                if self._stop.is_set():
                    break
                log.error("group %d: %s", self.index, exc)
                self.state = GroupState.FAILED
                return EXIT_MASTER_GONE
            done = threading.Event()
            threading.Thread(target=self._heartbeats, args=(conn, done), daemon=True).start()
            try:
                if self._play(conn):
                    self.state = GroupState.STOPPED
                    return EXIT_STOPPED
            except ProtocolError as exc:
                self.rejected[exc.reason] += 1
                log.warning("group %d: refused a frame from the master (%s); reconnecting", self.index, exc)
            except (OSError, TimeoutError, PeerClosed) as exc:
                log.warning("group %d: lost the master (%s); reconnecting", self.index, exc)
            finally:
                done.set()
                if self._stop.is_set():
                    try:
                        conn.send(MsgType.BYE, {})
                    except (OSError, TimeoutError):
                        pass
                conn.close()
        self.state = GroupState.STOPPED
        return EXIT_STOPPED

    def _play(self, conn: Connection) -> bool:
        """Play until STOP (returns True) or until stopped locally (False). Network errors propagate.

        Every segment sent gets exactly one WEIGHTS reply (or STOP); ``in_flight`` counts those owed.
        """
        msg = self._await(conn)
        if msg.type == MsgType.STOP:
            return True
        self._take_weights(msg)
        self.state = GroupState.PLAYING
        log.info("group %d playing: %d workers on %s, weights v%d, %s", self.index, self.assign.workers,
                 self.spec.env_id, self.policy.version, "synchronous rounds" if self.sync else "overlapped collection")
        n_steps = int(self.hp["n_steps"])
        in_flight = 0
        while not self._stop.is_set():
            seg = self.collector.collect(n_steps)
            fields, arrays = self._message(seg)  # A3C: the gradient at the behaviour weights, before a swap
            # The segment boundary, the only place new weights are swapped in: with the previous segment
            # still in flight (the double buffer is full) take its reply first, waiting if the learner is
            # still at it, so the master never holds more than one segment of ours.
            if in_flight:
                msg = self._await(conn)
                if msg.type == MsgType.STOP:
                    return self._stopped(msg)
                self._take_weights(msg)
                in_flight -= 1
            conn.send(MsgType.GRADS if self.grads is not None else MsgType.TRAJ, fields, arrays)
            in_flight += 1
            if self.sync:
                msg = self._await(conn)
                if msg.type == MsgType.STOP:
                    return self._stopped(msg)
                self._take_weights(msg)
                in_flight -= 1
        return False

    def _stopped(self, msg: Message) -> bool:
        log.info("group %d: the master ended the run (%.100s)", self.index, msg.fields.get("reason"))
        return True

    def _message(self, seg: Segment) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The TRAJ (PPO) or GRADS (A3C) message of one segment: fields and arrays."""
        stats: dict[str, np.ndarray] = {"ep_returns": np.asarray(seg.episode_returns, np.float64),
                                        "ep_lengths": np.asarray(seg.episode_lengths, np.int32)}
        fields: dict[str, Any] = {"version": seg.version, "env_steps": seg.steps}
        for prefix, moments in (("obs", seg.obs_moments), ("ret", seg.ret_moments)):
            if moments is not None:  # what the master merges into its running statistics
                f, a = moments_fields(prefix, moments)
                fields.update(f)
                stats.update(a)
        if self.grads is None:
            return fields, {**seg.flat(), **stats}
        # On-policy gradient: computed at the weights that acted (``version``); the master counts its
        # staleness when it applies it.
        grads, losses = self.grads.compute(self.policy.w, seg.flat())
        fields["losses"] = losses
        return fields, {**{f"g/{k}": v for k, v in grads.items()}, **stats}


def install_signal_handlers(group: WorkerGroup) -> None:
    def handler(signum: int, _frame: Any) -> None:
        group.request_stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
