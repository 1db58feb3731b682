"""Process backend: the master and each worker group as local processes (``launcher up --backend process``).

Children are fresh interpreters (``python -m worker ...``: the spawn model, nothing forked from a
process that imported TensorFlow), each in its own process group so a terminal's Ctrl-C reaches only
the launcher, which then tears down in order. Each child also asks the kernel for SIGTERM when the
launcher dies (``PR_SET_PDEATHSIG``), and a tiny reaper (:mod:`launcher.reaper`) SIGKILLs any that still run
:data:`~launcher.backends.process_children.ORPHAN_GRACE_S` later, so even a ``kill -9`` of the launcher leaves no
orphans, stuck ones included. A child and the reaper are :mod:`launcher.backends.process_children` (the Slurm
backend's steps are the same children).

What each child is started with (argv, environment) is :func:`launcher.backends.process_specs.process_specs`, the
same step ``launcher plan --backend process`` shows. The run secret reaches each child through an inherited pipe
(``LAUNCHER_SECRET_FILE=/dev/fd/N``), never its environment. Each child's log is opened without following links
and rotated past :data:`~launcher.backends.process_children.LOG_CAP_BYTES`.

The launcher binds the master's listening socket itself and hands it over (``pass_fds``): its port is
known before the master has imported TensorFlow, so the groups start at the same time and dial at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from launcher.backends import envcheck
from launcher.backends.base import (Backend, BackendStatus, DownReport, Event, FoundRun, Part, PartState, PreparedRun,
                                    name_order)
from launcher.backends.process_children import LOG_CAP_BYTES, ORPHAN_GRACE_S, _Child, _Reaper
from launcher.backends.process_specs import process_specs, uses_unix_socket
from launcher.backends.specs import LaunchSpecs, PartSpec
from launcher.config import RunConfig
from launcher.errors import BadInput
from launcher.gpu.placement import Plan
from launcher.procs import belongs, identity, launcher_record, send_signal, wait_gone
from launcher.safefs import distrust
from launcher.runs import RunDir, list_runs
from worker.contract import LISTEN_FD_ENV, MASTER_LOG, format_addr, group_log_name

log = logging.getLogger(__name__)


def check_on_host(cfg: RunConfig, on_event: Event | None) -> dict[str, Any]:
    """Make the env once with this interpreter, in a subprocess with the groups' PYTHONPATH (the process backend's
    and Slurm's process steps' env check)."""
    if cfg.with_packages and on_event is not None:
        on_event("event", {"message": f"--with {' '.join(cfg.with_packages)} is for container images; the "
                                      f"process backend runs this host's Python ({sys.executable})"})
    probe = envcheck.probe_on_host(cfg, sys.executable)
    if not probe.ok:
        raise envcheck.refusal(cfg, probe, containers=False)
    return probe.info


class ProcessBackend(Backend):
    """Runs a :class:`PreparedRun` as local processes."""

    name = "process"
    recovers_master = True
    elastic = True

    def __init__(self, python: str | None = None, *, orphan_grace_s: float = ORPHAN_GRACE_S,
                 log_cap_bytes: int = LOG_CAP_BYTES) -> None:
        """
        Args:
            python: the interpreter the children run (default: this one).
            orphan_grace_s: seconds a child may outlive a dead launcher after its SIGTERM before the reaper
                SIGKILLs it.
            log_cap_bytes: a child's log is rotated (one ``.1`` kept) past this size.
        """
        self.python = python or sys.executable
        self.orphan_grace_s = orphan_grace_s
        self.log_cap_bytes = log_cap_bytes
        self._reaper: _Reaper | None = None
        self.master: _Child | None = None
        self.groups: dict[int, _Child] = {}
        self.run: PreparedRun | None = None
        self._sock: socket.socket | None = None
        self._sock_dir: Path | None = None  # the Unix socket's private directory, removed at stop
        self._yielding: set[int] = set()  # groups asked to leave for an elastic run's yield (poll: YIELDED)

    def specs(self, run: PreparedRun, *, master_addr: str | None = None) -> LaunchSpecs:
        """Each part's argv and the environment set over this launcher's (:func:`process_specs`); ``start``
        gives it the address it bound."""
        return process_specs(run, python=self.python, environ=os.environ, master_addr=master_addr)

    def check_env(self, cfg: RunConfig, plan: Plan, run_id: str) -> dict[str, Any]:
        """The groups run this interpreter: ask it (:func:`check_on_host`)."""
        return check_on_host(cfg, self.on_event)

    def _start_child(self, child: _Child) -> None:
        child.start()
        if self._reaper is not None and child.proc is not None:
            self._reaper.watch(child.proc.pid)

    def start(self, run: PreparedRun) -> None:
        self.run = run
        sock, addr = self._listen(run)
        self._sock = sock
        logs = run.run_dir.files.logs
        logs.mkdir(exist_ok=True)
        specs = self.specs(run, master_addr=addr)
        inherited = envcheck.inherited_env(os.environ)

        def env_of(part: PartSpec, **at_start: str) -> dict[str, str]:
            return {**inherited, **part.env, **at_start}

        master = specs.part("master")
        # The master inherits the run's GPU leases too (launcher.gpu.handover): if the launcher is killed they
        # stay held while the master checkpoints and exits. With a lease broker there are no descriptors: the
        # broker ties the leases to the master's pid instead (_tie_leases).
        leases = run.reservation.fds if run.reservation is not None else ()
        self.master = _Child("master", list(master.command), env_of(master, **{LISTEN_FD_ENV: str(sock.fileno())}),
                             logs / MASTER_LOG, pass_fds=(sock.fileno(), *leases), secret=run.secret)
        self._reaper = _Reaper(self.python, self.orphan_grace_s, self.master.open_log())
        if self._sock_dir is not None:  # stop() removes it; if this launcher dies first, the reaper does
            self._reaper.on_death(["rm", "-rf", "--", str(self._sock_dir)])
        self._start_child(self.master)
        self._tie_leases()
        for g in run.plan.groups:
            part = specs.part(f"group-{g.index}")
            child = _Child(part.name, list(part.command), env_of(part), logs / group_log_name(g.index),
                           secret=run.secret)
            self._start_child(child)
            self.groups[g.index] = child
        # The launcher keeps its copy of the listening socket: a new master started in place of a dead one
        # (restart_master) gets the same address, and connections made meanwhile wait in its backlog.
        log.info("started master (pid %s) and %d groups; the master listens on %s",
                 self.master.proc and self.master.proc.pid, len(self.groups), addr)

    @staticmethod
    def _part(child: _Child, *, yielding: bool = False) -> Part:
        code = child.exit_code()
        if child.proc is None:
            state = PartState.STARTING
        elif code is None:
            state = PartState.RUNNING
        elif yielding:  # it left because it was asked to: however it exited, nothing restarts it
            state = PartState.YIELDED
        else:
            state = PartState.EXITED if code == 0 else PartState.FAILED
        return Part(child.name, state, code, child.restarts, str(child.proc.pid if child.proc else ""))

    def poll(self) -> BackendStatus:
        """Each child's state from ``waitpid``. Also keeps each log under its cap (the one write here: the
        children cannot rotate their own output, and a flood of refused connections grows the master's)."""
        assert self.master is not None
        for c in [self.master, *self.groups.values()]:
            c.cap_log(self.log_cap_bytes)
        return BackendStatus(self._part(self.master), {i: self._part(c, yielding=i in self._yielding)
                                                       for i, c in self.groups.items()})

    def idle(self, seconds: float) -> None:
        """Block on the master's process (up to ``seconds``): its end is seen at once, not at the next poll."""
        proc = self.master.proc if self.master is not None else None
        if proc is None:
            time.sleep(seconds)
            return
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            pass

    def restart_group(self, index: int) -> None:
        child = self.groups[index]
        child.restarts += 1
        os.write(child.open_log(), f"--- launcher: restarting {child.name} (restart {child.restarts}) ---\n".encode())
        self._start_child(child)

    def yield_group(self, index: int) -> None:
        """SIGUSR2 to the group: it sends the segment it is collecting, says goodbye (``reason: yield``), exits 0."""
        child = self.groups[index]
        self._yielding.add(index)
        os.write(child.open_log(), f"--- launcher: {child.name} yields its GPUs (elastic run) ---\n".encode())
        child.signal(signal.SIGUSR2)

    def kill_group(self, index: int) -> None:
        self.groups[index].signal(signal.SIGKILL)

    def release_yielded(self, uuids: tuple[str, ...]) -> tuple[str, ...]:
        assert self.run is not None and self.run.reservation is not None
        return tuple(self.run.reservation.release_some(uuids))

    def regrow(self, indices: tuple[int, ...], uuids: tuple[str, ...]) -> bool:
        """Lease the GPUs again (the master child's inherited descriptors are the old ones; a new master gets the
        new ones, restart_master), tie them to the master with a broker, then start each group as before."""
        assert self.run is not None and self.run.reservation is not None
        if not self.run.reservation.take_back(uuids):
            return False
        self._tie_leases()
        for index in indices:
            child = self.groups[index]
            if child.exit_code() is None:
                raise RuntimeError(f"{child.name} has not exited; it cannot be started again")
            self._yielding.discard(index)
            os.write(child.open_log(), f"--- launcher: {child.name} starts again (its GPUs are back) ---\n".encode())
            self._start_child(child)
        return True

    def _listen(self, run: PreparedRun) -> tuple[socket.socket, str]:
        """The master's listening socket, bound here so the groups can dial at once, and its address: a Unix
        socket in a fresh directory of mode 0700 (no other user can connect, so none can flood the master's
        pre-authentication slots), or TCP at ``--port``."""
        if uses_unix_socket(run):
            self._sock_dir = Path(tempfile.mkdtemp(prefix="launcher-"))  # 0700, this user's
            path = self._sock_dir / "master.sock"
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(str(path))
                sock.listen(256)
            except OSError as exc:
                sock.close()
                raise BadInput(f"cannot listen on the Unix socket {path}: {exc.strerror}",
                               hint="set TMPDIR to a writable local directory, or give --port") from None
            return sock, format_addr(str(path))
        host = run.spec.master_host
        try:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, run.spec.master_port))
            sock.listen(256)
        except OSError as exc:
            raise BadInput(f"cannot listen on {host}:{run.spec.master_port}: {exc.strerror}",
                           hint="pick another --port, or 0 for any free port") from None
        return sock, format_addr((run.spec.connect_host, sock.getsockname()[1]))

    def restart_master(self) -> None:
        """A new master process in place of the dead one: the same argv, environment, secret, GPU lease descriptors
        and listening socket (still open here), so the groups' reconnects reach it."""
        assert self.master is not None and self._sock is not None
        self.master.restarts += 1
        # The lease descriptors as they are now: an elastic run's yield and regrowth change them.
        leases = self.run.reservation.fds if self.run is not None and self.run.reservation is not None else ()
        self.master.pass_fds = (self._sock.fileno(), *leases)
        os.write(self.master.open_log(), f"--- launcher: the master died (exit {self.master.exit_code()}); starting "
                                         f"a new one from the newest checkpoint ---\n".encode())
        self._start_child(self.master)
        self._tie_leases()

    def _tie_leases(self) -> None:
        """With a lease broker: keep the run's GPU leases while the master lives, as inheriting the locked
        descriptors does without one (a killed launcher's GPUs stay leased until the master has exited)."""
        reservation = self.run.reservation if self.run is not None else None
        if reservation is not None and reservation.brokered and self.master is not None and self.master.proc:
            reservation.tie(self.master.proc.pid)

    def stop(self, *, grace_s: float = 8.0) -> None:
        deadline = time.monotonic() + grace_s
        if self.master is not None:
            self.master.signal(signal.SIGTERM)  # it checkpoints, tells the groups STOP, writes the summary
            self._wait([self.master], deadline - 2.0)
        rest = list(self.groups.values())
        for c in rest:
            c.signal(signal.SIGTERM)
        everyone = ([self.master] if self.master else []) + rest
        self._wait(everyone, deadline)
        for c in everyone:
            if c.exit_code() is None:
                log.warning("%s did not exit within %.0f s; killing it", c.name, grace_s)
                c.signal(signal.SIGKILL)
        for c in everyone:
            if c.proc is not None:
                try:
                    c.proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
            c.close_log()
        if self._reaper is not None:
            self._reaper.done()
            self._reaper = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._sock_dir is not None:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            self._sock_dir = None

    @staticmethod
    def _wait(children: list[_Child], deadline: float) -> None:
        while time.monotonic() < deadline and any(c.exit_code() is None for c in children if c.proc):
            time.sleep(0.05)

    def describe(self) -> dict[str, Any]:
        pids = {c.name: c.proc.pid for c in ([self.master] if self.master else []) + list(self.groups.values()) if c.proc}
        starts = {name: identity(pid).get("start") for name, pid in pids.items()}
        return {"backend": self.name, "pids": pids, "starts": starts, **launcher_record()}

    @classmethod
    def find(cls, run_id: str, run_dir: RunDir | None, record: dict[str, Any]) -> "ProcessRun":
        return ProcessRun(run_id, run_dir, record)

    @classmethod
    def live_run_ids(cls, root: Path, *, user: str | None) -> set[str]:
        """Process runs under ``root`` whose children or launcher still run."""
        out = set()
        for rd in list_runs(root):
            rec = rd.read_record()
            if rec.get("backend") == cls.name and ProcessRun(rd.run_id, rd, rec).anything_alive():
                out.add(rd.run_id)
        return out


