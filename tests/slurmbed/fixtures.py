"""pytest fixtures of the Slurm test bed (loaded by tests/conftest.py through ``pytest_plugins``).

* ``slurm_bed``: slurmctld and three slurmd (node1..node3, 4 CPUs and 2 fake GPUs each) with munge, one per
  session (bring-up takes seconds, but every Slurm test shares it); removed at the session's end even when a
  test fails, and the host must then be as it was before (:func:`host_state`).

The fixture skips, with the reason, where a bed cannot exist (not root; Slurm, munge, iproute2 or util-linux
missing: `.ci/run` installs them).
"""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.slurmbed.bed import BASE_DIR, PREFIX, TOOLS, SlurmBed, SlurmBedSpec, bring_up, tear_down
from tests.testbed import hostcheck, netns

MARKERS = ["slurm: runs on the Slurm test bed (slurmctld and slurmd's in network namespaces; root)"]


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)


def unavailable() -> str | None:
    """Why a Slurm bed cannot be brought up here (for a skip), or None."""
    if os.geteuid() != 0:
        return "the Slurm test bed needs root (network namespaces, mknod, munged as the munge user)"
    for tool in TOOLS:
        if shutil.which(tool) is None:
            return f"the Slurm test bed needs `{tool}` (apt-get install slurmctld slurmd slurm-client munge)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "the Slurm test bed needs the munge user (the munge package makes it)"
    return None


@dataclass(frozen=True)
class HostState:
    namespaces: tuple[str, ...]
    links: tuple[str, ...]
    processes: tuple[str, ...]
    beds: tuple[str, ...]
    host_mounts: tuple[str, ...]
    etc: tuple[str, ...]
    libnetwork_sockets: tuple[str, ...]  # a node engine's, if a test gave a node one


def _digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError as exc:
        return f"unreadable: {exc.strerror}"


def host_state(bed_ids: list[str]) -> HostState:
    """What the Slurm beds ``bed_ids`` could have changed on the host: their namespaces, links, directories,
    processes (daemons, munged, slurmstepd and steps), mounts in the host's namespace on /etc/hosts or the
    Docker socket, and the host's own Slurm and munge configuration (which a bed must never touch)."""
    prefixes = tuple(f"{PREFIX}{i}" for i in bed_ids)
    dirs = [str(BASE_DIR / i) for i in bed_ids]
    mounts = tuple(line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                   if line.split()[4] in ("/etc/hosts", "/run/docker.sock", "/var/run/docker.sock")
                   or any(line.split()[4].startswith(d) for d in dirs))
    etc = tuple(f"{p}: {_digest(p)}" for p in (Path("/etc/hosts"), Path("/etc/munge/munge.key"))) + (
        tuple(sorted(str(p) for p in Path("/etc/slurm").rglob("*"))) if Path("/etc/slurm").is_dir() else ())
    return HostState(
        namespaces=tuple(n for n in netns.names(PREFIX) if n.startswith(prefixes)),
        links=tuple(n for n in netns.host_links(PREFIX) if n.startswith(prefixes)),
        processes=hostcheck._processes(dirs),  # daemons, munged; steps die with the namespaces
        beds=tuple(d for d in dirs if Path(d).exists()),
        host_mounts=mounts,
        etc=etc,
        libnetwork_sockets=hostcheck._stale_sockets(),
    )


def _bed(spec: SlurmBedSpec) -> Iterator[SlurmBed]:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    bed_id = os.urandom(3).hex()
    before = host_state([bed_id])
    t0 = time.monotonic()
    bed = bring_up(spec, bed_id)
    print(f"slurm figures: bed_bring_up={time.monotonic() - t0:.1f}s")
    try:
        yield bed
    finally:
        t0 = time.monotonic()
        problems = tear_down(bed)
        print(f"slurm figures: bed_teardown={time.monotonic() - t0:.1f}s")
    assert not problems, f"slurm bed {bed.id} teardown: {problems}"
    after = host_state([bed_id])
    assert after == before, f"slurm bed {bed.id} left the host changed:\nbefore {before}\nafter  {after}"


@pytest.fixture(scope="session")
def slurm_bed() -> Iterator[SlurmBed]:
    yield from _bed(SlurmBedSpec(nodes=3, gpus=2, cpus=4))
