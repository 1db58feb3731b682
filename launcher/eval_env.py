"""Which env ``launcher eval`` makes, and from where its code may come: the launcher's record of the run (never
the run's results, which its containers can write), the user's ``--env``/``--env-dir``, nothing inside the
results. Split from :mod:`launcher.evaluate`, which plays the policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher.errors import BadInput, MissingDependency
from launcher.runs import RunDir
from launcher.safefs import read_json_at as read_json


def run_spec(run_dir: RunDir, env: str | None = None) -> tuple[dict[str, Any], str]:
    """The run's spec and the env to make: from the launcher's record of the run (where its containers cannot
    write), ``env`` (``--env``) overriding it; a legacy run's spec (in its results) gives an env id only when
    it names no module to import (:func:`launcher.legacy.legacy_env_id`).

    Raises:
        BadInput: no readable spec; a legacy run's module env id not given again with ``--env``.
    """
    from launcher.legacy import legacy_env_id

    spec, trusted = run_dir.read_spec()
    if not spec:
        raise BadInput(f"run {run_dir.run_id} has no readable spec.json in {run_dir.host if trusted else run_dir.path}",
                       hint="is this a launcher results directory?")
    if trusted:
        env_id = env if env is not None else spec.get("env_id")
        if not isinstance(env_id, str) or not env_id:
            raise BadInput(f"run {run_dir.run_id}'s spec.json names no env", hint="give it with --env ID")
        return dict(spec), env_id
    return dict(spec), legacy_env_id(run_dir, spec, env)


def drop_run_paths(run_dir: RunDir) -> None:
    """Take off ``sys.path`` any entry inside the run's results (``python -m launcher`` started there puts the
    working directory first): a module the run's containers planted there is never imported here."""
    import sys

    inside = run_dir.path.resolve()
    for entry in list(sys.path):
        where = Path(entry or ".").resolve()
        if where == inside or inside in where.parents:
            sys.path.remove(entry)


def import_env_dir(run_dir: RunDir, env_dir: Path | None) -> None:
    """Put the user's env modules first on ``sys.path``, as ``up`` put them on the groups' PYTHONPATH, so a
    ``module:EnvId`` of their own can be made here too: ``env_dir`` (``--env-dir`` on eval's command line), else
    the ``--env-dir`` the run was started with, from the launcher's record of it (never from a legacy run's
    ``config.json``, which the run's containers could write). A directory inside the run's results is refused.

    Raises:
        BadInput: not a directory, or inside the run's results (exit 2).
    """
    import sys

    flag = "--env-dir"
    if env_dir is None and not run_dir.legacy:
        saved = (read_json(run_dir.config) or {}).get("env_dir")
        env_dir, flag = (Path(saved), "the run's --env-dir") if isinstance(saved, str) and saved else (None, flag)
    if env_dir is None:
        return
    where = env_dir.resolve()
    if not where.is_dir():
        raise BadInput(f"{flag} {env_dir} is not a directory", hint="give the directory of your env modules with "
                                                                    "`launcher eval RUN --env-dir DIR`")
    results = run_dir.path.resolve()
    if where == results or results in where.parents:
        raise BadInput(f"{flag} {env_dir} is inside the run's results {run_dir.path}, which the run's containers "
                       f"can write; eval imports nothing from there", hint="keep your env modules elsewhere and give "
                                                                          "that directory with --env-dir")
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))


def check_env(env_id: str, env_args: dict[str, Any]) -> None:
    """Make the env once here; an env this host cannot make is one error saying what to add."""
    from worker.envs import EnvError, make_env

    try:
        make_env(env_id, seed=0, **env_args).close()
    except EnvError as exc:
        if exc.kind == "missing_module":
            raise MissingDependency(f"launcher eval makes the env on this host: {exc}",
                                    hint=f"give the directory of your env module with `--env-dir DIR`, or install "
                                         f"{exc.package or 'its package'} here") from None
        raise BadInput(f"launcher eval cannot make the run's env here: {exc}") from None


__all__ = ["check_env", "drop_run_paths", "import_env_dir", "run_spec"]