class ProcessRun(FoundRun):
    """A process run found again: the pids its record names, each trusted only while its command line still
    names the run. Its output is in the run's ``logs/`` files (the children write there)."""

    backend = "process"

    def _pids(self) -> dict[str, int]:
        return {name: int(pid) for name, pid in (self.record.get("pids") or {}).items()
                if isinstance(pid, int) or str(pid).isdigit()}

    def _owner(self) -> int | None:
        """The uid the run's processes must run as: its directory's owner. -1 (nobody) when that directory
        is not to be trusted (a link, writable by everyone) or cannot be read."""
        if self.run_dir is None:
            return -1
        if (why := distrust(self.run_dir.path)) is not None:
            log.warning("not trusting the pids in %s: the directory %s", self.run_dir.record, why)
            return -1
        return os.stat(self.run_dir.path).st_uid

    def _belongs(self, name: str, pid: int) -> bool:
        """Whether ``pid`` is still this run's ``name`` (:func:`launcher.procs.belongs`)."""
        start = (self.record.get("starts") or {}).get(name)
        return belongs(pid, self.run_id, start=start if isinstance(start, int) else None, owner_uid=self._owner(),
                       leader=True)

    def anything_alive(self) -> bool:
        """Whether a child of the run, or its launcher, still runs."""
        if any(self._belongs(n, p) for n, p in self._pids().items()):
            return True
        start = self.record.get("launcher_start")
        return belongs(int(self.record.get("launcher_pid") or 0), "launcher",
                       start=start if isinstance(start, int) else None, owner_uid=None, leader=False)

    def parts(self) -> list[Part]:
        parts = []
        for name, pid in sorted(self._pids().items(), key=lambda kv: name_order(kv[0])):
            alive = self._belongs(name, pid)
            parts.append(Part(name, PartState.RUNNING if alive else PartState.EXITED, ident=str(pid),
                              status="alive" if alive else "gone"))
        return parts

    def down(self, report: DownReport, *, grace_s: float) -> None:
        """SIGTERM to each child's process group, the master first (it checkpoints), SIGKILL after that."""
        alive = {n: p for n, p in self._pids().items() if self._belongs(n, p)}
        if not alive:
            return
        if "master" in alive:
            send_signal(alive["master"], signal.SIGTERM, group=True)
            wait_gone([(alive["master"], self.run_id)], max(1.0, grace_s - 2.0))
        for name, pid in alive.items():
            if name != "master":
                send_signal(pid, signal.SIGTERM, group=True)
        wait_gone([(p, self.run_id) for p in alive.values()], 3.0)
        for name, pid in alive.items():
            if self._belongs(name, pid):  # checked again right before the SIGKILL: still the same process
                log.warning("pid %d did not exit on SIGTERM; killing it", pid)
                send_signal(pid, signal.SIGKILL, group=True)
        report.pids = sorted(alive.values())
