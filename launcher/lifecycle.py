"""Runs after ``up``: what is running (``status``), what it printed (``logs``), and stopping it (``down``).

A run is found from two places that outlive any launcher process: its results directory (``run.json``
names the backend, the launcher's pid and, for the process backend, its children's pids) and, for the
Docker backend, the engine itself (every container and network carries ``launcher.run`` and friends).
``down`` therefore works after the launcher was killed, and on a run whose results root nobody remembers.

Library functions only; :mod:`launcher.cli.status`, ``logs`` and ``down`` print what these return.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher import docker_client as dc
from launcher.errors import BadInput, LauncherError
from launcher.runs import RunDir, find_run, list_runs, owner_uid_gid
from worker.results import read_json

log = logging.getLogger(__name__)

LIVE_STATES = ("preparing", "starting", "running", "stopping")


# ------------------------------------------------------------------------------------------- processes
def _proc_cmdline(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def pid_is_ours(pid: int, must_contain: str) -> bool:
    """Whether ``pid`` is alive, belongs to this user (any user for root), is not a zombie, and its command
    line contains ``must_contain`` (a guard against a recycled pid)."""
    if pid <= 0:
        return False
    cmd = _proc_cmdline(pid)
    if not cmd or must_contain not in cmd:
        return False
    try:
        st = os.stat(f"/proc/{pid}")
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    if state == "Z":
        return False
    return os.geteuid() == 0 or st.st_uid == os.geteuid()


def _wait_gone(pids: list[tuple[int, str]], timeout_s: float) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if pid_is_ours(*p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if pid_is_ours(*p)]
    return alive


def _signal(pid: int, sig: int, *, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ----------------------------------------------------------------------------------------------- views
@dataclass
class PartView:
    """One process or container of a run."""

    name: str  # master, group-0, ...
    state: str  # Docker's status (running, restarting, exited, ...) or alive/gone for a process
    ident: str = ""  # container id (12) or pid
    restarts: int = 0
    exit_code: int | None = None
    health: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state, "id": self.ident, "restarts": self.restarts,
                "exit_code": self.exit_code, "health": self.health}


@dataclass
class RunView:
    """A run as ``launcher status`` shows it."""

    run_id: str
    path: Path | None
    backend: str
    state: str  # the record's state, or ``stale`` when it says live and nothing runs
    parts: list[PartView] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)  # the master's status.json
    summary: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    @property
    def live(self) -> bool:
        return any(p.state in ("running", "restarting", "created", "alive") for p in self.parts)

    def to_dict(self) -> dict[str, Any]:
        s = self.status
        groups = s.get("groups") or {}
        return {
            "schema": "launcher.run-status/v1", "run_id": self.run_id, "results": str(self.path or ""),
            "backend": self.backend, "state": self.state, "live": self.live, "note": self.note,
            "parts": [p.to_dict() for p in self.parts],
            "env_steps": s.get("env_steps", self.summary.get("env_steps")),
            "env_steps_per_s": s.get("env_steps_per_s"), "updates": s.get("updates", self.summary.get("updates")),
            "mean_return": s.get("mean_return", self.summary.get("mean_return")),
            "episodes_in_window": s.get("episodes_in_window"),
            "groups_connected": sum(1 for g in groups.values() if g.get("connected")), "groups": len(groups),
            "workers_connected": sum(g.get("workers", 0) for g in groups.values() if g.get("connected")),
            "outcome": self.summary.get("outcome"),
        }


def _docker_engine() -> tuple[dc.Engine | None, str]:
    reason = dc.engine_unavailable_reason()
    if reason is not None:
        return None, reason
    try:
        return dc.Engine(), ""
    except LauncherError as exc:
        return None, exc.message


def _container_parts(snaps: list[dc.ContainerSnapshot]) -> list[PartView]:
    parts = []
    for s in snaps:
        role = s.labels.get(dc.ROLE_LABEL, "?")
        name = "master" if role == "master" else f"group-{s.labels.get(dc.GROUP_LABEL, '?')}"
        parts.append(PartView(name, s.status, s.short_id, s.restart_count, s.exit_code, s.health))
    return sorted(parts, key=lambda p: (p.name != "master", len(p.name), p.name))


def _swarm_parts(engine: dc.Engine, run_id: str) -> list[PartView]:
    """A swarm run's services, each as its newest task (on whichever node it runs)."""
    from launcher.backends.swarm import service_parts

    return [PartView(p.name, p.state, p.ident, p.restarts, p.exit_code) for p in service_parts(engine, run_id)]


