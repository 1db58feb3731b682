"""The Docker backend's side of an elastic run (``launcher up --elastic``, :mod:`launcher.elastic`).

Without a lease broker a Docker run's leases are held by its containers (the launcher hands them over:
:mod:`launcher.gpu.handover`). In an elastic run the master holds only its own GPUs' leases and each GPU the master
does not use is held by the lowest-index group on it (:func:`launcher.gpu.elastic.lease_owners`): a yielded group's
exit drops its GPU's lease (the kernel's, as for the master), and a regrown one takes it again first thing (the
launcher checks that the GPU is free right before, and confirms from ``/proc/locks`` right after, as at the start;
another run that took it in between wins, and the group stays yielded). With a broker the leases are tied to the
master container as for any run, and a yield or regrowth is the broker's release and lease, as on the process
backend.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable

from launcher.backends.base import Part, PartState, PreparedRun
from launcher.errors import NoResources
from launcher.gpu import handover
from launcher.gpu.elastic import lease_owners
from launcher.gpu.leaseholders import list_holders

log = logging.getLogger(__name__)

GROUP_LEASE_TIMEOUT_S = 15.0


def group_leases(run: PreparedRun) -> tuple[tuple[str, ...] | None, dict[int, tuple[str, ...]]]:
    """(the master's lease UUIDs, each owning group's): ``(None, {})`` when the master holds them all (a run that is
    not elastic). Pure."""
    if not run.elastic_min:
        return None, {}
    groups = {g.index: tuple(g.share.gpu_uuids) for g in run.plan.groups}
    owned = lease_owners(tuple(run.plan.master.gpu_uuids), groups)
    theirs = {u for uuids in owned.values() for u in uuids}
    return tuple(u for u in run.plan.gpu_uuids if u not in theirs), owned


class ElasticContainers:
    """Mixed into :class:`launcher.backends.docker.DockerBackend`: yield, release, regrow."""

    elastic = True
    # DockerBackend's (set in its __init__ and start):
    run: PreparedRun | None
    engine: Any
    group_ids: dict[int, str]
    master_id: str | None
    _leases: tuple[tuple[str, ...], Any]
    _owned: dict[int, tuple[str, ...]]  # group -> the GPUs whose leases it holds itself (group_leases)
    _yielding: set[int]  # groups asked to leave for a yield: poll shows them YIELDED
    _tie_to_master: Callable[[Any, str], None]

    def yielded(self, index: int, part: Part) -> Part:
        """``part`` as :meth:`poll` shows it: a group that left because it was asked to is YIELDED, however it exited."""
        return replace(part, state=PartState.YIELDED) if index in self._yielding and not part.state.alive else part

    def yield_group(self, index: int) -> None:
        """SIGUSR2 to the group's container: it sends its segment, says goodbye (``reason: yield``) and exits 0."""
        self._yielding.add(index)
        self.engine.kill(self.group_ids[index], "SIGUSR2")

    def kill_group(self, index: int) -> None:
        self.engine.kill(self.group_ids[index], "SIGKILL")

    def release_yielded(self, uuids: tuple[str, ...]) -> tuple[str, ...]:
        """With a broker, its release; without one the owning group's exit dropped the leases (the kernel's)."""
        reservation = self.run.reservation if self.run is not None else None
        if reservation is not None and reservation.brokered:
            return tuple(reservation.release_some(uuids))
        return uuids

    def regrow(self, indices: tuple[int, ...], uuids: tuple[str, ...]) -> bool:
        reservation = self.run.reservation if self.run is not None else None
        if reservation is not None and reservation.brokered:
            if not reservation.take_back(uuids):
                return False
            assert self.master_id is not None
            self._tie_to_master(reservation, self.master_id)
            for index in indices:
                self._yielding.discard(index)
                self.engine.start(self.group_ids[index])
            return True
        where = self._leases[1]
        if {h.uuid for h in list_holders(where)} & set(uuids):
            return False
        owners = sorted(indices, key=lambda i: i not in self._owned)  # the groups that take a lease start first
        started = []
        for index in owners:
            self._yielding.discard(index)
            self.engine.start(self.group_ids[index])
            started.append(index)
            if index in self._owned:
                try:
                    self._confirm_group_leases(index, self._owned[index])
                except NoResources as exc:  # another run took the GPU in the gap: it keeps it; we stay yielded
                    log.warning("group %d could not take its GPU lease back: %s", index, exc.message)
                    for i in started:
                        self._yielding.add(i)
                        self.engine.kill(self.group_ids[i], "SIGKILL")
                    return False
        return True

    def _confirm_group_leases(self, index: int, uuids: tuple[str, ...]) -> None:
        """Wait until group ``index``'s container holds the leases it owns (:func:`handover.confirm_held_by_container`)."""
        cid = self.group_ids[index]

        def exit_code() -> int | None:
            c = self.engine.inspect(cid)
            return -1 if c is None else c.exit_code

        handover.confirm_held_by_container(uuids, cid, exit_code=exit_code, where=self._leases[1],
                                           timeout_s=GROUP_LEASE_TIMEOUT_S, who=f"group {index}")
