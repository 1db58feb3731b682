"""The environments workers run, and the way every caller gets one: by gymnasium id.

Importing this package registers our own envs with gymnasium (``launcher/Snake-v0``, see
:mod:`worker.envs.snake`), so after ``import worker.envs`` a plain ``gymnasium.make`` finds them too.
:func:`make_env`, :func:`make_vector_env` and :func:`describe_env` do that import for you and turn an
unknown id into a ``ValueError`` that suggests the ids you probably meant.

Env packages register their ids when they are imported (gymnasium 1.x loads no entry points), so an id
may name its module in gymnasium's own syntax, ``module:EnvId`` (``flappy_bird_gymnasium:FlappyBird-v0``):
the module is imported first, in every process that makes the env. Importing it runs the user's code; the
user chose it. ``ALE/*`` ids import ``ale_py`` by themselves and are preprocessed for Atari
(:mod:`worker.envs.atari`). Every failure is an :class:`EnvError` (a ``ValueError``) whose ``kind`` says
which: a module that cannot be imported (``missing_module``, naming the module and what is missing), an
unknown id (``unknown_id``), or arguments the env refuses (``bad_args``).
"""

from __future__ import annotations

import difflib
import importlib
import re
from dataclasses import dataclass
from typing import Any, Literal

import gymnasium
import numpy as np
from gymnasium import spaces

from worker.contract import plain_env_id as plain_id  # the one definition; per-env defaults key on it

__all__ = ["SNAKE_ID", "EnvError", "EnvInfo", "describe_env", "make_env", "make_vector_env", "plain_id",
           "register_envs", "resolve_env", "split_env_id"]

SNAKE_ID = "launcher/Snake-v0"


def register_envs() -> None:
    """Register our envs with gymnasium. Idempotent: ids already registered are left alone.

    Re-registering would only make gymnasium warn about overriding an id, so we check first.
    """
    if SNAKE_ID not in gymnasium.registry:
        gymnasium.register(id=SNAKE_ID, entry_point="worker.envs.snake:SnakeEnv")


register_envs()


class EnvError(ValueError):
    """An env that cannot be made here. ``kind``: ``missing_module`` (``module`` cannot be imported;
    ``missing`` is the module Python could not find, ``package`` the pip package that usually provides it),
    ``missing_library`` (a shared library the env loads is not installed; ``package``: its Debian package),
    ``unknown_id`` (no such registered id), ``bad_args`` (the env refused its keyword arguments) or ``error``
    (anything else its constructor raised)."""

    def __init__(self, message: str, *, kind: str, env_id: str, module: str | None = None,
                 missing: str | None = None, package: str | None = None) -> None:
        super().__init__(message)
        self.kind, self.env_id, self.module, self.missing, self.package = kind, env_id, module, missing, package

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "env_id": self.env_id, "module": self.module, "missing": self.missing,
                "package": self.package, "message": str(self)}


def split_env_id(env_id: str) -> tuple[str | None, str]:
    """``"pkg.mod:Env-v0"`` -> ``("pkg.mod", "Env-v0")``; an id without a module -> ``(None, env_id)``.

    gymnasium's own syntax (``gymnasium.make("module:EnvId")``). Raises :class:`EnvError` (``unknown_id``)
    when either side is empty or the module is not a dotted Python name.
    """
    if ":" not in env_id:
        return None, env_id
    module, _, plain = env_id.partition(":")
    if not plain or ":" in plain or not all(part.isidentifier() for part in module.split(".")):
        raise EnvError(f"env id {env_id!r} is not 'EnvId' or 'module:EnvId' (a dotted module name, one colon, "
                       f"then a registered id, e.g. 'flappy_bird_gymnasium:FlappyBird-v0')",
                       kind="unknown_id", env_id=env_id)
    return module, plain


# Modules whose pip package has another name, for the "install ..." hint.
_PACKAGES = {"ale_py": "ale-py", "cv2": "opencv-python-headless"}


def _package_for(module: str) -> str:
    top = module.split(".")[0]
    return _PACKAGES.get(top, top.replace("_", "-"))


