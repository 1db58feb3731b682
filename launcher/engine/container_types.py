"""A container as the engine layer passes it, typed: :class:`ContainerSpec`, everything one container of a run is
created with (``docker create`` flags; :meth:`ContainerSpec.create_kwargs` turns it into the SDK's keyword
arguments), and :class:`Container`, one container as ``docker inspect`` saw it.

:class:`launcher.engine.client.Engine` takes the one and returns the other (:mod:`launcher.engine.client`
re-exports both); backends build the specs and read the snapshots, and unit tests fake the engine with these
values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ContainerSpec:
    """Everything one container of a run is created with (``docker create`` flags, typed).

    Attributes:
        name: container name, unique on the engine (``launcher-<run>-master``).
        image: image reference.
        command: arguments after the image's entrypoint (``python -m worker``).
        environment: environment variables (the spec and the secret included).
        labels: ``launcher.*`` labels; ``status``/``down`` find the run's parts by them.
        network: the run's network name; the container's name resolves on it.
        user: ``uid:gid`` the process runs as.
        nano_cpus: CPU limit in 1e-9 CPUs (``--cpus 2`` is 2_000_000_000); 0: no limit.
        gpu_uuids: GPUs handed to the container through a DeviceRequest; empty: none.
        restart_max: ``on-failure`` restart policy with this many retries; None: never restart.
        binds: host path -> container path, read-write bind mounts.
        read_only: read-only root filesystem (``/tmp`` is a tmpfs then).
        tmpfs: container path -> mount options.
        cap_drop, security_opt: as ``docker run --cap-drop`` / ``--security-opt``.
        ports: container port -> host port, published on 127.0.0.1 only.
        memory_bytes, pids_limit: ``--memory`` (swap included: none) and ``--pids-limit``; 0: no limit.
    """

    name: str
    image: str
    command: tuple[str, ...]
    environment: Mapping[str, str]
    labels: Mapping[str, str]
    network: str
    user: str
    nano_cpus: int = 0
    gpu_uuids: tuple[str, ...] = ()
    restart_max: int | None = None
    binds: Mapping[str, str] = field(default_factory=dict)
    read_only_binds: Mapping[str, str] = field(default_factory=dict)  # host path -> container path, read-only
    read_only: bool = True
    tmpfs: Mapping[str, str] = field(default_factory=lambda: {"/tmp": "rw,nosuid,nodev,size=1g"})
    cap_drop: tuple[str, ...] = ("ALL",)
    security_opt: tuple[str, ...] = ("no-new-privileges",)
    ports: Mapping[int, int] = field(default_factory=dict)
    memory_bytes: int = 0
    pids_limit: int = 0

    def create_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``client.containers.create`` for this spec."""
        from docker.types import DeviceRequest, Mount

        kwargs: dict[str, Any] = {
            "image": self.image, "command": list(self.command), "name": self.name,
            "environment": dict(self.environment), "labels": dict(self.labels), "network": self.network,
            "user": self.user, "read_only": self.read_only, "tmpfs": dict(self.tmpfs),
            "cap_drop": list(self.cap_drop), "security_opt": list(self.security_opt),
            "mounts": [Mount(target=dst, source=src, type="bind", read_only=False) for src, dst in self.binds.items()]
            + [Mount(target=dst, source=src, type="bind", read_only=True) for src, dst in self.read_only_binds.items()],
            "restart_policy": ({"Name": "on-failure", "MaximumRetryCount": self.restart_max}
                               if self.restart_max is not None else {"Name": "no"}),
            "log_config": {"Type": "json-file", "Config": {"max-size": "50m", "max-file": "2"}},
            "detach": True,
        }
        if self.nano_cpus:
            kwargs["nano_cpus"] = self.nano_cpus
        if self.memory_bytes:
            kwargs.update(mem_limit=self.memory_bytes, memswap_limit=self.memory_bytes)
        if self.pids_limit:
            kwargs["pids_limit"] = self.pids_limit
        if self.gpu_uuids:
            kwargs["device_requests"] = [DeviceRequest(driver="nvidia", device_ids=list(self.gpu_uuids),
                                                       capabilities=[["gpu"]])]
        if self.ports:
            kwargs["ports"] = {f"{c}/tcp": ("127.0.0.1", h) for c, h in self.ports.items()}
        return kwargs


@dataclass(frozen=True)
class Container:
    """One container as ``docker inspect`` saw it (docker-py's ``Container.attrs``, typed).

    ``status`` is Docker's (created, running, restarting, exited, dead, paused, removing);
    ``health`` is the healthcheck status or ``""`` when the image has none.
    """

    id: str
    name: str
    status: str
    exit_code: int | None
    restart_count: int
    labels: Mapping[str, str]
    health: str = ""
    pid: int = 0
    started_at: str = ""
    finished_at: str = ""
    oom_killed: bool = False

    @property
    def short_id(self) -> str:
        return self.id[:12]

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> "Container":
        state = attrs.get("State") or {}
        status = str(state.get("Status", "unknown"))
        return cls(
            id=str(attrs.get("Id", "")), name=str(attrs.get("Name", "")).lstrip("/"), status=status,
            exit_code=None if status in ("created", "running", "restarting", "paused") else state.get("ExitCode"),
            restart_count=int(attrs.get("RestartCount") or 0),
            labels=dict((attrs.get("Config") or {}).get("Labels") or {}),
            health=str((state.get("Health") or {}).get("Status", "")), pid=int(state.get("Pid") or 0),
            started_at=str(state.get("StartedAt", "")), finished_at=str(state.get("FinishedAt", "")),
            oom_killed=bool(state.get("OOMKilled")),
        )
