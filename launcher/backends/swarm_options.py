"""The Swarm backend's own ``launcher up`` options (read by :mod:`launcher.backends.swarm`): where the master and
the worker groups run, and the container image options it shares with the Docker backend. Light (see
:mod:`launcher.backends.docker_options`)."""

from __future__ import annotations

from launcher.backends.docker_options import IMAGE, WITH
from launcher.option import Option
from worker.contract import SWARM_MASTER

SWARM_GROUPS = ("spread", "any")  # --swarm-groups (launcher.backends.swarm_specs.group_placement)

OPTIONS: tuple[Option, ...] = (
    IMAGE,
    WITH,
    Option("swarm-master", "swarm_master", "choice", "swarm backend: the master's node; auto: a node labelled "
           "launcher.storage=true if any, else this one (docs/scaling-out.md)", choices=SWARM_MASTER),
    Option("swarm-groups", "swarm_groups", "choice", "swarm backend: where worker groups run; spread: off the "
           "master's node when other ready nodes can hold them; any: wherever the scheduler likes",
           choices=SWARM_GROUPS),
)
