"""A test bed: N extra Docker daemons as swarm nodes on a private bridge, and a local registry.

Layout of a bed with id ``ab12cd`` (every name carries the id, so teardown touches only what it made)::

    host ns: ltbab12cdh 10.213.K.1/24 ─┐            registry on 127.0.0.1:5000 (host), forwarder
    ns ltbab12cd-br:  br0 ─────────────┴── n0 ── n1 ── n2 …
    ns ltbab12cd-n0:  eth0 10.213.K.10  dockerd (swarm manager), 127.0.0.1:5000 → registry
    ns ltbab12cd-n1:  eth0 10.213.K.11  dockerd (swarm worker),  127.0.0.1:5000 → registry
    /var/lib/launcher-testbed/ab12cd/{bed.json, n0/, n1/, registry/, forward.pid}

The manager is a dedicated daemon (node 0), not the host's default daemon: other tests make the default
daemon a one-node swarm of their own (tests/docker/test_swarm.py), and two swarms cannot share one engine.
The host reaches every daemon by its unix socket (``Node.docker_host``), which each swarm node also carries
as its ``launcher.engine`` label, as an administrator labels a cluster's nodes: the launcher's teardown asks
each node whether the run's task containers are gone (launcher/backends/swarm_gone.py). The launcher needs
nothing else.

``bring_up`` records the bed in ``bed.json`` before it creates anything, and ``tear_down`` works from
that record alone, step by step, carrying on past a failed step, so a bed is removed even after a
crash halfway through bring-up or a killed test process (``scripts/testbed.sh down``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from collections.abc import Callable
from typing import Any, TypeVar

from launcher.engine.swarm import ENGINE_LABEL
from tests.testbed import daemon, netns, registry
from tests.testbed.daemon import Node

log = logging.getLogger(__name__)
T = TypeVar("T")

BASE_DIR = Path(os.environ.get("LAUNCHER_TESTBED_DIR", "/var/lib/launcher-testbed"))
PREFIX = "ltb"
SUBNET_BASE = "10.213"  # /24s 10.213.0.0 … 10.213.255.0; a bed takes one that no host route uses
LIBNETWORK_SOCKETS = Path("/run/docker/libnetwork")
READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class BedSpec:
    """What to bring up. ``gpus[i]`` made-up GPU UUIDs are advertised by node i (none when shorter)."""

    nodes: int = 3
    swarm: bool = True
    registry: bool = True
    gpus: tuple[int, ...] = ()
    storage_driver: str = os.environ.get("LAUNCHER_TESTBED_STORAGE", "overlay2")
    nvidia: bool = False  # every daemon gets the stand-in NVIDIA toolkit (daemon.install_nvidia_hook)

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 50:
            raise ValueError(f"nodes must be 1..50, got {self.nodes}")
        if len(self.gpus) > self.nodes or any(g < 0 for g in self.gpus):
            raise ValueError(f"gpus gives a non-negative count per node, got {self.gpus} for {self.nodes} nodes")


@dataclass(frozen=True)
class Bed:
    """A bed as recorded in ``bed.json``: enough to find and remove every part of it."""

    id: str
    root: Path
    subnet: str  # "10.213.K", or "" before one was picked
    nodes: tuple[Node, ...]
    registry_port: int | None
    swarm: bool
    created: float = 0.0  # time.time() at planning: teardown removes only stale sockets made since

    @property
    def prefix(self) -> str:
        return f"{PREFIX}{self.id}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    @property
    def host_veth(self) -> str:
        return f"{self.prefix}h"

    @property
    def host_address(self) -> str:
        return f"{self.subnet}.1"

    @property
    def manager(self) -> Node:
        return self.nodes[0]

    @property
    def registry(self) -> str | None:
        """The registry as image names spell it on every daemon (``localhost:5000``)."""
        return f"localhost:{self.registry_port}" if self.registry_port else None

    def to_json(self) -> str:
        doc = asdict(self)
        doc["root"] = str(self.root)
        doc["nodes"] = [{**asdict(n), "root": str(n.root)} for n in self.nodes]
        return json.dumps(doc, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Bed":
        doc = json.loads(text)
        nodes = tuple(Node(**{**n, "root": Path(n["root"]), "gpus": tuple(n["gpus"]), "labels": tuple(n["labels"])})
                      for n in doc["nodes"])
        return cls(doc["id"], Path(doc["root"]), doc["subnet"], nodes, doc["registry_port"], doc["swarm"],
                   doc.get("created", 0.0))

    def save(self) -> None:
        tmp = self.root / "bed.json.tmp"
        tmp.write_text(self.to_json())
        tmp.replace(self.root / "bed.json")


def fake_gpu_uuid(bed_id: str, node: int, gpu: int) -> str:
    """A made-up UUID in NVML's format, unique per bed, node and GPU."""
    return f"GPU-{bed_id}00-{node:04x}-{gpu:04x}-0000-{int(bed_id, 16):012x}"


