"""A worker group: one process running K workers (env instances, one vector env) and the algorithm's
:class:`worker.api.Actor`, which turns them into payloads for the master.

Lifecycle (``GroupState``): CONNECTING -> PLAYING -> (disconnected: CONNECTING with backoff) ... ->
STOPPED (the master said the run is over) | FAILED (auth refused, the master stayed away past the reconnect
deadline, or the algorithm's code raised: then the group tells the master, which ends the run).

How the model runs comes from the master's SETUP (:mod:`worker.acting`): numpy (no TensorFlow in the group) or
TensorFlow. The launcher counts env steps and finished episodes itself (:class:`worker.segments.EpisodeCounter`
around the envs) and sends them with every payload, whatever the actor does.

Unless the schedule makes groups wait (``sync``), collection overlaps learning (double-buffered, as Sample
Factory's sampler and APPO): a group sends a payload tagged with its behaviour weights' version and at once
collects the next one with the weights it has, while the master learns. At the payload boundary it takes the
weights that arrived meanwhile; with one payload already in flight it waits for that payload's reply before
sending the next, so at most one is in flight and a payload is at most one round old when the master uses it.

A master (or an impostor on the network) that sends anything malformed gets the same treatment as a bad peer
gets from the master: a ``rejected.<reason>`` count in :attr:`WorkerGroup.rejected`, one log line, and a
reconnect with backoff, never a traceback and never an exit from the reconnect loop (only a refused secret
ends the group at once).
"""

from __future__ import annotations

import collections
import enum
import logging
import random
import signal
import threading
import time
import traceback
from typing import Any, Mapping

import numpy as np

from worker.acting import ActingRuntime, Setup
from worker.algorithms import build_model, describe, load_algorithm, resolve_hparams
from worker.api import ActorContext, Reject, Spaces
from worker.contract import (EXIT_OK, EXTRA_PREFIX, GROUP_AUTH_REFUSED_EXIT, GROUP_MASTER_GONE_EXIT,
                             GROUP_USER_CODE_EXIT, RunSpec, format_addr)
from worker.envs import make_vector_env
from worker.protocol import Connection, Message, MsgType, PeerClosed, ProtocolError, client_handshake, dial
from worker.protocol.frames import DTYPES as WIRE_DTYPES
from worker.segments import EpisodeCounter
from worker.validate import EP_LENGTHS, EP_RETURNS

log = logging.getLogger("worker.group")

# The exit codes are the contract's (the supervisor decides on them): worker.contract.
EXIT_STOPPED = EXIT_OK
EXIT_MASTER_GONE = GROUP_MASTER_GONE_EXIT
EXIT_AUTH = GROUP_AUTH_REFUSED_EXIT  # the master refused our secret: not restarted, no budget spent
EXIT_USER_CODE = GROUP_USER_CODE_EXIT  # the algorithm's code raised in this group: not restarted


class GroupState(str, enum.Enum):
    CONNECTING = "connecting"
    PLAYING = "playing"
    STOPPED = "stopped"
    FAILED = "failed"


class MasterGone(Exception):
    pass


class UserCodeFailed(Exception):
    """The algorithm's actor (or the model function) raised in this group; ``error`` is what the master gets."""

    def __init__(self, error: dict[str, str]) -> None:
        super().__init__(f"{error['type']}: {error['message']}")
        self.error = error


