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
from worker.contract import LISTEN_FD_ENV, SECRET_FILE_ENV


def process_specs(run: PreparedRun, *, python: str, environ: Mapping[str, str], port: int | None = None) -> LaunchSpecs:
    """The master's and each group's argv and environment (over :func:`~launcher.backends.envcheck.inherited_env`).
    Pure, given ``environ`` (the launcher's environment) and the working directory.

    Args:
        python: the interpreter the children run.
        port: the master's port the groups dial (``start`` knows it once it has bound; None: the spec's).
    """
    extra = envcheck.code_env(user_code(run.config), environ)
    # From inside the results root, -P and our own directory on PYTHONPATH (envcheck.host_python).
    worker = (*envcheck.host_python(python, run.run_dir.path.parent, extra), "-m", "worker")
    spec_path = str(run.run_dir.files.spec)
    master_port = run.spec.master_port if port is None else port
    master = PartSpec("master", (*worker, "master", "--spec", spec_path),
                      {**extra, **worker_env(Kind.PROCESS, run.plan.master, master_addr=None)}, inherits=HOST_ENV,
                      at_start=(LISTEN_FD_ENV, SECRET_FILE_ENV), gpu_uuids=tuple(run.plan.master.gpu_uuids),
                      cpus=run.plan.master.cpus)
    groups = tuple(
        PartSpec(f"group-{g.index}", (*worker, "group", "--index", str(g.index), "--spec", spec_path),
                 {**extra, **worker_env(Kind.PROCESS, g.share, master_addr=f"{run.spec.connect_host}:{master_port}")},
                 inherits=HOST_ENV, at_start=(SECRET_FILE_ENV,), gpu_uuids=tuple(g.share.gpu_uuids), cpus=g.share.cpus)
        for g in run.plan.groups)
    note = "port 0: the master's port is picked at the start, and the groups' LAUNCHER_MASTER_ADDR names it" \
        if port is None and master_port == 0 else ""
    return LaunchSpecs("process", (master, *groups), note=note)