# Shared libraries env packages load that a minimal image may lack, and the Debian package that has each.
_SYSTEM_PACKAGES = {"libgthread-2.0": "libglib2.0-0", "libglib-2.0": "libglib2.0-0", "libGL": "libgl1",
                    "libEGL": "libegl1", "libX11": "libx11-6", "libsndfile": "libsndfile1"}
_SHARED_LIBRARY = re.compile(r"([\w.+-]+\.so[\w.]*): cannot open shared object file")


def missing_library(exc: BaseException) -> EnvError | None:
    """An :class:`EnvError` (``missing_library``) when ``exc`` says a shared library could not be loaded (a
    system package, not a Python one: ``pip``/``--with`` cannot add it), else None."""
    m = _SHARED_LIBRARY.search(str(exc))
    if m is None:
        return None
    lib = m.group(1)
    package = next((deb for prefix, deb in _SYSTEM_PACKAGES.items() if lib.startswith(prefix + ".")), None)
    return EnvError(f"a system library is missing here: {lib} ({type(exc).__name__}: {exc})",
                    kind="missing_library", env_id="", missing=lib, package=package)


def import_env_module(module: str, env_id: str) -> None:
    """Import ``module`` (it registers its envs with gymnasium on import).

    Raises:
        EnvError: ``missing_module``, naming the module, what Python could not find and the usual package.
    """
    try:
        importlib.import_module(module)
    except ImportError as exc:
        if (lib := missing_library(exc)) is not None:
            lib.env_id, lib.module = env_id, module
            raise lib from exc
        missing = exc.name or module
        package = _package_for(missing)
        because = ("it is not installed" if missing == module or module.startswith(missing + ".")
                   else f"it needs {missing!r}, which is not installed")
        raise EnvError(f"env {env_id!r}: module {module!r} cannot be imported here ({because}: {exc}); install "
                       f"the package that provides it (usually {package!r}) or put its source directory on the "
                       f"Python path", kind="missing_module", env_id=env_id, module=module, missing=missing,
                       package=package) from exc


def resolve_env(env_id: str) -> str:
    """Import what ``env_id`` needs (its ``module:``, ``ale_py`` for ``ALE/*``) and return the registered
    id to make. Raises :class:`EnvError` (``missing_module`` or ``unknown_id``)."""
    module, plain = split_env_id(env_id)
    if module is not None:
        import_env_module(module, env_id)
    if plain.startswith("ALE/") and plain not in gymnasium.registry:
        import_env_module("ale_py", env_id)
    _require_registered(plain, env_id)
    return plain


def _bad_args(env_id: str, kwargs: dict[str, Any], exc: TypeError) -> EnvError:
    return EnvError(f"env {env_id!r} does not take the arguments {sorted(kwargs)} (--env-arg / [up.env_args]): "
                    f"{exc}", kind="bad_args", env_id=env_id)


def _make(env_id: str, render_mode: str | None, kwargs: dict[str, Any]) -> gymnasium.Env[Any, Any]:
    """One env of ``env_id`` as every caller gets it: resolved, Atari-preprocessed for ``ALE/*`` ids."""
    from worker.envs import atari

    plain = resolve_env(env_id)
    try:
        if atari.is_atari(plain):
            return atari.make_atari(plain, render_mode=render_mode, **kwargs)
        return gymnasium.make(plain, render_mode=render_mode, **kwargs)
    except TypeError as exc:
        if kwargs and "argument" in str(exc):
            raise _bad_args(env_id, kwargs, exc) from exc
        raise
    except gymnasium.error.DependencyNotInstalled as exc:
        missing = "cv2" if "opencv" in str(exc).lower() else None
        raise EnvError(f"env {env_id!r} needs a package that is not installed here: {exc}", kind="missing_module",
                       env_id=env_id, module=missing, missing=missing,
                       package=_package_for(missing) if missing else None) from exc