def _process_parts(run_dir: RunDir, record: dict[str, Any]) -> list[PartView]:
    parts = []
    for name, pid in sorted((record.get("pids") or {}).items(), key=lambda kv: (kv[0] != "master", kv[0])):
        alive = pid_is_ours(int(pid), run_dir.run_id)
        parts.append(PartView(name, "alive" if alive else "gone", str(pid)))
    return parts


def view_run(run_dir: RunDir | None, *, engine: dc.Engine | None = None, engine_reason: str = "",
             run_id: str | None = None) -> RunView:
    """What run ``run_dir`` (or, with no directory, the containers labelled ``run_id``) is doing now."""
    rid = run_dir.run_id if run_dir else str(run_id)
    record = run_dir.read_record() if run_dir else {}
    backend = str(record.get("backend", "docker" if run_dir is None else "?"))
    view = RunView(rid, run_dir.path if run_dir else None, backend, str(record.get("state", "unknown")))
    if run_dir is not None:
        view.status = read_json(run_dir.files.status) or {}
        view.summary = read_json(run_dir.files.summary) or {}
    if backend in ("docker", "swarm"):
        if engine is None:
            view.note = f"cannot ask the Docker engine: {engine_reason}"
            return view
        view.parts = (_container_parts(engine.containers({dc.RUN_LABEL: rid})) if backend == "docker"
                      else _swarm_parts(engine, rid))
    elif backend == "process":
        view.parts = _process_parts(run_dir, record) if run_dir else []
    master = next((p for p in view.parts if p.name == "master"), None)
    if view.state in LIVE_STATES and master is not None and master.state in ("exited", "dead") and master.exit_code:
        # Groups may still be retrying (and restarting) while nobody serves them.
        view.state = "failed"
        view.note = (f"the master exited with code {master.exit_code}; `launcher down {rid}` then "
                     f"`launcher up --resume {rid}` continues from the last checkpoint")
    elif view.state in LIVE_STATES and not view.live:
        if record.get("detached") and view.parts:
            view.state = "ended"  # a detached run's containers exit when it is done; `down` removes them
        else:
            view.note = f"run.json says {view.state!r} but nothing of it is running (the launcher was killed?)"
            view.state = "stale"
    return view


def view_runs(root: Path, *, run: str | None = None) -> list[RunView]:
    """``run`` (an id or directory), or every run under ``root`` plus any Docker run whose containers
    exist with its results elsewhere."""
    engine, reason = _docker_engine()
    try:
        if run is not None:
            try:
                rd: RunDir | None = find_run(root, run)
            except BadInput:
                if engine is None or not engine.containers({dc.RUN_LABEL: run}):
                    raise
                rd = None
            return [view_run(rd, engine=engine, engine_reason=reason, run_id=run)]
        views = [view_run(rd, engine=engine, engine_reason=reason) for rd in list_runs(root)]
        if engine is not None:
            known = {v.run_id for v in views}
            for rid in sorted({s.labels.get(dc.RUN_LABEL, "") for s in engine.containers({dc.RUN_LABEL: None})} - known):
                if rid:
                    views.append(view_run(_run_dir_from_labels(engine, rid), engine=engine, run_id=rid))
        return views
    finally:
        if engine is not None:
            engine.close()


def _run_dir_from_labels(engine: dc.Engine, run_id: str) -> RunDir | None:
    for s in engine.containers({dc.RUN_LABEL: run_id}):
        path = Path(s.labels.get(dc.RESULTS_LABEL, ""))
        if s.labels.get(dc.RESULTS_LABEL) and (path / "spec.json").exists():
            return RunDir(run_id, path)
    return None


# ------------------------------------------------------------------------------------------------ down
@dataclass
class DownReport:
    """What ``down`` found and removed for one run."""

    run_id: str
    results: str = ""
    containers: list[str] = field(default_factory=list)
    networks: int = 0
    pids: list[int] = field(default_factory=list)
    launcher_signalled: bool = False
    services: list[str] = field(default_factory=list)  # swarm runs
    secrets: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "results": self.results, "containers": self.containers,
                "networks": self.networks, "pids": self.pids, "launcher_signalled": self.launcher_signalled,
                "services": self.services, "secrets": self.secrets}


