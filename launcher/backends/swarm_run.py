"""A Swarm run after its start: found again by label (:class:`SwarmRun`: its services as parts, their logs, a
``down``), and :func:`teardown`, the one way its services, secret, network and volume go away.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any, Callable

from launcher import safefs
from launcher.backends.base import DownReport, Part, part_order
from launcher.backends.containers import (UNPRIVILEGED_UID_GID, EngineRun, LogCopy, labelled_results, logs_dir_for,
                                          run_dir_from_labels, save_logs)
from launcher.backends.swarm_gone import wait_gone
from launcher.backends.swarm_specs import service_state
from launcher.engine.client import Engine
from launcher.engine.labels import ROLE_LABEL, RUN_LABEL, USER_LABEL, part_name
from launcher.engine.swarm import (ENDED, LOGS_DEADLINE_S, PRE_RUNNING, RESTART_DELAY_S, STOP_GRACE_S, NodeInfo, SwarmEngine, TaskInfo,
                                   latest, parse_timestamp)
from launcher.errors import LauncherError
from launcher.runs import RunDir
from worker.contract import LOGS_DIR

log = logging.getLogger(__name__)
LOST_LOGS_DEADLINE_S = 3.0  # a service with a task on a down node: its stream from there will not end
# A service's state in ``launcher status``, in the Docker backend's words.
_WORDS = {"starting": "created", "running": "running", "restarting": "restarting", "exited": "exited",
          "failed": "exited", "lost": "exited"}


class SwarmRun(EngineRun):
    """A Swarm run found again by its ``launcher.run`` label, on this engine if it is a swarm manager
    (``engine``: a connected engine to use; default: one is connected on first need)."""

    backend = "swarm"

    @property
    def swarm(self) -> SwarmEngine | None:
        """The swarm manager to ask; None when no engine answers (see :attr:`unreachable`) or it is no manager."""
        if self.engine is None:
            return None
        swarm = SwarmEngine(self.engine)
        return None if swarm.manager_problem() else swarm

    def _services(self) -> list[dict[str, Any]]:
        swarm = self.swarm
        return swarm.services({RUN_LABEL: self.run_id}) if swarm is not None else []

    def exists(self) -> bool:
        """Whether the swarm has any service of this run."""
        return bool(self._services())

    def results_from_labels(self) -> RunDir | None:
        return run_dir_from_labels(self.run_id, [s["Spec"].get("Labels") or {} for s in self._services()])

    def parts(self) -> list[Part]:
        """Each service of the run and its newest task, across nodes; empty off a swarm manager."""
        swarm = self.swarm
        if swarm is None:
            return []
        services = self._services()
        tasks = swarm.tasks([s["ID"] for s in services])
        nodes = {n.id: n for n in swarm.nodes()}
        parts = []
        for s in services:
            svc_labels = s["Spec"].get("Labels") or {}
            ts = tasks.get(s["ID"], [])
            policy = s["Spec"]["TaskTemplate"].get("RestartPolicy") or {}
            attempts = None if svc_labels.get(ROLE_LABEL) == "master" or policy.get("Condition") == "none" \
                else int(policy.get("MaxAttempts", 0))
            restarts = max(0, len(ts) - 1)
            state, code = service_state(ts, attempts, restarts)
            t = latest(ts)
            word = "rejected" if t is not None and t.state == "rejected" else _WORDS[state.value]
            node = nodes.get(t.node_id) if t else None
            parts.append(Part(part_name(svc_labels), state, code, restarts, t.container_id[:12] if t else "", word,
                              node=(node.hostname if node else t.node_id[:12]) if t else "",
                              lost=lost_node(ts, nodes)))
        return sorted(parts, key=part_order)

    def _service_of(self, part: str) -> str | None:
        return next((str(s["Spec"]["Name"]) for s in self._services()
                     if part_name(s["Spec"].get("Labels") or {}) == part), None)

    def logs(self, part: str) -> bytes | None:
        """What ``part`` printed, every task of it (like ``docker service logs``)."""
        name = self._service_of(part)
        return None if name is None or self.swarm is None else self.swarm.service_logs(name)

    def follow(self, part: str, *, poll_s: float) -> Iterator[bytes] | None:
        name = self._service_of(part)
        if name is None or self.swarm is None:
            return None
        run_dir = self.run_dir

        def saved() -> bytes | None:  # what teardown appended to the run's logs/ before removing the service
            if run_dir is None:
                return None
            try:
                return safefs.read_tail(run_dir.path, f"{LOGS_DIR}/{part}.log")
            except OSError:  # missing, or not a regular file of ours (safefs.UnsafeFile)
                return None

        return _follow_service(self.swarm, self.run_id, name, max(poll_s, 1.0), saved=saved)

    def down(self, report: DownReport, *, grace_s: float) -> None:
        """Services first (the swarm would replace a task container removed under it), then whatever
        containers and networks of the run are left, as for a Docker run."""
        from launcher.backends.docker_run import DockerRun

        if self.engine is None:
            raise LauncherError(f"cannot reach the Docker engine to stop run {self.run_id}: {self.unreachable}",
                                hint="start the engine (or fix DOCKER_HOST) and run `launcher down` again")
        nets = len(self.engine.networks({RUN_LABEL: self.run_id}))
        removed = teardown(self.engine, self.run_id, grace_s=grace_s, run_dir=self.run_dir)
        report.services, report.secrets = removed.services, removed.secrets
        DockerRun(self.run_id, self.run_dir, self.record, engine=self.engine).down(report, grace_s=grace_s)
        report.networks = nets


def lost_node(tasks: list[TaskInfo], nodes: Mapping[str, NodeInfo]) -> str:
    """``node X lost at T`` for the newest of ``tasks`` that ran on a node now down; ``""`` if none did. Pure."""
    for t in sorted(tasks, key=lambda t: t.created, reverse=True):
        n = nodes.get(t.node_id)
        if n is not None and n.state == "down":
            return f"node {n.hostname} lost at {n.updated_at}Z" if n.updated_at else f"node {n.hostname} lost"
    return ""


def _follow_service(swarm: SwarmEngine, run_id: str, name: str, poll_s: float, *,
                    saved: Callable[[], bytes | None] = lambda: None) -> Iterator[bytes]:
    """A service's output as it is written, until it has no live task (like ``docker service logs -f``, which
    never ends by itself). Lines are read by timestamp, so none is printed twice. When the service is removed
    between two polls (``launcher down`` seconds after the last lines), the rest comes from ``saved()``: the
    run's log file, which teardown writes before it removes the service."""
    since: str | None = None
    seen: set[bytes] = set()
    ended_at: float | None = None
    last: bytes | None = None  # the last line printed, to find where the saved copy goes on
    while True:
        fresh = []
        for line in swarm.service_logs(name, since=since, timestamps=True).splitlines(keepends=True):
            stamp, _, text = line.partition(b" ")
            if line in seen:
                continue
            seen.add(line)
            fresh.append(text)
            since = _since(stamp.decode(errors="replace")) or since
        if fresh:
            last = fresh[-1]
            yield b"".join(fresh)
        if len(seen) > 10_000:
            seen = set(sorted(seen)[-2_000:])
        sid = next((s["ID"] for s in swarm.services({RUN_LABEL: run_id}) if s["Spec"]["Name"] == name), None)
        t = latest(swarm.tasks([sid])[sid]) if sid else None
        if t is None:  # the service is gone: what it printed after our last read is in the saved copy
            rest = _after_last(saved() or b"", last)
            if rest:
                yield rest
            return
        if t.state in ENDED:  # over, unless the swarm starts another task after its restart delay
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > 3 * RESTART_DELAY_S + poll_s:
                return
        else:
            ended_at = None
        time.sleep(poll_s)