def plan(spec: BedSpec, bed_id: str | None = None) -> Bed:
    """The bed ``spec`` describes, with names and paths, before anything exists (pure but for the id)."""
    bed_id = bed_id or os.urandom(3).hex()
    root = BASE_DIR / bed_id
    nodes = []
    for i in range(spec.nodes):
        count = spec.gpus[i] if i < len(spec.gpus) else 0
        nodes.append(Node(name=f"{PREFIX}{bed_id}-n{i}", index=i, address="", root=root / f"n{i}",
                          storage_driver=spec.storage_driver,
                          gpus=tuple(fake_gpu_uuid(bed_id, i, g) for g in range(count)),
                          labels=(f"launcher.testbed={bed_id}",), nvidia=spec.nvidia))
    return Bed(bed_id, root, "", tuple(nodes), registry.PORT if spec.registry else None, spec.swarm, time.time())


def bring_up(spec: BedSpec, bed_id: str | None = None) -> Bed:
    """Create the bed: namespaces and bridge, registry and forwarder, daemons, the swarm. On any failure
    everything made so far is removed before the error propagates. ``bed_id``: six hex digits (default:
    random), so a caller can look for what a failed bring-up might have left.

    Raises:
        RuntimeError: a step failed; the message names it and carries the tool's own error.
    """
    bed = plan(spec, bed_id)
    bed.root.mkdir(parents=True, exist_ok=False)
    bed.save()
    t0 = time.monotonic()
    try:
        BASE_DIR.mkdir(parents=True, exist_ok=True)
        with open(BASE_DIR / ".lock", "w") as lock:  # two beds must not pick the same /24
            fcntl.flock(lock, fcntl.LOCK_EX)
            bed = replace(bed, subnet=netns.free_subnet(SUBNET_BASE))
            bed = replace(bed, nodes=tuple(replace(n, address=f"{bed.subnet}.{10 + n.index}") for n in bed.nodes))
            bed.save()
            netns.add(bed.bridge_ns)
            netns.make_bridge(bed.bridge_ns, bed.host_veth, bed.host_address, 24)
        for n in bed.nodes:
            netns.add(n.name)
            netns.wire(bed.bridge_ns, n.name, f"n{n.index}", n.address, 24)
        if bed.registry_port:
            registry.start(bed.root / "registry", bed.registry_port)
            _start_forwarder(bed)
        for n in bed.nodes:
            daemon.start(n)
        log.info("test bed %s: %d daemons up in %.1f s", bed.id, len(bed.nodes), time.monotonic() - t0)
        if bed.swarm:
            _make_swarm(bed)
            log.info("test bed %s: swarm of %d nodes ready after %.1f s", bed.id, len(bed.nodes),
                     time.monotonic() - t0)
    except BaseException:
        tear_down(bed)
        raise
    return bed


def _start_forwarder(bed: Bed) -> None:
    port = str(bed.registry_port)
    argv = [sys.executable, "-m", "tests.testbed.forward", "--listen-port", port, "--target-port", port,
            *(str(netns.path(n.name)) for n in bed.nodes)]
    root = Path(__file__).resolve().parents[2]
    with open(bed.root / "forward.log", "ab") as err:
        proc = subprocess.Popen(argv, cwd=root, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                start_new_session=True)
    (bed.root / "forward.pid").write_text(str(proc.pid))
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "ready" once every listener is bound; EOF if it died
    if line.strip() != b"ready":
        raise RuntimeError(f"the forwarder did not start: {(bed.root / 'forward.log').read_text()[-2000:]}")


