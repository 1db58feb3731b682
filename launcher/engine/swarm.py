"""Swarm calls (nodes, services, tasks, secrets, volumes) on a manager: what the Swarm backend needs.

Above this module everything is typed values: a :class:`ServiceSpec` goes in, :class:`NodeInfo` and
:class:`TaskInfo` snapshots come out, and the engine's errors come back as :mod:`launcher.errors` types through
:func:`launcher.engine.errors.engine_call`. It reuses the connection (and the container and network calls) of
:class:`launcher.engine.client.Engine`.
"""

from __future__ import annotations

import calendar
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.engine.client import Engine
from launcher.engine.errors import engine_call
from launcher.engine.labels import ROLE_LABEL, RUN_LABEL, label_filters
from launcher.errors import LauncherError, MissingDependency

log = logging.getLogger(__name__)

GPU_RESOURCE = "NVIDIA-GPU"  # the generic resource kind nodes advertise (daemon.json node-generic-resources)
SECRET_FILE = "launcher-secret"  # the secret's file name under /run/secrets
# A node label: the Docker host URL at which the launcher's machine reaches that node's own engine
# (``docker node update --label-add launcher.engine=tcp://gpu-node-7:2376 gpu-node-7``); teardown asks it
# whether the run's task containers are gone (launcher.backends.swarm_gone, docs/scaling-out.md).
ENGINE_LABEL = "launcher.engine"
RESTART_DELAY_S = 1.0  # between a group's failure and its next task
LOGS_DEADLINE_S = 15.0  # the longest one service's logs may take to read (a lost node's stream never ends)
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
    state: str = ""  # the swarm's word: ready, down, unknown, disconnected
    updated_at: str = ""  # when the node's record last changed (its state, for a lost node), RFC 3339

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
                   dict(spec.get("Labels") or {}), int(res.get("NanoCPUs") or 0), gpus,
                   str((attrs.get("Status") or {}).get("State") or ""), str(attrs.get("UpdatedAt") or "")[:19])


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
    memory_bytes: int = 0  # the task's memory limit; 0: none
    pids_limit: int = 0  # the task's pids limit (API 1.41+); 0: none

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
        resources = Resources(cpu_limit=self.nano_cpus or None, mem_limit=self.memory_bytes or None,
                              generic_resources={GPU_RESOURCE: self.gpus} if self.gpus else None)
        if self.pids_limit:  # docker-py has no argument for it; the engine reads Limits.Pids (API 1.41)
            resources.setdefault("Limits", {})["Pids"] = self.pids_limit
        return {
            "image": self.image, "args": list(self.args), "name": self.name, "env": dict(self.env),
            "labels": dict(self.labels), "container_labels": dict(self.labels), "networks": [self.network],
            "user": self.user, "read_only": True, "cap_drop": ["ALL"],
            # Engines before API 1.46 drop this field: there a setuid file of the image still gains euid 0 (with
            # no capabilities: cap_drop ALL empties the bounding set); docs/reliability.md says so.
            "privileges": {"NoNewPrivileges": True},
            "mounts": [m.to_sdk() for m in self.mounts], "constraints": list(self.constraints),
            "mode": ServiceMode("replicated", replicas=1), "endpoint_spec": EndpointSpec(mode="dnsrr"),
            "restart_policy": RestartPolicy(condition=rp["Condition"], delay=rp.get("Delay", 0),
                                            max_attempts=rp.get("MaxAttempts", 0)),
            "resources": resources,
            "secrets": [SecretReference(secret_id, secret, filename=SECRET_FILE, uid=str(uid_gid[0]),
                                        gid=str(uid_gid[1]), mode=0o400)],
            "stop_grace_period": int(self.stop_grace_s * 1e9),
            "log_driver": "json-file", "log_driver_options": {"max-size": "50m", "max-file": "2"},
        }



