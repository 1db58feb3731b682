"""What a test bed could leave on the host, as one comparable snapshot.

A test takes one before bring-up and one after teardown; they must be equal. Only what the beds with the
given ids could make is looked at (names with their prefixes, paths under their directories), plus the
registry port, stale libnetwork sockets and host iptables rules naming the beds' range: other engineers'
Docker tests (and their own beds) change the default daemon's networks, iptables and swarm state at the
same time. A bed never talks to the default
daemon at all (its manager is a daemon of its own), so the host's swarm is not its to check.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.testbed import netns, registry
from tests.testbed.bed import BASE_DIR, LIBNETWORK_SOCKETS, PREFIX, SUBNET_BASE
from tests.testbed.daemon import CGROUP_ROOT, mounts_under


@dataclass(frozen=True)
class HostState:
    namespaces: tuple[str, ...]
    links: tuple[str, ...]
    mounts: tuple[str, ...]
    cgroups: tuple[str, ...]
    processes: tuple[str, ...]
    beds: tuple[str, ...]
    registry_answers: bool
    libnetwork_sockets: tuple[str, ...]
    iptables_rules: tuple[str, ...]


def _processes(dirs: list[str]) -> tuple[str, ...]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(d in cmd for d in dirs):
            found.append(cmd.strip())
    return tuple(sorted(found))


def _stale_sockets() -> tuple[str, ...]:
    """libnetwork sockets nobody listens on (a killed daemon's): a bed must not add any."""
    import socket

    stale = []
    for p in sorted(LIBNETWORK_SOCKETS.glob("*.sock")) if LIBNETWORK_SOCKETS.is_dir() else []:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(1)
        try:
            s.connect(str(p))
        except ConnectionRefusedError:
            stale.append(p.name)
        except OSError:
            pass
        finally:
            s.close()
    return tuple(stale)


def _iptables() -> tuple[str, ...]:
    try:
        out = subprocess.run(["iptables-save"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ("iptables-save failed",)
    return tuple(line for line in out.splitlines() if SUBNET_BASE + "." in line or PREFIX in line)


def snapshot(bed_ids: list[str]) -> HostState:
    """The host as far as the beds ``bed_ids`` could have changed it."""
    prefixes = tuple(f"{PREFIX}{i}" for i in bed_ids)
    dirs = [str(BASE_DIR / i) for i in bed_ids]
    cgroups = sorted(str(p) for p in CGROUP_ROOT.glob(f"*/{PREFIX}*") if p.name.startswith(prefixes)) \
        if CGROUP_ROOT.is_dir() else []
    return HostState(
        namespaces=tuple(n for n in netns.names(PREFIX) if n.startswith(prefixes)),
        links=tuple(n for n in netns.host_links(PREFIX) if n.startswith(prefixes)),
        mounts=tuple(m for d in dirs for m in mounts_under(Path(d))),
        cgroups=tuple(cgroups),
        processes=_processes(dirs),
        beds=tuple(d for d in dirs if Path(d).exists()),
        registry_answers=registry.answers(),
        libnetwork_sockets=_stale_sockets(),
        iptables_rules=_iptables(),
    )
