"""NVML under a deadline: every query sequence runs in a forked helper process that can be killed.

Why a process and not a thread: a driver that hangs does so inside an ioctl, in uninterruptible sleep. A thread
stuck there cannot be stopped, and the interpreter waits for it at exit, so the launcher would hang anyway. A
child process can be abandoned: the launcher sends it SIGKILL at the deadline and never waits for it (a
process in uninterruptible sleep dies only when the driver lets go; until then it is the kernel's problem,
not ours).

Why one long-lived helper and not a fork per query: NVML is initialised once per helper (``nvmlInit`` opens the
devices, which without persistence mode takes a while on real GPUs), and the live view and the supervisor ask
every couple of seconds. The helper is forked on the first query (about a millisecond), answers queries in
order, and exits when this process closes the pipe (:func:`stop`, at exit, or when this process dies).

Protocol: length-prefixed pickles over two pipes. Request ``(function, args)``: a module-level function the
helper runs (it was forked from us, so it has the same code); reply ``("ok", value)`` or ``("error", text)``.
Before each NVML call the helper writes the call's name into a page shared with us (:func:`note_call`), so a
deadline can say where the driver is stuck.

The deadline is ``$LAUNCHER_NVML_TIMEOUT`` seconds (default :data:`DEFAULT_TIMEOUT_S`), read when a query starts
so ``launcher gpus``, ``plan``, ``up`` and the supervisor's watch share one setting (docs/gpus.md).
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import pickle
import select
import signal
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from launcher.errors import BadInput, MissingDependency

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

TIMEOUT_ENV = "LAUNCHER_NVML_TIMEOUT"
DEFAULT_TIMEOUT_S = 5.0
_HEADER = struct.Struct("!I")
_NOTE_BYTES = 256
_STOP_GRACE_S = 0.5  # how long a helper gets to call nvmlShutdown and exit before it is killed


class NvmlTimeout(MissingDependency):
    """NVML did not answer within the deadline (exit 6): the driver is hung or the GPU wedged."""

    def __init__(self, timeout_s: float, stuck_in: str | None) -> None:
        where = f", stuck in {stuck_in}" if stuck_in else ""
        super().__init__(
            f"the NVIDIA driver did not answer within {timeout_s:g} s (NVML{where}); the GPUs cannot be read",
            hint=f"check `nvidia-smi` (it may hang too) and `dmesg` for Xid errors; the GPU may need a reset or the "
                 f"machine a reboot. {TIMEOUT_ENV}=SECONDS sets the deadline; --gpus none runs on CPU without NVML",
        )
        self.timeout_s = timeout_s
        self.stuck_in = stuck_in


class NvmlHelperFailed(MissingDependency):
    """The helper died or answered with an error (not a hang): e.g. the library crashed the process."""


def timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """The deadline in seconds: ``$LAUNCHER_NVML_TIMEOUT`` (a positive number), else :data:`DEFAULT_TIMEOUT_S`.

    Raises:
        BadInput: the variable is set to something that is not a positive number of seconds.
    """
    raw = (os.environ if environ is None else environ).get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise BadInput(f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds",
                       hint=f"set it to e.g. {DEFAULT_TIMEOUT_S:g}, or unset it for the default")
    return value


# ------------------------------------------------------------------------------------------- in the helper
_note: mmap.mmap | None = None  # the shared page, set in the helper only


def note_call(name: str) -> None:
    """Record the NVML call about to start (in the helper; a no-op elsewhere). Costs a memory write."""
    if _note is not None:
        data = name.encode(errors="replace")[: _NOTE_BYTES - 1]
        _note[: len(data) + 1] = data + b"\0"


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _serve(requests: int, replies: int) -> None:
    """The helper's loop: run each request, send the reply; return on EOF."""
    while True:
        head = _read_exact(requests, _HEADER.size)
        if head is None:
            return
        body = _read_exact(requests, _HEADER.unpack(head)[0])
        if body is None:
            return
        try:
            fn, args = pickle.loads(body)
            reply: tuple[str, Any] = ("ok", fn(*args))
            data = pickle.dumps(reply)
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller as text
            data = pickle.dumps(("error", f"{type(exc).__name__}: {exc}"))
        note_call("")
        _write_all(replies, _HEADER.pack(len(data)) + data)


