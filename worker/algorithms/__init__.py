"""The one registry of algorithms, and how a run finds its algorithm and model: a built-in by name
(``ppo``, ``a3c``), or the user's own as ``module:Name`` / ``path/to/file.py:Name`` (:func:`load_algorithm`),
and a model function as ``module:function`` / ``path/to/file.py:function`` (:func:`load_model_fn`).

Every algorithm, built-in or not, is a :class:`worker.api.Algorithm` subclass; nothing in the launcher
branches on an algorithm's name outside this table. Loading user code imports it (the user chose it); a
module that does not import or a missing name is a :class:`UserCodeError` that names the module and the error.
Standard library at import (the host's config check imports this package).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:  # worker.api imports worker.algorithms.hparams: no import of it here at run time
    from worker.api import Algorithm

BUILTINS: dict[str, str] = {"ppo": "worker.algorithms.ppo:PPO", "a3c": "worker.algorithms.a3c:A3C"}


class UserCodeError(Exception):
    """User code that cannot be used: ``kind`` is ``import`` (the module did not import), ``name`` (no such
    name in it), ``type`` (not what was expected), ``hparams`` (unknown or bad ``--set`` values) or
    ``raised`` (it raised while running); ``ref`` the reference given; ``detail`` the error, with the last
    traceback line of the user's code where there is one."""

    def __init__(self, kind: str, ref: str, detail: str) -> None:
        super().__init__(f"{ref}: {detail}")
        self.kind, self.ref, self.detail = kind, ref, detail

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "ref": self.ref, "message": self.detail}


def split_ref(ref: str) -> tuple[str, str]:
    """``"pkg.mod:Name"`` or ``"dir/file.py:Name"`` -> (module or path, name). Raises ValueError."""
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ValueError(f"{ref!r} is not MODULE:NAME or PATH.py:NAME")
    return target, name


def where_raised(exc: BaseException) -> str:
    """``file:line in function`` of the innermost traceback frame (the user's code, usually)."""
    tb = traceback.extract_tb(exc.__traceback__)
    if not tb:
        return ""
    f = tb[-1]
    return f"{Path(f.filename).name}:{f.lineno} in {f.name}"


def describe(exc: BaseException) -> str:
    """``Type: message (file:line in function)``: the last line of a traceback, and where."""
    where = where_raised(exc)
    return f"{type(exc).__name__}: {exc}" + (f" ({where})" if where else "")


def _import(target: str, ref: str) -> Any:
    """The module ``target`` names: a dotted module name, or a ``.py`` file imported under its stem (its
    directory goes first on ``sys.path``, so modules beside it import too)."""
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            if not path.is_file():
                raise UserCodeError("import", ref, f"no such file {target}")
            if str(path.parent) not in sys.path:
                sys.path.insert(0, str(path.parent))
            name = path.stem
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise UserCodeError("import", ref, f"{target} cannot be imported as a Python module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(target)
    except UserCodeError:
        raise
    except ModuleNotFoundError as exc:
        raise UserCodeError("import", ref, f"module {target!r} cannot be imported: {describe(exc)}") from exc
    except BaseException as exc:  # noqa: BLE001 - the module's own code raised anything while importing
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise UserCodeError("import", ref, f"importing {target} raised {describe(exc)}") from exc


def _resolve(ref: str) -> Any:
    target, name = split_ref(ref)
    module = _import(target, ref)
    try:
        return getattr(module, name)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise UserCodeError("name", ref, f"{target} has no {name!r} (it has: {', '.join(public[:12]) or 'nothing'})") from None


def load_algorithm(ref: str) -> "type[Algorithm]":
    """The :class:`worker.api.Algorithm` subclass ``ref`` names: a built-in's name, ``module:Name`` or
    ``path/to/file.py:Name``. Raises :class:`UserCodeError` (the module, and what went wrong)."""
    from worker.api import Algorithm

    try:
        cls = _resolve(BUILTINS.get(ref, ref))
    except ValueError as exc:
        raise UserCodeError("name", ref, f"{exc}; or a built-in: {', '.join(BUILTINS)}") from None
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise UserCodeError("type", ref, f"{ref} is a {type(cls).__name__}, not a subclass of worker.api.Algorithm")
    return cls  # type: ignore[no-any-return]


def load_model_fn(ref: str) -> Callable[..., Any]:
    """The model function ``ref`` names (``module:function`` or ``path/to/file.py:function``), called as
    ``function(spaces, hparams)`` -> a Keras model. Raises :class:`UserCodeError`."""
    try:
        fn = _resolve(ref)
    except ValueError as exc:
        raise UserCodeError("name", ref, str(exc)) from None
    if not callable(fn):
        raise UserCodeError("type", ref, f"{ref} is a {type(fn).__name__}, not a function")
    return fn  # type: ignore[no-any-return]


def resolve_hparams(cls: "type[Algorithm]", name: str, env_id: str, spaces: Any, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """An algorithm's hyper-parameters for one env: declared defaults < its per-env tuning < ``overrides``.
    Raises :class:`UserCodeError` (kind ``hparams``) naming the unknown key or the bad value."""
    from worker.algorithms.hparams import defaults_of, merge

    try:
        hp = merge({**defaults_of(cls.hparams), **cls.tuned(env_id, spaces)}, overrides, algo=name)
        problems = cls.check_hparams(hp)
    except ValueError as exc:
        raise UserCodeError("hparams", name, str(exc)) from None
    if problems:
        raise UserCodeError("hparams", name, "; ".join(problems))
    return hp


def build_model(algorithm: Any, model_ref: str | None, seed: int) -> Any:
    """The run's Keras model: ``--model``'s function, or the algorithm's own; Keras seeded with ``seed`` first,
    so the master and every TensorFlow-acting group build the same initial weights."""
    import keras

    keras.utils.set_random_seed(seed)
    if model_ref:
        return load_model_fn(model_ref)(algorithm.spaces, algorithm.hp)
    return algorithm.model()
