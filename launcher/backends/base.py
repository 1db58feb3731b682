"""The backend interface, the prepared run every backend starts from, and the one type for a run's parts.

A backend owns its run after start (PyTorch elastic's agent split: a blueprint, then an instance):

* while ``launcher up`` watches it, :meth:`Backend.poll` reads every :class:`Part` (and changes nothing),
  :meth:`Backend.restart_group` starts a dead group again when the supervisor decides so, and
  :meth:`Backend.stop` takes everything down;
* afterwards, from any process, :meth:`Backend.find` gives a :class:`FoundRun` from the run's results
  directory and the engine's labels: its parts, their logs, and a ``down``. ``launcher status``/``logs``/
  ``down`` use only that, whichever backend ran it.
"""

from __future__ import annotations

import abc
import enum
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from launcher.config import RunConfig, gpu_request

Event = Callable[[str, dict[str, Any]], None]  # (kind, data), the supervisor's event vocabulary
from launcher.backends.specs import LaunchSpecs
from launcher.gpu.placement import Plan
from launcher.runs import RunDir
from worker.contract import RunSpec


def host_plan(cfg: RunConfig, run_id: str, *, cpu_count: int | None = None,
              report: Callable[[str], None] | None = None) -> tuple[Plan, Any]:
    """Select and lease GPUs (if any) and plan, within the site policy: one call into :mod:`launcher.gpu`.
    Returns (plan, reservation or None); ``plan.reasons`` says where the policy limited the run. The default
    :meth:`Backend.make_plan`; ``launcher.up.make_plan`` is this function."""
    from launcher import gpu

    outcome = gpu.plan_and_reserve(gpu_request(cfg), run_id=run_id, cpu_count=cpu_count or os.cpu_count() or 1,
                                   report=report)
    return outcome.plan, outcome.reservation


def event_lines(on_event: Event | None) -> Callable[[str], None] | None:
    """A backend's progress lines as the supervisor's ``event`` records (None when nobody listens)."""
    if on_event is None:
        return None
    return lambda line: on_event("event", {"message": line})


@dataclass(frozen=True)
class PreparedRun:
    """A run ready to start: validated config, plan, spec (as the master sees it) and its secret.

    The secret is kept out of ``repr`` so a stray log line cannot leak it.
    """

    config: RunConfig
    plan: Plan
    spec: RunSpec
    run_dir: RunDir
    secret: str = field(repr=False)
    # The launcher's GPU leases (launcher.gpu.reservations.Reservation; None on CPU): a container backend
    # hands them to the master (launcher.gpu.handover) so they live as long as the run.
    reservation: Any = field(default=None, repr=False, compare=False)
    # ``--elastic``: the fewest worker groups the run may shrink to for a queued run (launcher.elastic); None: never.
    elastic_min: int | None = None

    @property
    def run_id(self) -> str:
        return self.spec.run_id

    @property
    def results_dir(self) -> Path:
        return self.run_dir.path


class PartState(str, enum.Enum):
    """Where one part (the master, a worker group) of a run is, on any backend."""

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"  # its own system (the engine's restart policy, the swarm) is starting it again
    EXITED = "exited"  # exited 0: the master told it the run is over
    FAILED = "failed"  # exited non-zero and nothing is starting it again (yet)
    LOST = "lost"  # failed with its restart budget spent, or vanished
    YIELDED = "yielded"  # an elastic run gave its GPUs to a queued run; it comes back when they free (launcher.elastic)

    @property
    def alive(self) -> bool:
        return self in (PartState.STARTING, PartState.RUNNING, PartState.RESTARTING)