def _make_swarm(bed: Bed) -> None:
    m = bed.manager
    daemon.docker(m, "swarm", "init", "--advertise-addr", m.address, "--listen-addr", f"{m.address}:2377")
    token = daemon.docker(m, "swarm", "join-token", "-q", "worker").stdout.strip()
    for n in bed.nodes[1:]:
        daemon.docker(n, "swarm", "join", "--token", token, "--advertise-addr", n.address,
                      "--listen-addr", f"{n.address}:2377", f"{m.address}:2377")
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        states = node_states(bed)
        if len(states) == len(bed.nodes) and all(s == "ready" for s in states.values()):
            break
        time.sleep(0.2)
    else:
        raise RuntimeError(f"swarm nodes not ready after {READY_TIMEOUT_S:.0f} s: {node_states(bed)}")
    for n in bed.nodes:  # where the launcher reaches each node's engine, as an admin labels a cluster's nodes
        daemon.docker(m, "node", "update", "--label-add", f"{ENGINE_LABEL}={n.docker_host}", n.name)


def node_states(bed: Bed) -> dict[str, str]:
    """hostname -> state (ready, down, unknown) as the manager sees them (``docker node ls``)."""
    out = daemon.docker(bed.manager, "node", "ls", "--format", "{{.Hostname}} {{.Status}}", timeout=20).stdout
    return {line.split()[0]: line.split()[1].lower() for line in out.splitlines() if line.strip()}


def lose_node(bed: Bed, node: Node) -> None:
    """Stage a lost machine: cut its network (its veth goes down), SIGKILL its daemon, then every process
    in its namespace and cgroups (containerd, shims, its containers). Killing the daemon alone would not
    do: the shims keep its containers running. The data root stays, so ``restore_node`` can bring it back."""
    netns.ip("link", "set", "eth0", "down", ns=node.name)
    pid = daemon.pid_of(node)
    if pid:
        os.kill(pid, signal.SIGKILL)
    _kill_all_of(node, LEFTOVER_WAIT_S)


# How long a lost node's processes may take to be gone. On a loaded machine a SIGKILLed containerd can take
# seconds to exit (a task in uninterruptible sleep on its overlay mounts); until it has, it holds the flock on
# its metadata database, and a restored daemon's containerd blocks on that lock until dockerd gives up
# ("timeout waiting for containerd to start", seen once in CI).
LEFTOVER_WAIT_S = 30.0


def _kill_all_of(node: Node, wait_s: float) -> set[int]:
    """SIGKILL every process in ``node``'s namespace and cgroups until none is left or ``wait_s`` passes;
    returns what is still there."""
    inode = netns.inode(node.name)
    return daemon.kill_until_gone(
        lambda: set(netns.pids_inside({inode} if inode else set())) | daemon.pids_in_cgroups(node), wait_s)


def restore_node(bed: Bed, node: Node) -> None:
    """The lost machine comes back: network up, its daemon started again on the same data root (it rejoins
    the swarm by itself). Nothing of the lost daemon may still run then (see :data:`LEFTOVER_WAIT_S`); a start
    that fails anyway is retried once after clearing what it left."""
    for attempt in (1, 2):
        left = _kill_all_of(node, LEFTOVER_WAIT_S)
        if left:
            raise RuntimeError(f"{node.name}: processes {sorted(left)} outlived SIGKILL for {LEFTOVER_WAIT_S:g} s")
        daemon.unmount_all(node.root / "exec")  # what the killed daemon left mounted (container namespaces)
        netns.ip("link", "set", "eth0", "up", ns=node.name)
        try:
            daemon.start(node)
            return
        except RuntimeError:
            if attempt == 2:
                raise
            log.warning("%s: its daemon did not come back; clearing what it left and starting it again", node.name)


