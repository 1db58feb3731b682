"""After a Swarm run's services are removed: wait until no task container of the run is left on a node.

Why (issue 24): removing a service returns at once. Each node then stops its task's container and reports
it stopped, the swarm forgets the task, and only then does the node remove the container (on the test bed
0.1-0.4 s after the task left the manager's list). ``launcher up`` or ``down`` saying "done" while a node
still held a container of the run was wrong for anyone reading it as finished (and made the multi-node test
flaky).

Two views, asked until neither shows anything of the run or the bound (:data:`GONE_TIMEOUT_S`) passes:

* the swarm's tasks (:meth:`SwarmEngine.run_tasks`): on every node, but only until the node reported the
  container stopped;
* the engines themselves, the only view that sees the container go: this manager's (the connected one) and
  that of each node labelled ``launcher.engine=URL`` (:data:`~launcher.engine.swarm.ENGINE_LABEL`: where this
  machine reaches the node's engine; docs/scaling-out.md).

The lost-node rule, as in ``launcher status``: a node the swarm marks down is not waited for, nor is a
labelled node whose engine does not answer; both are named. An unlabelled node is waited for through the
swarm's tasks alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from launcher.engine.client import Engine
from launcher.engine.swarm import ENGINE_LABEL, NodeInfo, SwarmEngine
from launcher.errors import LauncherError

log = logging.getLogger(__name__)

GONE_TIMEOUT_S = 30.0  # a task's stop grace (8 s) and the removal, with room for a loaded node
NODE_ENGINE_TIMEOUT_S = 5.0  # a labelled node's engine must answer within this, or it is not waited for
POLL_S = 0.3
TASK_LABEL = "com.docker.swarm.task.id"  # the engine's label on every swarm task container (none on a Docker run's)


@dataclass
class Leftovers:
    """What :func:`wait_gone` found when it returned: ``held``, node hostname -> the run's task containers (or
    tasks) it still had, empty when all are gone; ``unasked``, node hostname -> why it was not waited for."""

    held: dict[str, list[str]] = field(default_factory=dict)
    unasked: dict[str, str] = field(default_factory=dict)
    waited_s: float = 0.0

    def warnings(self, what: str, run_filter: str) -> list[str]:
        """One sentence per node that still holds something or was not waited for; none when all is gone.
        ``run_filter``: the ``docker ps --filter`` that shows the run's containers on a node."""
        lines = [f"{what}: node {node} still holds {', '.join(sorted(items))} {self.waited_s:.0f} s after the "
                 f"services were removed (on that node: `docker ps -a --filter {run_filter}`)"
                 for node, items in sorted(self.held.items())]
        return lines + [f"{what}: node {node} not waited for: {why}" for node, why in sorted(self.unasked.items())]


class _Engines:
    """The engines to ask: the connected manager's, and each labelled node's, connected once; a node whose
    engine does not answer goes into ``unasked`` and is not asked again."""

    def __init__(self, swarm: SwarmEngine, unasked: dict[str, str]) -> None:
        self.swarm, self.unasked = swarm, unasked
        self.here = swarm.local_node()
        self._open: dict[str, Engine] = {}

    def of(self, node: NodeInfo) -> Engine | None:
        if node.id == self.here:
            return self.swarm.engine
        url = node.labels.get(ENGINE_LABEL)
        if not url or node.hostname in self.unasked:
            return None
        if node.id not in self._open:
            try:
                self._open[node.id] = Engine(NODE_ENGINE_TIMEOUT_S, docker_host_url=url)
            except LauncherError as exc:
                self.unasked[node.hostname] = f"its engine at {url} (label {ENGINE_LABEL}) does not answer: " \
                                              f"{exc.__cause__ or exc}"
                return None
        return self._open[node.id]

    def close(self) -> None:
        for engine in self._open.values():
            engine.close()


def _held(swarm: SwarmEngine, engines: _Engines, flt: Mapping[str, str | None],
          unasked: dict[str, str]) -> dict[str, list[str]]:
    """Node hostname -> what of the runs matching ``flt`` it holds now, by either view."""
    nodes = {n.id: n for n in swarm.nodes()}
    held: dict[str, list[str]] = {}
    for t in swarm.run_tasks(flt):
        node = nodes.get(t.node_id)
        if node is None:  # never assigned: no container anywhere
            continue
        if node.state == "down":
            when = f" at {node.updated_at}Z" if node.updated_at else ""
            unasked.setdefault(node.hostname, f"lost{when} (down); the swarm removes the run's containers "
                                              "there when it comes back")
        if node.hostname not in unasked:
            what = f"container {t.container_id[:12]} (task {t.state})" if t.container_id else f"task {t.id[:12]}"
            held.setdefault(node.hostname, []).append(what)
    for node in nodes.values():
        engine = None if node.state == "down" else engines.of(node)
        if engine is None:
            continue
        try:
            names = [c.name for c in engine.containers({**flt, TASK_LABEL: None})]
        except LauncherError as exc:
            unasked[node.hostname] = f"its engine stopped answering: {exc}"
            held.pop(node.hostname, None)
            continue
        if names:
            shown = held.setdefault(node.hostname, [])
            shown[:] = [s for s in shown if not s.startswith("container ")] + names  # by name where we can
    return held


def wait_gone(swarm: SwarmEngine, flt: Mapping[str, str | None], *, timeout_s: float = GONE_TIMEOUT_S,
              poll_s: float = POLL_S) -> Leftovers:
    """Wait until no node the launcher can ask holds a task container of the runs matching ``flt`` (labels,
    as for :meth:`SwarmEngine.services`), for at most ``timeout_s`` seconds. Never raises for a node: one that
    does not answer is named in the result (see the module docstring)."""
    started = time.monotonic()
    unasked: dict[str, str] = {}
    engines = _Engines(swarm, unasked)
    try:
        while True:
            held = _held(swarm, engines, flt, unasked)
            waited = time.monotonic() - started
            if not held or waited >= timeout_s:
                return Leftovers(held, unasked, waited)
            time.sleep(poll_s)
    finally:
        engines.close()
