"""The master (learner): a lifecycle that runs the algorithm's :class:`worker.api.Learner`, serves worker
groups and writes the results.

Lifecycle (``MasterState``): STARTING -> RUNNING -> STOPPING -> FINISHED | FAILED. ``run`` reads top to
bottom: load the algorithm and build the learner (restoring the newest intact checkpoint), decide how the
groups act (the model converted to numpy, or TensorFlow), listen, loop until a stop condition, and always
end in ``_shutdown``: STOP to every group, a last checkpoint, the exported model, the curve, ``summary.json``.

The parts live beside it: :mod:`worker.master_start` (the start, before the loop: algorithm, learner,
checkpoint restore, acting, listening; a base class of :class:`Master`), :mod:`worker.links` (sockets and
threads), :mod:`worker.validate` (what may be used), :mod:`worker.schedules` (when to update),
:mod:`worker.broadcast` (the weights frames the groups get), :mod:`worker.reporting` (what is counted and
written).
Nothing here branches on which algorithm runs.
"""

from __future__ import annotations

import enum
import logging
import queue
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from worker.algorithms import UserCodeError
from worker.api import Payload, Reject
from worker.broadcast import VersionFrames, first_non_finite, policy_arrays, with_extras
from worker.contract import EXIT_FAILED, EXIT_OK, RunFiles, RunSpec, plain_env_id
from worker.early import EarlyStart
from worker.ending import Outcome, error_doc
from worker.inbox import ByteBoundedInbox
from worker.links import Counters, GroupLink
from worker.master_start import Starting
from worker.protocol import Message, MsgType
from worker.recovery import note_recovery, previous_master
from worker.reporting import (Tally, episodes_record, export_model, numeric, policy_doc, save_best,
                              save_checkpoint_policy)
from worker.results import MetricsLog, atomic_write_json, plot_learning_curve
from worker.validate import Refusal, arrays_of, check_payload

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


