"""Containers, networks and logs on one Docker engine: the calls the Docker backend and ``status``/``logs``/
``down`` make.

Everything above this module works with plain typed values (:mod:`launcher.engine.container_types`, re-exported
here): a :class:`ContainerSpec` goes in, a :class:`Container` comes out, and the engine's errors come back as
:mod:`launcher.errors` types through :func:`launcher.engine.errors.engine_call`. Unit tests fake this layer only (docker-py's own split: raw calls
below, typed values above). Swarm calls are in :mod:`launcher.engine.swarm`, image calls in
:mod:`launcher.engine.images`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from launcher.engine.container_types import Container, ContainerSpec  # re-exported: the engine's typed values
from launcher.engine.errors import ENGINE_HINT, docker_host, engine_call, is_not_found
from launcher.engine.labels import RUN_LABEL, label_filters
from launcher.errors import LauncherError, MissingDependency

if TYPE_CHECKING:
    from docker.client import DockerClient as DockerClient  # re-exported for type hints only

log = logging.getLogger(__name__)

PING_TIMEOUT_S = 3
API_TIMEOUT_S = 60
# A helper container (the env check, the model export) runs the user's code: the engine keeps at most 2 MiB
# of its output (json-file, two files of 1 MiB: older output is dropped), and the launcher reads its last lines.
# Two files, not one: with one, the engine empties it when it fills, and the lines written just before (the
# probe's answer, when a few bytes on the other stream follow it) were lost now and then.
HELPER_LOG_CONFIG = {"type": "json-file", "config": {"max-size": "1m", "max-file": "2"}}
HELPER_LOG_TAIL_LINES = 2000


def connect_client(timeout_s: float = API_TIMEOUT_S, docker_host_url: str | None = None) -> "DockerClient":
    """A Docker client that has answered a ping (like ``docker version``).

    ``docker_host_url``: another engine than ``$DOCKER_HOST`` (a swarm node's, see
    :mod:`launcher.backends.swarm_gone`), reached with the same TLS settings (``DOCKER_TLS_VERIFY``,
    ``DOCKER_CERT_PATH``) as ``$DOCKER_HOST`` would be.

    Raises:
        MissingDependency: no engine answers; the message names the DOCKER_HOST value seen.
    """
    try:
        import docker.client
    except ImportError as exc:
        raise MissingDependency("the docker Python package is not installed",
                                hint="`pip install docker` (scripts/setup.sh installs it)") from exc
    try:
        environment = None if docker_host_url is None else {**os.environ, "DOCKER_HOST": docker_host_url}
        client = docker.client.from_env(timeout=max(1, int(timeout_s)), environment=environment)
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any SDK or transport error means: no engine here
        raise MissingDependency(f"no Docker engine answers (DOCKER_HOST={docker_host_url or docker_host()}): {exc}",
                                hint=ENGINE_HINT) from exc
    return client


def engine_unavailable_reason(timeout_s: float = PING_TIMEOUT_S) -> str | None:
    """None when a Docker engine answers a ping within ``timeout_s`` seconds, else why not (like
    ``docker version``). Never raises: ``--backend auto`` asks this on every ``up``."""
    try:
        connect_client(timeout_s).close()
    except MissingDependency as exc:
        return exc.message if "not installed" in exc.message else \
            f"no Docker engine answers at DOCKER_HOST={docker_host()}: {str(exc.__cause__ or exc)}"
    return None


def labelled_containers(labels: Mapping[str, str | None] | None = None, *, running_only: bool = True,
                        timeout_s: float = 5) -> tuple[list[Container], str | None]:
    """Containers carrying ``labels`` (default: any ``launcher.run``), with no engine being no error (like
    ``docker ps --filter label=launcher.run``). ``launcher gpus`` and GPU selection ask this.

    Returns:
        (containers, reason): with no reachable engine, an empty list and a sentence saying why.
    """
    try:
        engine = Engine(timeout_s=timeout_s)
    except LauncherError as exc:
        return [], exc.message
    try:
        found = engine.containers(labels or {RUN_LABEL: None})
    except LauncherError as exc:
        return [], exc.message
    finally:
        engine.close()
    return [c for c in found if c.status in ("running", "restarting", "paused")] if running_only else found, None


# Docker's isolation of an --internal bridge filters only forwarded traffic: the host owns the bridge's
# gateway address, so a container reached every service listening on the host's addresses (0.0.0.0) through
# it (issue 25, finding 4). With no IPv4 address on the bridge the host neither answers on the run's subnet
# nor has a route back to it; the members still reach each other, switched by the bridge. Docker 20.10
# honours it on an internal bridge (tests/docker/test_run_network.py). Port publishing needs the address,
# so only an internal bridge gets it.
INTERNAL_BRIDGE_OPTIONS: Mapping[str, str] = {"com.docker.network.bridge.inhibit_ipv4": "true"}


def remove_container(container_id: str, client: "DockerClient") -> bool:
    """Remove a container, killing it if it still runs (like ``docker rm -f``); False if already gone (for
    :class:`Engine` and the image builds, which hold a bare client)."""
    try:
        return bool(engine_call(f"remove container {container_id[:12]}", lambda: client.api.remove_container(
            container_id, force=True) or True, gone=False))
    except LauncherError as exc:
        if "already in progress" in exc.message:
            return True
        raise


class Engine:
    """A connected Docker engine (``docker.from_env()``), with the calls the backends need.

    Raises :class:`~launcher.errors.MissingDependency` on construction when no engine answers; every
    other engine error becomes a :class:`~launcher.errors.LauncherError` saying what was being done.
    """

    def __init__(self, timeout_s: float = API_TIMEOUT_S, docker_host_url: str | None = None) -> None:
        self.client = connect_client(timeout_s, docker_host_url)
        self._info: dict[str, Any] | None = None

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------------------------------ engine
    def info(self) -> dict[str, Any]:
        """``docker info``, asked once per Engine."""
        if self._info is None:
            self._info = dict(engine_call("read docker info", self.client.info))
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
    def create_network(self, name: str, labels: Mapping[str, str], *, internal: bool = True,
                       driver: str = "bridge", attachable: bool = False) -> str:
        """Create a network (like ``docker network create --internal``); returns its id.

        ``internal``: members reach each other by name but nothing outside; ``driver`` overlay with
        ``attachable`` makes a Swarm run's network. An internal bridge also gets no host address
        (:data:`INTERNAL_BRIDGE_OPTIONS`, like ``-o com.docker.network.bridge.inhibit_ipv4=true``).
        """
        options = dict(INTERNAL_BRIDGE_OPTIONS) if internal and driver == "bridge" else None
        net = engine_call(f"create network {name}", lambda: self.client.networks.create(
            name, driver=driver, options=options, internal=internal, attachable=attachable or None,
            labels=dict(labels), check_duplicate=True),
            hint=f"`launcher down` the run that owns it, or `docker network rm {name}`")
        return str(net.id)

    def networks(self, labels: Mapping[str, str | None], *,
                 driver: str | None = None) -> list[tuple[str, str, dict[str, str]]]:
        """(id, name, labels) of every network carrying ``labels`` (a None value: any value)."""
        flt: dict[str, Any] = {"label": label_filters(labels)}
        if driver:
            flt["driver"] = driver
        nets = engine_call("list networks", lambda: self.client.networks.list(filters=flt))
        return [(str(n.id), str(n.name), dict(n.attrs.get("Labels") or {})) for n in nets]

    def remove_network(self, name_or_id: str) -> bool:
        """Remove a network (like ``docker network rm``); False when it was already gone."""
        return bool(engine_call(
            f"remove network {name_or_id}", lambda: self.client.api.remove_network(name_or_id) or True, gone=False,
            hint="a container outside the run may still be attached; `docker network inspect` it"))

    def network_exists(self, name_or_id: str) -> bool:
        return bool(engine_call(f"inspect network {name_or_id}",
                                lambda: self.client.api.inspect_network(name_or_id) and True, gone=False))

    # --------------------------------------------------------------------------------------- containers
    def create(self, spec: ContainerSpec) -> str:
        """Create (not start) a container (like ``docker create``); returns its id."""
        return str(engine_call(f"create container {spec.name} from image {spec.image}",
                               lambda: self.client.containers.create(**spec.create_kwargs()).id,
                               hint="`launcher down --all` removes leftovers of earlier runs"))

    def start(self, container_id: str) -> None:
        """Start a created or exited container (like ``docker start``)."""
        engine_call(f"start container {container_id[:12]}", lambda: self.client.api.start(container_id))

    def inspect(self, container_id: str) -> Container | None:
        """The container's state now (like ``docker inspect``); None when it no longer exists."""
        attrs = engine_call(f"inspect container {container_id[:12]}",
                            lambda: self.client.api.inspect_container(container_id), gone=None)
        return None if attrs is None else Container.from_attrs(attrs)

    def inspect_raw(self, container_id: str) -> dict[str, Any]:
        """The full ``docker inspect`` document (tests and ``status --json`` read it)."""
        return dict(engine_call(f"inspect container {container_id[:12]}",
                                lambda: self.client.api.inspect_container(container_id)))

    def containers(self, labels: Mapping[str, str | None]) -> list[Container]:
        """Every container (running or not) carrying ``labels`` (like ``docker ps -a --filter label=..``)."""
        found = engine_call("list containers", lambda: self.client.api.containers(
            all=True, filters={"label": label_filters(labels)}))
        snaps = [s for s in (self.inspect(c["Id"]) for c in found) if s is not None]
        return sorted(snaps, key=lambda s: s.name)

    def stop(self, container_id: str, timeout_s: float) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s`` seconds (like ``docker stop -t``). Gone already: fine."""
        try:
            engine_call(f"stop container {container_id[:12]}",
                        lambda: self.client.api.stop(container_id, timeout=max(0, int(round(timeout_s)))), gone=None)
        except LauncherError as exc:
            log.warning("%s", exc)

    def kill(self, container_id: str, signal: str = "SIGKILL") -> None:
        """Send ``signal`` to the container's main process (like ``docker kill -s``)."""
        try:
            engine_call(f"kill container {container_id[:12]}",
                        lambda: self.client.api.kill(container_id, signal=signal), gone=None)
        except LauncherError as exc:
            log.debug("%s", exc)

    def remove(self, container_id: str) -> bool:
        """Remove a container, killing it if it still runs (like ``docker rm -f``); False if already gone."""
        return remove_container(container_id, self.client)

    def wait_stopped(self, container_id: str, timeout_s: float) -> bool:
        """Block until the container is not running (like ``docker wait --condition not-running``), for at most
        ``timeout_s`` seconds. True when it has stopped or is gone; False when the time ran out or the engine
        did not answer (the SDK's read timeout on a unix socket is a ``requests`` ConnectionError), so a caller
        that polls anyway loses nothing by it."""
        try:
            self.client.api.wait(container_id, timeout=timeout_s, condition="not-running")
        except Exception as exc:  # noqa: BLE001 - a timeout or an outage both mean "not seen to stop"
            return is_not_found(exc)
        return True

    def wait_removed(self, container_ids: list[str], timeout_s: float = 10.0) -> None:
        """Wait until none of ``container_ids`` exists (removal is asynchronous for a dying container)."""
        deadline = time.monotonic() + timeout_s
        pending = list(container_ids)
        while pending and time.monotonic() < deadline:
            pending = [c for c in pending if self.inspect(c) is not None]
            if pending:
                time.sleep(0.1)

    def run_once(self, image: str, entrypoint: list[str], *, user: str, labels: Mapping[str, str],
                 mounts: list[tuple[str, str, str, bool]]) -> bool:
        """Run a throw-away container to its end, with no network (like ``docker run --rm --network none``),
        hardened like a run's own containers: no capabilities, ``no-new-privileges``, a read-only root, and
        memory (1 GiB) and pids (256) limits.

        ``mounts``: (type, source, target, read_only). Returns whether it exited 0; a failure is logged.
        """
        from docker.types import Mount

        try:
            engine_call(f"run a helper container of {image}", lambda: self.client.containers.run(
                image, entrypoint=entrypoint, user=user, network_disabled=True, remove=True, labels=dict(labels),
                cap_drop=["ALL"], security_opt=["no-new-privileges"], read_only=True, mem_limit=2**30,
                memswap_limit=2**30, pids_limit=256, log_config=HELPER_LOG_CONFIG,
                mounts=[Mount(target, source, type=kind, read_only=ro) for kind, source, target, ro in mounts]))
        except LauncherError as exc:
            log.warning("%s", exc)
            return False
        return True

    def run_capture(self, image: str, command: list[str], *, user: str, labels: Mapping[str, str],
                    read_only_binds: Mapping[str, str] | None = None, environment: Mapping[str, str] | None = None,
                    timeout_s: float = 120.0, gpu_uuids: tuple[str, ...] = ()) -> tuple[int, str, str]:
        """Run ``command`` in a throw-away container of ``image`` to its end and return (exit status, stdout,
        stderr), like ``docker run --rm --network none --entrypoint CMD``; hardened like a run's containers (no
        capabilities, ``no-new-privileges``, read-only root with a ``/tmp`` tmpfs, 2 GiB, 256 pids). Its log is
        capped by the engine (:data:`HELPER_LOG_CONFIG`: the code it runs is the user's, and may print without
        end) and only its last :data:`HELPER_LOG_TAIL_LINES` lines of each stream are read. The container is
        removed whatever happens; past ``timeout_s`` it is killed (status 137). ``gpu_uuids``: GPUs handed to
        it as a run's containers get theirs (``--gpus '"device=UUID,..."'``).
        """
        from docker.types import DeviceRequest, Mount

        mounts = [Mount(target=dst, source=src, type="bind", read_only=True)
                  for src, dst in (read_only_binds or {}).items()]
        gpus: dict[str, Any] = {"device_requests": [DeviceRequest(
            driver="nvidia", device_ids=list(gpu_uuids), capabilities=[["gpu"]])]} if gpu_uuids else {}
        container = engine_call(f"create a helper container of {image}", lambda: self.client.containers.create(
            image, entrypoint=command[:1], command=command[1:], user=user, network_disabled=True,
            labels=dict(labels), environment=dict(environment or {}), cap_drop=["ALL"],
            security_opt=["no-new-privileges"], read_only=True, tmpfs={"/tmp": "rw,nosuid,nodev,size=256m"},
            mem_limit=2 * 2**30, memswap_limit=2 * 2**30, pids_limit=256, mounts=mounts,
            log_config=HELPER_LOG_CONFIG, **gpus),
            hint=f"is {image} on this engine? `docker image inspect {image}`")
        try:
            engine_call(f"start helper container {container.short_id}", container.start)
            try:
                status = container.wait(timeout=timeout_s)
                code = int(status.get("StatusCode", -1))
            except Exception:  # noqa: BLE001 - a read timeout: it ran too long
                engine_call(f"kill helper container {container.short_id}", container.kill, gone=None)
                code = 137
            # Its end only: the engine keeps at most HELPER_LOG_CONFIG's size, and what matters (the probe's
            # answer, the exception) is last.
            out = engine_call("read its output", lambda: container.logs(stdout=True, stderr=False,
                                                                        tail=HELPER_LOG_TAIL_LINES), gone=b"")
            err = engine_call("read its output", lambda: container.logs(stdout=False, stderr=True,
                                                                        tail=HELPER_LOG_TAIL_LINES), gone=b"")
        finally:
            self.remove(container.id)
        return code, bytes(out).decode(errors="replace"), bytes(err).decode(errors="replace")

    # --------------------------------------------------------------------------------------------- logs
    def logs(self, container_id: str, *, tail: int | None = None) -> bytes:
        """Everything the container wrote to stdout/stderr, across its restarts (like ``docker logs``)."""
        return bytes(engine_call(f"read the logs of container {container_id[:12]}", lambda: self.client.api.logs(
            container_id, stdout=True, stderr=True, tail="all" if tail is None else tail), gone=b""))

    def follow_logs(self, container_id: str, *, tail: int | None = None) -> Iterator[bytes]:
        """Chunks of output as the container writes them, until it stops (like ``docker logs -f``)."""
        stream = engine_call(f"follow the logs of container {container_id[:12]}", lambda: self.client.api.logs(
            container_id, stdout=True, stderr=True, stream=True, follow=True, tail="all" if tail is None else tail),
            gone=iter(()))
        try:
            yield from stream
        except Exception as exc:  # noqa: BLE001 - the engine closed the stream: the container is gone
            log.debug("log stream of %s ended: %s", container_id[:12], exc)
