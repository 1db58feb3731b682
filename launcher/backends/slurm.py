"""Slurm backend: a run as one Slurm job whose steps are the master and the worker groups
(``launcher up --backend slurm``).

One run is, on the cluster:

* one job ``launcher-<run id>`` of N nodes from :func:`~launcher.backends.slurm_specs.plan_slurm`, submitted with
  ``sbatch --no-kill`` (a lost node shrinks the job instead of ending it); its batch script only holds the
  allocation. Started inside an allocation (``salloc``, or ``launcher up`` in an ``sbatch`` script), the run uses
  that job and submits nothing;
* one step per process, ``srun --jobid=J --nodelist=NODE --gres=gpu:G --exact``: each is a child of the launcher
  here (the process backend's children: a log it writes, the secret in a pipe, SIGTERM when the launcher dies, a
  reaper that also cancels the job) and srun forwards the run secret to the task through its stdin. Slurm sets
  each step's ``CUDA_VISIBLE_DEVICES`` from the GRES it allocated; a step without GPUs gets ``--gres=none`` and
  sees none;
* the master listens on its node's address (port 0) and writes ``master.addr`` into the results directory,
  which every node must see at the same path (a shared file system); each group's step waits for that file
  and dials it;
* on each node the step runs ``python -m worker`` from the shared venv, or the run's image on the node's Docker
  engine (``--slurm-runtime``, :func:`~launcher.backends.slurm_specs.task_command`).

A node lost mid-run (its slurmd silent, so slurmctld marks it down and removes it from the job) ends the steps
on it; srun does not notice a node that vanished, so :meth:`SlurmBackend.poll` marks those steps FAILED (the
lost node and when), and the supervisor's restart budget starts each lost group again through
:meth:`SlurmBackend.restart_group`: its old step is cancelled and a new one started on a surviving node of the
job with room (:func:`~launcher.backends.slurm_specs.restart_node`). A master killed by a signal is replaced by
:meth:`SlurmBackend.restart_master`: a new step on its node at its port (the groups never re-read
``master.addr``), never elsewhere (:mod:`launcher.recovery`). Every Slurm command goes through
:mod:`launcher.slurm.commands`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

from launcher import safefs
from launcher.backends.base import Backend, BackendStatus, Event, PreparedRun, event_lines
from launcher.backends.process import check_on_host
from launcher.backends.process_children import ORPHAN_GRACE_S, _Child, _Reaper
from launcher.backends.envcheck import host_env
from launcher.backends.slurm_parts import MAX_ADDR_BYTES, master_port_written
from launcher.backends.slurm_run import SlurmRun, live_jobs, wait_gone, wait_running
from launcher.backends.slurm_specs import (JOB_PLACEHOLDER, MASTER_NODE_PLACEHOLDER, SlurmPlan, allocation_view,
                                           plan_slurm, request_from, restart_node, sbatch_args, slot_nodes, step_specs)
from launcher.backends.slurm_watch import SlurmWatch
from launcher.backends.specs import LaunchSpecs
from launcher.config import RunConfig
from launcher.errors import BadInput, LauncherError, RunFailed
from launcher.gpu.placement import Plan
from launcher.procs import launcher_record
from launcher.runs import RunDir
from launcher.slurm import commands
from launcher.usercode import user_code
from launcher.slurm.model import JobInfo, NodeInfo
from worker.contract import LOGS_DIR, MASTER_ADDR_FILE, MASTER_LOG, group_log_name
from worker.ending import RunState

log = logging.getLogger(__name__)

NODE_WATCH_S = 2.0  # how often poll() asks slurmctld for the job, its steps and the nodes
STOP_WAIT_S = 30.0  # how long stop() waits for the job and its steps to be gone
JOB_LOG = "job.log"  # the batch script's output, in logs/ (`launcher logs RUN --part job`)
Progress = Callable[[str], None]


class SlurmBackend(SlurmWatch, Backend):
    """Runs a :class:`PreparedRun` as the steps of one Slurm job (``sbatch`` + ``srun --jobid`` each); what it
    reads of the job and its steps while the run goes on is :class:`~launcher.backends.slurm_watch.SlurmWatch`."""

    name = "slurm"
    restart_grace_s = 0.0  # nothing but the supervisor starts a step again
    outlives_launcher = False
    recovers_master = True  # on its node and port while that node is in the job (restart_master)
    detach_hint = ("the steps are the launcher's children; for an unattended run submit `launcher up --backend "
                   "slurm` itself in a batch script (`sbatch --wrap '…'`): it then runs in that allocation")

    def __init__(self, *, runtime: str = "auto", image: str | None = None, extra_args: tuple[str, ...] = (),
                 progress: Progress | None = None, python: str | None = None, node_watch_s: float = NODE_WATCH_S,
                 orphan_grace_s: float = ORPHAN_GRACE_S) -> None:
        """
        Args:
            runtime: ``--slurm-runtime``: auto, docker or process (where each step runs on its node).
            image: the run's image for the docker runtime (default: the CPU or GPU tag of this version).
            extra_args: ``--slurm-arg``: more ``sbatch`` options (account, QoS, constraint).
            progress: receives human-readable lines (the queue, lost nodes).
            python: the interpreter the steps run (default: this one; every node must have it at this path).
            node_watch_s: how often poll() asks slurmctld about the job, its steps and the nodes.
            orphan_grace_s: how long a step may outlive a killed launcher before the reaper ends it.
        """
        self.runtime = runtime
        self.image = image
        self.extra_args = tuple(extra_args)
        self.progress = progress or (lambda line: None)
        self.python = python or sys.executable
        self.node_watch_s = node_watch_s
        self.orphan_grace_s = orphan_grace_s
        self.run: PreparedRun | None = None
        self.plan: SlurmPlan | None = None
        self.job_id: str | None = None
        self.owns_job = False
        self.children: dict[str, _Child] = {}
        self.master_host = ""  # the address the master listens on (its node's NodeAddr)
        self._base_env: dict[str, str] = {}  # what every step's srun inherits (host_env)
        self.nodes: dict[str, str] = {}  # part -> the node its step runs on
        self.step_ids: dict[str, str] = {}  # part -> its newest step's id ("12.3")
        self.lost_nodes: dict[str, str] = {}  # node -> when slurmctld lost it
        self.lost_parts: dict[str, str] = {}  # part -> "node X lost at T", while its step is not started again
        self.was_lost: dict[str, str] = {}  # part -> the last such text, for `status`
        self.step_gpus: dict[str, str] = {}  # part -> SLURM_STEP_GPUS its step printed
        self._log_offset: dict[str, int] = {}
        self.job_nodes: tuple[str, ...] = ()
        self._node_info: dict[str, NodeInfo] = {}
        self._watched_at = float("-inf")
        self._unreachable_since: float | None = None
        self._reaper: _Reaper | None = None
        self._stopped = False

    # ------------------------------------------------------------------------------------ before the start
    @classmethod
    def from_config(cls, cfg: RunConfig, *, on_event: Event | None = None) -> "SlurmBackend":
        return cls(runtime=cfg.slurm_runtime, image=cfg.image, extra_args=tuple(cfg.slurm_args),
                   progress=event_lines(on_event))

    @classmethod
    def make_plan(cls, cfg: RunConfig, run_id: str, *,
                  report: Callable[[str], None] | None = None) -> tuple[Plan, Any]:
        """The plan from Slurm's view of the partition (or of the allocation this launcher runs in); no GPU
        leases: Slurm owns the GPUs."""
        view = commands.cluster()
        alloc = commands.in_allocation()
        nodes = None
        if alloc is not None:
            job = commands.job(alloc)
            if job is None or not job.running:
                raise BadInput(f"SLURM_JOB_ID={alloc} names no running job ({job.word if job else 'unknown to Slurm'})",
                               hint="unset SLURM_JOB_ID to submit a job of the run's own")
            view, nodes = allocation_view(view, job), job.nodes
        return plan_slurm(view, request_from(cfg, allocation=nodes)), None

    def preflight(self, plan: Plan) -> None:
        for command in ("sbatch", "srun", "scontrol", "scancel"):
            commands.require(command)

    def check_env(self, cfg: RunConfig, plan: Plan, run_id: str) -> dict[str, Any]:
        """Process steps run this Python from the shared venv: ask it here, as the process backend does. Docker
        steps run the image on each node's engine, which this host cannot ask before the start."""
        if cfg.slurm_runtime == "docker":
            code = user_code(cfg)
            if code.dirs:  # the step's container mounts the results only
                raise BadInput(f"--slurm-runtime docker does not mount {code.dirs[0]} (--env-dir, --algo or --model "
                               "files) into the nodes' containers",
                               hint="add your code to the image as a package (`launcher build --with dist/<file>.whl`) "
                                    "and name it MODULE:Name, or use --slurm-runtime process (a shared venv)")
            return {}
        return check_on_host(cfg, self.on_event)

    # ------------------------------------------------------------------------------------------- start
    def specs(self, run: PreparedRun, *, job_id: str = JOB_PLACEHOLDER, master_addr: str = MASTER_NODE_PLACEHOLDER,
              master_port: int = 0) -> LaunchSpecs:
        """Each step's ``srun`` line and environment (:func:`step_specs`; the docker runtime's image: ``--image`` or
        this version's CPU or GPU tag); the job's id and the master's node stand in until ``start`` knows them. A
        plan not made from Slurm's view (``launcher plan``) has no steps."""
        from launcher import image as image_mod

        if not isinstance(run.plan, SlurmPlan):
            return LaunchSpecs(self.name, note="the steps come from the plan Slurm's view gives at the start")
        image = self.image or image_mod.default_tag(image_mod.flavour_for(run.plan.kind == "gpu"))
        return step_specs(run, run.plan, job_id=job_id, nodes=self.nodes, master_addr=master_addr,
                          runtime=self.runtime, python=self.python, image=image, master_port=master_port)

    def start(self, run: PreparedRun) -> None:
        if not isinstance(run.plan, SlurmPlan):
            raise LauncherError("the Slurm backend needs a plan made from Slurm's view (SlurmBackend.make_plan)")
        self.run, self.plan = run, run.plan
        logs = run.run_dir.files.logs
        logs.mkdir(exist_ok=True)
        self._reaper = _Reaper(sys.executable, self.orphan_grace_s,
                               safefs.open_append(run.run_dir.path, f"{LOGS_DIR}/{JOB_LOG}"))
        alloc = commands.in_allocation()
        if alloc is not None:
            self.job_id, self.owns_job = alloc, False
            self.progress(f"slurm: running in allocation {alloc} (SLURM_JOB_ID)")
        else:
            args = sbatch_args(self.plan, run.run_id, log_path=str((logs / JOB_LOG).resolve()),
                               timeout_s=run.config.timeout_s, extra=self.extra_args)
            self.job_id, self.owns_job = commands.submit(args), True
            self._reaper.on_death([commands.require("scancel"), self.job_id])  # if this launcher dies
            self.progress(f"slurm: submitted job {self.job_id} ({self.plan.nodes} node(s), {self.plan.node_cpus} "
                          f"CPU(s) and {self.plan.node_gpus} GPU(s) each)")
        run.run_dir.update_record(slurm_job=self.job_id, owns_job=self.owns_job)
        job = wait_running(self.job_id, job_log=logs / JOB_LOG, on_queued=self._queued,
                           stop_requested=self.stop_requested)
        self.job_nodes = job.nodes
        run.run_dir.update_record(slurm_state=job.state, slurm_reason=job.reason)
        self.nodes = slot_nodes(self.plan, job.nodes)
        self._node_info = {n.name: n for n in commands.cluster().nodes}
        master_node = self.nodes["master"]
        addr = self.master_host = self._address(master_node)
        run.run_dir.files.master_addr.unlink(missing_ok=True)  # a resumed run's earlier master left it behind
        base = self._base_env = host_env(user_code(run.config))
        for part in self.specs(run, job_id=self.job_id, master_addr=addr).parts:
            log_name = MASTER_LOG if part.name == "master" else group_log_name(part.name.partition("-")[2])
            child = _Child(part.name, list(part.command), {**base, **part.env}, logs / log_name, secret=run.secret,
                           secret_on_stdin=True)
            self.children[part.name] = child
            self._start_child(child)
        self.progress(f"slurm: job {self.job_id} runs on {', '.join(job.nodes)}; master on {master_node} ({addr}), "
                      + ", ".join(f"{s.name} on {self.nodes[s.name]}" for s in self.plan.steps if s.name != "master"))

    def _address(self, node: str) -> str:
        """The master's listening address on ``node``: slurmctld's NodeAddr, as an IP when this host can resolve
        it (the master binds it on its node: nothing listens on other interfaces)."""
        info = self._node_info.get(node)
        addr = info.addr if info is not None else node
        try:
            return socket.gethostbyname(addr)
        except OSError:
            return addr

    def _argv(self, name: str) -> list[str]:  # its node: self.nodes[name] ("": any node of the job with room)
        assert self.run is not None and self.job_id is not None
        return list(self.specs(self.run, job_id=self.job_id).part(name).command)

    def _start_child(self, child: _Child) -> None:
        self._log_offset[child.name] = os.fstat(child.open_log()).st_size  # where this start's output begins
        self.step_gpus.pop(child.name, None)
        child.start()
        if self._reaper is not None and child.proc is not None:
            self._reaper.watch(child.proc.pid)

    def _queued(self, job: JobInfo) -> None:
        """Say why Slurm queues the job and record it (``launcher status`` shows the run queued)."""
        assert self.run is not None
        self.progress(f"slurm: job {self.job_id} queued: {job.word}")
        self.run.run_dir.update_record(state=RunState.QUEUED.value, slurm_state=job.state, slurm_reason=job.reason)

    # ---------------------------------------------------------------------------------------------- watch
    def poll(self) -> BackendStatus:
        """Each step's state from its srun (still running, or its exit status) and, every ``node_watch_s``, from
        slurmctld (a step on a lost node is FAILED: its srun never notices). Reads only."""
        assert self.run is not None
        if time.monotonic() - self._watched_at >= self.node_watch_s:
            self._watched_at = time.monotonic()
            self._watch()
        for c in self.children.values():
            c.cap_log(64 * 1024 * 1024)
        groups = {int(n.partition("-")[2]): self._part(n) for n in self.children if n != "master"}
        return BackendStatus(self._part("master"), groups)

    def idle(self, seconds: float) -> None:
        """Block on the master's srun (up to ``seconds``): its end is seen at once."""
        child = self.children.get("master")
        if child is None or child.proc is None:
            time.sleep(seconds)
            return
        try:
            child.proc.wait(timeout=seconds)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
            pass

    # -------------------------------------------------------------------------------------------- restart
    def _end_step(self, name: str) -> None:
        """End part ``name``'s step for good: its srun (which hangs on a lost node's connection) and the step
        itself (which slurmctld keeps listed while its node is gone)."""
        child = self.children[name]
        child.signal(signal.SIGKILL)
        if child.proc is not None:
            try:
                child.proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 - a srun in uninterruptible sleep: the reaper has its pid
                pass
        step = self.step_ids.pop(name, None)
        if step is not None:
            try:
                commands.cancel(step)
            except LauncherError as exc:
                log.warning("cannot cancel step %s: %s", step, exc.message)

    def restart_group(self, index: int) -> None:
        """Start group ``index``'s step again: on its node when that is still in the job, else on the job's node
        with the most room. With no room anywhere, srun waits for some (Slurm queues the step)."""
        assert self.plan is not None and self.job_id is not None
        name = f"group-{index}"
        self._end_step(name)
        self._watch()
        lost = {n for n, i in self._node_info.items() if i.lost} | set(self.lost_nodes)
        running = {n: self.nodes[n] for n, c in self.children.items()
                   if n != name and c.exit_code() is None and n not in self.lost_parts}
        node = restart_node(self.plan.step(name), self.plan, self.job_nodes, lost, running, self.nodes.get(name))
        if node is None:
            self.progress(f"slurm: no node of job {self.job_id} has room for {name} now; its step waits for room")
        elif node != self.nodes.get(name):
            self.progress(f"slurm: {name} starts again on {node} (it ran on {self.nodes.get(name)})")
        if name in self.lost_parts:
            self.was_lost[name] = self.lost_parts.pop(name)
        self.nodes[name] = node or ""
        child = self.children[name]
        child.argv = self._argv(name)
        child.restarts += 1
        os.write(child.open_log(), f"--- launcher: starting {name} again on {node or 'any node with room'} "
                                   f"(restart {child.restarts}) ---\n".encode())
        self._start_child(child)

    # --------------------------------------------------------------------------------- the master replaced
    def restart_master(self) -> None:
        """A new master step in place of the dead one, as the process backend starts a new child: on the same node
        and the same port (``srun --nodelist=NODE``, the spec's port), so the groups, which never restart, reconnect
        to the address they dialled; the old connections' TIME_WAIT does not stop the bind (the master's socket
        has SO_REUSEADDR). The new master restores the newest checkpoint and records the recovery.

        Raises:
            RunFailed: the master's node is lost, or ``master.addr`` does not say which port the groups dial.
        """
        node, port = self._master_return()
        self._end_step("master")
        assert self.run is not None and self.job_id is not None
        part = self.specs(self.run, job_id=self.job_id, master_addr=self.master_host, master_port=port).part("master")
        child = self.children["master"]
        code = child.exit_code()
        child.argv, child.env = list(part.command), {**self._base_env, **part.env}
        child.restarts += 1
        where = f"{self.master_host}:{port}" if port else f"{self.master_host}, any free port (no group had its address)"
        os.write(child.open_log(), f"--- launcher: the master died (srun exit {code}); starting a new one on {node} "
                                   f"({where}) from the newest checkpoint (restart {child.restarts}) ---\n".encode())
        self._start_child(child)
        self.progress(f"slurm: a new master step on {node} ({where}) in place of the dead one")

    def master_recovery_blocked(self) -> str | None:
        try:
            self._master_return()
        except RunFailed as exc:
            return exc.message
        return None

    def _master_return(self) -> tuple[str, int]:
        """Where a new master must listen for the groups to reach it: the dead one's node and port (0 when it died
        before it wrote ``master.addr``: the groups still wait for the file). Asks slurmctld first.

        Raises:
            RunFailed: that node is lost or gone from the job (a master elsewhere is at an address no group dials),
                or ``master.addr`` is unreadable or not one line ``HOST:PORT`` on the master's address.
        """
        assert self.run is not None
        self._watch()
        node = self.nodes["master"]
        info = self._node_info.get(node)
        if "master" in self.lost_parts or (info is not None and info.lost) or node not in self.job_nodes:
            state = self.lost_parts.get("master") or (f"node {node} {info.word}" if info is not None
                                                        else f"node {node} gone from job {self.job_id}")
            raise RunFailed(f"the master's node is lost ({state}): a new master elsewhere would listen where no group "
                            "dials", hint=f"`launcher up --resume {self.run.run_id}` continues from the last checkpoint")
        try:
            data = safefs.read_bytes(self.run.run_dir.path, MASTER_ADDR_FILE, max_bytes=MAX_ADDR_BYTES)
        except FileNotFoundError:
            return node, 0
        except OSError as exc:
            raise RunFailed(f"cannot tell which port the groups dial: {exc}",
                            hint=f"`launcher up --resume {self.run.run_id}` continues from the last checkpoint") from None
        try:
            return node, master_port_written(data, self.master_host)
        except ValueError as exc:
            raise RunFailed(f"cannot tell which port the groups dial: the dead master's {MASTER_ADDR_FILE} is refused "
                            f"({exc})", hint=f"`launcher up --resume {self.run.run_id}` continues from the last "
                                             "checkpoint") from None

    # ----------------------------------------------------------------------------------------------- stop
    def stop(self, *, grace_s: float = 8.0) -> None:
        """The master first (SIGTERM through Slurm: it checkpoints and tells the groups to stop), then the groups,
        then whatever did not end (srun killed, its step cancelled), then the job, waiting until Slurm lists none
        of it. Idempotent; safe after a partial start (a queued job is cancelled)."""
        if self._stopped:
            return
        self._stopped = True
        deadline = time.monotonic() + grace_s
        master = self.children.get("master")
        if master is not None:
            self._term("master")
            self._wait([master], deadline - 2.0)
        for name in self.children:
            if name != "master":
                self._term(name)
        self._wait(list(self.children.values()), deadline)
        for name, child in self.children.items():
            if child.exit_code() is None and child.proc is not None:
                log.warning("%s's step did not end within %.0f s; cancelling it", name, grace_s)
                self._end_step(name)
        try:
            self._cancel_job()
        finally:
            for child in self.children.values():
                child.close_log()
            if self._reaper is not None:
                self._reaper.done()
                self._reaper = None

    def _term(self, name: str) -> None:
        """SIGTERM to part ``name``'s task through slurmctld (``scancel --signal=TERM STEP``): the task stops
        cleanly (the master checkpoints). Not to srun: srun turns a SIGTERM of its own into SIGKILL for its tasks.
        A step still unknown, or one on a lost node, is left to :meth:`_end_step` after the grace period."""
        child = self.children[name]
        if child.exit_code() is not None or child.proc is None or name in self.lost_parts:
            return
        if name not in self.step_ids:
            self._watch()
        step = self.step_ids.get(name)
        if step is None:
            log.warning("%s's step is not listed by Slurm yet; it is ended after the grace period", name)
            return
        try:
            commands.cancel(step, signal="TERM")
        except LauncherError as exc:
            log.warning("cannot signal step %s through Slurm: %s", step, exc.message)

    @staticmethod
    def _wait(children: list[_Child], deadline: float) -> None:
        while time.monotonic() < deadline and any(c.exit_code() is None for c in children if c.proc):
            time.sleep(0.05)

    def _cancel_job(self) -> None:
        if self.job_id is None or self.run is None:
            return
        if self.owns_job:
            commands.cancel(self.job_id)
        gone = wait_gone(self.job_id, self.run.run_id, owns_job=self.owns_job, timeout_s=STOP_WAIT_S)
        if not gone:
            log.warning("Slurm still lists job %s or its steps %.0f s after scancel", self.job_id, STOP_WAIT_S)

    # ------------------------------------------------------------------------------------------- records
    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"backend": self.name, "slurm_runtime": self.runtime, **launcher_record()}
        if self.job_id is not None:
            d.update(slurm_job=self.job_id, owns_job=self.owns_job, nodes=dict(self.nodes), steps=dict(self.step_ids),
                     step_gpus=dict(self.step_gpus))
        if self.lost_nodes:
            d.update(lost_nodes=dict(self.lost_nodes))
        return d

    @classmethod
    def find(cls, run_id: str, run_dir: RunDir | None, record: dict[str, Any]) -> SlurmRun:
        return SlurmRun(run_id, run_dir, record)

    @classmethod
    def live_run_ids(cls, root: Path, *, user: str | None) -> set[str]:
        return live_jobs(root)

