"""A Docker run after its start: found again by its ``launcher.run`` label (:class:`DockerRun`: its containers
as parts, their logs, a ``down``), and :func:`teardown`, the one way its containers and network go away.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

from launcher.backends.base import DownReport, Part, PartState, part_order
from launcher.backends.containers import (EngineRun, LogCopy, logs_dir_for, remove_secret_file, run_dir_from_labels,
                                          save_logs)
from launcher.engine.client import Container, Engine
from launcher.engine.labels import ROLE_LABEL, RUN_LABEL, USER_LABEL, part_name
from launcher.errors import LauncherError
from launcher.runs import RunDir


def container_state(c: Container | None) -> PartState:
    """A container's Docker status as a :class:`PartState`. Pure.

    ``restarting`` is the engine's ``on-failure`` policy at work; a container that exited non-zero and stays
    exited is FAILED (the policy gave up, or ignores a ``docker kill``): the supervisor decides. One that
    vanished (removed behind our back) is LOST: nothing will bring it back.
    """
    if c is None:
        return PartState.LOST
    if c.status == "created":
        return PartState.STARTING
    if c.status in ("running", "paused"):
        return PartState.RUNNING
    if c.status == "restarting":
        return PartState.RESTARTING
    return PartState.EXITED if c.exit_code == 0 else PartState.FAILED


def container_part(name: str, c: Container | None, extra_restarts: int = 0) -> Part:
    """The :class:`Part` a container is; ``extra_restarts``: starts the engine's policy did not count."""
    if c is None:
        return Part(name, PartState.LOST, restarts=extra_restarts, status="gone")
    return Part(name, container_state(c), c.exit_code, c.restart_count + extra_restarts, c.short_id, c.status,
                c.health)


class DockerRun(EngineRun):
    """A Docker run found again by its ``launcher.run`` label (``engine``: a connected engine to use; default:
    one is connected on first need, and its absence is :attr:`unreachable`)."""

    backend = "docker"

    def containers(self) -> list[Container]:
        return self.engine.containers({RUN_LABEL: self.run_id}) if self.engine is not None else []

    def exists(self) -> bool:
        """Whether the engine has any container or network of this run."""
        eng = self.engine
        return eng is not None and bool(eng.containers({RUN_LABEL: self.run_id}) or eng.networks({RUN_LABEL: self.run_id}))

    def results_from_labels(self) -> RunDir | None:
        return run_dir_from_labels(self.run_id, [c.labels for c in self.containers()])

    def parts(self) -> list[Part]:
        return sorted((container_part(part_name(c.labels), c) for c in self.containers()), key=part_order)

    def _container_of(self, part: str) -> Container | None:
        return next((c for c in self.containers() if part_name(c.labels) == part), None)

    def logs(self, part: str) -> bytes | None:
        c = self._container_of(part) if self.engine is not None else None
        return None if c is None or self.engine is None else self.engine.logs(c.id)

    def follow(self, part: str, *, poll_s: float) -> Iterator[bytes] | None:
        c = self._container_of(part) if self.engine is not None else None
        if c is None or self.engine is None:
            return None
        return _follow_container(self.engine, c.id, poll_s)

    def down(self, report: DownReport, *, grace_s: float) -> None:
        if self.engine is None:
            raise LauncherError(f"cannot reach the Docker engine to stop run {self.run_id}: {self.unreachable}",
                                hint="start the engine (or fix DOCKER_HOST) and run `launcher down` again")
        report.networks = len(self.engine.networks({RUN_LABEL: self.run_id}))
        report.containers = [c.name for c in teardown(self.engine, self.run_id, grace_s=grace_s, run_dir=self.run_dir)]


def _follow_container(engine: Engine, cid: str, poll_s: float) -> Iterator[bytes]:
    yield from engine.follow_logs(cid)
    # A restarting group's stream ends at its exit; pick it up again while it lives on.
    while (c := engine.inspect(cid)) is not None and c.status in ("restarting", "running"):
        time.sleep(poll_s)
        yield from engine.follow_logs(cid, tail=0)


def teardown(engine: Engine, run_id: str | None, *, grace_s: float = 8.0, run_dir: RunDir | None = None,
             user: str | None = None, restarted: Mapping[str, int] | None = None) -> list[Container]:
    """Stop and remove every container and network of ``run_id`` (None: of every run), found by label.

    The master gets SIGTERM first and ``grace_s`` seconds to checkpoint and tell its groups to stop (like
    ``docker stop -t``); then the groups; each container's output is appended to the run's ``logs/``
    (``run_dir``'s, or the ``launcher.results`` label's directory) before it is removed. Results stay.
    Idempotent. ``user``: only runs labelled with this uid. ``restarted``: container name -> the times the
    supervisor started it again (``docker start``, which the engine's restart count leaves out), for the logs'
    headers. Returns the containers it found.
    """
    flt: dict[str, str | None] = {RUN_LABEL: run_id}
    if user is not None:
        flt[USER_LABEL] = user
    found = engine.containers(flt)
    masters = [c for c in found if c.labels.get(ROLE_LABEL) == "master"]
    others = [c for c in found if c not in masters]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda c: engine.stop(c.id, max(1.0, grace_s - 2.0)), masters))
        list(pool.map(lambda c: engine.stop(c.id, 2.0), others))
    final = [engine.inspect(c.id) or c for c in found]
    by_run: dict[str, list[Container]] = {}
    for c in final:
        by_run.setdefault(c.labels.get(RUN_LABEL, "?"), []).append(c)
    for rid, group in by_run.items():
        target = logs_dir_for(run_dir if rid == run_id else None, group[0].labels)
        if target is not None:
            extra = dict(restarted or {})
            save_logs([LogCopy(c.labels, f"output of container {c.name} ({c.short_id}), "
                                         f"{c.restart_count + extra.get(c.name, 0)} restart(s), "
                                         f"ended {c.status} exit {c.exit_code}", engine.logs(c.id)) for c in group],
                      target)
    for c in final:
        engine.remove(c.id)
    engine.wait_removed([c.id for c in final])
    for nid, _, _ in engine.networks(flt):
        engine.remove_network(nid)
    for rid in {*by_run, *([run_id] if run_id else [])}:
        users = {c.labels.get(USER_LABEL, "") for c in by_run.get(rid, [])}
        remove_secret_file(rid, (0, *(int(u) for u in users if u.isdigit())))
    return final
