"""The one place the Swarm backend and the lifecycle commands touch the Docker SDK's swarm calls.

Above this module everything is typed values: a :class:`ServiceSpec` goes in, :class:`NodeInfo` and
:class:`TaskInfo` snapshots come out, and Docker's errors come back as :mod:`launcher.errors` types. It reuses
the connection (and the container and network calls) of :class:`launcher.docker_client.Engine`.
"""

from __future__ import annotations

import calendar
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from launcher import docker_client as dc
from launcher.errors import LauncherError, MissingDependency

log = logging.getLogger(__name__)

GPU_RESOURCE = "NVIDIA-GPU"  # the generic resource kind nodes advertise (daemon.json node-generic-resources)
SECRET_FILE = "launcher-secret"  # the secret's file name under /run/secrets
RESTART_DELAY_S = 1.0  # between a group's failure and its next task
STOP_GRACE_S = 8.0  # SIGTERM to SIGKILL for tasks the swarm stops (the master checkpoints in it)
PRE_RUNNING = ("new", "allocated", "pending", "assigned", "accepted", "preparing", "ready", "starting")
ENDED = ("complete", "failed", "rejected", "shutdown", "orphaned", "remove")
SWARM_HINT = ("make this engine a swarm manager (`docker swarm init`, see docs/scaling-out.md), point DOCKER_HOST "
              "at a manager, or use --backend docker")


# ------------------------------------------------------------------------------------------ snapshots
@dataclass(frozen=True)
class NodeInfo:
    """One swarm node as ``docker node inspect`` saw it; ``gpus``: its advertised NVIDIA-GPU resources."""

    id: str
    hostname: str
    role: str
    ready: bool
    labels: Mapping[str, str]
    nano_cpus: int = 0
    gpus: int = 0

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> "NodeInfo":
        spec, desc = attrs.get("Spec") or {}, attrs.get("Description") or {}
        res = desc.get("Resources") or {}
        gpus = 0
        for r in res.get("GenericResources") or []:
            named, discrete = r.get("NamedResourceSpec") or {}, r.get("DiscreteResourceSpec") or {}
            if named.get("Kind") == GPU_RESOURCE:
                gpus += 1
            elif discrete.get("Kind") == GPU_RESOURCE:
                gpus += int(discrete.get("Value") or 0)
        ready = (attrs.get("Status") or {}).get("State") == "ready" and spec.get("Availability", "active") == "active"
        return cls(str(attrs.get("ID", "")), str(desc.get("Hostname", "")), str(spec.get("Role", "")), ready,
                   dict(spec.get("Labels") or {}), int(res.get("NanoCPUs") or 0), gpus)


@dataclass(frozen=True)
class TaskInfo:
    """One task of a service (like a row of ``docker service ps``)."""

    id: str
    service_id: str
    node_id: str
    state: str  # new .. running, complete, failed, rejected, shutdown, orphaned
    desired: str
    exit_code: int | None
    err: str
    container_id: str
    created: tuple[int, int]  # (seconds, nanoseconds) of CreatedAt, for ordering
    gpus: tuple[str, ...] = ()  # the NVIDIA-GPU resources the engine assigned

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> "TaskInfo":
        st = attrs.get("Status") or {}
        cs = st.get("ContainerStatus") or {}
        gpus = tuple(str((r.get("NamedResourceSpec") or {}).get("Value", ""))
                     for r in attrs.get("AssignedGenericResources") or []
                     if (r.get("NamedResourceSpec") or {}).get("Kind") == GPU_RESOURCE)
        state = str(st.get("State", "new"))
        code = cs.get("ExitCode") if state in ENDED and state != "rejected" else None
        return cls(str(attrs.get("ID", "")), str(attrs.get("ServiceID", "")), str(attrs.get("NodeID", "")), state,
                   str(attrs.get("DesiredState", "")), None if code is None else int(code), str(st.get("Err") or ""),
                   str(cs.get("ContainerID") or ""), parse_timestamp(str(attrs.get("CreatedAt", ""))), gpus)


