"""Process backend: the master and each worker group as local processes (``launcher up --backend process``).

Children are fresh interpreters (``python -m worker ...``: the spawn model, nothing forked from a
process that imported TensorFlow), each in its own process group so a terminal's Ctrl-C reaches only
the launcher, which then tears down in order. Each child also asks the kernel for SIGTERM when the
launcher dies (``PR_SET_PDEATHSIG``), so even a ``kill -9`` of the launcher leaves no orphans.

The launcher binds the master's listening socket itself and hands it over (``pass_fds``): its port is
known before the master has imported TensorFlow, so the groups start at the same time and dial at once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from launcher.backends.base import Backend, BackendStatus, PreparedRun, ProcState, ProcStatus
from launcher.errors import BadInput
from worker.master import LISTEN_FD_ENV
from worker.spec import SECRET_ENV

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class _Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, pass_fds: tuple[int, ...] = ()):
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.pass_fds = pass_fds
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, pass_fds=self.pass_fds, process_group=0,
                                     preexec_fn=_die_with_parent, close_fds=True)

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class ProcessBackend(Backend):
    """Runs a :class:`PreparedRun` as local processes."""

    name = "process"
    restarts_groups = False

    def __init__(self, python: str | None = None) -> None:
        self.python = python or sys.executable
        self.master: _Child | None = None
        self.groups: dict[int, _Child] = {}
        self.run: PreparedRun | None = None
        self._sock: socket.socket | None = None

    def _base_env(self, run: PreparedRun) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LAUNCHER_")}
        env.update({SECRET_ENV: run.secret, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                    "TF_ENABLE_ONEDNN_OPTS": "0", "MPLBACKEND": "Agg"})
        return env

    def start(self, run: PreparedRun) -> None:
        self.run = run
        host = run.spec.master_host
        try:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, run.spec.master_port))
            sock.listen(256)
        except OSError as exc:
            raise BadInput(f"cannot listen on {host}:{run.spec.master_port}: {exc.strerror}",
                           hint="pick another --port, or 0 for any free port") from None
        self._sock = sock
        port = sock.getsockname()[1]
        spec_path = run.run_dir.files.spec
        logs = run.run_dir.files.logs
        logs.mkdir(exist_ok=True)
        worker = [self.python, "-m", "worker"]
        menv = self._base_env(run)
        menv.update({k: v for k, v in run.plan.master.env.items() if k != "NVIDIA_VISIBLE_DEVICES"})
        menv["CUDA_VISIBLE_DEVICES"] = ",".join(run.plan.master.gpu_uuids)
        menv[LISTEN_FD_ENV] = str(sock.fileno())
        menv["LAUNCHER_TF_THREADS"] = str(max(1, int(run.plan.master.cpus)))
        self.master = _Child("master", [*worker, "master", "--spec", str(spec_path)], menv, logs / "master.log",
                             pass_fds=(sock.fileno(),))
        self.master.start()
        for g in run.plan.groups:
            genv = self._base_env(run)
            genv.update({k: v for k, v in g.share.env.items() if k != "NVIDIA_VISIBLE_DEVICES"})
            genv["CUDA_VISIBLE_DEVICES"] = ",".join(g.share.gpu_uuids)
            genv.update({"LAUNCHER_MASTER_ADDR": f"{run.spec.connect_host}:{port}", "OMP_NUM_THREADS": "1",
                         "OPENBLAS_NUM_THREADS": "1", "LAUNCHER_TF_THREADS": "1"})
            child = _Child(f"group-{g.index}", [*worker, "group", "--index", str(g.index), "--spec", str(spec_path)],
                           genv, logs / f"group-{g.index}.log")
            child.start()
            self.groups[g.index] = child
        # The master holds its own copy of the listening socket now.
        sock.close()
        self._sock = None
        log.info("started master (pid %s) and %d groups on 127.0.0.1:%d", self.master.proc and self.master.proc.pid,
                 len(self.groups), port)

    def _status(self, child: _Child, budget_spent: bool = False) -> ProcStatus:
        code = child.exit_code()
        if child.proc is None:
            state = ProcState.STARTING
        elif code is None:
            state = ProcState.RUNNING
        elif code == 0:
            state = ProcState.EXITED
        else:
            state = ProcState.FAILED
        return ProcStatus(child.name, state, code, child.restarts, str(child.proc.pid if child.proc else ""))

    def poll(self) -> BackendStatus:
        assert self.master is not None
        return BackendStatus(self._status(self.master), {i: self._status(c) for i, c in self.groups.items()})

    def restart_group(self, index: int) -> None:
        child = self.groups[index]
        child.close_log()
        child.restarts += 1
        with open(child.log_path, "ab") as fh:
            fh.write(f"--- launcher: restarting {child.name} (restart {child.restarts}) ---\n".encode())
        child.start()

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
        if self._sock is not None:
            self._sock.close()

    @staticmethod
    def _wait(children: list[_Child], deadline: float) -> None:
        while time.monotonic() < deadline and any(c.exit_code() is None for c in children if c.proc):
            time.sleep(0.05)

    def describe(self) -> dict[str, Any]:
        pids = {c.name: c.proc.pid for c in ([self.master] if self.master else []) + list(self.groups.values()) if c.proc}
        return {"backend": self.name, "pids": pids, "launcher_pid": os.getpid()}