@dataclass(frozen=True)
class Part:
    """One process, container or service of a run, as its backend sees it now.

    Attributes:
        name: ``master`` or ``group-N``.
        state: the backend-neutral state.
        exit_code: the last exit status, None while it runs.
        restarts: how often it was started again, by anyone (the engine's policy, the swarm, the supervisor).
        ident: pid, or container id (12 characters).
        status: the backend's own word (Docker's container status, ``alive``/``gone`` for a process), as
            ``launcher status`` prints it.
        health: the container's healthcheck status, ``""`` without one.
        node: the swarm node it runs on, ``""`` elsewhere.
        lost: on a swarm or Slurm, the lost node an earlier task or step of it ran on and since when (``node X lost
            at T``), ``""`` when none was lost.
        reason: why its system holds it back (Slurm's pending reason: ``Resources``, ``Priority``), ``""`` when
            nothing does.
        gpus: the GPUs its system gave it, where that system picks them (Slurm: the step's ``SLURM_STEP_GPUS``
            on its node), ``""`` when unknown or none.
    """

    name: str
    state: PartState
    exit_code: int | None = None
    restarts: int = 0
    ident: str = ""
    status: str = ""
    health: str = ""
    node: str = ""
    lost: str = ""
    reason: str = ""
    gpus: str = ""

    @property
    def group(self) -> int | None:
        """The worker group's index; None for the master."""
        head, _, index = self.name.partition("-")
        return int(index) if head == "group" and index.isdigit() else None

    @property
    def word(self) -> str:
        """What ``launcher status`` prints for it: the backend's own word, else the state's."""
        return (self.status or self.state.value) + (f" ({self.reason})" if self.reason else "")

    def to_dict(self) -> dict[str, Any]:
        """The part in ``launcher status --json`` (schema launcher.run-status/v2): ``state`` in the one
        backend-neutral vocabulary (:class:`PartState`), ``status`` the backend's own word for it."""
        d: dict[str, Any] = {"name": self.name, "state": self.state.value, "status": self.word, "id": self.ident,
                             "restarts": self.restarts, "exit_code": self.exit_code, "health": self.health}
        d.update({k: v for k, v in (("node", self.node), ("lost", self.lost), ("reason", self.reason),
                                    ("gpus", self.gpus)) if v})
        return d


def part_order(part: Part) -> tuple[bool, int, str]:
    """Sort key: the master first, then groups by index."""
    return name_order(part.name)


def name_order(name: str) -> tuple[bool, int, str]:
    """Sort key of a part's name (``master``, ``group-N``): the master first, then groups by index, so that
    ``group-2`` comes before ``group-10``."""
    return (name != "master", len(name), name)


@dataclass(frozen=True)
class BackendStatus:
    """One :meth:`Backend.poll`: the master and each group by index."""

    master: Part
    groups: dict[int, Part]


@dataclass
class DownReport:
    """What ``down`` found and removed for one run (``launcher down --json``, schema launcher.down/v1)."""

    run_id: str
    results: str = ""
    containers: list[str] = field(default_factory=list)
    networks: int = 0
    pids: list[int] = field(default_factory=list)
    launcher_signalled: bool = False
    services: list[str] = field(default_factory=list)  # swarm runs
    secrets: int = 0
    jobs: list[str] = field(default_factory=list)  # Slurm runs: the job and steps cancelled (``12``, ``12.3``)

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "results": self.results, "containers": self.containers,
                "networks": self.networks, "pids": self.pids, "launcher_signalled": self.launcher_signalled,
                "services": self.services, "secrets": self.secrets, "jobs": self.jobs}

    @property
    def removed_anything(self) -> bool:
        return bool(self.containers or self.services or self.pids or self.jobs)


class FoundRun(abc.ABC):
    """A run found again after its start, by results directory and by label (docker-py's idea of a model a
    ``Collection`` finds again). Opened by :meth:`Backend.find`; close it when done.

    ``unreachable``: why the backend's system (:attr:`system`: the Docker engine, Slurm) cannot be asked, ``""``
    when it can; the parts are then unknown (empty) and :meth:`down` raises.
    """

    backend: ClassVar[str] = "?"  # the backend's name, as run.json records it
    system: ClassVar[str] = "the Docker engine"  # what holds the run's parts, for messages
    unreachable: str = ""

    def __init__(self, run_id: str, run_dir: RunDir | None, record: dict[str, Any]) -> None:
        self.run_id = run_id
        self.run_dir = run_dir
        self.record = record

    @abc.abstractmethod
    def parts(self) -> list[Part]:
        """Every part of the run that still exists, the master first."""

    def exists(self) -> bool:
        """Whether the backend's system still holds anything of this run (containers, networks, services)."""
        return bool(self.parts())

    def results_from_labels(self) -> RunDir | None:
        """The results directory the run's labels name, when it is on this host."""
        return None

    def logs(self, part: str) -> bytes | None:
        """What ``part`` printed, from the backend while the part exists; None: read the run's ``logs/``."""
        return None

    def follow(self, part: str, *, poll_s: float) -> Iterator[bytes] | None:
        """``part``'s output as it is written, until it ends; None: follow the run's ``logs/`` file."""
        return None

    @abc.abstractmethod
    def down(self, report: DownReport, *, grace_s: float) -> None:
        """Stop every part, the master first (it checkpoints), keep their output in ``logs/``, remove what the
        run made (containers, services, networks, secrets); results stay. Fills ``report``. Idempotent."""

    def close(self) -> None:
        """Let go of any connection the run was found through."""


