"""Can the run's env be made where its worker groups will run? Asked before anything of the run starts.

The process backend's groups run on this host's Python, so that Python is asked, in a subprocess with the
groups' ``PYTHONPATH`` (``--env-dir``); a container backend's groups run in the run's image, so a throw-away
container of that image is asked (like ``docker run --rm --network none --user UID:GID``), with the same
``--env-dir`` mount and the run's labels. Both run ``python -m worker.envs.probe`` (:mod:`worker.envs.probe`),
which makes the env once exactly as the groups will and prints what came out. A refusal is one error saying
what was wrong, the value seen, where it was asked and what to add:

* the env's module (or ``ale_py``/``cv2`` for ``ALE/*``) is not there: :class:`~launcher.errors.MissingDependency`
  (exit 6), with ``launcher build --with PKG`` / ``up --with PKG`` for containers, ``pip install`` for the
  process backend, and ``--env-dir`` for a module of one's own;
* a shared library it loads is not there (a system package, e.g. pygame's mixer needs libglib2.0-0):
  :class:`~launcher.errors.MissingDependency` (exit 6), naming the library and the Debian package;
* no such id, arguments the env refuses, or its constructor failing: :class:`~launcher.errors.BadInput`
  (exit 2).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from launcher.config import RunConfig
from launcher.errors import BadInput, LauncherError, MissingDependency
from worker.contract import plain_env_id

log = logging.getLogger(__name__)

ENV_DIR_MOUNT = "/opt/launcher/envs"  # where --env-dir is mounted (read-only) in every container of a run
PROBE_MODULE = "worker.envs.probe"
PROBE_TIMEOUT_S = 180.0  # an env package may import heavy things (ale-py loads ROMs, pygame starts)
NOT_MADE = 3  # worker.envs.probe.EXIT_NOT_MADE


@dataclass(frozen=True)
class EnvProbe:
    """What one probe said: ``info`` (the env's spaces) when it was made, else ``error`` (kind, module, missing,
    package, message); ``where``: where it was asked, for messages."""

    where: str
    info: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] = field(default_factory=dict)
    python: str = "python"  # the interpreter asked (process backend), for the install hint

    @property
    def ok(self) -> bool:
        return not self.error


def probe_args(cfg: RunConfig) -> list[str]:
    """The probe's arguments after ``python``: ``-m worker.envs.probe ENV --args JSON``."""
    return ["-m", PROBE_MODULE, cfg.env_id, "--args", json.dumps(dict(cfg.env_args), sort_keys=True)]


def pythonpath(env_dir: Path | None, inherited: str | None) -> str | None:
    """``PYTHONPATH`` of a process backend's processes: ``env_dir`` first, then what the launcher had."""
    parts = ([str(env_dir.resolve())] if env_dir is not None else []) + ([inherited] if inherited else [])
    return os.pathsep.join(parts) or None


