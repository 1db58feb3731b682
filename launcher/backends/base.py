"""The backend interface and the prepared run every backend starts from."""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.config import RunConfig
from launcher.placement import Plan
from launcher.runs import RunDir
from worker.spec import RunSpec


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

    @property
    def run_id(self) -> str:
        return self.spec.run_id

    @property
    def results_dir(self) -> Path:
        return self.run_dir.path


class ProcState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    EXITED = "exited"  # exited 0: the master told it the run is over
    FAILED = "failed"  # exited non-zero
    LOST = "lost"  # failed and its restart budget is spent


@dataclass
class ProcStatus:
    name: str
    state: ProcState
    exit_code: int | None = None
    restarts: int = 0
    ident: str = ""  # pid or container id


@dataclass
class BackendStatus:
    master: ProcStatus
    groups: dict[int, ProcStatus]


class Backend(abc.ABC):
    """How a :class:`PreparedRun` becomes running processes or containers.

    ``restarts_groups``: True when the backend (e.g. Docker's restart policy) restarts dead groups itself;
    otherwise the supervisor calls :meth:`restart_group` within the run's restart budget.
    """

    name: str = "?"
    restarts_groups: bool = False

    @abc.abstractmethod
    def start(self, run: PreparedRun) -> None:
        """Start the master and every worker group. Raise LauncherError subclasses on failure."""

    @abc.abstractmethod
    def poll(self) -> BackendStatus:
        """Current state of the master and groups (cheap; called every half second)."""

    @abc.abstractmethod
    def restart_group(self, index: int) -> None:
        """Start group ``index`` again after it died."""

    @abc.abstractmethod
    def stop(self, *, grace_s: float = 8.0) -> None:
        """Stop everything: the master first (it checkpoints and tells groups to stop), then the rest;
        kill what has not exited after ``grace_s``. Idempotent; safe after a partial start."""

    def describe(self) -> dict[str, Any]:
        """What to record in run.json so ``status``/``down`` can find the run's parts later."""
        return {"backend": self.name}
