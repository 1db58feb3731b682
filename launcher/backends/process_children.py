"""A run's host children: :class:`_Child`, one child process and its log (started with the run secret in an
inherited pipe, asking the kernel for SIGTERM when the launcher dies, its log opened without following links and
rotated past :data:`LOG_CAP_BYTES`), and :class:`_Reaper`, the run's :mod:`launcher.reaper` that SIGKILLs
what still runs :data:`ORPHAN_GRACE_S` after the launcher's death.

The process backend's children (:mod:`launcher.backends.process`) and the Slurm backend's ``srun`` steps
(:mod:`launcher.backends.slurm`) are both these.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
from pathlib import Path

from launcher import safefs
from launcher.procs import identity
from worker.contract import SECRET_FILE_ENV

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
ORPHAN_GRACE_S = 10.0  # a master gets SIGTERM when the launcher dies, checkpoints in well under this, then SIGKILL
LOG_CAP_BYTES = 64 * 1024 * 1024  # per child log; one rotated copy (.1) is kept beside it


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class _Child:
    """One child process and its log: ``logs/<name>.log`` opened through :mod:`launcher.safefs` (never through
    a link), kept at most :data:`LOG_CAP_BYTES` (then copied to ``<name>.log.1`` and truncated)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, pass_fds: tuple[int, ...] = (),
                 secret: str = "", secret_on_stdin: bool = False):
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.pass_fds = pass_fds
        self.secret = secret
        self.secret_on_stdin = secret_on_stdin  # srun forwards its stdin to the step's task on another node
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._log: int | None = None

    @property
    def _where(self) -> tuple[Path, str]:
        return self.log_path.parent.parent, f"{self.log_path.parent.name}/{self.log_path.name}"

    def open_log(self) -> int:
        if self._log is None:
            self._log = safefs.open_append(*self._where)
        return self._log

    def start(self) -> None:
        """Start it (like ``subprocess.Popen``) with the run secret in a pipe it inherits: the secret is in no
        environment (``/proc/<pid>/environ``), argv or file; the child reads ``/dev/fd/N`` to its end (or its
        stdin, ``secret_on_stdin``)."""
        log_fd = self.open_log()
        env, fds, secret_r = dict(self.env), self.pass_fds, None
        stdin: int = subprocess.DEVNULL
        if self.secret:
            secret_r, w = os.pipe()
            os.write(w, self.secret.encode())  # 64 bytes: far below a pipe's buffer
            os.close(w)
            if self.secret_on_stdin:
                stdin = secret_r
            else:
                env[SECRET_FILE_ENV] = f"/dev/fd/{secret_r}"
                fds = (*fds, secret_r)
        try:
            self.proc = subprocess.Popen(self.argv, env=env, stdin=stdin, stdout=log_fd,
                                         stderr=subprocess.STDOUT, pass_fds=fds, process_group=0,
                                         preexec_fn=_die_with_parent, close_fds=True)
        finally:
            if secret_r is not None:
                os.close(secret_r)

    def cap_log(self, cap_bytes: int) -> bool:
        """Copy the log to ``<name>.log.1`` and truncate it once it passes ``cap_bytes`` (the child appends, so
        it carries on at the new start). Returns whether it did."""
        if self._log is None or os.fstat(self._log).st_size <= cap_bytes:
            return False
        root, rel = self._where
        src = out = None
        try:
            src = safefs.open_beneath(root, rel, os.O_RDONLY)
            out = safefs.open_beneath(root, rel + ".1", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            offset = 0
            while chunk := os.pread(src, 1 << 20, offset):
                os.write(out, chunk)
                offset += len(chunk)
        except OSError as exc:  # the cap holds anyway: the earlier part is lost rather than kept
            log.warning("cannot keep the earlier part of %s: %s", self.log_path, exc)
        finally:
            for fd in (src, out):
                if fd is not None:
                    os.close(fd)
        os.ftruncate(self._log, 0)
        os.write(self._log, f"--- launcher: {self.name}.log passed {cap_bytes} bytes; the earlier part is in "
                            f"{self.log_path.name}.1 ---\n".encode())
        return True

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
            os.close(self._log)
            self._log = None


class _Reaper:
    """The run's :mod:`launcher.reaper`: told every child's process group; SIGKILLs them ``grace_s`` after the
    launcher's death if SIGTERM (``PR_SET_PDEATHSIG``) did not end them."""

    def __init__(self, python: str, grace_s: float, stderr: int) -> None:
        self.proc = subprocess.Popen([python, "-m", "launcher.reaper", f"{grace_s:g}"], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True, close_fds=True)

    def watch(self, pid: int) -> None:
        ticks = identity(pid).get("start")
        if ticks is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(f"{pid} {ticks}\n".encode())
                self.proc.stdin.flush()
            except OSError:
                pass

    def on_death(self, argv: list[str]) -> None:
        """Run ``argv`` (with a deadline) after the children are reaped, if the launcher dies first."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.write(f"run {json.dumps(argv)}\n".encode())
                self.proc.stdin.flush()
            except OSError:
                pass

    def done(self) -> None:
        """The launcher stopped its children itself: the reaper exits at once."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.write(b"done\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