def tear_down(bed: Bed) -> list[str]:
    """Remove every part of ``bed``, carrying on past failures; returns the problems met (empty when clean).

    Order: daemons (SIGTERM, then SIGKILL), every process left in the nodes' namespaces or cgroups
    (containerd, shims, containers), forwarder and registry, mounts under the bed's directory, cgroups,
    namespaces, the host veth, stale libnetwork sockets of our daemons, the directory.
    """
    problems: list[str] = []

    def step(what: str, fn: Any, *args: Any) -> None:
        t = time.monotonic()
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - teardown must try every step
            problems.append(f"{what}: {exc}")
            log.warning("test bed %s: %s failed: %s", bed.id, what, exc)
        log.debug("test bed %s: %s took %.1f s", bed.id, what, time.monotonic() - t)

    inodes = {i for i in (netns.inode(n.name) for n in bed.nodes) if i is not None}
    pids = [p for p in (daemon.pid_of(n) for n in bed.nodes) if p]
    for pid in pids:
        step(f"SIGTERM dockerd {pid}", os.kill, pid, signal.SIGTERM)
    deadline = time.monotonic() + daemon.STOP_GRACE_S
    for pid in pids:
        if not daemon._wait_gone(pid, max(0.0, deadline - time.monotonic())):
            step(f"SIGKILL dockerd {pid}", os.kill, pid, signal.SIGKILL)
    # shims outlive their daemon; containers die with their cgroup's processes
    daemon.kill_until_gone(
        lambda: set(netns.pids_inside(inodes)) | set().union(*(daemon.pids_in_cgroups(n) for n in bed.nodes)), 0.9)
    step("stop forwarder", registry.stop_pidfile, bed.root / "forward.pid")
    step("stop registry", registry.stop_pidfile, bed.root / "registry" / "registry.pid")
    step("unmount", daemon.unmount_all, bed.root)
    for n in bed.nodes:
        step(f"cgroups of {n.name}", daemon.remove_cgroups, n)
        step(f"namespace {n.name}", netns.delete, n.name)
    step(f"namespace {bed.bridge_ns}", netns.delete, bed.bridge_ns)
    if bed.subnet and bed.host_veth in netns.host_links(bed.prefix):
        step(f"veth {bed.host_veth}", netns.delete_host_link, bed.host_veth)
    step("stale libnetwork sockets", remove_stale_libnetwork_sockets, bed.created)
    step(f"remove {bed.root}", daemon.remove_tree, bed.root)
    return problems


def remove_stale_libnetwork_sockets(since: float) -> None:
    """Docker 20.10 puts each daemon's setkey socket in /run/docker/libnetwork/<controller>.sock, whatever its
    exec root; a killed daemon leaves it. Remove those made since ``since`` (while the bed lived) that no
    process listens on any more: a live daemon's socket accepts a connection and is kept, and an older
    stale one is not ours to remove."""
    import socket as so

    if not LIBNETWORK_SOCKETS.is_dir():
        return
    for sock_path in LIBNETWORK_SOCKETS.glob("*.sock"):
        try:
            if sock_path.stat().st_mtime < since - 1:
                continue
        except OSError:
            continue
        s = so.socket(so.AF_UNIX, so.SOCK_STREAM)
        s.settimeout(1)
        try:
            s.connect(str(sock_path))
        except ConnectionRefusedError:
            sock_path.unlink(missing_ok=True)
        except OSError:
            pass
        finally:
            s.close()


def beds() -> list[Bed]:
    """Every bed recorded under ``BASE_DIR`` (a crashed test's included)."""
    return recorded(BASE_DIR, Bed.from_json)


def recorded(base: Path, parse: Callable[[str], T]) -> list[T]:
    """Every ``<base>/*/bed.json`` that ``parse`` reads (the Slurm bed's records too); an unreadable one is
    logged and skipped."""
    found = []
    for f in sorted(base.glob("*/bed.json")) if base.is_dir() else []:
        try:
            found.append(parse(f.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("unreadable bed record %s: %s", f, exc)
    return found
