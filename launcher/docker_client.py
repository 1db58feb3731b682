"""The one place the Docker backend and the lifecycle commands touch the Docker SDK.

Everything above this module works with plain typed values: a :class:`ContainerSpec` goes in, a
:class:`ContainerSnapshot` comes out, and Docker's errors come back as :mod:`launcher.errors` types.
Unit tests fake this layer only (docker-py's own split: raw calls below, typed values above).

Image builds have their own wrapper (:mod:`launcher.image`); this one covers networks, containers and logs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from launcher.errors import LauncherError, MissingDependency

log = logging.getLogger(__name__)

RUN_LABEL = "launcher.run"
ROLE_LABEL = "launcher.role"
GROUP_LABEL = "launcher.group"
GPUS_LABEL = "launcher.gpus"
RESULTS_LABEL = "launcher.results"
USER_LABEL = "launcher.user"

PING_TIMEOUT_S = 3
API_TIMEOUT_S = 60


def docker_host() -> str:
    """The engine address the SDK will use, for messages."""
    return os.environ.get("DOCKER_HOST") or "unset, so unix:///var/run/docker.sock"


def engine_unavailable_reason(timeout_s: float = PING_TIMEOUT_S) -> str | None:
    """None when a Docker engine answers a ping within ``timeout_s`` seconds, else why not (like
    ``docker version``). Never raises: ``--backend auto`` asks this on every ``up``."""
    try:
        import docker.client
        from docker.errors import DockerException
    except ImportError:
        return "the docker Python package is not installed"
    try:
        client = docker.client.from_env(timeout=max(1, int(timeout_s)))
        try:
            client.ping()
        finally:
            client.close()
    except DockerException as exc:
        return f"no Docker engine answers at DOCKER_HOST={docker_host()}: {exc}"
    except Exception as exc:  # noqa: BLE001 - urllib3/socket errors reach us unwrapped in some versions
        return f"no Docker engine answers at DOCKER_HOST={docker_host()}: {type(exc).__name__}: {exc}"
    return None


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
    read_only: bool = True
    tmpfs: Mapping[str, str] = field(default_factory=lambda: {"/tmp": "rw,nosuid,nodev,size=1g"})
    cap_drop: tuple[str, ...] = ("ALL",)
    security_opt: tuple[str, ...] = ("no-new-privileges",)
    ports: Mapping[int, int] = field(default_factory=dict)

    def create_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``client.containers.create`` for this spec."""
        from docker.types import DeviceRequest, Mount

        kwargs: dict[str, Any] = {
            "image": self.image, "command": list(self.command), "name": self.name,
            "environment": dict(self.environment), "labels": dict(self.labels), "network": self.network,
            "user": self.user, "read_only": self.read_only, "tmpfs": dict(self.tmpfs),
            "cap_drop": list(self.cap_drop), "security_opt": list(self.security_opt),
            "mounts": [Mount(target=dst, source=src, type="bind", read_only=False) for src, dst in self.binds.items()],
            "restart_policy": ({"Name": "on-failure", "MaximumRetryCount": self.restart_max}
                               if self.restart_max is not None else {"Name": "no"}),
            "log_config": {"Type": "json-file", "Config": {"max-size": "50m", "max-file": "2"}},
            "detach": True,
        }
        if self.nano_cpus:
            kwargs["nano_cpus"] = self.nano_cpus
        if self.gpu_uuids:
            kwargs["device_requests"] = [DeviceRequest(driver="nvidia", device_ids=list(self.gpu_uuids),
                                                       capabilities=[["gpu"]])]
        if self.ports:
            kwargs["ports"] = {f"{c}/tcp": ("127.0.0.1", h) for c, h in self.ports.items()}
        return kwargs