def _after_last(saved: bytes, last: bytes | None) -> bytes:
    """The lines of ``saved`` after the last occurrence of the line ``last`` (all of it when nothing was printed
    yet; nothing when ``last`` is not there, rather than print twice). Pure."""
    if last is None:
        return saved
    lines = saved.splitlines(keepends=True)
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].rstrip(b"\n") == last.rstrip(b"\n"):
            return b"".join(lines[i + 1:])
    return b""


def _since(stamp: str) -> str | None:
    secs, nanos = parse_timestamp(stamp)
    return f"{secs}.{nanos:09d}" if secs else None


def _log_copies(swarm: SwarmEngine, services: list[dict[str, Any]], tasks: dict[str, list[TaskInfo]],
                early: Mapping[str, bytes]) -> list[LogCopy]:
    """Each service's whole output (every task still in the swarm's history; ``early``: read before a service
    was scaled down, as its tasks and their output are gone then)."""
    copies = []
    down = {n.id for n in swarm.nodes() if n.state == "down"}
    for s in services:
        ts = tasks.get(s["ID"], [])
        t = latest(ts)
        deadline = LOST_LOGS_DEADLINE_S if any(x.node_id in down for x in ts) else LOGS_DEADLINE_S
        copies.append(LogCopy(s["Spec"].get("Labels") or {},
                              f"output of service {s['Spec']['Name']}, {len(ts)} task(s), {max(0, len(ts) - 1)} "
                              f"restart(s), last {t.state if t else 'none'} exit {t.exit_code if t else None}",
                              early.get(s["ID"]) or swarm.service_logs(s["ID"], deadline_s=deadline)))
    return copies


def _wait(pred: Callable[[], bool], timeout_s: float, interval: float = 0.3) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def _volume_of(service: Mapping[str, Any]) -> str | None:
    mounts = service["Spec"]["TaskTemplate"]["ContainerSpec"].get("Mounts") or []
    return next((str(m["Source"]) for m in mounts if m.get("Type") == "volume"), None)


