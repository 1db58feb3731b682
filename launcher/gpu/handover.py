"""A run's GPU leases handed to its master, so they live as long as the run and not the launcher.

Docker (attached or detached): the launcher mounts the run's lease files read-only into the master
container (:func:`master_mounts`), names them in ``LAUNCHER_LEASES`` (:func:`master_env`), drops its own
locks right before the master starts (:func:`hand_over`), and :func:`confirm_held_by_container` waits until
``/proc/locks`` shows a process of that container holding every lease before the groups start. ``flock``
cannot pass a lock between processes that do not share a descriptor, so the hand-over has a gap of about
a container start: another launcher may take a GPU in it; the master then exits
:data:`worker.lease.LEASE_LOST_EXIT` and :func:`confirm_held_by_container` raises NoResources (the caller
tears the run down; ``--wait`` queues again). The kernel drops the master's locks when its process ends
(``launcher down``, ``docker kill``, an engine restart), so the GPUs are free within a second of the run's end.

Process backend: the master child inherits the locked descriptors (:attr:`Reservation.fds`, passed like the
listening socket), so the leases outlive a killed launcher for as long as the master finishes.
Swarm: leases stay with the swarm's generic resources (the engine schedules GPUs across nodes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from launcher.errors import NoResources
from launcher.gpu.leaseholders import list_holders
from launcher.gpu.reservations import LeaseDir, Reservation, lease_dir
from worker.contract import LEASE_DIR, LEASE_LOST_EXIT, LEASES_ENV


def container_path(uuid: str) -> str:
    return f"{LEASE_DIR}/{uuid}.lock"


def master_mounts(reservation: Reservation, uuids: Iterable[str] | None = None) -> dict[str, str]:
    """Host lease file -> path in the container; mount them read-only (``flock`` needs no write). ``uuids``: only
    these of the run's leases (an elastic run's groups hold their own GPUs': :func:`launcher.gpu.elastic.lease_owners`)."""
    only = None if uuids is None else set(uuids)
    return {str(p): container_path(u) for u, p in zip(reservation.uuids, reservation.paths) if only is None or u in only}


def master_env(reservation: Reservation, uuids: Iterable[str] | None = None) -> dict[str, str]:
    """The container's ``LAUNCHER_LEASES`` (read by :func:`worker.lease.hold_from_env`); ``uuids`` as above."""
    only = None if uuids is None else set(uuids)
    mine = [u for u in reservation.uuids if only is None or u in only]
    return {LEASES_ENV: ",".join(container_path(u) for u in mine)} if mine else {}


def lease_dir_of(reservation: Reservation) -> LeaseDir:
    """Where ``reservation``'s lease files are (for :func:`confirm_held_by_container`)."""
    return LeaseDir(reservation.lock_dir)


def hand_over(reservation: Reservation) -> tuple[str, ...]:
    """Drop the launcher's own locks, right before the master container starts; returns the UUIDs."""
    uuids = reservation.uuids
    reservation.release()
    return uuids


def confirm_held_by_container(uuids: tuple[str, ...], container_id: str, *, exit_code: Callable[[], int | None],
                              where: LeaseDir | None = None, timeout_s: float = 30.0,
                              poll_s: float = 0.05, who: str = "the master") -> float:
    """Wait until a process in ``container_id`` holds every lease in ``uuids`` (from ``/proc/locks``).

    Args:
        exit_code: the master container's exit code, None while it runs.
        where: the lease directory (None: the admin store, else the single-user default).

    Returns:
        Seconds it took.

    Raises:
        NoResources: the master exited (another run took a GPU first: it exits LEASE_LOST_EXIT), or the
            leases were not taken within ``timeout_s``; the message names who holds them.
    """
    ld = where or lease_dir()
    started = time.monotonic()
    while True:
        holders = {h.uuid: h for h in list_holders(ld)}
        mine = [u for u in uuids if u in holders and holders[u].container_id == container_id]
        if len(mine) == len(uuids):
            return time.monotonic() - started
        code = exit_code()
        others = "; ".join(f"{u} held by {holders[u].describe()}" for u in uuids if u in holders and u not in mine)
        if code is not None or time.monotonic() - started > timeout_s:
            why = ("another run leased a GPU first" if code == LEASE_LOST_EXIT
                   else f"{who} exited with code {code}" if code is not None
                   else f"{who} did not take its GPU leases within {timeout_s:g} s")
            raise NoResources(f"{why}: {others or 'no holder seen'}",
                              hint="run it again (or with --wait to queue); `launcher gpus` shows who holds what")
        time.sleep(poll_s)
