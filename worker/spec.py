"""The run specification: the one contract between the launcher (host side) and what runs in a run.

The launcher writes it as JSON (``LAUNCHER_SPEC`` environment variable or ``--spec FILE``); the master and
every worker group read it once at start and pass typed values down. The run secret is never part of it:
it travels separately in ``LAUNCHER_SECRET`` (or a Docker secret file) and is removed from the
environment as soon as it is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

ALGOS = ("ppo", "a3c")
SPEC_VERSION = 1


@dataclass(frozen=True)
class GroupAssignment:
    """What one worker-group process runs: how many workers (env instances) and on which device."""

    index: int
    workers: int
    gpu: bool = False  # whether this group's process sees a GPU (it then limits TF memory)
    memory_limit_bytes: int | None = None  # TF per-process GPU memory cap; None: memory growth only

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"group index must be >= 0, got {self.index}")
        if self.workers < 1:
            raise ValueError(f"group {self.index}: workers must be >= 1, got {self.workers}")


@dataclass(frozen=True)
class RunSpec:
    """Everything the master and the worker groups need to know about a run.

    Attributes:
        run_id: the run's id; names its containers, network, results directory and log lines.
        env_id: a registered gymnasium env id (``CartPole-v1``, ``launcher/Snake-v0``, ...).
        algo: ``ppo`` or ``a3c``.
        seed: base seed; worker w of group g uses ``seed + 1000 * g + w``.
        max_steps: total env steps over all workers after which the run ends (None: no limit).
        until_return: end the run when the mean return over the last ``return_window`` episodes reaches
            this value (None: no target).
        master_host: address the master binds (process backend: 127.0.0.1; container: 0.0.0.0 on the
            run's private network only).
        master_port: port the master binds; 0 lets the OS choose (it is then written to ``master.addr``).
        connect_host: address the worker groups dial to reach the master.
        results_dir: the run's results directory as the master sees it.
        checkpoint_every: updates between checkpoints.
        hparams: algorithm hyper-parameter overrides (see ``worker.algorithms``).
        groups: one entry per worker group.
    """

    run_id: str
    env_id: str
    algo: str
    seed: int = 0
    max_steps: int | None = None
    until_return: float | None = None
    return_window: int = 100
    master_host: str = "127.0.0.1"
    master_port: int = 0
    connect_host: str = "127.0.0.1"
    results_dir: str = "results"
    checkpoint_every: int = 50
    hparams: dict[str, Any] = field(default_factory=dict)
    groups: tuple[GroupAssignment, ...] = ()
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 20.0
    handshake_timeout_s: float = 5.0
    max_frame_bytes: int = 256 * 1024 * 1024
    max_connections: int = 256
    version: int = SPEC_VERSION

    def __post_init__(self) -> None:
        problems = []
        if self.algo not in ALGOS:
            problems.append(f"algo must be one of {', '.join(ALGOS)}, got {self.algo!r}")
        if self.max_steps is not None and self.max_steps < 1:
            problems.append(f"max_steps must be >= 1, got {self.max_steps}")
        if self.return_window < 1:
            problems.append(f"return_window must be >= 1, got {self.return_window}")
        if not 0 <= self.master_port <= 65535:
            problems.append(f"master_port must be in 0..65535, got {self.master_port}")
        if self.checkpoint_every < 1:
            problems.append(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def total_workers(self) -> int:
        return sum(g.workers for g in self.groups)

    def group(self, index: int) -> GroupAssignment:
        for g in self.groups:
            if g.index == index:
                return g
        raise KeyError(f"run {self.run_id} has no group {index}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunSpec":
        data = dict(data)
        if data.get("version", SPEC_VERSION) != SPEC_VERSION:
            raise ValueError(f"run spec version {data.get('version')} is not {SPEC_VERSION}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown run spec fields: {', '.join(unknown)}")
        data["groups"] = tuple(GroupAssignment(**g) for g in data.get("groups", ()))
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        return cls.from_dict(json.loads(text))


SECRET_ENV = "LAUNCHER_SECRET"
SECRET_FILE_ENV = "LAUNCHER_SECRET_FILE"
SPEC_ENV = "LAUNCHER_SPEC"


def take_secret(environ: dict[str, str] | None = None) -> bytes:
    """Read the run secret once and remove it from the environment so children and logs never see it.

    Reads ``LAUNCHER_SECRET_FILE`` (a Docker secret, e.g. ``/run/secrets/...``) when set, else
    ``LAUNCHER_SECRET``. Raises ``RuntimeError`` (without the value) when neither is set or it is empty.
    """
    env = os.environ if environ is None else environ
    path = env.pop(SECRET_FILE_ENV, None)
    value = env.pop(SECRET_ENV, None)
    if path:
        with open(path, "rb") as fh:
            secret = fh.read().strip()
    elif value:
        secret = value.encode()
    else:
        raise RuntimeError(f"no run secret: set {SECRET_ENV} or {SECRET_FILE_ENV}")
    if len(secret) < 16:
        raise RuntimeError("the run secret is shorter than 16 bytes; the launcher generates 32")
    return secret