@dataclass(frozen=True)
class ContainerSnapshot:
    """One container as ``docker inspect`` saw it.

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
    def from_attrs(cls, attrs: Mapping[str, Any]) -> "ContainerSnapshot":
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


def _label_filters(labels: Mapping[str, str | None]) -> list[str]:
    return [k if v is None else f"{k}={v}" for k, v in labels.items()]


class Engine:
    """A connected Docker engine (``docker.from_env()``), with the calls the backend needs.

    Raises :class:`~launcher.errors.MissingDependency` on construction when no engine answers; every
    other engine error becomes a :class:`~launcher.errors.LauncherError` saying what was being done.
    """

    def __init__(self, timeout_s: int = API_TIMEOUT_S) -> None:
        import docker.client
        from docker.errors import DockerException

        try:
            self.client = docker.client.from_env(timeout=timeout_s)
            self.client.ping()
        except DockerException as exc:
            raise MissingDependency(
                f"no Docker engine answers (DOCKER_HOST={docker_host()}): {exc}",
                hint="start the engine (`sudo systemctl start docker`), or point DOCKER_HOST at one; your user "
                     "needs access to its socket (the docker group); or use --backend process") from exc
        self._info: dict[str, Any] | None = None

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------------------------------ engine
    def info(self) -> dict[str, Any]:
        """``docker info``, asked once per Engine."""
        if self._info is None:
            self._info = dict(self.client.info())
        return self._info

    def runtimes(self) -> tuple[str, ...]:
        """The OCI runtimes the engine knows (``docker info`` Runtimes), e.g. ``('runc', 'nvidia')``."""
        return tuple(sorted((self.info().get("Runtimes") or {}).keys()))

    def cpu_count(self) -> int:
        """CPUs the engine's host has (``docker info`` NCPU): the most ``nano_cpus`` may ask for."""
        return int(self.info().get("NCPU") or os.cpu_count() or 1)

    def has_nvidia_runtime(self) -> bool:
        """Whether nvidia-container-toolkit is registered with the engine."""
        return "nvidia" in self.runtimes()

    # ----------------------------------------------------------------------------------------- networks
    def create_network(self, name: str, labels: Mapping[str, str], *, internal: bool = True) -> str:
        """Create a bridge network (like ``docker network create --internal``); returns its id.

        ``internal``: containers on it reach each other by name but nothing outside the host's bridge.
        """
        from docker.errors import APIError

        try:
            net = self.client.networks.create(name, driver="bridge", internal=internal, labels=dict(labels),
                                              check_duplicate=True)
        except APIError as exc:
            raise LauncherError(f"cannot create network {name}: {exc.explanation or exc}",
                                hint=f"`launcher down` the run that owns it, or `docker network rm {name}`") from exc
        return str(net.id)

    def networks(self, labels: Mapping[str, str | None]) -> list[tuple[str, str, dict[str, str]]]:
        """(id, name, labels) of every network carrying ``labels`` (a None value: any value)."""
        nets = self.client.networks.list(filters={"label": _label_filters(labels)})
        return [(str(n.id), str(n.name), dict(n.attrs.get("Labels") or {})) for n in nets]

    def remove_network(self, name_or_id: str) -> bool:
        """Remove a network (like ``docker network rm``); False when it was already gone."""
        from docker.errors import APIError, NotFound

        try:
            self.client.networks.get(name_or_id).remove()
        except NotFound:
            return False
        except APIError as exc:
            raise LauncherError(f"cannot remove network {name_or_id}: {exc.explanation or exc}",
                                hint="a container outside the run may still be attached; `docker network inspect` it") from exc
        return True

    # --------------------------------------------------------------------------------------- containers
    def create(self, spec: ContainerSpec) -> str:
        """Create (not start) a container (like ``docker create``); returns its id."""
        from docker.errors import APIError, ImageNotFound

        try:
            return str(self.client.containers.create(**spec.create_kwargs()).id)
        except ImageNotFound as exc:
            raise MissingDependency(f"image {spec.image} is not on this engine",
                                    hint="`launcher build` makes it; or pass --image") from exc
        except APIError as exc:
            raise LauncherError(f"cannot create container {spec.name}: {exc.explanation or exc}",
                                hint="`launcher down --all` removes leftovers of earlier runs") from exc

    def start(self, container_id: str) -> None:
        """Start a created container (like ``docker start``)."""
        from docker.errors import APIError

        try:
            self.client.api.start(container_id)
        except APIError as exc:
            raise LauncherError(f"cannot start container {container_id[:12]}: {exc.explanation or exc}") from exc

    def inspect(self, container_id: str) -> ContainerSnapshot | None:
        """The container's state now (like ``docker inspect``); None when it no longer exists."""
        from docker.errors import NotFound

        try:
            return ContainerSnapshot.from_attrs(self.client.api.inspect_container(container_id))
        except NotFound:
            return None

    def inspect_raw(self, container_id: str) -> dict[str, Any]:
        """The full ``docker inspect`` document (tests and ``status --json`` read it)."""
        return dict(self.client.api.inspect_container(container_id))

    def containers(self, labels: Mapping[str, str | None]) -> list[ContainerSnapshot]:
        """Every container (running or not) carrying ``labels`` (like ``docker ps -a --filter label=..``)."""
        found = self.client.api.containers(all=True, filters={"label": _label_filters(labels)})
        snaps = []
        for c in found:
            snap = self.inspect(c["Id"])
            if snap is not None:
                snaps.append(snap)
        return sorted(snaps, key=lambda s: s.name)

    def stop(self, container_id: str, timeout_s: float) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s`` seconds (like ``docker stop -t``). Gone already: fine."""
        from docker.errors import APIError, NotFound

        try:
            self.client.api.stop(container_id, timeout=max(0, int(round(timeout_s))))
        except NotFound:
            pass
        except APIError as exc:
            log.warning("stopping %s: %s", container_id[:12], exc.explanation or exc)

    def kill(self, container_id: str, signal: str = "SIGKILL") -> None:
        """Send ``signal`` to the container's main process (like ``docker kill -s``)."""
        from docker.errors import APIError, NotFound

        try:
            self.client.api.kill(container_id, signal=signal)
        except NotFound:
            pass
        except APIError as exc:
            log.debug("kill %s: %s", container_id[:12], exc.explanation or exc)

    def restart(self, container_id: str, timeout_s: float = 5) -> None:
        """Restart a container (like ``docker restart``)."""
        from docker.errors import APIError

        try:
            self.client.api.restart(container_id, timeout=int(timeout_s))
        except APIError as exc:
            raise LauncherError(f"cannot restart container {container_id[:12]}: {exc.explanation or exc}") from exc

    def remove(self, container_id: str) -> bool:
        """Remove a container, killing it if it still runs (like ``docker rm -f``); False if already gone."""
        from docker.errors import APIError, NotFound

        try:
            self.client.api.remove_container(container_id, force=True)
        except NotFound:
            return False
        except APIError as exc:
            if "already in progress" in str(exc):
                return True
            raise LauncherError(f"cannot remove container {container_id[:12]}: {exc.explanation or exc}") from exc
        return True

    def wait_removed(self, container_ids: list[str], timeout_s: float = 10.0) -> None:
        """Wait until none of ``container_ids`` exists (removal is asynchronous for a dying container)."""
        deadline = time.monotonic() + timeout_s
        pending = list(container_ids)
        while pending and time.monotonic() < deadline:
            pending = [c for c in pending if self.inspect(c) is not None]
            if pending:
                time.sleep(0.1)

    # --------------------------------------------------------------------------------------------- logs
    def logs(self, container_id: str, *, tail: int | None = None) -> bytes:
        """Everything the container wrote to stdout/stderr, across its restarts (like ``docker logs``)."""
        from docker.errors import NotFound

        try:
            return bytes(self.client.api.logs(container_id, stdout=True, stderr=True, tail="all" if tail is None else tail))
        except NotFound:
            return b""

    def follow_logs(self, container_id: str, *, tail: int | None = None) -> Iterator[bytes]:
        """Chunks of output as the container writes them, until it stops (like ``docker logs -f``)."""
        from docker.errors import NotFound

        try:
            yield from self.client.api.logs(container_id, stdout=True, stderr=True, stream=True, follow=True,
                                            tail="all" if tail is None else tail)
        except NotFound:
            return