def parse_probe(where: str, code: int, stdout: str, stderr: str, python: str = "python") -> EnvProbe:
    """The probe's result from its exit status and output (its last stdout line is a JSON document).

    Raises:
        LauncherError: the probe itself did not run (no such interpreter, a crash before it could answer).
    """
    for line in reversed(stdout.strip().splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and "ok" in doc:
            return EnvProbe(where, info=dict(doc.get("info") or {}), error={} if doc["ok"] else dict(doc["error"]),
                            python=python)
    tail = "\n".join(f"    {x}" for x in (stderr or stdout).strip().splitlines()[-8:])
    raise LauncherError(f"checking the env where the groups will run ({where}) failed: exit status {code}, "
                        f"no answer from {PROBE_MODULE}" + (f":\n{tail}" if tail else ""),
                        hint="the image or interpreter may predate env checks: rebuild it with `launcher build`")


def probe_on_host(cfg: RunConfig, python: str, environ: Mapping[str, str] | None = None) -> EnvProbe:
    """Ask ``python`` (the process backend's interpreter) to make the env, with the groups' PYTHONPATH."""
    env = dict(os.environ if environ is None else environ)
    env = {k: v for k, v in env.items() if not k.startswith("LAUNCHER_")}
    path = pythonpath(cfg.env_dir, env.get("PYTHONPATH"))
    if path:
        env["PYTHONPATH"] = path
    where = f"this host's Python {python}" + (f", PYTHONPATH {path}" if path else "")
    try:
        done = subprocess.run([python, *probe_args(cfg)], env=env, capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BadInput(f"--env {cfg.env_id!r}: making the env took longer than {PROBE_TIMEOUT_S:.0f} s ({where})",
                       hint="an env that hangs while it is made cannot train; check it alone with "
                            f"`{python} -m {PROBE_MODULE} {cfg.env_id}`") from None
    except OSError as exc:
        raise LauncherError(f"cannot run {python} to check the env: {exc}") from exc
    return parse_probe(where, done.returncode, done.stdout, done.stderr, python)


def container_mounts(env_dir: Path | None) -> dict[str, str]:
    """Read-only binds every container of a run gets for its env: ``--env-dir`` at :data:`ENV_DIR_MOUNT`."""
    return {str(env_dir.resolve()): ENV_DIR_MOUNT} if env_dir is not None else {}


def container_env(env_dir: Path | None) -> dict[str, str]:
    """Environment every container of a run gets for its env: ``PYTHONPATH`` naming the mount."""
    return {"PYTHONPATH": ENV_DIR_MOUNT} if env_dir is not None else {}


def refusal(cfg: RunConfig, probe: EnvProbe, *, containers: bool) -> LauncherError:
    """The one error for an env that cannot be made where the groups run: what, the value, where, what to do."""
    err = probe.error
    kind, message = err.get("kind", "error"), err.get("message", "")
    head = f"--env {cfg.env_id!r} cannot be made where the worker groups will run ({probe.where}): {message}"
    if kind == "missing_module":
        package = err.get("package") or "PACKAGE"
        if plain_env_id(cfg.env_id).startswith("ALE/"):
            package = "ale-py --with opencv-python-headless" if containers else "ale-py opencv-python-headless"
        if containers:
            hint = (f"add it to the run's image: `launcher up --with {package} ...` (or `launcher build --with "
                    f"{package}`, or `[build] with = [...]` in launcher.toml; a wheel file works too); a module of "
                    f"your own: `--env-dir DIR` with the directory that holds {err.get('module') or 'it'}")
        else:
            hint = (f"install it for this Python: `{probe.python} -m pip install {package}`; "
                    f"a module of your own: `--env-dir DIR` with the directory that holds "
                    f"{err.get('module') or 'it'}")
        return MissingDependency(head + "; nothing was started", hint=hint)
    if kind == "missing_library":
        deb = err.get("package")
        what = f"the Debian package {deb}" if deb else f"the system package that has {err.get('missing')}"
        hint = (f"{what} must be in the image (--with adds Python packages only): add it to PACKAGES in "
                f"docker/build-base.sh and rebuild the base (`docker rmi launcher-base:bookworm`, then `launcher "
                f"build`), or run on an --image that has it" if containers else
                f"install {what} on this host (`sudo apt-get install {deb or '...'}`)")
        return MissingDependency(head + "; nothing was started", hint=hint)
    hint = {"unknown_id": "check the id; `python -c 'import gymnasium, MODULE; gymnasium.pprint_registry()'` lists "
                          "what a module registers",
            "bad_args": "fix or drop the --env-arg / [up.env_args] values the env does not take"}.get(
        kind, "the env's constructor raised this; check its --env-arg values, or make it alone with "
              f"`python -m {PROBE_MODULE} {cfg.env_id}`")
    return BadInput(head + "; nothing was started", hint=hint)


def probe_in_image(engine: Any, image: str, cfg: RunConfig, run_labels: Mapping[str, str], user: str) -> EnvProbe:
    """Ask a throw-away container of ``image`` to make the env: the run's user, its ``--env-dir`` mount and
    environment, no network, removed afterwards (like ``docker run --rm --network none``).

    ``engine``: a connected :class:`launcher.engine.client.Engine`.
    """
    binds = container_mounts(cfg.env_dir)
    where = f"image {image} as uid:gid {user}, no network" + (f", --env-dir at {ENV_DIR_MOUNT}" if binds else "")
    code, out, err = engine.run_capture(image, ["python", *probe_args(cfg)], user=user, labels=run_labels,
                                        read_only_binds=binds, environment=container_env(cfg.env_dir),
                                        timeout_s=PROBE_TIMEOUT_S)
    return parse_probe(where, code, out, err)
