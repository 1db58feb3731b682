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
from launcher.usercode import UserCode, user_code
from worker.contract import plain_env_id

log = logging.getLogger(__name__)

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
    algo: dict[str, Any] = field(default_factory=dict)  # the algorithm's class, resolved hparams and their docs

    @property
    def ok(self) -> bool:
        return not self.error


def probe_args(cfg: RunConfig) -> list[str]:
    """The probe's arguments after ``python``: ``-m worker.envs.probe ENV --args JSON --algo REF [--model REF]
    --hparams JSON``: the env made, the algorithm loaded and its ``--set`` values checked, as the run will."""
    code = user_code(cfg)
    return ["-m", PROBE_MODULE, cfg.env_id, "--args", json.dumps(dict(cfg.env_args), sort_keys=True),
            "--algo", code.algo, *(["--model", code.model] if code.model else []),
            "--hparams", json.dumps(dict(cfg.hparams), sort_keys=True, default=list)]


def host_python(python: str, results_root: Path, env: dict[str, str]) -> list[str]:
    """How to start ``python -m ...`` for a run's host process (the env probe, the process backend's children)
    so that nothing in a run's results is imported: ``python -m`` puts the working directory first on
    ``sys.path``, and from inside ``<results root>/<run>/`` a module a run's container planted there would
    shadow the user's own. There it adds ``-P`` (no such entry) and puts the directory our ``worker`` package
    is in on ``env``'s ``PYTHONPATH`` instead, after the user's code directories. Returns the argv's start."""
    here, root = Path.cwd().resolve(), results_root.resolve()
    if root not in here.parents:  # the root itself is safe: a run directory's name is no module name
        return [python]
    ours = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), ours) if p)
    return [python, "-P"]


def pythonpath(code: UserCode, inherited: str | None) -> str | None:
    """``PYTHONPATH`` of a process backend's processes: the run's code directories first (``--env-dir``, then the
    directories of ``--algo``/``--model`` files), then what the launcher had."""
    parts = [str(d) for d in code.dirs] + ([inherited] if inherited else [])
    return os.pathsep.join(parts) or None


OWN_PREFIX = "LAUNCHER_"  # the launcher's own settings: never passed on to a run's processes


def inherited_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a run's processes get of the launcher's environment: everything but its ``LAUNCHER_*`` settings."""
    return {k: v for k, v in environ.items() if not k.startswith(OWN_PREFIX)}


def code_env(code: UserCode, environ: Mapping[str, str]) -> dict[str, str]:
    """``PYTHONPATH`` with the run's code directories (``--env-dir``, the directories of ``--algo``/``--model``
    files) first, when there are any or the launcher has one."""
    path = pythonpath(code, environ.get("PYTHONPATH"))
    return {"PYTHONPATH": path} if path else {}


def host_env(code: UserCode, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a run's processes started from this launcher get of its environment (and the env probe that stands
    for them): everything but its own ``LAUNCHER_*`` settings (the secret goes in a pipe), with the run's code
    directories first on ``PYTHONPATH``. (Slurm's steps get it too, through ``srun --export=ALL``.)"""
    environ = os.environ if environ is None else environ
    return {**inherited_env(environ), **code_env(code, environ)}


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
                            python=python, algo=dict(doc.get("algo") or {}))
    tail = "\n".join(f"    {x}" for x in (stderr or stdout).strip().splitlines()[-8:])
    raise LauncherError(f"checking the env where the groups will run ({where}) failed: exit status {code}, "
                        f"no answer from {PROBE_MODULE}" + (f":\n{tail}" if tail else ""),
                        hint="the image or interpreter may predate env checks: rebuild it with `launcher build`")


def probe_on_host(cfg: RunConfig, python: str, environ: Mapping[str, str] | None = None) -> EnvProbe:
    """Ask ``python`` (the process backend's interpreter) to make the env, with the groups' PYTHONPATH."""
    env = host_env(user_code(cfg), environ)
    path = env.get("PYTHONPATH")
    where = f"this host's Python {python}" + (f", PYTHONPATH {path}" if path else "")
    try:
        argv = [*host_python(python, cfg.results, env), *probe_args(cfg)]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BadInput(f"--env {cfg.env_id!r}: making the env took longer than {PROBE_TIMEOUT_S:.0f} s ({where})",
                       hint="an env that hangs while it is made cannot train; check it alone with "
                            f"`{python} -m {PROBE_MODULE} {cfg.env_id}`") from None
    except OSError as exc:
        raise LauncherError(f"cannot run {python} to check the env: {exc}") from exc
    return parse_probe(where, done.returncode, done.stdout, done.stderr, python)


def container_mounts(code: UserCode) -> dict[str, str]:
    """Read-only binds every container of a run gets for its code: ``--env-dir`` at
    :data:`launcher.usercode.ENV_DIR_MOUNT`, the directories of ``--algo``/``--model`` files under
    :data:`launcher.usercode.CODE_MOUNT`."""
    return code.mounts()


def container_env(code: UserCode) -> dict[str, str]:
    """Environment every container of a run gets for its code: ``PYTHONPATH`` naming the mounts."""
    mounts = list(code.mounts().values())
    return {"PYTHONPATH": ":".join(mounts)} if mounts else {}


def refusal(cfg: RunConfig, probe: EnvProbe, *, containers: bool) -> LauncherError:
    """The one error for an env that cannot be made where the groups run: what, the value, where, what to do."""
    err = probe.error
    kind, message = err.get("kind", "error"), err.get("message", "")
    if kind == "algo":
        return algo_refusal(cfg, probe)
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


def algo_refusal(cfg: RunConfig, probe: EnvProbe) -> LauncherError:
    """The one error for an algorithm or model that cannot be loaded where the groups run (exit 2)."""
    err = probe.error
    what = f"--algo {cfg.algo!r}" + (f" with --model {cfg.model!r}" if cfg.model else "")
    head = (f"{what} cannot be used where the worker groups will run ({probe.where}): {err.get('message', '')}; "
            "nothing was started")
    hint = {"import": "run the module alone to see the whole traceback (`python -c 'import MODULE'`); a package it "
                      "needs goes into containers with `--with PKG`, onto this host with pip",
            "name": "check the name after the colon: a worker.api.Algorithm subclass (--algo) or a function "
                    "(--model) defined in that module",
            "type": "--algo names a subclass of worker.api.Algorithm, --model a function (spaces, hparams) -> "
                    "keras.Model",
            "hparams": f"`launcher up --algo {cfg.algo} --set help` lists its hyper-parameters with their defaults",
            }.get(str(err.get("what")), "the algorithm's class raised this while its hyper-parameters were resolved")
    return BadInput(head, hint=hint)


def probe_in_image(engine: Any, image: str, cfg: RunConfig, run_labels: Mapping[str, str], user: str) -> EnvProbe:
    """Ask a throw-away container of ``image`` to make the env: the run's user, its ``--env-dir`` mount and
    environment, no network, removed afterwards (like ``docker run --rm --network none``).

    ``engine``: a connected :class:`launcher.engine.client.Engine`.
    """
    code = user_code(cfg)
    binds = container_mounts(code)
    where = f"image {image} as uid:gid {user}, no network" + (f", {', '.join(binds.values())} mounted" if binds else "")
    status, out, err = engine.run_capture(image, ["python", *probe_args(cfg)], user=user, labels=run_labels,
                                          read_only_binds=binds, environment=container_env(code),
                                          timeout_s=PROBE_TIMEOUT_S)
    return parse_probe(where, status, out, err)