@dataclass(frozen=True)
class EnvInfo:
    """What a policy network needs to know about an env: its observation and action shapes.

    Attributes:
        env_id: the gymnasium id it describes.
        obs_shape: shape of one observation.
        obs_dtype: numpy dtype name of observations (``"float32"``, ``"uint8"``, ...).
        action_kind: ``"discrete"`` (``Discrete(n)``, actions 0..n-1) or ``"box"`` (a vector of floats).
        n_actions: number of actions, for ``"discrete"``; None for ``"box"``.
        action_dim: length of the action vector, for ``"box"``; None for ``"discrete"``.
        action_low: per-dimension lower bound, for ``"box"``; None for ``"discrete"``.
        action_high: per-dimension upper bound, for ``"box"``; None for ``"discrete"``.
    """

    env_id: str
    obs_shape: tuple[int, ...]
    obs_dtype: str
    action_kind: Literal["discrete", "box"]
    n_actions: int | None = None
    action_dim: int | None = None
    action_low: tuple[float, ...] | None = None
    action_high: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.action_kind == "discrete":
            if self.n_actions is None or self.n_actions < 1:
                problems.append(f"a discrete action space needs n_actions >= 1, got {self.n_actions}")
            if self.action_dim is not None or self.action_low is not None or self.action_high is not None:
                problems.append("a discrete action space has no action_dim, action_low or action_high")
        elif self.action_kind == "box":
            if self.n_actions is not None:
                problems.append(f"a box action space has no n_actions, got {self.n_actions}")
            if self.action_dim is None or self.action_dim < 1:
                problems.append(f"a box action space needs action_dim >= 1, got {self.action_dim}")
            for name, bound in (("action_low", self.action_low), ("action_high", self.action_high)):
                if bound is None or len(bound) != self.action_dim:
                    problems.append(f"{name} must have action_dim={self.action_dim} values, got {bound}")
        else:
            problems.append(f"action_kind must be 'discrete' or 'box', got {self.action_kind!r}")
        if problems:
            raise ValueError(f"invalid EnvInfo for {self.env_id!r}: " + "; ".join(problems))

    @property
    def image_like(self) -> bool:
        """Whether observations are rank 3 (height, width, channels): a conv torso fits them."""
        return len(self.obs_shape) == 3


def make_env(
    env_id: str, seed: int, render_mode: str | None = None, **kwargs: Any
) -> gymnasium.Env[Any, Any]:
    """Build the env ``env_id`` with gymnasium (our ids included) and seed it.

    Seeding in gymnasium is only through ``reset(seed=...)``, so this resets the env once with ``seed``
    (and seeds its action space, for reproducible random policies). Callers then use ``reset()`` without
    a seed; each later episode continues the seeded stream, so the whole run is reproducible.

    Args:
        env_id: a registered gymnasium id, e.g. ``"CartPole-v1"`` or ``"launcher/Snake-v0"``, or
            ``"module:EnvId"`` (the module is imported first); ``ALE/*`` ids come Atari-preprocessed.
        seed: seed for the env's RNG and its action space.
        render_mode: passed to ``gymnasium.make`` (``"rgb_array"`` for frames); None for no rendering.
        **kwargs: env constructor arguments, passed to ``gymnasium.make`` (e.g. ``size=8`` for Snake).

    Raises:
        EnvError (a ValueError): if ``env_id`` is not registered (the message names close ids), its module
            cannot be imported, or the env refuses ``kwargs``.
    """
    env = _make(env_id, render_mode, kwargs)
    env.reset(seed=seed)
    env.action_space.seed(seed)
    return env


