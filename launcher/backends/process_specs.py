"""What the process backend starts, as pure functions over plain data: each part's argv and the environment
the launcher sets over its own (:func:`process_specs`). :mod:`launcher.backends.process` starts exactly that.
"""

from __future__ import annotations

from collections.abc import Mapping

from launcher.backends import envcheck
from launcher.backends.base import PreparedRun
from launcher.backends.containers import Kind, worker_env
from launcher.backends.specs import HOST_ENV, LaunchSpecs, PartSpec
from launcher.usercode import user_code
from worker.contract import LISTEN_FD_ENV, SECRET_FILE_ENV, format_addr


UNIX_PLACEHOLDER = "unix:<a private directory made at the start>/master.sock"


def uses_unix_socket(run: PreparedRun) -> bool:
    """Whether the master listens on a Unix socket in a directory only this user can enter (the default: no
    port asked for, so no other user of the machine can reach it, not even to knock), or on TCP at
    ``--port``."""
    return run.spec.master_port == 0


def process_specs(run: PreparedRun, *, python: str, environ: Mapping[str, str],
                  master_addr: str | None = None) -> LaunchSpecs:
    """The master's and each group's argv and environment (over :func:`~launcher.backends.envcheck.inherited_env`).
    Pure, given ``environ`` (the launcher's environment) and the working directory.

    Args:
        python: the interpreter the children run.
        master_addr: the address the groups dial, as ``start`` bound it (``unix:PATH`` by default); None: what
            the spec says (a placeholder for the Unix socket, whose directory ``start`` makes).
    """
    extra = envcheck.code_env(user_code(run.config), environ)
    # From inside the results root, -P and our own directory on PYTHONPATH (envcheck.host_python).
    worker = (*envcheck.host_python(python, run.run_dir.path.parent, extra), "-m", "worker")
    spec_path = str(run.run_dir.files.spec)
    if master_addr is None:
        master_addr = UNIX_PLACEHOLDER if uses_unix_socket(run) else \
            format_addr((run.spec.connect_host, run.spec.master_port))
    master = PartSpec("master", (*worker, "master", "--spec", spec_path),
                      {**extra, **worker_env(Kind.PROCESS, run.plan.master, master_addr=None)}, inherits=HOST_ENV,
                      at_start=(LISTEN_FD_ENV, SECRET_FILE_ENV), gpu_uuids=tuple(run.plan.master.gpu_uuids),
                      cpus=run.plan.master.cpus)
    groups = tuple(
        PartSpec(f"group-{g.index}", (*worker, "group", "--index", str(g.index), "--spec", spec_path),
                 {**extra, **worker_env(Kind.PROCESS, g.share, master_addr=master_addr)},
                 inherits=HOST_ENV, at_start=(SECRET_FILE_ENV,), gpu_uuids=tuple(g.share.gpu_uuids), cpus=g.share.cpus)
        for g in run.plan.groups)
    note = "no --port: the master listens on a Unix socket in a directory made at the start (mode 0700: no other " \
        "user can connect), and the groups' LAUNCHER_MASTER_ADDR names it" if master_addr == UNIX_PLACEHOLDER else ""
    return LaunchSpecs("process", (master, *groups), note=note)