class NoParts(FoundRun):
    """A run with nothing left to find or stop (its record names no backend that keeps parts)."""

    def parts(self) -> list[Part]:
        return []

    def down(self, report: DownReport, *, grace_s: float) -> None:
        return None


class Backend(abc.ABC):
    """How a :class:`PreparedRun` becomes running processes or containers, and how it is found again.

    ``restart_grace_s``: how long a FAILED group is left to the backend's own system (Docker's restart
    policy, the swarm) before the supervisor restarts it itself; 0 when nothing else ever restarts it.
    ``outlives_launcher``: whether the run's parts survive the launcher (``up --detach`` needs it).
    ``recovers_master``: whether :meth:`restart_master` can replace a dead master in place (issue 27).
    ``elastic``: whether :meth:`yield_group` and :meth:`regrow_group` work (``--elastic``, :mod:`launcher.elastic`).
    """

    name: ClassVar[str] = "?"
    on_event: Event | None = None  # what it reports before and after the start (set by from_config's caller)
    restart_grace_s: ClassVar[float] = 0.0
    outlives_launcher: ClassVar[bool] = False
    recovers_master: ClassVar[bool] = False
    elastic: ClassVar[bool] = False
    detach_hint: ClassVar[str] = "add --backend docker (an engine must answer), or leave out --detach"
    _stop_check: Callable[[], bool] | None = None

    def watch_stop(self, check: Callable[[], bool]) -> None:
        """``check()`` says whether a stop was asked for (SIGINT/SIGTERM): a :meth:`start` that can wait long (a
        run queued by Slurm) asks it and gives up, raising :class:`~launcher.errors.Interrupted`."""
        self._stop_check = check

    def stop_requested(self) -> bool:
        return self._stop_check is not None and self._stop_check()

    def specs(self, run: PreparedRun) -> LaunchSpecs:
        """What :meth:`start` starts for each part of ``run``: command, environment, mounts, GPUs
        (:mod:`launcher.backends.specs`). Pure: asks no engine or scheduler; ``launcher plan --backend X`` prints
        it and ``plan.json`` records it. A backend whose system decides the parts' nodes and GPUs at the start
        says so in the note."""
        return LaunchSpecs(self.name, note=f"the {self.name} backend decides its parts at the start")

    @abc.abstractmethod
    def start(self, run: PreparedRun) -> None:
        """Start the master and every worker group, as :meth:`specs` says. Raise LauncherError subclasses on
        failure."""

    @abc.abstractmethod
    def poll(self) -> BackendStatus:
        """Current state of the master and groups. Only reads (called every half second)."""

    @abc.abstractmethod
    def restart_group(self, index: int) -> None:
        """Start group ``index`` again after it died (the supervisor decides when, within the budget)."""

    def restart_master(self) -> None:
        """Start a new master in place of the dead one: the same command, environment, GPU leases, secret and
        address, so the groups reconnect to it (:mod:`launcher.recovery`). Only where ``recovers_master``."""
        raise NotImplementedError(f"the {self.name} backend does not replace a dead master")

    def master_recovery_blocked(self) -> str | None:
        """Why a dead master cannot be replaced in place right now although the backend can replace one (the
        Slurm backend: its node is lost, and the groups dial its address there), or None. Asked when a master
        died without recording an end (:meth:`launcher.recovery.MasterRecovery.judge`); may ask the backend's
        system."""
        return None

    def yield_group(self, index: int) -> None:
        """Ask group ``index`` to leave for good (an elastic run yielding its GPUs): it finishes and sends its
        current segment, says goodbye and exits 0; :meth:`poll` then shows it YIELDED, never FAILED. Only where
        ``elastic``."""
        raise NotImplementedError(f"the {self.name} backend has no elastic runs")

    def kill_group(self, index: int) -> None:
        """End a yielding group that did not leave in time (SIGKILL); :meth:`poll` still shows it YIELDED."""
        raise NotImplementedError(f"the {self.name} backend has no elastic runs")

    def release_yielded(self, uuids: tuple[str, ...]) -> tuple[str, ...]:
        """Release the leases of ``uuids``, GPUs that yielded groups (exited now) no longer share with any part of
        the run. Returns the UUIDs released."""
        raise NotImplementedError(f"the {self.name} backend has no elastic runs")

    def regrow(self, indices: tuple[int, ...], uuids: tuple[str, ...]) -> bool:
        """Lease ``uuids`` again for the run, without waiting, then start the yielded groups ``indices`` as they
        were; False, with nothing started or held, when another run holds one of the GPUs now."""
        raise NotImplementedError(f"the {self.name} backend has no elastic runs")

    @abc.abstractmethod
    def stop(self, *, grace_s: float = 8.0) -> None:
        """Stop everything: the master first (it checkpoints and tells groups to stop), then the rest;
        kill what has not exited after ``grace_s``. Idempotent; safe after a partial start."""

    def idle(self, seconds: float) -> None:
        """Wait until the next poll. A backend that can see its master end wakes up then (the run's end is
        not kept waiting up to a poll period); the default sleeps."""
        time.sleep(seconds)

    def fetch_results(self) -> None:
        """Bring results the master wrote elsewhere (a Swarm volume on another node) into the results
        directory; the supervisor calls it once the master ended, before it reads the summary."""

    def describe(self) -> dict[str, Any]:
        """What to record in run.json so ``status``/``down`` can find the run's parts later."""
        return {"backend": self.name}

    @classmethod
    def from_config(cls, cfg: RunConfig, *, on_event: Event | None = None) -> "Backend":
        """The backend ``launcher up`` uses for ``cfg``; ``on_event`` receives what it reports before and
        after the start (``event`` lines, ``build`` records of an image build), as the supervisor's events.
        ``launcher up`` makes one per run (:func:`launcher.up.prepare`) and uses it for the plan, the preflight,
        the env check, the start and the supervision."""
        return cls()

    @classmethod
    def make_plan(cls, cfg: RunConfig, run_id: str, *,
                  report: Callable[[str], None] | None = None) -> tuple[Plan, Any]:
        """The run's plan and its GPU leases (None on CPU). By default from this host: NVML's GPUs, the site
        policy and this host's cores (:func:`host_plan`); a backend whose scheduler owns the GPUs (Slurm) plans
        from the scheduler's view instead and takes no leases."""
        return host_plan(cfg, run_id, report=report)

    def preflight(self, plan: Plan) -> None:
        """What can be checked before anything is written (an engine, its NVIDIA runtime); raises
        MissingDependency, so a run that could never start leaves no run directory behind."""

    def check_env(self, cfg: RunConfig, plan: Plan, run_id: str) -> dict[str, Any]:
        """Make the run's env once where its worker groups will run (:mod:`launcher.backends.envcheck`), before
        anything of the run exists; returns its description (spaces). A container backend makes sure of its
        image first (a build, reported through :attr:`on_event`), and keeps it for the start.

        Raises:
            MissingDependency: the env's package or module is not there (exit 6).
            BadInput: no such id, or arguments the env refuses (exit 2).
        """
        return {}

    @classmethod
    def find(cls, run_id: str, run_dir: RunDir | None, record: dict[str, Any]) -> FoundRun:
        """The run ``run_id`` as this backend left it (``run_dir`` None: known only by its labels). A backend
        whose parts end with the launcher has nothing to find: that is the default."""
        return NoParts(run_id, run_dir, record)

    @classmethod
    def live_run_ids(cls, root: Path, *, user: str | None) -> set[str]:
        """Ids (or results directories) of this backend's runs that may still have live parts: those under
        ``root``, and those its system knows by label (``user``: only that uid's; None: everyone's)."""
        return set()