def _stop_launcher(record: dict[str, Any], grace_s: float) -> bool:
    """SIGTERM an attached launcher still supervising the run: it tears down in order and records the end."""
    pid = int(record.get("launcher_pid") or 0)
    if pid == os.getpid() or not pid_is_ours(pid, "launcher"):
        return False
    _signal(pid, signal.SIGTERM, group=False)
    _wait_gone([(pid, "launcher")], grace_s + 6.0)
    return True


def down_run(root: Path, run: str, *, grace_s: float = 8.0) -> DownReport:
    """Stop run ``run`` (id or directory) and remove its containers and network; results stay.

    Order: an attached launcher still watching it gets SIGTERM first (it stops the master, which
    checkpoints, then the groups); then whatever is left is found by label (Docker) or by the pids in
    run.json (process backend) and stopped the same way, master first. Idempotent.

    Raises:
        BadInput: no such run under ``root`` and no container labelled with it.
    """
    engine, reason = _docker_engine()
    try:
        try:
            rd: RunDir | None = find_run(root, run)
        except BadInput:
            if engine is None or not (engine.containers({dc.RUN_LABEL: run}) or engine.networks({dc.RUN_LABEL: run})):
                raise
            rd = _run_dir_from_labels(engine, run)
        rid = rd.run_id if rd else run
        record = rd.read_record() if rd else {}
        report = DownReport(rid, str(rd.path) if rd else "")
        report.launcher_signalled = _stop_launcher(record, grace_s)
        if record.get("backend") == "process" and rd is not None:
            report.pids = _stop_processes(rd, record, grace_s)
        if engine is not None:
            from launcher.backends.docker import teardown
            from launcher.backends.swarm import service_parts
            from launcher.backends.swarm import teardown as swarm_teardown

            nets = len(engine.networks({dc.RUN_LABEL: rid}))
            # Services first: the swarm would replace a task container removed under it. Only for a swarm
            # run: a Docker run's containers are nobody's tasks, and on an engine that is a swarm manager the
            # swarm teardown would wait for them (20 s) and then fail removing their network under them.
            backend = record.get("backend")
            if backend == "swarm" or (backend != "docker" and service_parts(engine, rid)):
                swarm = swarm_teardown(engine, rid, grace_s=grace_s, logs_dir=rd.files.logs if rd else None)
                report.services, report.secrets = swarm.services, swarm.secrets
            snaps = teardown(engine, rid, grace_s=grace_s, logs_dir=rd.files.logs if rd else None)
            report.containers = [s.name for s in snaps]
            report.networks = nets
        elif record.get("backend") in ("docker", "swarm"):
            raise LauncherError(f"cannot reach the Docker engine to stop run {rid}: {reason}",
                                hint="start the engine (or fix DOCKER_HOST) and run `launcher down` again")
        if rd is not None and (report.containers or report.services or report.pids) and not report.launcher_signalled:
            if str(record.get("state")) in LIVE_STATES:
                rd.update_record(state="interrupted", message="stopped by `launcher down`", ended=time.time())
        return report
    finally:
        if engine is not None:
            engine.close()


def _stop_processes(rd: RunDir, record: dict[str, Any], grace_s: float) -> list[int]:
    pids = {name: int(pid) for name, pid in (record.get("pids") or {}).items()}
    alive = {n: p for n, p in pids.items() if pid_is_ours(p, rd.run_id)}
    if not alive:
        return []
    # Each child leads its own process group (process backend); the master first, so it checkpoints.
    if "master" in alive:
        _signal(alive["master"], signal.SIGTERM, group=True)
        _wait_gone([(alive["master"], rd.run_id)], max(1.0, grace_s - 2.0))
    for name, pid in alive.items():
        if name != "master":
            _signal(pid, signal.SIGTERM, group=True)
    left = _wait_gone([(p, rd.run_id) for p in alive.values()], 3.0)
    for pid, _ in left:
        log.warning("pid %d did not exit on SIGTERM; killing it", pid)
        _signal(pid, signal.SIGKILL, group=True)
    return sorted(alive.values())


