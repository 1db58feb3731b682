"""The only code that talks to the GPU lease broker (:mod:`launcher.gpu.broker`).

One connection per request: the client sends one JSON line (at most
:data:`~launcher.gpu.broker_wire.MAX_REQUEST_BYTES`) and reads one JSON line back (the wire format is
:mod:`launcher.gpu.broker_wire`, shared with the broker). Who asks is never in the request: the broker reads the
caller's uid and pid from the socket (``SO_PEERCRED``). The client checks the other way round too: the process
serving the socket must be root's, else it refuses to believe the answer (someone else's socket at that path
cannot grant a lease).

A refusal comes back as the error the launcher raises elsewhere for the same thing: a GPU held by another run
or a per-user cap reached is :class:`~launcher.errors.NoResources` (exit 5), a request the broker refuses for
who asks (another user's lease, another user's process) or for its content is
:class:`~launcher.errors.BadInput` (exit 2), and no broker answering is
:class:`~launcher.errors.MissingDependency` (exit 6) naming the socket.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from launcher.errors import BadInput, LauncherError, MissingDependency, NoResources
from launcher.gpu.broker_wire import MAX_REPLY_BYTES, MAX_REQUEST_BYTES, parse_reply, peer_credentials, request_line

TIMEOUT_S = 10.0  # connect + answer; the broker answers in milliseconds unless it is stuck
START_HINT = "ask the administrator to start `launcher admin broker` (docs/gpus.md, \"The lease broker\")"
# A refusal's kind (broker_wire.REFUSALS) -> the error the launcher raises for the same thing elsewhere.
_RAISES: dict[str, type[LauncherError]] = {"busy": NoResources, "cap": NoResources, "denied": BadInput, "bad": BadInput}


def _unreachable(path: Path, why: str) -> MissingDependency:
    return MissingDependency(f"the GPU lease broker at {path} (named in the site file) is not answering: {why}",
                             hint=START_HINT)


def _read_line(sock: socket.socket, path: Path) -> bytes:
    buf = bytearray()
    while b"\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            if not buf:
                raise _unreachable(path, "it closed the connection without an answer")
            break
        buf += chunk
        if len(buf) > MAX_REPLY_BYTES:
            raise LauncherError(f"the GPU lease broker at {path} sent more than {MAX_REPLY_BYTES} bytes",
                                hint="report this: the broker's answers are one short JSON line")
    return bytes(buf.split(b"\n", 1)[0])


def ask(path: Path, request: dict[str, Any], *, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Send one request, return the broker's reply (``ok`` true) or raise its refusal (module docstring).

    Raises:
        MissingDependency: nothing answers at ``path`` (no broker running), or it answers too slowly.
        BadInput: the request is too long, or the broker refused it for who asks or what it says.
        NoResources: the broker refused a lease: GPUs held by other runs, or the per-user cap.
        LauncherError: the socket is served by a non-root process, or the reply is not the protocol's.
    """
    line = request_line(request)
    if len(line) > MAX_REQUEST_BYTES:
        raise BadInput(f"a lease broker request of {len(line)} bytes is longer than the {MAX_REQUEST_BYTES} allowed "
                       f"({len(request.get('uuids') or [])} UUIDs)", hint="ask for fewer GPUs in one run")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout_s)
    try:
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise _unreachable(path, exc.strerror or str(exc)) from None
        _, uid, _ = peer_credentials(sock)
        if uid != 0:
            raise LauncherError(f"the GPU lease broker socket {path} is served by uid {uid}, not root; not trusting it",
                                hint="ask the administrator to check who listens there and restart "
                                "`launcher admin broker` as root")
        try:
            sock.sendall(line)
            raw = _read_line(sock, path)
        except TimeoutError:
            raise _unreachable(path, f"no answer within {timeout_s:g} s") from None
        except OSError as exc:
            raise _unreachable(path, exc.strerror or str(exc)) from None
    finally:
        sock.close()
    reply = parse_reply(raw)
    if reply is None:
        raise LauncherError(f"the GPU lease broker at {path} answered {raw[:200]!r}, not a JSON object",
                            hint="check that `launcher admin broker` and this launcher are the same version")
    if reply.get("ok") is True:
        return reply
    message = str(reply.get("error") or f"the GPU lease broker at {path} refused the request without a reason")
    hint = reply.get("hint") if isinstance(reply.get("hint"), str) else None
    raise _RAISES.get(str(reply.get("refusal")), LauncherError)(message, hint=hint)


def lease(path: Path, run_id: str, uuids: Iterable[str], count: int | None = None) -> list[str]:
    """Lease ``uuids`` (all of them, or the first ``count`` free) for ``run_id``, tied to this process: the
    broker keeps them until :func:`release` or until every process tied to them has exited. Returns the
    UUIDs leased."""
    reply = ask(path, {"op": "lease", "run_id": run_id, "uuids": list(uuids), "count": count})
    return [str(u) for u in reply.get("uuids") or []]


def tie(path: Path, uuids: Iterable[str], pid: int) -> None:
    """Keep the leases of ``uuids`` (this user's) alive for as long as process ``pid`` (this user's) lives too."""
    ask(path, {"op": "tie", "uuids": list(uuids), "pid": pid})


def release(path: Path, uuids: Iterable[str]) -> list[str]:
    """Drop this user's leases of ``uuids`` now. Returns the UUIDs released (a lease already gone is not)."""
    return [str(u) for u in ask(path, {"op": "release", "uuids": list(uuids)}).get("released") or []]


def leases(path: Path) -> list[dict[str, Any]]:
    """Every lease the broker holds: uuid, uid, user, run_id, pids, since."""
    return [x for x in ask(path, {"op": "list"}).get("leases") or [] if isinstance(x, dict)]