def parse_timestamp(text: str) -> tuple[int, int]:
    """``2026-11-22T00:41:23.12345Z`` -> (epoch seconds, nanoseconds); Go trims trailing zeros."""
    base, _, frac = text.rstrip("Z").partition(".")
    try:
        secs = calendar.timegm(time.strptime(base, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return (0, 0)
    digits = "".join(ch for ch in frac if ch.isdigit())[:9]
    return (secs, int(digits.ljust(9, "0")) if digits else 0)


def latest(tasks: list[TaskInfo]) -> TaskInfo | None:
    """The service's newest task: the one the swarm is running, starting, or gave up on last."""
    return max(tasks, key=lambda t: t.created) if tasks else None



# --------------------------------------------------------------------------------------- service specs
@dataclass(frozen=True)
class MountSpec:
    """A bind, volume or tmpfs mount of a service (``docker service create --mount``)."""

    kind: str  # bind | volume | tmpfs
    target: str
    source: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)  # volume labels

    def to_sdk(self) -> Any:
        from docker.types import Mount

        if self.kind == "tmpfs":
            return Mount(target=self.target, source=None, type="tmpfs", tmpfs_size=2**30)
        return Mount(target=self.target, source=self.source, type=self.kind, read_only=False,
                     labels=dict(self.labels) if self.kind == "volume" else None)


@dataclass(frozen=True)
class ServiceSpec:
    """Everything one service of a run is created with (``docker service create`` flags, typed).

    ``args`` follow the image's entrypoint (``python -m worker``); ``labels`` go on the service and on its
    task containers; ``gpus``: NVIDIA-GPU generic resources reserved; ``restart_max``: None never restarts.
    """

    name: str
    image: str
    args: tuple[str, ...]
    env: Mapping[str, str]
    labels: Mapping[str, str]
    network: str
    user: str
    nano_cpus: int = 0
    gpus: int = 0
    restart_max: int | None = None
    constraints: tuple[str, ...] = ()
    mounts: tuple[MountSpec, ...] = ()
    stop_grace_s: float = STOP_GRACE_S

    def restart_policy(self) -> dict[str, Any]:
        """on-failure with ``restart_max`` attempts; none for the master and for a budget of 0 (the swarm
        reads max_attempts 0 as "no limit")."""
        if not self.restart_max:
            return {"Condition": "none"}
        return {"Condition": "on-failure", "MaxAttempts": self.restart_max, "Delay": int(RESTART_DELAY_S * 1e9)}

    def create_kwargs(self, secret_id: str, secret: str, uid_gid: tuple[int, int]) -> dict[str, Any]:
        """Keyword arguments of ``client.services.create`` for this spec."""
        from docker.types import EndpointSpec, Resources, RestartPolicy, SecretReference, ServiceMode

        rp = self.restart_policy()
        return {
            "image": self.image, "args": list(self.args), "name": self.name, "env": dict(self.env),
            "labels": dict(self.labels), "container_labels": dict(self.labels), "networks": [self.network],
            "user": self.user, "read_only": True, "cap_drop": ["ALL"],
            "mounts": [m.to_sdk() for m in self.mounts], "constraints": list(self.constraints),
            "mode": ServiceMode("replicated", replicas=1), "endpoint_spec": EndpointSpec(mode="dnsrr"),
            "restart_policy": RestartPolicy(condition=rp["Condition"], delay=rp.get("Delay", 0),
                                            max_attempts=rp.get("MaxAttempts", 0)),
            "resources": Resources(cpu_limit=self.nano_cpus or None,
                                   generic_resources={GPU_RESOURCE: self.gpus} if self.gpus else None),
            "secrets": [SecretReference(secret_id, secret, filename=SECRET_FILE, uid=str(uid_gid[0]),
                                        gid=str(uid_gid[1]), mode=0o400)],
            "stop_grace_period": int(self.stop_grace_s * 1e9),
            "log_driver": "json-file", "log_driver_options": {"max-size": "50m", "max-file": "2"},
        }



# ------------------------------------------------------------------------------------------- the engine
class SwarmEngine:
    """The Swarm calls the backend and ``status``/``logs``/``down`` need, over a connected
    :class:`~launcher.docker_client.Engine` (whose client this reuses)."""

    def __init__(self, engine: dc.Engine) -> None:
        self.engine = engine
        self.client = engine.client

    def manager_problem(self) -> str | None:
        """None when this engine is an active swarm manager, else what it is."""
        sw = self.engine.info().get("Swarm") or {}
        if sw.get("LocalNodeState") != "active":
            return f"this Docker engine is not in a swarm (Swarm: {sw.get('LocalNodeState') or 'unknown'})"
        if not sw.get("ControlAvailable"):
            return "this Docker engine is a swarm worker, not a manager: services are created on a manager"
        return None

    def local_node(self) -> str:
        return str((self.engine.info().get("Swarm") or {}).get("NodeID", ""))

    def nodes(self) -> list[NodeInfo]:
        return [NodeInfo.from_attrs(n.attrs) for n in self.client.nodes.list()]

    def image_here(self, image: str) -> bool:
        from launcher.image import image_exists

        return image_exists(image, self.client)

    def _api(self, what: str, call: Callable[[], Any], hint: str | None = None) -> Any:
        from docker.errors import APIError

        try:
            return call()
        except APIError as exc:
            raise LauncherError(f"cannot {what}: {exc.explanation or exc}", hint=hint) from exc

    def create_network(self, name: str, net_labels: Mapping[str, str]) -> str:
        """An attachable, internal overlay network (``docker network create -d overlay --attachable --internal``)."""
        net = self._api(f"create overlay network {name}", lambda: self.client.networks.create(
            name, driver="overlay", attachable=True, internal=True, labels=dict(net_labels), check_duplicate=True),
            hint="`launcher down` the run that owns it")
        return str(net.id)

    def create_secret(self, name: str, data: str, secret_labels: Mapping[str, str]) -> str:
        """A swarm secret (``docker secret create``); only tasks it is granted to can read it."""
        sec = self._api(f"create secret {name}", lambda: self.client.secrets.create(
            name=name, data=data.encode(), labels=dict(secret_labels)))
        return str(sec.id)

    def create_service(self, spec: ServiceSpec, secret_id: str, secret: str, uid_gid: tuple[int, int]) -> str:
        svc = self._api(f"create service {spec.name}",
                        lambda: self.client.services.create(**spec.create_kwargs(secret_id, secret, uid_gid)))
        return str(svc.id)

    def services(self, flt: Mapping[str, str | None]) -> list[dict[str, Any]]:
        """Every service carrying the labels (like ``docker service ls --filter label=..``), as attrs."""
        return [dict(s.attrs) for s in self.client.services.list(filters={"label": dc._label_filters(flt)})]

    def tasks(self, service_ids: list[str]) -> dict[str, list[TaskInfo]]:
        """Tasks of these services (one call), by service id (like ``docker service ps``)."""
        out: dict[str, list[TaskInfo]] = {sid: [] for sid in service_ids}
        if not service_ids:
            return out
        for attrs in self.client.api.tasks(filters={"service": list(service_ids)}):
            t = TaskInfo.from_attrs(attrs)
            if t.service_id in out:
                out[t.service_id].append(t)
        return out

    def service_logs(self, service: str, *, since: str | None = None, timestamps: bool = False) -> bytes:
        """Output of every task of ``service`` still in the swarm's history (like ``docker service logs``)."""
        from docker.errors import APIError, NotFound

        kw: dict[str, Any] = {"stdout": True, "stderr": True, "timestamps": timestamps, "is_tty": False}
        if since is not None:
            kw["since"] = since
        try:
            return b"".join(self.client.api.service_logs(service, **kw))
        except (NotFound, APIError) as exc:
            log.debug("logs of %s: %s", service, exc)
            return b""

    def scale_to_zero(self, service_id: str) -> None:
        from docker.errors import APIError, NotFound

        try:
            self.client.services.get(service_id).scale(0)
        except (NotFound, APIError) as exc:
            log.debug("scale %s: %s", service_id, exc)

    def remove_service(self, service_id: str) -> None:
        from docker.errors import NotFound

        try:
            self._api(f"remove service {service_id}", lambda: self.client.api.remove_service(service_id))
        except LauncherError as exc:
            if not isinstance(exc.__cause__, NotFound):
                raise

    def secrets(self, flt: Mapping[str, str | None]) -> list[tuple[str, str]]:
        return [(str(s.id), str(s.name)) for s in self.client.secrets.list(filters={"label": dc._label_filters(flt)})]

    def overlay_networks(self, flt: Mapping[str, str | None]) -> list[tuple[str, str]]:
        """(id, name) of every overlay network carrying the labels (a run's bridge network is not one)."""
        nets = self.client.networks.list(filters={"label": dc._label_filters(flt), "driver": "overlay"})
        return [(str(n.id), str(n.name)) for n in nets]

    def remove_secret(self, secret_id: str) -> None:
        from docker.errors import NotFound

        try:
            self.client.api.remove_secret(secret_id)
        except NotFound:
            pass

    def remove_network(self, net_id: str, timeout_s: float = 20.0) -> None:
        """Remove an overlay network and wait until it is gone. Both halves are asynchronous on a swarm: the
        removal fails while the tasks' endpoints are being released, and the network is listed for a moment
        after it succeeded."""
        from docker.errors import NotFound

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if not self.engine.remove_network(net_id):
                    return
                break
            except LauncherError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        while time.monotonic() < deadline:
            try:
                self.client.api.inspect_network(net_id)
            except NotFound:
                return
            time.sleep(0.2)

    def copy_volume(self, volume: str, dest: Path, image: str, user: str, run_id: str) -> bool:
        """Copy ``results/`` of a named volume on this node into ``dest`` (a throw-away container running as
        ``user``). False when the volume is not on this node."""
        from docker.errors import APIError, ContainerError, NotFound
        from docker.types import Mount

        try:
            self.client.volumes.get(volume)
        except NotFound:
            return False
        code = "import shutil; shutil.copytree('/src/results', '/dst', dirs_exist_ok=True)"
        try:
            self.client.containers.run(
                image, entrypoint=["python", "-c", code], user=user, network_disabled=True, remove=True,
                labels={dc.RUN_LABEL: run_id, dc.ROLE_LABEL: "copy"},
                mounts=[Mount("/src", volume, type="volume", read_only=True),
                        Mount("/dst", str(dest.resolve()), type="bind")])
        except (ContainerError, APIError) as exc:
            log.warning("cannot copy results out of volume %s: %s", volume, exc)
            return False
        return True

    def remove_volume(self, volume: str) -> None:
        from docker.errors import APIError, NotFound

        try:
            self.client.volumes.get(volume).remove()
        except (NotFound, APIError) as exc:
            log.debug("volume %s: %s", volume, exc)


def connect_swarm(engine: dc.Engine | None = None) -> SwarmEngine:
    """A :class:`SwarmEngine` on ``engine`` (default: a new connection).

    Raises:
        MissingDependency: no engine answers, or it is not a swarm manager.
    """
    swarm = SwarmEngine(engine or dc.Engine())
    problem = swarm.manager_problem()
    if problem:
        raise MissingDependency(f"--backend swarm: {problem}", hint=SWARM_HINT)
    return swarm