class WorkerGroup:
    """Run group ``index`` of ``spec`` until the master stops the run.

    Args:
        spec: the run spec.
        index: which group this process is.
        secret: the run secret.
        master_addr: (host, port) to dial, or a Unix socket's path.
        reconnect_deadline_s: give up after the master has been unreachable this long.
    """

    def __init__(self, spec: RunSpec, index: int, secret: bytes, master_addr: str | tuple[str, int], *,
                 reconnect_deadline_s: float = 60.0) -> None:
        self.spec = spec
        self.assign = spec.group(index)
        self.index = index
        self.secret = secret
        self.master_addr = master_addr
        self.reconnect_deadline_s = reconnect_deadline_s
        # Worker w of group g plays copy w of one vector env, seeded seed + 1000 g + w.
        self.envs = EpisodeCounter(make_vector_env(spec.env_id, self.assign.workers, **spec.env_args))
        self.spaces = Spaces(self.envs.single_observation_space, self.envs.single_action_space)
        self.algo_cls = load_algorithm(spec.algo)
        self.hp = resolve_hparams(self.algo_cls, spec.algo, spec.env_id, self.spaces, spec.hparams)
        self.algo = self.algo_cls(self.spaces, self.hp, num_workers=max(1, spec.total_workers))
        self.runtime: ActingRuntime | None = None
        self.actor: Any = None
        self.groups_wait = False
        self.state = GroupState.CONNECTING
        self._stop = threading.Event()
        self._yielding = False  # asked to leave for good: an elastic run gives this group's GPUs to another run
        self.connects = 0
        self._refusals = 0  # frames of the master refused in a row since the group last played: reconnects wait
        self.rejected: collections.Counter[str] = collections.Counter()  # what this group refused, by reason

    def request_stop(self, *, yielding: bool = False) -> None:
        """Stop at the next payload boundary (the segment being collected is sent first). ``yielding``: an
        elastic run gives this group's GPUs away; the goodbye says so and the master counts it as a yield."""
        self._yielding = self._yielding or yielding
        self._stop.set()

    # ------------------------------------------------------------------------------------------ connect
    def _connect(self) -> Connection:
        delay, first_fail = 0.1, None
        while not self._stop.is_set():
            try:
                s = dial(self.master_addr, timeout=self.spec.handshake_timeout_s)
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
                raise MasterGone(f"master {format_addr(self.master_addr)} unreachable for "
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

    def _await(self, conn: Connection, *types: MsgType) -> Message:
        """Wait for one of ``types`` (default WEIGHTS) or STOP, skipping heartbeats."""
        want = types or (MsgType.WEIGHTS,)
        while True:
            # Weights land straight in the runtime's spare arrays (no copy); other frames are consumed
            # before the next recv, so one reusable buffer serves them.
            try:
                msg = conn.recv(reuse_buffer=True, into=self._weights_target)
            except (ValueError, KeyError, TypeError, OverflowError) as exc:  # a decode path missed a case
                raise ProtocolError("malformed", f"{type(exc).__name__}: {str(exc)[:120]}") from None
            if msg.type in want or msg.type == MsgType.STOP:
                return msg
            if msg.type != MsgType.HEARTBEAT:
                raise ProtocolError("unexpected_type", f"master sent {msg.type.name}")

    def _weights_target(self, mtype: MsgType, fields: dict[str, Any]) -> dict[str, np.ndarray] | None:
        if mtype != MsgType.WEIGHTS or self.runtime is None or fields.get("unchanged"):
            return None
        return self.runtime.spare()

    # ----------------------------------------------------------------------------------------- the actor
    def _set_up(self, msg: Message) -> None:
        """Act as the master's SETUP says: the first time, build the runtime and the actor (the user's code)."""
        try:
            setup = Setup.from_fields(msg.fields)
        except ValueError as exc:
            raise ProtocolError("malformed", str(exc)[:200]) from None
        self.groups_wait = setup.groups_wait
        if self.runtime is not None:
            if setup.weights != self.runtime.setup.weights:
                raise ProtocolError("bad_shape", "the master's SETUP names other weights than before")
            return
        self.runtime = self._user_code("building the model", lambda: ActingRuntime(setup, self._build_keras))
        log.info("group %d acts with %s: %s", self.index, setup.acting, setup.reason)

    def _build_keras(self) -> Any:
        from worker.gpu_setup import configure_tf_devices

        configure_tf_devices(self.assign.memory_limit_bytes)
        return build_model(self.algo, self.spec.model, self.spec.seed)

    def _make_actor(self) -> None:
        assert self.runtime is not None
        runtime = self.runtime
        seed = self.spec.seed + 1000 * self.index
        ctx = ActorContext(spaces=self.spaces, hparams=self.hp, envs=self.envs, num_envs=self.assign.workers,
                           group=self.index, seed=seed, policy=runtime.policy, rng=np.random.default_rng(seed),
                           algorithm=self.algo, _runtime=runtime)
        self.actor = self._user_code("building the actor", lambda: self.algo.actor(ctx))

    def _user_code(self, what: str, fn: Any) -> Any:
        """Run the algorithm's code; what it raises ends this group (and, through the master, the run)."""
        try:
            return fn()
        except (ProtocolError, OSError, PeerClosed):
            raise
        except Reject as exc:  # the actor refused what the master sent: counted, the group reconnects
            raise UserCodeFailed({"type": "Reject", "message": str(exc), "where": what}) from exc
        except Exception as exc:  # noqa: BLE001 - the user's code may raise anything
            log.error("group %d: the algorithm's code raised while %s:\n%s", self.index, what,
                      "".join(traceback.format_exception(exc)).rstrip())
            raise UserCodeFailed({"type": type(exc).__name__, "message": str(exc)[:2000],
                                  "where": f"{what}: {describe(exc)}"[:300]}) from exc

    def _take_weights(self, msg: Message) -> None:
        """Swap in a WEIGHTS frame: the weights' names and shapes are checked and the actor has seen the
        learner's extras (``x/*``; it may refuse them, raising :class:`worker.api.Reject`) before anything of
        the frame is taken. "unchanged" (the version the group has) takes nothing."""
        version = msg.fields.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ProtocolError("malformed", "WEIGHTS without an integer version")
        assert self.runtime is not None
        if msg.fields.get("unchanged"):
            if version != self.runtime.version:
                raise ProtocolError("malformed", f"'unchanged' version {version}, we have {self.runtime.version}")
            return
        weights = {k: v for k, v in msg.arrays.items() if not k.startswith(EXTRA_PREFIX)}
        extras = {k[len(EXTRA_PREFIX):]: v for k, v in msg.arrays.items() if k.startswith(EXTRA_PREFIX)}
        try:
            self.runtime.check(weights)
        except ValueError as exc:
            raise ProtocolError("bad_shape", f"the master's weights do not fit this model: {exc}") from None
        try:
            self._user_code("taking new weights", lambda: self.actor.on_weights(extras))
        except UserCodeFailed as exc:
            if isinstance(exc.__cause__, Reject):
                raise ProtocolError(exc.__cause__.reason, exc.__cause__.detail) from None
            raise
        self.runtime.swap_in(weights, version)

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
            except UserCodeFailed as exc:
                self.state = GroupState.FAILED
                try:  # the master ends the run and records what the user's code raised
                    conn.send(MsgType.BYE, {"error": exc.error})
                except (OSError, TimeoutError):
                    pass
                done.set()
                conn.close()
                return EXIT_USER_CODE
            except ProtocolError as exc:
                self.rejected[exc.reason] += 1
                # Back off: a master that sends what this group cannot take will likely send it again.
                self._refusals += 1
                pause = min(0.2 * 2 ** (self._refusals - 1), 5.0)
                log.warning("group %d: refused a frame from the master (%s); reconnecting in %.1f s", self.index,
                            exc, pause)
                self._stop.wait(pause)
            except (OSError, TimeoutError, PeerClosed) as exc:
                log.warning("group %d: lost the master (%s); reconnecting", self.index, exc)
            finally:
                done.set()
                if self._stop.is_set():
                    try:
                        conn.send(MsgType.BYE, {"reason": "yield"} if self._yielding else {})
                    except (OSError, TimeoutError):
                        pass
                conn.close()
        self.state = GroupState.STOPPED
        return EXIT_STOPPED

    def _play(self, conn: Connection) -> bool:
        """Play until STOP (returns True) or until stopped locally (False). Network errors propagate.

        Every payload sent gets exactly one WEIGHTS reply (or STOP); ``in_flight`` counts those owed.
        """
        msg = self._await(conn, MsgType.SETUP)
        if msg.type == MsgType.STOP:
            return True
        self._set_up(msg)
        msg = self._await(conn)
        if msg.type == MsgType.STOP:
            return True
        if self.actor is None:
            self._make_actor()
        self._take_weights(msg)
        assert self.runtime is not None
        self.state = GroupState.PLAYING
        self._refusals = 0
        log.info("group %d playing: %d workers on %s, weights v%d, %s", self.index, self.assign.workers,
                 self.spec.env_id, self.runtime.version,
                 "synchronous rounds" if self.groups_wait else "overlapped collection")
        in_flight = 0
        while not self._stop.is_set():
            version = self.runtime.version
            arrays = self._user_code("collecting a payload", self.actor.collect)
            fields, payload = self._frame(arrays, version)
            # The payload boundary, the only place new weights are swapped in: with the previous payload still in
            # flight (the double buffer is full) take its reply first, waiting if the learner is still at it, so
            # the master never holds more than one payload of ours.
            if in_flight:
                msg = self._await(conn)
                if msg.type == MsgType.STOP:
                    return self._stopped(msg)
                self._take_weights(msg)
                in_flight -= 1
            conn.send(MsgType.TRAJ, fields, payload)
            in_flight += 1
            if self.groups_wait:
                msg = self._await(conn)
                if msg.type == MsgType.STOP:
                    return self._stopped(msg)
                self._take_weights(msg)
                in_flight -= 1
        return False

    def _stopped(self, msg: Message) -> bool:
        log.info("group %d: the master ended the run (%.100s)", self.index, msg.fields.get("reason"))
        return True

    def _frame(self, arrays: Any, version: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The payload frame: the actor's arrays, and the launcher's own count of env steps and episodes."""
        if not isinstance(arrays, Mapping):
            raise UserCodeFailed({"type": "TypeError", "message": f"collect() returned a {type(arrays).__name__}, "
                                  "not a mapping of names to numpy arrays", "where": "collecting a payload"})
        steps, returns, lengths = self.envs.take()
        payload = {str(k): v for k, v in arrays.items()}
        for name, value in payload.items():
            if not isinstance(value, np.ndarray) or value.dtype not in WIRE_DTYPES.values():
                raise UserCodeFailed({"type": "TypeError", "where": "collecting a payload",
                                      "message": f"payload field {name!r} is {type(value).__name__} "
                                                 f"{getattr(value, 'dtype', '')}: a payload holds numpy arrays of "
                                                 "bool, int8-64, uint8 or float16-64"})
        payload[EP_RETURNS] = np.asarray(returns, np.float64)
        payload[EP_LENGTHS] = np.asarray(lengths, np.int32)
        return {"version": version, "env_steps": steps}, payload


def install_signal_handlers(group: WorkerGroup) -> None:
    def handler(signum: int, _frame: Any) -> None:
        group.request_stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    # SIGUSR2: the launcher of an elastic run takes this group's GPUs back for a queued run (launcher.elastic).
    signal.signal(signal.SIGUSR2, lambda signum, frame: group.request_stop(yielding=True))
