"""The user's own code in a run: ``--algo`` and ``--model`` references, and the directories the run's processes
need on their import path for them (and for ``--env-dir``).

``--algo ppo`` names a built-in. ``--algo pkg.module:Class`` names a module importable where the groups run (a
package added with ``--with``, or a module in ``--env-dir``). ``--algo path/to/file.py:Class`` names a file on
this host: its directory goes on the import path of every process of the run (``PYTHONPATH`` for the process
backend, a read-only mount for containers, like ``--env-dir``) and the run imports it as ``file:Class``.
``--model`` takes the same two forms, naming a function ``(spaces, hparams) -> keras.Model``.

Nothing here imports the user's code: the pre-flight probe does, where the groups will run
(:mod:`launcher.backends.envcheck`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from launcher.errors import BadInput
from worker.contract import ALGOS, is_code_ref

if TYPE_CHECKING:
    from launcher.config import RunConfig

ENV_DIR_MOUNT = "/opt/launcher/envs"  # where --env-dir is mounted (read-only) in every container of a run
CODE_MOUNT = "/opt/launcher/code"  # where the directories of --algo/--model files are mounted: CODE_MOUNT/<n>


@dataclass(frozen=True)
class UserCode:
    """What the run's processes import: ``algo`` and ``model`` as ``module:Name`` (or a built-in's name), and the
    host directories that must be on their import path: ``--env-dir`` and those of ``--algo``/``--model`` files."""

    algo: str
    model: str | None = None
    env_dir: Path | None = None
    code_dirs: tuple[Path, ...] = ()

    @property
    def dirs(self) -> tuple[Path, ...]:
        """Every directory for the import path, ``--env-dir`` first (host paths)."""
        return ((self.env_dir,) if self.env_dir is not None else ()) + self.code_dirs

    def mounts(self) -> dict[str, str]:
        """Host directory -> where every container of the run sees it (read-only)."""
        out = {str(self.env_dir): ENV_DIR_MOUNT} if self.env_dir is not None else {}
        out.update({str(d): f"{CODE_MOUNT}/{i}" for i, d in enumerate(self.code_dirs)})
        return out


def _split(ref: str, flag: str) -> tuple[str, Path | None]:
    """(module:Name as the run imports it, the file's directory or None) for one reference."""
    if not is_code_ref(ref):
        raise BadInput(f"{flag} {ref!r} is neither a built-in ({', '.join(ALGOS)}) nor MODULE:Name or FILE.py:Name"
                       if flag == "--algo" else f"{flag} {ref!r} is not MODULE:function or FILE.py:function",
                       hint="e.g. --algo examples/dppo_pendulum.py:DPPO, or --algo mypackage.algos:MyAlgorithm")
    target, _, name = ref.rpartition(":")
    if not target.endswith(".py"):
        return ref, None
    path = Path(target).expanduser()
    if not path.is_file():
        raise BadInput(f"{flag} {ref!r}: no such file {path}", hint="give the path of your .py file, relative to "
                       "the current directory or absolute")
    path = path.resolve()
    if not path.stem.isidentifier():
        raise BadInput(f"{flag} {ref!r}: {path.name} cannot be imported as a module (its name is not an identifier)",
                       hint="rename the file, e.g. my_algo.py")
    return f"{path.stem}:{name}", path.parent


def resolve(algo: str, model: str | None, env_dir: Path | None) -> UserCode:
    """The run's :class:`UserCode` from ``--algo``, ``--model`` and ``--env-dir``. Raises :class:`BadInput`
    (exit 2) for a reference that is not one, a file that is not there, or two files of one name."""
    dirs: list[Path] = []
    stems: dict[str, Path] = {}
    refs: list[str | None] = []
    for flag, ref in (("--algo", algo), ("--model", model)):
        if ref is None or (flag == "--algo" and ref in ALGOS):
            refs.append(ref)
            continue
        module_ref, directory = _split(ref, flag)
        if directory is not None:
            stem = module_ref.partition(":")[0]
            if stems.setdefault(stem, directory) != directory:
                raise BadInput(f"--algo and --model name two files called {stem}.py in different directories "
                               f"({stems[stem]} and {directory}); the run would import only one",
                               hint="rename one of them")
            if directory not in dirs:
                dirs.append(directory)
        refs.append(module_ref)
    assert refs[0] is not None
    env = env_dir.resolve() if env_dir is not None else None
    return UserCode(algo=refs[0], model=refs[1], env_dir=env, code_dirs=tuple(d for d in dirs if d != env))


def user_code(cfg: "RunConfig") -> UserCode:
    """:func:`resolve` for a run's configuration."""
    return resolve(cfg.algo, cfg.model, cfg.env_dir)