def down_all(root: Path, *, grace_s: float = 8.0) -> list[DownReport]:
    """``down`` every live run: process runs under ``root`` with live pids, and every Docker run on the
    engine (found by label; only the invoking user's unless the launcher runs as root)."""
    reports: list[DownReport] = []
    targets: list[str] = []
    for rd in list_runs(root):
        rec = rd.read_record()
        if rec.get("backend") == "process" and (
                any(pid_is_ours(int(p), rd.run_id) for p in (rec.get("pids") or {}).values())
                or pid_is_ours(int(rec.get("launcher_pid") or 0), "launcher")):
            targets.append(str(rd.path))
    engine, _ = _docker_engine()
    if engine is not None:
        try:
            mine = None if os.geteuid() == 0 else str(owner_uid_gid()[0])
            flt: dict[str, str | None] = {dc.RUN_LABEL: None}
            if mine is not None:
                flt[dc.USER_LABEL] = mine
            rids = {s.labels.get(dc.RUN_LABEL, "") for s in engine.containers(flt)}
            rids |= {labels.get(dc.RUN_LABEL, "") for _, _, labels in engine.networks(flt)}
            targets.extend(sorted(r for r in rids if r))
        finally:
            engine.close()
    for target in targets:
        reports.append(down_run(root, target, grace_s=grace_s))
    return reports


# ------------------------------------------------------------------------------------------------ logs
def log_target_name(master: bool, group: int | None) -> str | None:
    """``master``, ``group-N``, or None (every part)."""
    if group is not None:
        return f"group-{group}"
    return "master" if master else None


def log_files(rd: RunDir) -> dict[str, Path]:
    """The run's kept log files by part name (``master``, ``group-0``, ...)."""
    d = rd.files.logs
    if not d.is_dir():
        return {}
    files = {p.stem: p for p in d.glob("*.log")}
    return dict(sorted(files.items(), key=lambda kv: (kv[0] != "master", len(kv[0]), kv[0])))


def read_logs(root: Path, run: str, part: str | None) -> Iterator[tuple[str, bytes]]:
    """(part name, output) of ``part`` (None: every part), from the engine while the run's containers exist,
    else from the files kept in ``<results>/<run>/logs/``.

    Raises:
        BadInput: no such run, or no such part.
    """
    view = view_runs(root, run=run)[0]
    if view.backend in ("docker", "swarm") and view.parts:
        engine = dc.Engine()
        try:
            snaps = {p.name: p for p in view.parts}
            names = [part] if part else list(snaps)
            _check_part(part, list(snaps), view.run_id)
            for name in names:
                if view.backend == "swarm":
                    from launcher.backends.swarm import read_service_logs

                    yield name, read_service_logs(engine, view.run_id, name)
                else:
                    yield name, engine.logs(snaps[name].ident)
        finally:
            engine.close()
        return
    if view.path is None:
        raise BadInput(f"run {run} has neither containers nor a results directory here")
    files = log_files(RunDir(view.run_id, view.path))
    _check_part(part, list(files), view.run_id)
    for name in ([part] if part else list(files)):
        yield name, files[name].read_bytes()


def follow_logs(root: Path, run: str, part: str | None, *, poll_s: float = 0.5) -> Iterator[bytes]:
    """Output of ``part`` (None: the master) as it is written, until the run stops (like ``tail -f``)."""
    part = part or "master"
    view = view_runs(root, run=run)[0]
    if view.backend == "swarm" and view.parts:
        from launcher.backends.swarm import follow_service_logs

        _check_part(part, [p.name for p in view.parts], view.run_id)
        engine = dc.Engine()
        try:
            yield from follow_service_logs(engine, view.run_id, part, poll_s=max(poll_s, 1.0))
        finally:
            engine.close()
        return
    if view.backend == "docker" and view.parts:
        snaps = {p.name: p for p in view.parts}
        _check_part(part, list(snaps), view.run_id)
        engine = dc.Engine()
        try:
            cid = snaps[part].ident
            yield from engine.follow_logs(cid)
            # A restarting group's stream ends at its exit; pick it up again while it lives on.
            while (snap := engine.inspect(cid)) is not None and snap.status in ("restarting", "running"):
                time.sleep(poll_s)
                yield from engine.follow_logs(cid, tail=0)
        finally:
            engine.close()
        return
    if view.path is None:
        raise BadInput(f"run {run} has neither containers nor a results directory here")
    rd = RunDir(view.run_id, view.path)
    files = log_files(rd)
    _check_part(part, list(files), view.run_id)
    with open(files[part], "rb") as fh:
        while True:
            chunk = fh.read()
            if chunk:
                yield chunk
                continue
            if not view_run(rd).live:
                return
            time.sleep(poll_s)


def _check_part(part: str | None, known: list[str], run_id: str) -> None:
    if part is not None and part not in known:
        raise BadInput(f"run {run_id} has no {part} (it has: {', '.join(known) or 'nothing yet'})",
                       hint="pick one with --master or --group N")
