"""What a running Slurm run knows of its steps, read, never changed: every ``node_watch_s`` slurmctld's view of the
job (its nodes, its steps' ids, the nodes' states: a node lost, down or removed from the job, marks the parts whose
steps ran on it), the GPUs each step was given (the line its prologue printed first in the part's log), and from
all that each step's :class:`~launcher.backends.base.Part` for ``launcher status``.

:class:`SlurmWatch` is a part of :class:`launcher.backends.slurm.SlurmBackend`, which holds the state it reads and
writes (declared below) and calls it from ``poll``, ``restart_group`` and ``stop``.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from launcher import safefs
from launcher.backends.base import Part, PreparedRun
from launcher.backends.process_children import _Child
from launcher.backends.slurm_parts import step_gpus_printed, step_number, step_part
from launcher.backends.slurm_specs import lost_text, node_lost_at, part_of_step
from launcher.errors import LauncherError
from launcher.slurm import commands
from launcher.slurm.model import NodeInfo
from worker.contract import LOGS_DIR


class SlurmWatch:
    """Reads slurmctld and the steps' logs into the Slurm backend's state (set in ``SlurmBackend.__init__``)."""

    run: PreparedRun | None
    job_id: str | None
    progress: Callable[[str], None]
    children: dict[str, _Child]
    nodes: dict[str, str]  # part -> the node its step runs on
    step_ids: dict[str, str]  # part -> its newest step's id ("12.3")
    lost_nodes: dict[str, str]  # node -> when slurmctld lost it
    lost_parts: dict[str, str]  # part -> "node X lost at T", while its step is not started again
    was_lost: dict[str, str]  # part -> the last such text, for `status`
    step_gpus: dict[str, str]  # part -> SLURM_STEP_GPUS its step printed
    job_nodes: tuple[str, ...]
    _log_offset: dict[str, int]  # part -> where its log's output of this start of it begins
    _node_info: dict[str, NodeInfo]
    _unreachable_since: float | None

    def _watch(self) -> None:
        """Ask slurmctld for the job's nodes, its steps and the nodes' states; mark the parts whose node is lost
        (down or not responding, or removed from the job). Changes nothing of the run."""
        assert self.job_id is not None and self.run is not None
        try:
            job = commands.job(self.job_id)
            steps = commands.steps(self.job_id)
            nodes = {n.name: n for n in commands.cluster().nodes}
        except LauncherError as exc:  # a controller restart: the steps' own state still comes from srun
            if self._unreachable_since is None:
                self._unreachable_since = time.monotonic()
                self.progress(f"slurm: cannot ask the controller ({exc.message}); the steps' srun still report")
            return
        if self._unreachable_since is not None:
            self.progress(f"slurm: the controller answers again after {time.monotonic() - self._unreachable_since:.0f} s")
            self._unreachable_since = None
        self._node_info = nodes
        if job is not None:
            self.job_nodes = job.nodes
        known = (dict(self.step_ids), dict(self.step_gpus))
        for s in steps:
            part = part_of_step(self.run.run_id, s.name)
            if part is not None and step_number(s.step_id) >= step_number(self.step_ids.get(part, "")):
                self.step_ids[part] = s.step_id
        self._read_step_lines()
        if (self.step_ids, self.step_gpus) != known:
            self.run.run_dir.update_record(steps=dict(self.step_ids), step_gpus=dict(self.step_gpus))
        now = time.strftime("%Y-%m-%dT%H:%M:%S")
        for part, node in self.nodes.items():
            child = self.children.get(part)
            if not node or child is None or child.exit_code() is not None or part in self.lost_parts:
                continue  # no node: a step started again where Slurm finds room, not placed yet
            info = nodes.get(node)
            gone = job is not None and job.running and node not in job.nodes
            if (info is not None and info.down) or gone:
                when = self.lost_nodes.get(node) or (node_lost_at(info, now) if info is not None else now)
                if node not in self.lost_nodes:
                    self.lost_nodes[node] = when
                    master_here = self.nodes.get("master") == node
                    self.progress(f"slurm: node {node} lost at {when} ({info.word if info else 'gone from the job'});"
                                  + (" the master's step with it: the run ends (its groups dial its address there)"
                                     if master_here else
                                     " its steps end and lost groups start again on the job's other nodes"))
                self.lost_parts[part] = lost_text(node, when)
                self.run.run_dir.update_record(lost_nodes=dict(self.lost_nodes),
                                               lost_parts={**self.was_lost, **self.lost_parts})

    def _read_step_lines(self) -> None:
        """The GPUs Slurm gave each step, from the line its prologue printed first (``launcher: step 12.3 on
        node2: SLURM_STEP_GPUS=0 …``) in the part's log, read from where this start of it began."""
        assert self.run is not None
        for name, child in self.children.items():
            if name in self.step_gpus or child.proc is None:
                continue
            rel = f"{LOGS_DIR}/{child.log_path.name}"
            try:
                fd = safefs.open_beneath(self.run.run_dir.path, rel, os.O_RDONLY)
                try:
                    head = os.pread(fd, 4096, self._log_offset.get(name, 0))
                finally:
                    os.close(fd)
            except OSError:
                continue
            gpus = step_gpus_printed(head.decode(errors="replace"))
            if gpus is not None:
                self.step_gpus[name] = gpus

    def _part(self, name: str) -> Part:
        child = self.children[name]
        return step_part(name, started=child.proc is not None, code=child.exit_code(), restarts=child.restarts,
                         ident=self.step_ids.get(name, ""), node=self.nodes.get(name, ""),
                         lost=self.lost_parts.get(name) or self.was_lost.get(name, ""),
                         lost_now=name in self.lost_parts, gpus=self.step_gpus.get(name, ""))