class Master(Starting):
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
        self.state = MasterState.STARTING
        self.counters_net = Counters()
        self.inbox: ByteBoundedInbox[tuple[GroupLink, Message]] = ByteBoundedInbox(inbox_budget(spec))
        self.stop_reason: str | None = None
        self.outcome: str | None = None
        self.error: dict[str, str] | None = None  # what ended the run, for summary.json
        self._stop = threading.Event()
        self._listen_sock = listen_sock
        self.tally = Tally(spec)
        self.frames = VersionFrames()
        # Set once the learner is built and restored: only then may shutdown save a checkpoint or export.
        self._learner_ready = False
        self._diverged = False  # the learner produced non-finite weights: nothing of them is saved
        self.acting: dict[str, Any] = {"path": None, "reason": "not decided yet"}
        self.early: EarlyStart | None = None  # the numpy-made start the groups got before TensorFlow loaded

    # ---------------------------------------------------------------------------------------------- run
    def run(self) -> int:
        self.files.root.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLog(self.files.metrics)
        prev = previous_master(self.files.status)  # a master of this run that died mid-run: this one recovers it
        self._restored_from: str | None = None
        try:
            self._load_algorithm()
            self._start_early(recovering=prev is not None)  # serves the groups now when it can (worker/early.py)
            self._build_learner()
            note_recovery(prev, self.tally, self._restored_from, self.metrics, self.tb)
            if self.early is None:  # an early start is serving already
                self._serve()
            self.state = MasterState.RUNNING
            self._check_done()  # a resumed run may already be done
            next_report = 0.0
            while not self._stop.is_set():
                self._drain_inbox()
                self._maybe_update()
                self._check_done()
                if time.monotonic() >= next_report:
                    self._report()
                    next_report = time.monotonic() + 1.0
            return self._shutdown(failed=self.error is not None)
        except Exception as exc:
            log.exception("master failed")
            if self.error is None:
                where = "the algorithm" if isinstance(exc, UserCodeError) else self._phase
                self.error = {"type": "UserCodeError", "message": str(exc)[:2000], "where": where} \
                    if isinstance(exc, UserCodeError) else error_doc(exc, where)
            self.stop_reason = self.stop_reason or "error"
            return self._shutdown(failed=True)

    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            self._stop.set()

    _phase = "the master's start"

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
        version, frame = self.tally.c.version, self.weights_frame()
        link.sent_version = version
        return info, [self.setup_frame, frame]

    def _on_message(self, link: GroupLink, msg: Message) -> None:
        # Waits while the inbox's byte budget is spent: the sender's TCP stalls, not the master's memory.
        while not self.inbox.put((link, msg), msg.nbytes, timeout=1.0):
            if self._stop.is_set() or not link.alive:
                return

    def _on_leave(self, link: GroupLink, reason: str) -> None:
        yielded = reason == "yielded"  # its elastic run gave its GPUs to a queued run; the rounds go on without it
        self.tally.left(link.group, yielded=yielded)
        if not self._stop.is_set():
            log.info("group %d left: %s", link.group, reason)
            self.metrics.write({"type": "event", "t": time.time(), "event": "group_yielded" if yielded else
                                "group_left", "group": link.group, "reason": reason})

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
        if msg.type == MsgType.BYE:
            self._group_failed(link, msg.fields.get("error"))
            return
        refusal = check_payload(msg, schema=self.schema, max_steps=self._max_steps(link))
        payload = None
        if refusal is None:
            payload = Payload(arrays_of(msg), group=link.group, version=int(msg.fields["version"]),
                              env_steps=int(msg.fields["env_steps"]))
            try:
                self.learner.check(payload)
            except Reject as exc:
                refusal = Refusal(exc.reason, exc.detail or exc.reason)
        if refusal is not None or payload is None:
            assert refusal is not None
            self.counters_net.add(refusal.counter)
            log.warning("refused a payload from group %d: %s (%s)", link.group, refusal.reason, refusal.detail)
            if refusal.closes:
                link.close()
            else:
                self.reply(link)  # e.g. a field off its schema: drop it, let the group go on
            return
        self._record_experience(link, msg)
        self.learner.observe(payload)
        if self.scheduler.offer(link, payload):
            self.reply(link)

    def _group_failed(self, link: GroupLink, error: Any) -> None:
        """A group's copy of the algorithm raised: the run ends, failed, with what it said."""
        doc = error if isinstance(error, dict) else {}
        self.error = {"type": str(doc.get("type", "Error"))[:200], "message": str(doc.get("message", ""))[:2000],
                      "where": f"group {link.group}: {str(doc.get('where', 'the actor'))[:300]}"}
        log.error("group %d stopped on an error in the algorithm's code: %s: %s (%s); ending the run", link.group,
                  self.error["type"], self.error["message"], self.error["where"])
        self.request_stop("group_error")

    def _max_steps(self, link: GroupLink) -> int:
        """What one payload of this group may hold (rows and env steps) for its workers in the spec (as it
        claimed, if the spec lists no groups: the HELLO's claim was checked against the spec at join otherwise)."""
        workers = next((g.workers for g in self.spec.groups if g.index == link.group), link.workers)
        return max(1, int(self.algo.max_rows(workers)))

    def _record_experience(self, link: GroupLink, msg: Message) -> None:
        steps = int(msg.fields["env_steps"])
        rets = msg.arrays["ep_returns"].astype(float).tolist()
        self.tally.experience(link.group, link.workers, steps, rets)
        if rets:
            self.metrics.write(episodes_record(link.group, self.tally.c.env_steps, steps, rets,
                                               msg.arrays["ep_lengths"].astype(int).tolist()))

    def _maybe_update(self) -> None:
        """Run the updates the schedule says are due, then answer the groups that wait for them."""
        sched = self.scheduler
        live = {link.group for link in self.server.live_links()}
        while sched.due(live, sched.waiting_groups(lambda link: link.alive)):
            taken = sched.take(self.tally.c.version)
            if taken.stale:
                self.counters_net.add("dropped.stale", taken.stale)
            self.tally.lagged(taken.lags, taken.stale)
            if taken.payloads:
                self._phase = "the learner's update"
                scalars = self.learner.update(taken.payloads)
                self._phase = "running"
                self.tally.losses = numeric(scalars)
                self.tally.updated()
                self.weights_frame()  # checks the new weights are finite before anything sends or saves them
            for link in taken.links:
                self.reply(link)
            # After the replies, so the groups play on with the new weights while it is written (~8 ms for
            # CartPole's model on this CPU) instead of waiting for it (docs/benchmarks.md, issue 28 section).
            if taken.payloads and self.tally.c.updates % self.checkpoint_every == 0:
                self._checkpoint()
            if sched.barrier:
                break  # one round per pass: new payloads are drained first

    def _progress(self) -> float:
        """How far the run is toward --max-steps (0 without a limit): the learning-rate schedule's clock."""
        return min(1.0, self.tally.c.env_steps / self.spec.max_steps) if self.spec.max_steps else 0.0

    def reply(self, link: GroupLink) -> None:
        """Answer a group: the current weights, or "unchanged" when it already has this version."""
        version = self.tally.c.version
        if link.sent_version == version:
            link.post(self.unchanged_frame())
        else:
            link.sent_version = version
            link.post(self.weights_frame())

    def weights_frame(self) -> list[Any]:
        """The current weights and the learner's extras, encoded once per version and shared by every send."""
        return self.frames.weights(self.tally.c.version, self._policy_arrays, self._check_finite)

    def unchanged_frame(self) -> list[Any]:
        return self.frames.unchanged(self.tally.c.version)

    def _check_finite(self, arrays: dict[str, Any]) -> None:
        # Checked once here, at the source, rather than by every group on every broadcast.
        bad = first_non_finite(arrays)
        if bad is not None:
            self._diverged = True
            raise FloatingPointError(f"the learner produced non-finite weights ({bad!r}) after update "
                                     f"{self.tally.c.updates}; the last good checkpoint is kept: lower the learning "
                                     "rate (a --set value; `--set help` lists them) and resume from it")

    def _checkpoint(self) -> None:
        before, self._phase = self._phase, "writing a checkpoint"  # what summary.json names if this raises
        self.learner.checkpoint()  # brings the learner's own variables up to date
        path = self.ckpt.save(self.tally.c, list(self.tally.recent))
        save_checkpoint_policy(self.files, self.tally.c.updates, self._policy_arrays(), self.ckpt.checkpoints)
        self._phase = before
        self.tally.last_ckpt = (self.tally.c.updates, time.monotonic(), path)
        log.debug("checkpoint %s", path)

    def _check_done(self) -> None:
        spec, tally = self.spec, self.tally
        mean = tally.mean_return()
        if spec.until_return is not None and mean is not None and len(tally.recent) >= spec.return_window \
                and mean >= spec.until_return:
            self.request_stop(Outcome.TARGET_REACHED.value)
        elif spec.max_steps is not None and tally.c.env_steps >= spec.max_steps:
            self.request_stop(Outcome.MAX_STEPS.value)

    # ------------------------------------------------------------------------------------------ reporting
    def status(self) -> dict[str, Any]:
        return self.tally.status(state=self.state.value, queue_depth=len(getattr(self, "scheduler", ())) +
                                 self.inbox.qsize(), network=self.counters_net.snapshot(),
                                 stop_reason=self.stop_reason, acting=self.acting, error=self.error)

    def _policy_arrays(self) -> dict[str, Any]:
        if not self._learner_ready and self.early is not None:  # version 0 while TensorFlow loads
            return with_extras(self.early.weights, self.early.extras)
        return policy_arrays(self.model, self.learner)

    def _report(self) -> None:
        best = self.tally.new_best()
        if best is not None and self._learner_ready and not self._diverged:
            c = self.tally.c
            save_best(self.files, self._policy_arrays(),
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
            # A learner that failed to build or restore holds fresh weights and zero counters: saving it would
            # push the run's real checkpoints out (max_to_keep) and a resume would start over. Non-finite
            # weights are never saved: the last good checkpoint stays the newest.
            if self._learner_ready and not self._diverged:
                self._checkpoint()
                export_model(self.files, self.learner.export_model(), self._policy_arrays(), self._policy_doc())
                self._report()
        except Exception as exc:
            log.exception("final checkpoint/export failed")
            if self.error is None:
                self.error = error_doc(exc, "the final checkpoint and export")
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
        self.outcome = (Outcome.FAILED if failed else Outcome.parse(reason) or Outcome.STOPPED).value
        atomic_write_json(self.files.summary, tally.summary(outcome=self.outcome, reason=reason, root=self.files.root,
                                                            network=self.counters_net.snapshot(), error=self.error,
                                                            acting=self.acting))
        self.state = MasterState.FAILED if failed else MasterState.FINISHED
        atomic_write_json(self.files.status, {**self.status(), "state": self.state.value})
        self.metrics.write({"type": "event", "t": time.time(), "event": "master_stopped", "outcome": self.outcome})
        self.metrics.close()
        mean = tally.mean_return()
        log.info("run %s %s: mean return %s over %d episodes, %d env steps, %d updates", spec.run_id, self.outcome,
                 None if mean is None else round(mean, 2), len(tally.recent), tally.c.env_steps, tally.c.updates)
        if self.error:
            log.error("the run failed: %s: %s (%s)", self.error["type"], self.error["message"], self.error["where"])
        return EXIT_FAILED if failed else EXIT_OK

    def _policy_doc(self) -> dict[str, Any]:
        return policy_doc(env_id=self.spec.env_id, algo=self.spec.algo, version=self.tally.c.version,
                          policy_output=int(self.algo.policy_output), spaces=self.spaces, names=self.names,
                          program=self.program, acting=self.acting)


def install_signal_handlers(master: Master) -> None:
    def handler(signum: int, _frame: Any) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        master.request_stop(Outcome.INTERRUPTED.value)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
