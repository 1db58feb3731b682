"""Network namespaces, veth pairs and the bridge of a test bed, with iproute2 (``ip``) alone.

Why namespaces: an extra ``dockerd`` in the host's namespace would fight the default daemon over
``docker0``, its iptables chains and ports 2377/7946/4789. In a namespace of its own each daemon has
its own interfaces, routes and iptables, so nothing it does reaches the host's. The bridge that joins
the nodes lives in a namespace of its own too; the host gets one veth end and one address on it.

Every name made here starts with the bed's prefix (``ltb<id>``), so teardown removes exactly what
this bed made and nothing of anyone else's.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

NETNS_DIR = Path("/run/netns")
IP_TIMEOUT_S = 20


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip [-n NS] ARGS`` with a deadline; raises ``RuntimeError`` with ip's stderr on failure."""
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def path(ns: str) -> Path:
    """The bind-mounted file that names namespace ``ns`` (what ``nsenter --net=`` takes)."""
    return NETNS_DIR / ns


def add(ns: str) -> None:
    """Create namespace ``ns`` (like ``ip netns add``) with its loopback up: the TCP forwarder listens there."""
    ip("netns", "add", ns)
    ip("link", "set", "lo", "up", ns=ns)


def exists(ns: str) -> bool:
    return path(ns).exists()


def names(prefix: str) -> list[str]:
    """Namespaces whose names start with ``prefix``."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))


def inode(ns: str) -> int | None:
    """The namespace's inode: a process is inside ``ns`` when ``/proc/PID/ns/net`` has the same one."""
    try:
        return path(ns).stat().st_ino
    except OSError:
        return None


def pids_inside(inodes: set[int]) -> list[int]:
    """Processes whose network namespace is one of ``inodes`` (daemons, containerd, shims, forwarders)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.stat(entry / "ns" / "net").st_ino in inodes:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def delete(ns: str) -> None:
    """Remove namespace ``ns`` (like ``ip netns del``); its interfaces go with it (a veth takes its peer)."""
    if exists(ns):
        ip("netns", "del", ns, check=False)


def wire(bridge_ns: str, node_ns: str, port: str, address: str, prefix_len: int) -> None:
    """A veth from ``node_ns`` (named ``eth0`` there, with ``address``) to the bridge ``br0`` in ``bridge_ns``
    (named ``port`` there). Created straight into the two namespaces, so no name ever exists on the host."""
    ip("link", "add", "eth0", "netns", node_ns, "type", "veth", "peer", "name", port, "netns", bridge_ns)
    ip("link", "set", port, "master", "br0", "up", ns=bridge_ns)
    ip("addr", "add", f"{address}/{prefix_len}", "dev", "eth0", ns=node_ns)
    ip("link", "set", "eth0", "up", ns=node_ns)


def make_bridge(bridge_ns: str, host_veth: str, host_address: str, prefix_len: int) -> None:
    """The bridge ``br0`` in ``bridge_ns`` and one veth to the host (``host_veth`` there, with ``host_address``).

    No iptables rule anywhere: the bridge forwards at layer 2 inside its own namespace, and the host
    side is a plain interface with an address, so the host's firewall and forwarding are untouched.
    """
    ip("link", "add", "br0", "type", "bridge", ns=bridge_ns)
    ip("link", "set", "br0", "up", ns=bridge_ns)
    ip("link", "add", host_veth, "type", "veth", "peer", "name", "host", "netns", bridge_ns)
    ip("link", "set", "host", "master", "br0", "up", ns=bridge_ns)
    ip("addr", "add", f"{host_address}/{prefix_len}", "dev", host_veth)
    ip("link", "set", host_veth, "up")


def host_links(prefix: str) -> list[str]:
    """Interfaces on the host whose names start with ``prefix``."""
    out = ip("-o", "link", "show").stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()
            if line.split(":")[1].strip().startswith(prefix)]


def delete_host_link(name: str) -> None:
    ip("link", "del", name, check=False)


def free_subnet(base: str) -> str:
    """The first ``<base>.K`` (a /24, K 0..255) that no host route uses, e.g. ``10.213.4``.

    Raises:
        RuntimeError: every one is routed already.
    """
    used = used_subnets()
    for k in range(256):
        if f"{base}.{k}.0/24" not in used:
            return f"{base}.{k}"
    raise RuntimeError(f"every {base}.K.0/24 is routed on this host already")


def used_subnets() -> set[str]:
    """IPv4 routes on the host (their destinations), to pick a /24 that collides with none."""
    out = ip("-4", "-o", "route", "show", "table", "all").stdout
    return {line.split()[0] for line in out.splitlines() if line and line[0].isdigit()}
