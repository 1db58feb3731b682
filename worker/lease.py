"""The master takes over its run's GPU leases, first thing, so they live exactly as long as it does.

A detached Docker run's launcher exits; the GPUs must stay leased until the run ends, however it ends.
The launcher bind-mounts the run's lease files (read-only) into the master container and names them in
``LAUNCHER_LEASES``; :func:`hold_from_env` takes an exclusive ``flock`` on each before anything else is
imported (TensorFlow included) and keeps the descriptors open for the life of the process. The kernel drops
the locks when the master's process ends: ``launcher down``, a kill, the engine's restart. ``flock`` needs
no write access, so a read-only file owned by root works.

The launcher confirms from ``/proc/locks`` that a process in this container holds every lease before it
starts the groups. If another launcher took a GPU in between (the hand-over cannot be gapless with
``flock``), the master exits :data:`LEASE_LOST_EXIT` at once and that launcher tears the run down.
Standard library only: this runs before the heavy imports.
"""

from __future__ import annotations

import fcntl
import os
import sys

from worker.contract import LEASE_LOST_EXIT, LEASES_ENV

_held: list[int] = []  # open for the life of the process: closing one would drop its lease


def hold(paths: list[str]) -> None:
    """Take an exclusive lease on each file without waiting.

    Raises:
        BlockingIOError: one is held by another process (the others taken here are dropped again).
        OSError: a file cannot be opened.
    """
    taken: list[int] = []
    try:
        for path in paths:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            taken.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        for fd in taken:
            os.close(fd)
        raise
    _held.extend(taken)


def hold_from_env(environ: dict[str, str] | None = None) -> int:
    """Hold the leases named in ``LAUNCHER_LEASES`` (none: nothing to do). Returns how many were taken;
    exits the process with :data:`LEASE_LOST_EXIT` when one is held elsewhere."""
    env = os.environ if environ is None else environ
    paths = [p for p in (env.get(LEASES_ENV) or "").split(",") if p]
    if not paths:
        return 0
    try:
        hold(paths)
    except BlockingIOError:
        sys.stderr.write(f"master: a GPU lease of this run is held by another run ({', '.join(paths)}); "
                         "exiting so the launcher can choose again\n")
        sys.exit(LEASE_LOST_EXIT)
    except OSError as exc:
        sys.stderr.write(f"master: cannot open the GPU lease files: {exc}\n")
        sys.exit(LEASE_LOST_EXIT)
    return len(paths)


if __name__ == "__main__":  # a stand-in master for tests: hold the leases, then wait to be killed
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # as PID 1 in a container nothing else would end it
    print(f"holding {hold_from_env()} lease(s)", flush=True)
    signal.pause()
