"""A Docker engine as a found run sees it, for tests of what `status`, `runs` and `down` make of containers in a
given state (exited with a code, restarting) without starting any: the run's containers as the engine lists
them, no networks, empty logs. The real engine's behaviour is tests/docker/'s."""

from __future__ import annotations

import os

from launcher.engine import labels as dc
from launcher.engine.client import Container


class SnapshotEngine:
    """Only what a found Docker run asks of the engine: the run's containers and networks."""

    def __init__(self, snaps: list[Container]) -> None:
        self.snaps = snaps

    def containers(self, labels: dict[str, str | None]) -> list[Container]:
        return self.snaps

    def networks(self, labels: dict[str, str | None]) -> list[tuple[str, str, dict[str, str]]]:
        return []

    def logs(self, container_id: str) -> bytes:  # what `status` reads of a part that died: nothing said here
        return b""


def snap(role: str, status: str, code: int | None, group: str = "") -> Container:
    """A container of the run with ``role`` (master/group) in ``status`` (Docker's word) and exit ``code``."""
    return Container(os.urandom(32).hex(), f"c-{role}{group}", status, code, 0,
                     {dc.ROLE_LABEL: role, dc.GROUP_LABEL: group})