def _remove_secrets_and_networks(swarm: SwarmEngine, flt: dict[str, str | None], down: DownReport) -> None:
    """Remove the run's secrets and overlay networks (after its services), counting them in ``down``."""
    for sec_id, _ in swarm.secrets(flt):
        swarm.remove_secret(sec_id)
        down.secrets += 1
    for nid, _ in swarm.overlay_networks(flt):
        swarm.remove_network(nid)
        down.networks += 1


def teardown(engine: Engine, run_id: str | None, *, grace_s: float = STOP_GRACE_S, run_dir: RunDir | None = None,
             user: str | None = None, image: str | None = None) -> DownReport:
    """Stop and remove every service, secret and overlay network of ``run_id`` (None: of every run), found
    by label; results stay. Off a swarm manager it does nothing.

    Order, as on Docker: the master first, with ``grace_s`` to checkpoint and tell its groups to stop (on
    this node ``docker stop -t``; on another node the service is scaled to 0 and the task gets the service's
    stop grace period); groups then end by themselves (exit 0: not restarted); each service's output is
    appended to the run's ``logs/`` (``run_dir``'s or the ``launcher.results`` label's); a results volume on
    this node is copied into the results directory and then removed (one on another node is kept); then
    the services are removed and, bounded, waited for until no node holds a task container of the run
    (:func:`launcher.backends.swarm_gone.wait_gone`: a node still holding one after the bound, or not
    waited for, is named in a warning); then the secret and network. Idempotent.
    """
    swarm = SwarmEngine(engine)
    down = DownReport(run_id or "")
    if swarm.manager_problem():
        return down
    flt: dict[str, str | None] = {RUN_LABEL: run_id}
    if user is not None:
        flt[USER_LABEL] = user
    services = swarm.services(flt)
    if not services:  # a Docker run's containers and bridge network are not the swarm's to remove
        _remove_secrets_and_networks(swarm, flt, down)
        return down
    ids = [s["ID"] for s in services]
    here = swarm.local_node()
    early: dict[str, bytes] = {}
    for s in services:
        if (s["Spec"].get("Labels") or {}).get(ROLE_LABEL) != "master":
            continue
        for t in swarm.tasks([s["ID"]])[s["ID"]]:
            if t.state not in ("running", *PRE_RUNNING):
                continue
            if t.node_id == here and t.container_id:
                engine.stop(t.container_id, max(1.0, grace_s - 2.0))
            else:  # another node: only the swarm can stop it, and the task's output goes with it
                early[s["ID"]] = swarm.service_logs(s["ID"])
                swarm.scale_to_zero(s["ID"])

    def live() -> bool:
        return any(t.state in ("running", *PRE_RUNNING) for ts in swarm.tasks(ids).values() for t in ts)

    _wait(lambda: not live(), min(5.0, max(1.0, grace_s)))  # the groups got STOP from the master
    tasks = swarm.tasks(ids)
    by_run: dict[str, list[dict[str, Any]]] = {}
    for s in services:
        by_run.setdefault((s["Spec"].get("Labels") or {}).get(RUN_LABEL, "?"), []).append(s)
    copied: list[str] = []
    for rid, group in by_run.items():
        svc_labels = group[0]["Spec"].get("Labels") or {}
        # Only a directory the labelled user owns (a root `down --all` must not copy where any label points).
        results = run_dir.path if (run_dir is not None and rid == run_id) else labelled_results(svc_labels)
        target = logs_dir_for(run_dir if rid == run_id else None, svc_labels)
        if target is not None:
            save_logs(_log_copies(swarm, group, tasks, early), target)
        vol = next((v for v in map(_volume_of, group) if v), None)
        if vol and results is not None and results.is_dir():
            img = image or str(group[0]["Spec"]["TaskTemplate"]["ContainerSpec"]["Image"]).split("@")[0]
            owner = svc_labels.get(USER_LABEL) or str(os.getuid())
            if not owner.isdigit() or owner == "0":  # the helper never runs as root
                owner = str(UNPRIVILEGED_UID_GID[0])
            if swarm.copy_volume(vol, results, img, f"{owner}:{owner}", rid):
                copied.append(vol)
            else:
                log.warning("results of run %s stay in volume %s on the master's node", rid, vol)
    for s in services:
        swarm.remove_service(s["ID"])
        down.services.append(str(s["Spec"]["Name"]))
    # The nodes remove the task containers after this returns: done only when none is left (swarm_gone).
    for line in wait_gone(swarm, flt).warnings(f"run {run_id}" if run_id else "down --all",
                                               "label=" + "=".join(p for p in (RUN_LABEL, run_id) if p)):
        log.warning("%s", line)
    _remove_secrets_and_networks(swarm, flt, down)
    for vol in copied:
        swarm.remove_volume(vol)
    return down
