"""A Slurm test bed: one ``slurmctld`` and N ``slurmd`` on this machine, each in network, UTS and mount
namespaces of its own, with munge and fake GPUs as GRES.

Layout of a bed with id ``ab12cd`` (every name carries the id, so teardown touches only what it made)::

    host ns: lsbab12cdh 10.216.K.1/24 ─┐    munged (user munge), its socket under the bed's directory
    ns lsbab12cd-br:  br0 ─────────────┴── ctl ── node1 ── node2 …
    ns lsbab12cd-ctl:    eth0 10.216.K.2    slurmctld (hostname ctl)
    ns lsbab12cd-node1:  eth0 10.216.K.11   slurmd (hostname node1), gres gpu:2 = dev/node1-nvidia[0-1]
    /var/lib/launcher-slurmbed/ab12cd/{bed.json, slurm.conf, gres.conf, hosts, munge/, ctl/, node1/, dev/}

* Every daemon is started as ``nsenter --net=NS unshare --uts --mount sh -c '…; exec DAEMON'``: ``nsenter``, not
  ``ip netns exec`` (which remounts ``/sys``, and slurmd then finds no cgroup mount). In its private mount
  namespace the daemon sees the bed's ``hosts`` file as ``/etc/hosts`` (this machine's hostname maps to the
  bed's host address, so slurmctld reaches the launcher's ``srun`` by name as on a cluster) and, on a node,
  an empty file over ``/run/docker.sock`` (a node without a container engine: this machine's engine is not
  the node's). Nothing is mounted in the host's namespace.
* One munge key for all (``mungekey``), one ``munged`` running as the ``munge`` user with its socket, pid,
  log and seed files in the bed's directory; slurm.conf's ``AuthInfo=socket=…`` points every daemon and
  client there. ``/etc/munge`` is not touched.
* Fake GPUs: ``mknod dev/nodeN-nvidiaK c 195 K`` (gres.conf ``AutoDetect=off``, ``File=``; plain files are
  refused). Slurm sets each step's ``CUDA_VISIBLE_DEVICES`` from them.
* The launcher reaches the bed with ``SLURM_CONF=<dir>/slurm.conf`` (:meth:`SlurmBed.env`).

``bring_up`` records the bed in ``bed.json`` before it creates anything; ``tear_down`` works from that record
alone, carrying on past a failed step, so a bed is removed after a crash or a killed test
(``scripts/slurmbed.sh down``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pwd
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tests.testbed import netns
from tests.testbed.daemon import kill_until_gone

log = logging.getLogger(__name__)

BASE_DIR = Path(os.environ.get("LAUNCHER_SLURMBED_DIR", "/var/lib/launcher-slurmbed"))
PREFIX = "lsb"  # the Docker test bed's are ltb…
SUBNET_BASE = "10.216"  # the Docker test bed takes 10.213.K; two kinds of bed never collide
READY_TIMEOUT_S = 90.0
STOP_GRACE_S = 5.0
DOCKER_SOCKET = Path("/run/docker.sock")  # /var/run/docker.sock is a link to it on Debian
TOOLS = ("slurmctld", "slurmd", "munged", "mungekey", "ip", "nsenter", "unshare", "mount", "sbatch", "srun",
         "scontrol", "scancel", "sinfo")


@dataclass(frozen=True)
class SlurmBedSpec:
    nodes: int = 3
    gpus: int = 2  # fake GPUs per node
    cpus: int = 4  # CPUs each slurmd declares (config_overrides: more than the machine has is fine)
    slurmd_timeout_s: int = 5  # how long a silent node may be before slurmctld marks it not responding

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 20 or not 0 <= self.gpus <= 8 or self.cpus < 1:
            raise ValueError(f"nodes 1..20, gpus 0..8, cpus >= 1; got {self}")


@dataclass(frozen=True)
class SlurmBed:
    """A bed as recorded in ``bed.json``."""

    id: str
    root: Path
    subnet: str  # "10.216.K", "" before one was picked
    nodes: tuple[str, ...]  # node1, node2, …: Slurm's NodeName, the hostname and the namespace's suffix
    gpus: int
    cpus: int
    slurmd_timeout_s: int
    host_name: str  # this machine's hostname, as the daemons resolve it
    created: float = 0.0

    # ---------------------------------------------------------------------------------------- names
    @property
    def prefix(self) -> str:
        return f"{PREFIX}{self.id}"

    def ns(self, name: str) -> str:
        """The namespace of ``ctl``, ``br`` or a node."""
        return f"{self.prefix}-{name}"

    @property
    def host_veth(self) -> str:
        return f"{self.prefix}h"

    @property
    def host_address(self) -> str:
        return f"{self.subnet}.1"

    @property
    def ctl_address(self) -> str:
        return f"{self.subnet}.2"

    def address(self, node: str) -> str:
        return f"{self.subnet}.{10 + self.nodes.index(node) + 1}"

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket"

    def pidfile(self, daemon: str) -> Path:
        """``ctl`` or a node's daemon pidfile (``%n`` in slurm.conf is the node's name)."""
        return self.root / daemon / ("slurmctld.pid" if daemon == "ctl" else "slurmd.pid")

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment whose Slurm commands (and launchers) talk to this bed."""
        return {**(dict(os.environ) if base is None else base), "SLURM_CONF": str(self.conf)}

    # ---------------------------------------------------------------------------------------- record
    def to_json(self) -> str:
        return json.dumps({**asdict(self), "root": str(self.root)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "SlurmBed":
        doc = json.loads(text)
        return cls(**{**doc, "root": Path(doc["root"]), "nodes": tuple(doc["nodes"])})

    def save(self) -> None:
        tmp = self.root / "bed.json.tmp"
        tmp.write_text(self.to_json())
        tmp.replace(self.root / "bed.json")


# ------------------------------------------------------------------------------------------ configuration
def slurm_conf(bed: SlurmBed) -> str:
    """slurm.conf of ``bed`` (pure). The lines that matter on one machine without systemd: linuxproc process
    tracking and no task plugin (no cgroup delegation), per-node spool/pid/log files (``%n``), config_overrides
    (declared CPUs and GPUs are believed), a short SlurmdTimeout (a lost node is noticed in seconds), and
    ReturnToService=2 (a node that comes back is usable at once)."""
    d = bed.root
    lines = [
        f"ClusterName={bed.prefix}", f"SlurmctldHost=ctl({bed.ctl_address})", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", f"AuthInfo=socket={bed.munge_socket}", "CredType=cred/munge",
        f"StateSaveLocation={d}/ctl/state", f"SlurmctldPidFile={d}/ctl/slurmctld.pid",
        f"SlurmctldLogFile={d}/ctl/slurmctld.log", f"SlurmdSpoolDir={d}/%n/spool", f"SlurmdPidFile={d}/%n/slurmd.pid",
        f"SlurmdLogFile={d}/%n/slurmd.log", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none", "MpiDefault=none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "GresTypes=gpu", "SlurmdParameters=config_overrides", f"SlurmdTimeout={bed.slurmd_timeout_s}",
        "ReturnToService=2", "InactiveLimit=0", "KillWait=5", "MinJobAge=300",
    ]
    for n in bed.nodes:
        lines.append(f"NodeName={n} NodeAddr={bed.address(n)} NodeHostname={n} CPUs={bed.cpus}"
                     + (f" Gres=gpu:{bed.gpus}" if bed.gpus else "") + " State=UNKNOWN")
    lines.append(f"PartitionName=gpu Nodes={','.join(bed.nodes)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def gres_conf(bed: SlurmBed) -> str:
    lines = ["AutoDetect=off"]
    if bed.gpus:
        lines += [f"NodeName={n} Name=gpu File={bed.root}/dev/{n}-nvidia[0-{bed.gpus - 1}]" for n in bed.nodes]
    return "\n".join(lines) + "\n"


def hosts_file(bed: SlurmBed) -> str:
    """What the daemons read as /etc/hosts: this machine (where srun runs) and every daemon by name."""
    rows = [("127.0.0.1", "localhost"), (bed.host_address, bed.host_name), (bed.ctl_address, "ctl")]
    rows += [(bed.address(n), n) for n in bed.nodes]
    return "".join(f"{a} {n}\n" for a, n in rows)


def daemon_argv(bed: SlurmBed, name: str) -> list[str]:
    """The command line of ``ctl``'s slurmctld or a node's slurmd: enter the network namespace, take a UTS and
    mount namespace of its own, bind the bed's hosts file (and, on a node, an empty file over this machine's
    Docker socket), take the hostname, become the daemon (one pid throughout)."""
    binds = f'mount --bind {bed.root}/hosts /etc/hosts'
    if name != "ctl":
        binds += f' && if [ -e {DOCKER_SOCKET} ]; then mount --bind {bed.root}/no-engine {DOCKER_SOCKET}; fi'
    daemon = ["slurmctld", "-f", str(bed.conf)] if name == "ctl" else ["slurmd", "-f", str(bed.conf)]
    return ["nsenter", f"--net={netns.path(bed.ns(name))}", "--", "unshare", "--uts", "--mount", "--",
            "sh", "-c", f'{binds} && hostname "$0" && exec "$@"', name, *daemon]


# --------------------------------------------------------------------------------------------- bring-up
def plan(spec: SlurmBedSpec, bed_id: str | None = None) -> SlurmBed:
    bed_id = bed_id or os.urandom(3).hex()
    return SlurmBed(bed_id, BASE_DIR / bed_id, "", tuple(f"node{i + 1}" for i in range(spec.nodes)), spec.gpus,
                    spec.cpus, spec.slurmd_timeout_s, socket.gethostname(), time.time())


def bring_up(spec: SlurmBedSpec, bed_id: str | None = None) -> SlurmBed:
    """Create the bed and wait until every node is idle. On any failure everything made so far is removed
    before the error propagates.

    Raises:
        RuntimeError: a step failed; the message names it and carries the tool's error or the daemon's log.
    """
    bed = plan(spec, bed_id)
    BASE_DIR.mkdir(parents=True, exist_ok=True)
    bed.root.mkdir(exist_ok=False)
    bed.save()
    t0 = time.monotonic()
    try:
        with open(BASE_DIR / ".lock", "w") as lock:  # two beds must not pick the same /24
            fcntl.flock(lock, fcntl.LOCK_EX)
            bed = replace(bed, subnet=netns.free_subnet(SUBNET_BASE))
            bed.save()
            netns.add(bed.ns("br"))
            netns.make_bridge(bed.ns("br"), bed.host_veth, bed.host_address, 24)
        for name in ("ctl", *bed.nodes):
            netns.add(bed.ns(name))
            netns.wire(bed.ns("br"), bed.ns(name), f"p{name}"[:15], bed.ctl_address if name == "ctl"
                       else bed.address(name), 24)
        _write_files(bed)
        _start_munge(bed)
        _start(bed, "ctl")
        for n in bed.nodes:
            _start(bed, n)
        wait_idle(bed, bed.nodes)
        log.info("slurm bed %s: slurmctld and %d slurmd idle after %.1f s", bed.id, len(bed.nodes),
                 time.monotonic() - t0)
    except BaseException:
        tear_down(bed)
        raise
    return bed


def _write_files(bed: SlurmBed) -> None:
    for d in ("ctl/state", "dev", *(f"{n}/spool" for n in bed.nodes)):
        (bed.root / d).mkdir(parents=True, exist_ok=True)
    bed.conf.write_text(slurm_conf(bed))
    (bed.root / "gres.conf").write_text(gres_conf(bed))  # slurmd reads gres.conf beside slurm.conf
    (bed.root / "hosts").write_text(hosts_file(bed))
    (bed.root / "no-engine").write_text("")
    for n in bed.nodes:
        for g in range(bed.gpus):
            os.mknod(bed.root / "dev" / f"{n}-nvidia{g}", 0o660 | 0o020000, os.makedev(195, g))  # S_IFCHR


def _start_munge(bed: SlurmBed) -> None:
    m = bed.munge_dir
    m.mkdir(mode=0o755)
    user = pwd.getpwnam("munge")
    key = m / "munge.key"
    _run(["mungekey", "--create", f"--keyfile={key}"], "mungekey")
    os.chown(m, user.pw_uid, user.pw_gid)
    os.chown(key, user.pw_uid, user.pw_gid)
    key.chmod(0o600)
    _run(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups", "munged",
          f"--key-file={key}", f"--socket={bed.munge_socket}", f"--pid-file={m}/munged.pid",
          f"--log-file={m}/munged.log", f"--seed-file={m}/munge.seed"], "munged")
    _wait(lambda: bed.munge_socket.exists(), 10, f"munged's socket {bed.munge_socket}")


def _start(bed: SlurmBed, name: str) -> None:
    """Start ``ctl``'s slurmctld or a node's slurmd (both daemonize; their pidfile names them)."""
    out = bed.root / name / "start.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "ab") as fh:
        done = subprocess.run(daemon_argv(bed, name), stdin=subprocess.DEVNULL, stdout=fh, stderr=fh, timeout=60,
                              start_new_session=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name}'s daemon did not start (exit {done.returncode}): {_tail(out)} {_daemon_log(bed, name)}")
    _wait(lambda: pid_of(bed, name) is not None, 20, f"{name}'s daemon pidfile")


def _run(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}): {done.stderr.strip()}")


def _wait(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} after {timeout_s:.0f} s")
        time.sleep(0.1)


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _daemon_log(bed: SlurmBed, name: str) -> str:
    return _tail(bed.root / name / ("slurmctld.log" if name == "ctl" else "slurmd.log"))


def scontrol(bed: SlurmBed, *args: str, timeout: float = 20) -> str:
    done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=timeout, env=bed.env())
    if done.returncode != 0:
        raise RuntimeError(f"scontrol {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def node_states(bed: SlurmBed) -> dict[str, str]:
    """node -> slurmctld's state (``IDLE``, ``MIXED``, ``DOWN+NOT_RESPONDING``)."""
    try:
        out = scontrol(bed, "-o", "show", "node")
    except (RuntimeError, subprocess.TimeoutExpired):
        return {}
    states = {}
    for line in out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        states[fields.get("NodeName", "?")] = fields.get("State", "?")
    return states


def wait_idle(bed: SlurmBed, nodes: tuple[str, ...] | list[str], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until ``nodes`` are usable (IDLE or MIXED, answering)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = node_states(bed)
        if all(states.get(n, "").split("+")[0] in ("IDLE", "MIXED", "ALLOCATED") and "NOT_RESPONDING" not in
               states.get(n, "") and "DRAIN" not in states.get(n, "") for n in nodes):
            return
        time.sleep(0.5)
    raise RuntimeError(f"slurm bed {bed.id}: nodes not idle after {timeout_s:.0f} s: {node_states(bed)}; "
                       f"slurmctld log: {_daemon_log(bed, 'ctl')[-1500:]}")


# ------------------------------------------------------------------------------------------ processes
def pid_of(bed: SlurmBed, name: str) -> int | None:
    try:
        pid = int(bed.pidfile(name).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return pid if str(bed.conf).encode() in cmd else None


def _munged_pid(bed: SlurmBed) -> int | None:
    try:
        pid = int((bed.munge_dir / "munged.pid").read_text().strip())
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if str(bed.munge_dir).encode() in cmd else None


def _engine_pids(eng: Any) -> set[int]:
    """A node engine's containers (its cgroup tree); the daemon, containerd and shims are in the node's namespace."""
    from tests.testbed import daemon as dd

    return dd.pids_in_cgroups(eng)


def _inodes(bed: SlurmBed) -> set[int]:
    return {i for i in (netns.inode(bed.ns(n)) for n in ("ctl", *bed.nodes)) if i is not None}


def processes(bed: SlurmBed) -> set[int]:
    """Every process of the bed: in its daemons' network namespaces (daemons, slurmstepd, steps' tasks) and munged."""
    pids = set(netns.pids_inside(_inodes(bed)))
    munged = _munged_pid(bed)
    return pids | ({munged} if munged else set())


def lose_node(bed: SlurmBed, node: str) -> None:
    """Stage a lost machine: cut its network (its veth down), SIGKILL its slurmd and every process in its
    namespace (slurmstepd and the steps' tasks). Its spool stays, so :func:`restore_node` brings it back."""
    netns.ip("link", "set", "eth0", "down", ns=bed.ns(node))
    inode = netns.inode(bed.ns(node))
    left = kill_until_gone(lambda: set(netns.pids_inside({inode} if inode else set())), 20)
    if left:
        raise RuntimeError(f"{node}: processes {sorted(left)} outlived SIGKILL")


def restore_node(bed: SlurmBed, node: str) -> None:
    """The lost machine comes back: network up, slurmd started again (ReturnToService=2 makes it usable)."""
    netns.ip("link", "set", "eth0", "up", ns=bed.ns(node))
    _start(bed, node)
    wait_idle(bed, [node])


# --------------------------------------------------------------------------------------- a node's engine
def engine_node(bed: SlurmBed, node: str) -> "Any":
    """The Docker test bed's :class:`~tests.testbed.daemon.Node` record for ``node``'s own engine: its data
    root, socket and cgroup parent under names of this bed (``lsb<id>-<node>-docker``)."""
    from tests.testbed.daemon import Node

    return Node(name=f"{bed.ns(node)}-docker", index=bed.nodes.index(node), address=bed.address(node),
                root=bed.root / node / "docker", nvidia=True)


def add_engine(bed: SlurmBed, node: str, image: str | None = None) -> Path:
    """Give ``node`` a Docker engine of its own, as a cluster node with Docker has: a ``dockerd`` in the node's
    network namespace (its containers' host network is the node's), with the stand-in NVIDIA toolkit (a
    ``--gpus`` request works and mounts nothing), whose socket the node's slurmd (and so every step) sees as
    ``/run/docker.sock``; ``image`` copied onto it from this machine's engine. Returns the socket.

    Raises:
        RuntimeError: the daemon did not answer, or the copy failed.
    """
    from tests.testbed import daemon as dd

    eng = engine_node(bed, node)
    for sub in ("data", "exec"):
        (eng.root / sub).mkdir(parents=True, exist_ok=True)
    (eng.root / "daemon.json").write_text(json.dumps(eng.daemon_config(), indent=1))
    env = dd.install_nvidia_hook(eng)
    argv = ["nsenter", f"--net={netns.path(bed.ns(node))}", "--", "unshare", "--uts", "--mount", "--", "sh", "-c",
            'hostname "$0" && exec "$@"', node, "dockerd", "--config-file", str(eng.root / "daemon.json"),
            "--data-root", str(eng.root / "data"), "--exec-root", str(eng.root / "exec"), "--pidfile",
            str(eng.pidfile), "-H", eng.docker_host, "--cgroup-parent", eng.cgroup_parent]
    with open(eng.log_file, "ab") as out:
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, env=env)
    _wait(lambda: eng.socket.exists() and dd._answers(eng), 60, f"{node}'s dockerd on {eng.socket}")
    slurmd = pid_of(bed, node)
    assert slurmd is not None, f"{node} has no slurmd"
    _run(["nsenter", "-t", str(slurmd), "--mount", "--", "sh", "-c",
          f"umount {DOCKER_SOCKET} 2>/dev/null; mount --bind {eng.socket} {DOCKER_SOCKET}"], f"{node}'s engine socket")
    if image:
        save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        load = subprocess.run(["docker", "-H", eng.docker_host, "load", "-q"], stdin=save.stdout, capture_output=True,
                              text=True, timeout=900)
        assert save.stdout is not None
        save.stdout.close()
        if save.wait(timeout=120) != 0 or load.returncode != 0:
            raise RuntimeError(f"copying {image} onto {node}'s engine failed: {load.stderr.strip()}")
    return eng.socket


def remove_engine(bed: SlurmBed, node: str) -> None:
    """Take ``node``'s engine away again (its daemon, containers, cgroups, socket binding and data root); the
    node goes on without one. Bed teardown does the same for any engine still there."""
    from tests.testbed import daemon as dd
    from tests.testbed.bed import remove_stale_libnetwork_sockets

    eng = engine_node(bed, node)
    dd.stop(eng)
    left = kill_until_gone(lambda: _engine_pids(eng) | _engine_daemons(eng), 20)
    if left:
        raise RuntimeError(f"{node}'s engine: processes {sorted(left)} outlived SIGKILL")
    slurmd = pid_of(bed, node)
    if slurmd is not None:
        _run(["nsenter", "-t", str(slurmd), "--mount", "--", "sh", "-c",
              f"umount {DOCKER_SOCKET}; [ -e {DOCKER_SOCKET} ] && mount --bind {bed.root}/no-engine {DOCKER_SOCKET}"
              "; true"], f"{node}'s engine socket")
    dd.remove_cgroups(eng)
    remove_stale_libnetwork_sockets(bed.created)
    _remove_tree(eng.root)


def _engine_daemons(eng: Any) -> set[int]:
    """dockerd, containerd and shims of a node's engine: their command lines name its directory."""
    from tests.helpers import processes_mentioning

    return {pid for pid, _ in processes_mentioning(str(eng.root))}


# ------------------------------------------------------------------------------------------- teardown
def tear_down(bed: SlurmBed) -> list[str]:
    """Remove every part of ``bed``, carrying on past failures; returns the problems met (empty when clean).

    Order: every job cancelled (so no step outlives the bed), daemons (SIGTERM, then SIGKILL), every process
    left in the bed's namespaces and munged, namespaces and the host veth, the directory (config, munge key,
    device nodes, logs).
    """
    problems: list[str] = []

    def step(what: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - teardown must try every step
            problems.append(f"{what}: {exc}")
            log.warning("slurm bed %s: %s failed: %s", bed.id, what, exc)

    if pid_of(bed, "ctl") is not None:
        step("cancel jobs", lambda: subprocess.run(["scancel", "--full", "--user", "root"], env=bed.env(),
                                                   capture_output=True, timeout=15))
    daemons = [p for p in (pid_of(bed, n) for n in ("ctl", *bed.nodes)) if p]
    for pid in daemons:
        step(f"SIGTERM {pid}", os.kill, pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(pid_of(bed, n) for n in ("ctl", *bed.nodes)):
        time.sleep(0.1)
    engines = [engine_node(bed, n) for n in bed.nodes if (bed.root / n / "docker").is_dir()]
    left = kill_until_gone(lambda: processes(bed) | set().union(*(_engine_pids(e) for e in engines)), 20)
    if left:
        problems.append(f"processes {sorted(left)} outlived SIGKILL")
    for e in engines:
        from tests.testbed import daemon as dd
        from tests.testbed.bed import remove_stale_libnetwork_sockets

        step(f"cgroups of {e.name}", dd.remove_cgroups, e)
        step("stale libnetwork sockets", remove_stale_libnetwork_sockets, bed.created)
    for name in ("ctl", *bed.nodes, "br"):
        step(f"namespace {bed.ns(name)}", netns.delete, bed.ns(name))
    if bed.subnet and bed.host_veth in netns.host_links(bed.prefix):
        step(f"veth {bed.host_veth}", netns.delete_host_link, bed.host_veth)
    step(f"remove {bed.root}", _remove_tree, bed.root)
    return problems


def _remove_tree(root: Path) -> None:
    done = subprocess.run(["rm", "-rf", "--one-file-system", str(root)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or root.exists():
        raise RuntimeError(f"rm -rf {root}: {done.stderr.strip()}")


def beds() -> list[SlurmBed]:
    """Every bed recorded under ``BASE_DIR`` (a crashed test's included)."""
    from tests.testbed.bed import recorded

    return recorded(BASE_DIR, SlurmBed.from_json)