# ------------------------------------------------------------------------------------------- the engine
class SwarmEngine:
    """The Swarm calls the backend needs, over a connected :class:`~launcher.engine.client.Engine` (whose
    client this reuses)."""

    def __init__(self, engine: Engine) -> None:
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
        return [NodeInfo.from_attrs(n.attrs) for n in engine_call("list swarm nodes", self.client.nodes.list)]

    def image_here(self, image: str) -> bool:
        from launcher.engine.images import image_exists

        return image_exists(image, self.client)

    def create_network(self, name: str, net_labels: Mapping[str, str]) -> str:
        """An attachable, internal overlay network (``docker network create -d overlay --attachable --internal``)."""
        return self.engine.create_network(name, net_labels, internal=True, driver="overlay", attachable=True)

    def create_secret(self, name: str, data: str, secret_labels: Mapping[str, str]) -> str:
        """A swarm secret (``docker secret create``); only tasks it is granted to can read it."""
        sec = engine_call(f"create secret {name}", lambda: self.client.secrets.create(
            name=name, data=data.encode(), labels=dict(secret_labels)))
        return str(sec.id)

    def create_service(self, spec: ServiceSpec, secret_id: str, secret: str, uid_gid: tuple[int, int]) -> str:
        svc = engine_call(f"create service {spec.name}",
                          lambda: self.client.services.create(**spec.create_kwargs(secret_id, secret, uid_gid)))
        return str(svc.id)

    def services(self, flt: Mapping[str, str | None]) -> list[dict[str, Any]]:
        """Every service carrying the labels (like ``docker service ls --filter label=..``), as attrs."""
        found = engine_call("list services", lambda: self.client.services.list(filters={"label": label_filters(flt)}))
        return [dict(s.attrs) for s in found]

    def tasks(self, service_ids: list[str]) -> dict[str, list[TaskInfo]]:
        """Tasks of these services (one call), by service id (like ``docker service ps``)."""
        out: dict[str, list[TaskInfo]] = {sid: [] for sid in service_ids}
        if not service_ids:
            return out
        for attrs in engine_call("list tasks", lambda: self.client.api.tasks(filters={"service": list(service_ids)})):
            t = TaskInfo.from_attrs(attrs)
            if t.service_id in out:
                out[t.service_id].append(t)
        return out

    def run_tasks(self, flt: Mapping[str, str | None]) -> list[TaskInfo]:
        """Every task the swarm still lists whose service carried the labels, removed services included (a
        task keeps its service's labels; the swarm drops a removed service's task once its node reported the
        container stopped, a moment before the node removes the container)."""
        found = engine_call("list tasks", lambda: self.client.api.tasks(filters={"label": label_filters(flt)}))
        return [TaskInfo.from_attrs(attrs) for attrs in found]

    def service_logs(self, service: str, *, since: str | None = None, timestamps: bool = False,
                     deadline_s: float = LOGS_DEADLINE_S) -> bytes:
        """Output of every task of ``service`` still in the swarm's history (like ``docker service logs``).

        Bounded by ``deadline_s``: the manager streams each task's output from the task's node, and the stream
        of a task on a lost node never ends (issue 16: teardown and ``launcher down`` hung on it for good).
        The read runs in a daemon thread; past the deadline what came so far is returned, with a last line
        saying the rest is unavailable, and the thread is left to the end of the process.
        """
        kw: dict[str, Any] = {"stdout": True, "stderr": True, "timestamps": timestamps, "is_tty": False}
        if since is not None:
            kw["since"] = since
        chunks: list[bytes] = []
        done = threading.Event()

        def read() -> None:
            try:
                engine_call(f"read the logs of service {service}",
                            lambda: chunks.extend(self.client.api.service_logs(service, **kw)), gone=None)
            except LauncherError as exc:
                log.debug("%s", exc)
            except Exception as exc:  # noqa: BLE001 - a broken stream mid-way: keep what came
                log.debug("logs of service %s ended: %s", service, exc)
            finally:
                done.set()

        threading.Thread(target=read, name=f"logs-{service[:24]}", daemon=True).start()
        if done.wait(deadline_s):
            return b"".join(chunks)
        log.warning("logs of service %s: nothing more within %.0f s (a task on a lost node?); the rest is "
                    "unavailable", service, deadline_s)
        return b"".join(list(chunks)) + (f"[launcher: the rest of this output is unavailable: the engine sent "
                                         f"nothing more within {deadline_s:.0f} s (a task on a lost node?)]\n").encode()

    def force_update(self, service_id: str, *, constraints: tuple[str, ...] | None = None) -> None:
        """A new task for the service (like ``docker service update --force``): a manual restart. ``constraints``:
        replace the service's placement constraints in the same update (``--constraint-add``), None keeps them."""
        def update() -> Any:
            svc = self.client.services.get(service_id)
            if constraints is None:
                return svc.force_update()
            return svc.update(constraints=list(constraints), force_update=True, fetch_current_spec=True)

        engine_call(f"restart service {service_id[:12]}", update)

    def scale_to_zero(self, service_id: str) -> None:
        try:
            engine_call(f"scale service {service_id[:12]} to 0",
                        lambda: self.client.services.get(service_id).scale(0), gone=None)
        except LauncherError as exc:
            log.debug("%s", exc)

    def remove_service(self, service_id: str) -> None:
        engine_call(f"remove service {service_id}", lambda: self.client.api.remove_service(service_id), gone=None)

    def secrets(self, flt: Mapping[str, str | None]) -> list[tuple[str, str]]:
        found = engine_call("list secrets", lambda: self.client.secrets.list(filters={"label": label_filters(flt)}))
        return [(str(s.id), str(s.name)) for s in found]

    def overlay_networks(self, flt: Mapping[str, str | None]) -> list[tuple[str, str]]:
        """(id, name) of every overlay network carrying the labels (a run's bridge network is not one)."""
        return [(nid, name) for nid, name, _ in self.engine.networks(flt, driver="overlay")]

    def remove_secret(self, secret_id: str) -> None:
        engine_call(f"remove secret {secret_id}", lambda: self.client.api.remove_secret(secret_id), gone=None)

    def remove_network(self, net_id: str, timeout_s: float = 20.0) -> None:
        """Remove an overlay network and wait until it is gone. Both halves are asynchronous on a swarm: the
        removal fails while the tasks' endpoints are being released, and the network is listed for a moment
        after it succeeded."""
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
        while time.monotonic() < deadline and self.engine.network_exists(net_id):
            time.sleep(0.2)

    def volume_exists(self, volume: str) -> bool:
        return bool(engine_call(f"inspect volume {volume}", lambda: self.client.api.inspect_volume(volume) and True,
                                gone=False))

    def copy_volume(self, volume: str, dest: Path, image: str, user: str, run_id: str) -> bool:
        """Copy ``results/`` of a named volume on this node into ``dest`` (a throw-away container running as
        ``user``). False when the volume is not on this node or the copy failed; True, copying nothing, when the
        master never wrote ``results/`` (killed before its first file: there is nothing to keep)."""
        if not self.volume_exists(volume):
            return False
        # Entry by entry, so ``dest`` itself keeps its owner's mode (copytree would copystat it: EPERM when the
        # helper's user does not own it).
        code = ("import os, shutil\n"
                "src = '/src/results'\n"
                "for name in sorted(os.listdir(src)) if os.path.isdir(src) else []:\n"
                "    a, b = os.path.join(src, name), os.path.join('/dst', name)\n"
                "    shutil.copytree(a, b, dirs_exist_ok=True) if os.path.isdir(a) else shutil.copy2(a, b)\n")
        return self.engine.run_once(image, ["python", "-c", code], user=user,
                                    labels={RUN_LABEL: run_id, ROLE_LABEL: "copy"},
                                    mounts=[("volume", volume, "/src", True), ("bind", str(dest.resolve()), "/dst", False)])

    def remove_volume(self, volume: str) -> None:
        try:
            engine_call(f"remove volume {volume}", lambda: self.client.api.remove_volume(volume), gone=None)
        except LauncherError as exc:
            log.debug("%s", exc)


def connect_swarm(engine: Engine | None = None) -> SwarmEngine:
    """A :class:`SwarmEngine` on ``engine`` (default: a new connection).

    Raises:
        MissingDependency: no engine answers, or it is not a swarm manager.
    """
    swarm = SwarmEngine(engine or Engine())
    problem = swarm.manager_problem()
    if problem:
        raise MissingDependency(f"--backend swarm: {problem}", hint=SWARM_HINT)
    return swarm
