"""How a master starts: the first phase of :meth:`worker.master.Master.run`, before it serves any payload.

In order: load the algorithm (built-in or the user's) with its hyper-parameters for this env, its schedule and
checkpoint interval; build the Keras model, the learner and the payload schema, restoring the newest intact
checkpoint; decide how the groups act (the model converted to numpy, or TensorFlow) and encode the SETUP frame;
listen and start serving groups. Each step names itself in ``_phase``, which ``summary.json`` reports if it
raises.

Why apart from the loop: these steps run once and only set up what the loop in :mod:`worker.master` uses;
:class:`Starting` is a part of :class:`worker.master.Master` (its base class), not a class of its own.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from worker.acting import decide_acting
from worker.algorithms import build_model, load_algorithm, resolve_hparams
from worker.api import LearnerContext, Spaces
from worker.contract import TF_THREADS_ENV, RunFiles, RunSpec, format_addr
from worker.early import EarlyStart
from worker.envs import make_env
from worker.links import Counters, GroupLink, LinkServer, listening_socket
from worker.protocol import Message, MsgType, encode_parts
from worker.reporting import Tally, write_policy_doc
from worker.results import MetricsLog, atomic_write_text
from worker.schedules import Scheduler
from worker.validate import check_schema

log = logging.getLogger("worker.master")


class Starting:
    """The start of :class:`worker.master.Master`: the steps its ``run`` takes before the loop. They read what
    ``Master.__init__`` set (declared below) and set what the loop uses (the algorithm, learner, schema,
    checkpointer, acting decision, SETUP frame, TensorBoard writer and the link server)."""

    if TYPE_CHECKING:  # Master's, set in its __init__ and run or defined there
        spec: RunSpec
        secret: bytes
        files: RunFiles
        tally: Tally
        metrics: MetricsLog
        counters_net: Counters
        acting: dict[str, Any]
        _listen_sock: socket.socket | None
        _phase: str
        _restored_from: str | None
        _learner_ready: bool
        early: EarlyStart | None

        def _progress(self) -> float: ...
        def _check_finite(self, arrays: dict[str, Any]) -> None: ...
        def _policy_doc(self) -> dict[str, Any]: ...
        def _on_join(self, link: GroupLink) -> tuple[dict[str, Any], list[Any]]: ...
        def _on_message(self, link: GroupLink, msg: Message) -> None: ...
        def _on_leave(self, link: GroupLink, reason: str) -> None: ...

    def _load_algorithm(self) -> None:
        """The algorithm (built-in or the user's), its hyper-parameters for this env, schedule and schema."""
        spec = self.spec
        self._phase = "loading the algorithm"
        env = make_env(spec.env_id, seed=spec.seed, **spec.env_args)
        self.spaces = Spaces(env.observation_space, env.action_space)
        env.close()
        self.algo_cls = load_algorithm(spec.algo)
        self.hp = resolve_hparams(self.algo_cls, spec.algo, spec.env_id, self.spaces, spec.hparams)
        self.algo = self.algo_cls(self.spaces, self.hp, num_workers=max(1, spec.total_workers))
        self.schedule = self.algo.schedule()
        self.scheduler = Scheduler(self.schedule)
        self.checkpoint_every = spec.checkpoint_every or int(self.algo.checkpoint_every)

    def _start_early(self, recovering: bool) -> None:
        """Serve the groups before TensorFlow loads when the run allows it (:mod:`worker.early`): the built-in
        network's numpy program and initial weights are version 0; their first segments wait in the inbox."""
        from worker.early import early_start
        from worker.keras_convert import Conversion

        spec = self.spec
        self._phase = "making the groups' first policy in numpy"
        self.early = early_start(self.algo, spec.model, spec.acting, spec.seed, self.files.checkpoints, recovering)
        if self.early is None:
            return
        shapes = dict(self.early.program.weights)
        self._decide_acting(Conversion(self.early.program, self.early.reason), shapes, tuple(shapes))
        self._serve()

    def _build_learner(self) -> None:
        import tensorflow as tf

        from worker.checkpoint import Checkpointer
        from worker.early import verify
        from worker.keras_convert import convert, get_weights, set_weights, weight_names

        threads = int(os.environ.get(TF_THREADS_ENV, "0"))
        if threads:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        spec = self.spec
        self._phase = "building the model"
        self.model = build_model(self.algo, spec.model, spec.seed)
        if self.early is not None:  # the groups already play with these: the learner starts from them too
            set_weights(self.model, self.early.weights)
        self.names = weight_names(self.model)
        variables = dict(zip(self.names, self.model.weights))
        trainable = tuple(n for n, v in variables.items() if v.trainable)
        self._phase = "building the learner"
        ctx = LearnerContext(spaces=self.spaces, hparams=self.hp, model=self.model, variables=variables,
                             trainable=trainable, seed=spec.seed, num_workers=spec.total_workers,
                             algorithm=self.algo, _progress=self._progress)
        self.learner = self.algo.learner(ctx)
        shapes = {n: tuple(int(d) for d in v.shape) for n, v in variables.items()}
        self.schema = dict(self.algo.payload(shapes, trainable))
        check_schema(self.schema)
        self._phase = "restoring the newest checkpoint"
        self.ckpt = Checkpointer(self.files.checkpoints, self.learner.checkpoint(), window=spec.return_window)
        restored = self.ckpt.restore_latest()
        if restored and self.early is not None:
            raise RuntimeError(f"a checkpoint appeared in {self.files.checkpoints} while the master started early "
                               "from fresh weights; start the run again (or with --resume)")
        if restored:
            c, recent, path = restored
            self.learner.restored()
            self.tally.c = c
            self.tally.recent.extend(recent)
            self.tally.last_ckpt = (c.updates, time.monotonic(), path)
            self._restored_from = path
            log.info("resumed from %s: env_steps=%d updates=%d episodes=%d", path, c.env_steps, c.updates, c.episodes)
        if self.early is not None:
            self._phase = "checking the groups' numpy-made first policy against Keras"
            if trainable != tuple(shapes):
                raise RuntimeError(f"early start: the Keras model's trainable weights are {trainable}, the groups "
                                   f"were told {tuple(shapes)}")
            error = verify(self.early, self.model, self.learner.extras(), self.spaces.observation, seed=spec.seed)
            self.acting["max_error"] = round(error, 6)
            log.info("the groups' numpy-made first policy matches Keras (largest error %.3g of float32 rounding)",
                     error)
        else:
            self._phase = "deciding how the groups act"
            self._decide_acting(convert(self.model, self.spaces.observation, seed=spec.seed), shapes, trainable)
        self._check_finite(get_weights(self.model))
        write_policy_doc(self.files, self._policy_doc())  # `launcher eval` of a run that never ends needs it
        from worker.results import TensorBoardWriter

        self.tb = TensorBoardWriter(self.files.tensorboard)
        self._learner_ready = True
        self._phase = "running"
        log.info("learner ready (%s)", "the groups have played since the start" if self.early is not None
                 else "the groups are served from now on")

    def _decide_acting(self, conversion: Any, shapes: dict[str, tuple[int, ...]], trainable: tuple[str, ...]) -> None:
        self.program, self.acting, setup = decide_acting(conversion, self.spec.acting, shapes, trainable,
                                                         groups_wait=self.schedule.groups_wait)
        log.info("groups act with %s: %s", self.acting["path"], self.acting["reason"])
        self.setup_frame = encode_parts(MsgType.SETUP, setup)

    def _listen(self) -> socket.socket:
        if self._listen_sock is not None:
            return self._listen_sock
        return listening_socket(self.spec.master_host, self.spec.master_port)

    def _serve(self) -> None:
        spec = self.spec
        sock = self._listen()
        bound = sock.getsockname()
        where = format_addr(bound if isinstance(bound, str) else (bound[0], bound[1]))
        atomic_write_text(self.files.master_addr, f"{where}\n")
        self.server = LinkServer(
            sock, secret=self.secret, run_id=spec.run_id, max_frame_bytes=spec.max_frame_bytes,
            heartbeat_interval_s=spec.heartbeat_interval_s, heartbeat_timeout_s=spec.heartbeat_timeout_s,
            handshake_timeout_s=spec.handshake_timeout_s, max_connections=spec.max_connections,
            counters=self.counters_net, on_join=self._on_join, on_message=self._on_message, on_leave=self._on_leave)
        self.server.start()
        log.info("master of run %s listening on %s (%s on %s, %d workers in %d groups, %s schedule)", spec.run_id,
                 where, spec.algo, spec.env_id, spec.total_workers, len(spec.groups), self.schedule.kind)
        self.metrics.write({"type": "event", "t": time.time(), "event": "master_started",
                            "env_steps": self.tally.c.env_steps, "updates": self.tally.c.updates,
                            "acting": self.acting["path"], "tensorflow_loaded": "tensorflow" in sys.modules})