def _helper_main(requests: int, replies: int, note: mmap.mmap, on_exit: Callable[[], None] | None) -> None:
    """Entry point in the forked child. Never returns: ``os._exit`` so the parent's atexit handlers and
    buffered stdout are not run or flushed twice."""
    global _note
    code = 0
    try:
        # Ctrl-C reaches the whole process group; the parent handles it and closes our pipe.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # Drop every inherited descriptor but ours: a copy of a GPU lease's descriptor would keep its flock
        # alive after the launcher releases it, and sockets or pipes kept open would confuse their peers.
        keep = sorted({0, 1, 2, requests, replies})
        for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
            if high > low + 1:
                os.closerange(low + 1, high)
        _note = note
        _serve(requests, replies)
        if on_exit is not None:
            on_exit()
    except BaseException:  # noqa: BLE001 - a helper must never fall back into the parent's code
        code = 1
    finally:
        os._exit(code)


# ------------------------------------------------------------------------------------------- in the caller
class _Helper:
    """The parent's handle on one helper process."""

    def __init__(self, on_exit: Callable[[], None] | None) -> None:
        self.note = mmap.mmap(-1, _NOTE_BYTES)  # anonymous and shared: survives the fork, visible both ways
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child; covered by every test that reads NVML
            os.close(req_w)
            os.close(rep_r)
            _helper_main(req_r, rep_w, self.note, on_exit)
        os.close(req_r)
        os.close(rep_w)
        os.set_inheritable(req_w, False)
        os.set_inheritable(rep_r, False)
        self.requests, self.replies = req_w, rep_r

    def stuck_in(self) -> str | None:
        raw = bytes(self.note[:_NOTE_BYTES]).split(b"\0", 1)[0].decode(errors="replace")
        return raw or None

    def ask(self, fn: Callable[..., Any], args: tuple[Any, ...], deadline: float) -> tuple[str, Any] | None:
        """Send one request and wait for its reply until ``deadline`` (monotonic); None on timeout."""
        data = pickle.dumps((fn, args))
        _write_all(self.requests, _HEADER.pack(len(data)) + data)
        buf = b""
        need = _HEADER.size
        body_len: int | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.replies], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.replies, max(need - len(buf), 65536))
            if not chunk:
                raise EOFError("the NVML helper exited")
            buf += chunk
            if body_len is None and len(buf) >= _HEADER.size:
                body_len = _HEADER.unpack(buf[: _HEADER.size])[0]
                need = _HEADER.size + body_len
            if body_len is not None and len(buf) >= need:
                reply: tuple[str, Any] = pickle.loads(buf[_HEADER.size: need])
                return reply

    def close(self, *, grace_s: float) -> str | None:
        """Close the pipes; give the helper ``grace_s`` to exit on its own, then SIGKILL it and do not wait.
        Returns how it ended when it did ("killed by SIGSEGV", "exit status 1"), else None."""
        for fd in (self.requests, self.replies):
            try:
                os.close(fd)
            except OSError:
                pass
        end = time.monotonic() + grace_s
        while True:
            done, how = _reap_status(self.pid)
            if done:
                return how
            if time.monotonic() >= end:
                break
            time.sleep(0.005)
        kill(self.pid)
        return None


