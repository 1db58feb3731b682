"""Runs made before the launcher kept its own records apart from the results (*legacy* runs): their
``config.json`` and ``spec.json`` sit in the results directory, which the run's containers could write. What
may still be taken from them, for ``launcher up --resume`` and ``launcher eval``.

The rule: a value that names code to import, where the run runs, or a host path or command is never taken
from such a file. Either the user gives it again on the command line, or it keeps its default, or (the file
says something else) the command is refused and the message shows what the file says, so that the user
can pass it after checking it. Everything else (sizes, counts, hyper-parameters) is taken as before.
"""

from __future__ import annotations

import shlex
from typing import Any, Mapping

from launcher.config.options import BY_FIELD, RunConfig
from launcher.errors import BadInput
from launcher.runs import RunDir
from launcher.safefs import read_json_at

# RunConfig fields a legacy file never gives: code (env_id's module, algo, model), where it runs (backend, image
# and the packages added to it, Slurm and Swarm placement), and host paths (env_dir is bind-mounted into the
# containers; lock_dir is where GPU leases are taken).
TRUSTED_ONLY: tuple[str, ...] = ("env_id", "algo", "model", "backend", "image", "env_dir", "with_packages", "build",
                                 "lock_dir", "allow_other_users", "slurm_args", "slurm_runtime", "slurm_partition",
                                 "swarm_master", "swarm_groups")
_DEFAULTS = RunConfig().to_dict()


def _plain(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return None if value is None else (value if isinstance(value, (bool, int, float)) else str(value))


def _printable(value: Any) -> str:
    text = "".join(c if c.isprintable() else "?" for c in str(value))[:200]
    return shlex.quote(text)


def flags_for(field: str, value: Any) -> str:
    """The command-line flags that give ``field`` the value ``value`` (printable characters only)."""
    opt = BY_FIELD[field]
    if isinstance(value, list):
        return " ".join(f"{opt.flag} {_printable(v)}" for v in value)
    if opt.kind == "bool":
        return opt.flag if value else ""
    return f"{opt.flag} {_printable(value)}"


def legacy_config(run_dir: RunDir, given: Mapping[str, Any]) -> dict[str, Any]:
    """The saved config of legacy run ``run_dir`` without what it may not give (:data:`TRUSTED_ONLY`), for
    ``up --resume`` with the flags ``given`` (keyed by RunConfig field).

    Raises:
        BadInput: the file sets a :data:`TRUSTED_ONLY` field to other than its default and the flags do not give
            it; the message names each, with what the file says, and the hint the flags to pass (exit 2).
    """
    saved = read_json_at(run_dir.files.config)
    if not isinstance(saved, dict):
        raise BadInput(f"run {run_dir.run_id} has no launcher record (no {run_dir.config}) and no readable "
                       f"config.json in its results {run_dir.path}", hint="start a new run with `launcher up`")
    missing = {f: saved[f] for f in TRUSTED_ONLY
               if f in saved and f not in given and _plain(saved[f]) != _plain(_DEFAULTS.get(f))}
    if missing:
        says = ", ".join(f"{BY_FIELD[f].flag} = {_printable(_plain(v))}" for f, v in missing.items())
        flags = " ".join(flags_for(f, _plain(v)) for f, v in missing.items())
        raise BadInput(
            f"run {run_dir.run_id} was made by an older launcher that kept its config in the results directory "
            f"{run_dir.path}, which the run's containers could write; `--resume` does not take the code, the "
            f"backend, the image or host paths from it. That file says: {says}",
            hint=f"check those values, then pass them yourself: `launcher up --resume {run_dir.run_id} {flags}`")
    return {k: v for k, v in saved.items() if k not in TRUSTED_ONLY}


def legacy_env_id(run_dir: RunDir, spec: Mapping[str, Any], given: str | None) -> str:
    """The env ``launcher eval`` makes for legacy run ``run_dir``: ``given`` (``--env``), else the spec's when it
    names no module to import (``pkg.module:EnvId``; a gymnasium id is looked up, not imported).

    Raises:
        BadInput: the spec's env id names a module and ``--env`` was not given (exit 2).
    """
    if given is not None:
        return given
    env_id = spec.get("env_id")
    if not isinstance(env_id, str) or not env_id:
        raise BadInput(f"run {run_dir.run_id}'s spec.json names no env", hint="give it: `launcher eval RUN --env ID`")
    if ":" in env_id:
        raise BadInput(
            f"run {run_dir.run_id} was made by an older launcher that kept its spec in the results directory "
            f"{run_dir.path}, which the run's containers could write; its env id {_printable(env_id)} names a "
            f"module to import, and eval does not import a module named by that file",
            hint=f"check it, then pass it yourself: `launcher eval {run_dir.run_id} --env {_printable(env_id)} "
                 f"--env-dir DIR`")
    return env_id