def make_vector_env(env_id: str, num_envs: int, **kwargs: Any) -> gymnasium.vector.VectorEnv[Any, Any, Any]:
    """``num_envs`` copies of ``env_id`` stepped as one vector env, the fastest that keeps the semantics.

    Where gymnasium ships the env's own numpy-vectorised implementation (``vector_entry_point``, e.g.
    CartPole: one array operation steps every copy, ~2.5x ``SyncVectorEnv`` at 16 envs) that is used; it
    autoresets in ``NEXT_STEP`` mode (the step after an episode ends returns the reset observation with
    reward 0 and ignores the action), which :class:`worker.algorithms.rollout.Collector` masks out. Every
    other env runs in gymnasium's ``SyncVectorEnv`` in ``SAME_STEP`` mode (the final observation in
    ``info["final_obs"]``), the semantics of stepping the envs one by one. Not reset: the caller seeds
    the first ``reset`` (copy ``i`` gets ``seed + i`` with ``SyncVectorEnv``).

    ``ALE/*`` ids are ``num_envs`` preprocessed Atari envs (:mod:`worker.envs.atari`) in a ``SyncVectorEnv``;
    ale-py's own vector env is not needed.

    Raises:
        EnvError (a ValueError): as :func:`make_env`.
    """
    from worker.envs import atari

    plain = resolve_env(env_id)
    same_step = {"autoreset_mode": gymnasium.vector.AutoresetMode.SAME_STEP}
    if atari.is_atari(plain):
        _make(env_id, None, kwargs).close()  # its errors as make_env's, before num_envs copies are made
        return gymnasium.vector.SyncVectorEnv([lambda: atari.make_atari(plain, **kwargs)] * num_envs,
                                              autoreset_mode=gymnasium.vector.AutoresetMode.SAME_STEP)
    if gymnasium.spec(plain).vector_entry_point is not None and not kwargs:
        try:
            return gymnasium.make_vec(plain, num_envs=num_envs, vectorization_mode="vector_entry_point")
        except (ImportError, gymnasium.error.Error):  # e.g. a JAX implementation without JAX installed
            pass
    try:
        return gymnasium.make_vec(plain, num_envs=num_envs, vectorization_mode="sync", vector_kwargs=same_step,
                                  **kwargs)
    except TypeError as exc:
        if kwargs and "argument" in str(exc):
            raise _bad_args(env_id, kwargs, exc) from exc
        raise


def describe_env(env_id: str, **kwargs: Any) -> EnvInfo:
    """Build ``env_id`` once (with ``kwargs``, as :func:`make_env` would), read its observation and action
    spaces, and close it.

    Raises:
        ValueError: if ``env_id`` cannot be made (an :class:`EnvError`), its observations are not a ``Box``,
            or its actions are neither ``Discrete`` (starting at 0) nor a rank-1 ``Box``.
    """
    env = _make(env_id, None, kwargs)
    try:
        return describe_spaces(env_id, env.observation_space, env.action_space)
    finally:
        env.close()


def describe_spaces(
    env_id: str, observation_space: spaces.Space[Any], action_space: spaces.Space[Any]
) -> EnvInfo:
    """:class:`EnvInfo` from an env's spaces, without building the env (see :func:`describe_env`).

    Raises:
        ValueError: for spaces our policies cannot handle, naming the space.
    """
    if not isinstance(observation_space, spaces.Box):
        raise ValueError(f"env {env_id!r}: observation space {observation_space} is not supported; only Box")
    obs_shape = tuple(int(d) for d in observation_space.shape)
    obs_dtype = np.dtype(observation_space.dtype).name
    if isinstance(action_space, spaces.Discrete):
        if int(action_space.start) != 0:
            raise ValueError(
                f"env {env_id!r}: Discrete action space starts at {action_space.start}; only 0 is supported"
            )
        return EnvInfo(env_id, obs_shape, obs_dtype, "discrete", n_actions=int(action_space.n))
    if isinstance(action_space, spaces.Box) and len(action_space.shape) == 1:
        return EnvInfo(
            env_id,
            obs_shape,
            obs_dtype,
            "box",
            action_dim=int(action_space.shape[0]),
            action_low=tuple(float(x) for x in action_space.low),
            action_high=tuple(float(x) for x in action_space.high),
        )
    raise ValueError(
        f"env {env_id!r}: action space {action_space} is not supported; only Discrete or a rank-1 Box"
    )


def _require_registered(env_id: str, given: str | None = None) -> None:
    """Raise an :class:`EnvError` naming ``env_id`` (as the user ``given`` it) and the closest registered ids
    if it is not registered."""
    if env_id in gymnasium.registry:
        return
    given = given or env_id
    # Match case-insensitively ("cartpole-v1" should find "CartPole-v1"), then report the real spelling.
    by_lower = {known.lower(): known for known in gymnasium.registry}
    close = [by_lower[m] for m in difflib.get_close_matches(env_id.lower(), by_lower, n=3, cutoff=0.6)]
    hint = (
        "did you mean " + " or ".join(repr(c) for c in close) + "?"
        if close
        else "list the registered ids with gymnasium.pprint_registry()"
    )
    where = "" if given == env_id else f" (after importing {split_env_id(given)[0]!r})"
    raise EnvError(f"unknown env id {env_id!r}{where}: it is not registered with gymnasium; {hint}",
                   kind="unknown_id", env_id=given)
