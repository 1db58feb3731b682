"""A Slurm run's job seen from outside the backend: waiting while Slurm queues it (:func:`wait_running`) and
until it is gone (:func:`wait_gone`); after its start, from any process, its job and steps as parts (Slurm's own
states and pending reason), their output (the ``logs/`` files the launcher writes), and ``down`` (``scancel``,
then waiting until Slurm lists nothing of it). Found from the run's record (``run.json``: the job id, whether the
run submitted it, the lost nodes), never from a backend instance.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, ClassVar

from launcher.backends.base import DownReport, FoundRun, Part, PartState, part_order
from launcher.backends.slurm_parts import step_number
from launcher.backends.slurm_specs import job_name, job_part, part_of_step
from launcher.errors import Interrupted, LauncherError, RunFailed
from launcher.runs import list_runs
from launcher.slurm import commands
from launcher.slurm.model import JobInfo, StepInfo
from worker.ending import RunState

log = logging.getLogger(__name__)

DOWN_WAIT_S = 30.0
QUEUE_POLL_S = 1.0  # how often wait_running() asks about a queued job


def wait_gone(job_id: str, run_id: str, *, owns_job: bool, timeout_s: float) -> bool:
    """Wait until Slurm lists neither the job (when the run owns it) nor a step of the run on one of the job's
    nodes (a step whose node was lost stays listed until its job ends); True when so."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            job = commands.job(job_id)
            steps = [s for s in commands.steps(job_id) if part_of_step(run_id, s.name)
                     and set(s.nodes) & set(job.nodes)] if job is not None and not job.ended else []
        except LauncherError:
            job, steps = None, []
        if (job is None or job.ended or not owns_job) and not steps:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def wait_running(job_id: str, *, job_log: Path, on_queued: Callable[[JobInfo], None],
                 stop_requested: Callable[[], bool]) -> JobInfo:
    """Wait while Slurm queues job ``job_id``, calling ``on_queued`` when its pending reason changes; give up on a
    stop request. ``job_log``: the batch script's output, named in the error when the job ends unrun.

    Raises:
        Interrupted: SIGINT/SIGTERM while queued (the backend's stop() cancels the job).
        RunFailed: the job ended, or Slurm forgot it, before it ran.
    """
    seen = ""
    while True:
        job = commands.job(job_id)
        if job is None:
            raise RunFailed(f"Slurm job {job_id} vanished before it ran", hint=f"`scontrol show job {job_id}`")
        if job.running:
            return job
        if job.ended:
            raise RunFailed(f"Slurm job {job_id} ended before it ran: {job.word}",
                            hint=f"see {job_log} and `scontrol show job {job_id}`")
        if job.word != seen:
            seen = job.word
            on_queued(job)
        if stop_requested():
            raise Interrupted(f"stopped while Slurm job {job_id} was queued ({job.word})")
        time.sleep(QUEUE_POLL_S)


class SlurmRun(FoundRun):
    """A Slurm run found from its record: the job (``job``) and each step of the run (``master``, ``group-N``)."""

    backend = "slurm"
    system: ClassVar[str] = "Slurm"

    @property
    def job_id(self) -> str:
        return str(self.record.get("slurm_job") or "")

    def parts(self) -> list[Part]:
        """The job with Slurm's state and pending reason, then the run's steps that Slurm lists (the newest of
        each part), each with its node and, when a node it ran on was lost, which and when."""
        if not self.job_id:
            return []
        try:
            job = commands.job(self.job_id)
            steps = commands.steps(self.job_id) if job is not None and not job.ended else []
        except LauncherError as exc:
            self.unreachable = exc.message
            return []
        if job is None or job.ended:
            return []
        lost_nodes: dict[str, str] = self.record.get("lost_nodes") or {}
        lost_parts: dict[str, str] = self.record.get("lost_parts") or {}
        step_gpus: dict[str, str] = self.record.get("step_gpus") or {}
        parts = [job_part(job)]
        newest: dict[str, StepInfo] = {}
        for s in steps:
            part = part_of_step(self.run_id, s.name)
            if part is not None and (part not in newest or step_number(s.step_id) > step_number(newest[part].step_id)):
                newest[part] = s
        for part, s in newest.items():
            on_lost = bool(set(s.nodes) & set(lost_nodes)) or not set(s.nodes) & set(job.nodes)
            parts.append(Part(part, PartState.FAILED if on_lost else PartState.RUNNING, ident=s.step_id,
                              status="lost" if on_lost else s.state, node=",".join(s.nodes),
                              lost=lost_parts.get(part, ""), gpus=step_gpus.get(part, "") if not on_lost else ""))
        parts[1:] = sorted(parts[1:], key=part_order)
        return parts

    def down(self, report: DownReport, *, grace_s: float) -> None:
        """The master's step first (SIGTERM through Slurm: it checkpoints and tells the groups to stop), then the
        job (``scancel``; in an allocation the run did not submit, only the run's steps), waiting until Slurm lists
        none of them."""
        if not self.job_id:
            return
        job = commands.job(self.job_id)
        if job is None or job.ended:
            return
        # The whole job goes only when Slurm itself names it for this run: the record says whether the run
        # submitted it, but a record (a legacy one sat in the results) is not proof enough to scancel a job.
        owns = bool(self.record.get("owns_job")) and job.name == job_name(self.run_id)
        if self.record.get("owns_job") and not owns:
            log.warning("job %s is named %r, not %r: only the steps of run %s in it are cancelled", self.job_id,
                        job.name, job_name(self.run_id), self.run_id)
        steps = {part_of_step(self.run_id, s.name): s for s in commands.steps(self.job_id)
                 if part_of_step(self.run_id, s.name)}
        master = steps.get("master")
        if master is not None and job.running:
            commands.cancel(master.step_id, signal="TERM")
            deadline = time.monotonic() + max(1.0, grace_s - 2.0)
            while time.monotonic() < deadline and any(s.name == master.name for s in commands.steps(self.job_id)):
                time.sleep(0.3)
        if owns:
            commands.cancel(self.job_id)
            report.jobs.append(self.job_id)
        for s in steps.values():
            if not owns:
                commands.cancel(s.step_id)
            report.jobs.append(s.step_id)
        if not wait_gone(self.job_id, self.run_id, owns_job=owns, timeout_s=DOWN_WAIT_S):
            log.warning("Slurm still lists job %s or its steps %.0f s after scancel", self.job_id, DOWN_WAIT_S)


def live_jobs(root: Path) -> set[str]:
    """Slurm runs under ``root`` whose record says live and whose job Slurm still runs or queues."""
    out = set()
    for rd in list_runs(root):
        rec = rd.read_record()
        if rec.get("backend") != "slurm" or not RunState.parse(rec.get("state")).live or not rec.get("slurm_job"):
            continue
        try:
            job = commands.job(str(rec["slurm_job"]))
        except LauncherError:
            continue
        if job is not None and not job.ended:
            out.add(rd.run_id)
    return out
