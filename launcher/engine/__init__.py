"""The engine layer: the only modules that import the Docker SDK.

* :mod:`~launcher.engine.labels`: the ``launcher.*`` labels, defined once;
* :mod:`~launcher.engine.errors`: SDK and transport errors become ``LauncherError`` types in one function;
* :mod:`~launcher.engine.client`: containers, networks and logs (:class:`Engine`);
* :mod:`~launcher.engine.container_types`: a container's typed spec (:class:`ContainerSpec`) and snapshot
  (:class:`Container`);
* :mod:`~launcher.engine.swarm`: nodes, services, tasks, secrets and volumes (:class:`SwarmEngine`);
* :mod:`~launcher.engine.images`: image existence, builds, pushes and the registry probe.

Nothing here knows about runs or plans: backends (:mod:`launcher.backends`) build the typed specs and read
the typed snapshots (docker-py's own layering: raw calls below, typed values above).
"""

from launcher.engine.client import Engine, connect_client, engine_unavailable_reason, labelled_containers
from launcher.engine.container_types import Container, ContainerSpec
from launcher.engine.errors import docker_host, engine_call, engine_error

__all__ = ["Container", "ContainerSpec", "Engine", "connect_client", "docker_host", "engine_call", "engine_error",
           "engine_unavailable_reason", "labelled_containers"]
