"""Engine errors become :mod:`launcher.errors` types here, in one function (docker-py's own
``errors.create_api_error_from_http_exception`` idea, turned the other way).

Every call into the Docker SDK goes through :func:`engine_call`, so what a caller catches is always a
:class:`~launcher.errors.LauncherError` that says what was being done, what the engine answered and what to
try: an engine that stops answering mid-run (``requests``/``urllib3`` connection errors, which some SDK
versions do not wrap) is a :class:`~launcher.errors.MissingDependency` like one that never answered.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from launcher.errors import LauncherError, MissingDependency

T = TypeVar("T")
_RAISE = object()

ENGINE_HINT = ("start the engine (`sudo systemctl start docker`), or point DOCKER_HOST at one; your user needs "
               "access to its socket (the docker group); or use --backend process")


ENGINE_RESTART_WINDOW_S = 60.0  # how long a supervisor or teardown waits for an engine that stopped answering


class EngineUnreachable(MissingDependency):
    """The engine stopped answering (a connection refused or broken): it may come back (a ``systemctl restart
    docker``), so a supervisor or a teardown waits for it a while (:func:`outlast_outage`) before giving up."""


def docker_host() -> str:
    """The engine address the SDK will use, for messages."""
    return os.environ.get("DOCKER_HOST") or "unset, so unix:///var/run/docker.sock"


def is_not_found(exc: BaseException) -> bool:
    """Whether ``exc`` is the engine saying the object does not exist (404)."""
    try:
        from docker.errors import NotFound
    except ImportError:
        return False
    return isinstance(exc, NotFound)


def _connection_error(exc: BaseException) -> bool:
    try:
        from docker.errors import DockerException
        from requests.exceptions import ConnectionError as RequestsConnectionError
        from urllib3.exceptions import HTTPError as Urllib3Error
    except ImportError:
        return isinstance(exc, OSError)
    from docker.errors import APIError, ContainerError

    if isinstance(exc, (APIError, ContainerError)):  # the engine answered
        return False
    return isinstance(exc, (DockerException, RequestsConnectionError, Urllib3Error, OSError))


def engine_error(exc: BaseException, doing: str, *, hint: str | None = None) -> LauncherError:
    """The :class:`LauncherError` for ``exc``, raised by the SDK while ``doing`` (``"create network X"``).

    * no engine, or the connection to it broke: :class:`MissingDependency`, naming DOCKER_HOST;
    * an image the engine does not have: :class:`MissingDependency` (``launcher build`` makes it);
    * a container run to its end that exited non-zero: :class:`LauncherError` with its status and last stderr;
    * anything else the engine refused: :class:`LauncherError` with the engine's explanation.
    """
    from docker.errors import APIError, ContainerError, ImageNotFound

    if isinstance(exc, LauncherError):
        return exc
    if isinstance(exc, ContainerError):
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
        last = err.strip().splitlines()[-1][:300] if err.strip() else "no stderr"
        return LauncherError(f"cannot {doing}: the container exited with status {exc.exit_status}: {last}", hint=hint)
    if isinstance(exc, ImageNotFound):
        return MissingDependency(f"cannot {doing}: the image is not on this engine ({exc.explanation or exc})",
                                 hint=hint or "`launcher build` makes it; or pass --image")
    if isinstance(exc, APIError):
        return LauncherError(f"cannot {doing}: {exc.explanation or exc}", hint=hint)
    if _connection_error(exc):
        text = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        return EngineUnreachable(f"cannot {doing}: no Docker engine answers at DOCKER_HOST={docker_host()}: {text}",
                                 hint=ENGINE_HINT)
    return LauncherError(f"cannot {doing}: {type(exc).__name__}: {exc}", hint=hint)


def engine_call(doing: str, call: Callable[[], T], *, hint: str | None = None, gone: object = _RAISE) -> T:
    """``call()``, with every SDK error turned into a :class:`LauncherError` by :func:`engine_error`.

    Args:
        doing: what the call does, for the message (``"start container abc"``).
        hint: what to try when the engine refuses.
        gone: returned instead of raising when the engine says the object does not exist (404).
    """
    try:
        return call()
    except LauncherError:  # already ours (a signal handler's, say): as it is
        raise
    except Exception as exc:  # noqa: BLE001 - every SDK and transport error is mapped here, once
        if gone is not _RAISE and is_not_found(exc):
            return gone  # type: ignore[return-value]
        raise engine_error(exc, doing, hint=hint) from exc


def outlast_outage(call: Callable[[], T], *, window_s: float, poll_s: float = 1.0,
                   on_wait: Callable[[EngineUnreachable], None] | None = None) -> T:
    """``call()``, called again while the engine does not answer, for up to ``window_s`` seconds (an engine
    restart takes a few). ``on_wait`` hears of each failed try. Raises the last :class:`EngineUnreachable`
    when the window closes; any other error at once."""
    import time

    deadline = time.monotonic() + window_s
    while True:
        try:
            return call()
        except EngineUnreachable as exc:
            if time.monotonic() + poll_s > deadline:
                raise
            if on_wait is not None:
                on_wait(exc)
            time.sleep(poll_s)