def _reap_status(pid: int) -> tuple[bool, str | None]:
    """Collect ``pid`` if it has exited (never blocks): (gone, how it ended when known)."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True, None  # already collected (by us or by someone reaping every child)
    if done != pid:
        return False, None
    if os.WIFSIGNALED(status):
        return True, f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return True, f"exit status {os.waitstatus_to_exitcode(status)}"


def _reap(pid: int) -> bool:
    """Collect ``pid`` if it has exited (never blocks). True when it is gone."""
    return _reap_status(pid)[0]


_abandoned: list[int] = []


def kill(pid: int) -> None:
    """SIGKILL a helper and leave it: a process in uninterruptible sleep cannot be waited for. Later calls
    collect it (no zombie piles up) once the kernel lets it die."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if not _reap(pid):
        _abandoned.append(pid)


def _reap_abandoned() -> None:
    _abandoned[:] = [pid for pid in _abandoned if not _reap(pid)]


_lock = threading.Lock()
_helper: _Helper | None = None
_atexit_registered = False


def call(fn: Callable[..., _T], *args: Any, on_exit: Callable[[], None] | None = None,
         timeout: float | None = None) -> _T:
    """Run ``fn(*args)`` in the NVML helper and return its result, within the deadline.

    Args:
        fn: a module-level function (it is sent by name) whose result pickles; it runs in the helper.
        on_exit: run in the helper when it is told to stop (e.g. ``nvmlShutdown``); taken from the call that
            starts the helper.
        timeout: seconds; None: :func:`timeout_s` (``$LAUNCHER_NVML_TIMEOUT`` or 5 s). Concurrent callers queue
            for the one helper; the wait counts against their deadline too.

    Raises:
        NvmlTimeout: no answer within the deadline (exit 6); the helper was killed and is not waited for.
        NvmlHelperFailed: the helper died or ``fn`` raised (the message has the exception's text).
        BadInput: ``$LAUNCHER_NVML_TIMEOUT`` is not a positive number.
    """
    global _helper, _atexit_registered
    limit = timeout_s() if timeout is None else timeout
    deadline = time.monotonic() + limit
    if not _lock.acquire(timeout=limit):
        raise NvmlTimeout(limit, "a query of another thread")
    try:
        _reap_abandoned()
        if _helper is None:
            _helper = _Helper(on_exit)
            if not _atexit_registered:
                atexit.register(stop)
                _atexit_registered = True
        helper = _helper
        try:
            reply = helper.ask(fn, args, deadline)
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            _helper = None
            stuck = helper.stuck_in()
            how = helper.close(grace_s=0.2) or str(exc)
            raise NvmlHelperFailed(
                f"the NVIDIA library crashed the process reading the GPUs ({how}"
                + (f" in {stuck}" if stuck else "") + ")",
                hint="check `nvidia-smi` and `dmesg`; a driver and library of different versions or a broken "
                     "install can do this; --gpus none runs on CPU without NVML") from None
        if reply is None:
            stuck = helper.stuck_in()
            _helper = None
            helper.close(grace_s=0)
            logger.debug("NVML timed out after %g s in %s; helper %d killed", limit, stuck, helper.pid)
            raise NvmlTimeout(limit, stuck)
        status, value = reply
        if status != "ok":
            raise NvmlHelperFailed(f"reading the GPUs failed: {value}", hint="run `nvidia-smi` to check the driver")
        result: _T = value
        return result
    finally:
        _lock.release()


def stop() -> None:
    """Stop the helper if one runs (it shuts NVML down); the next :func:`call` starts a fresh one."""
    global _helper
    if not _lock.acquire(timeout=_STOP_GRACE_S):
        # Another thread waits on the helper (a hung driver, a daemon watch thread at exit): end it now rather
        # than wait out that thread's deadline; its call then fails with NvmlHelperFailed.
        helper, _helper = _helper, None
        if helper is not None:
            kill(helper.pid)
        return
    try:
        helper, _helper = _helper, None
        if helper is not None:
            helper.close(grace_s=_STOP_GRACE_S)
        _reap_abandoned()
    finally:
        _lock.release()


def helper_pid() -> int | None:
    """The running helper's pid (for tests and diagnostics)."""
    return None if _helper is None else _helper.pid
