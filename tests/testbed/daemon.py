"""One extra ``dockerd`` in a network namespace of its own: start it, wait for it, stop it, clean up after it.

Started with ``nsenter --net=/run/netns/NAME`` (not ``ip netns exec``, which remounts ``/sys`` and leaves
the daemon an empty ``/sys/fs/cgroup``) and ``unshare --uts`` plus ``hostname`` so the node has its own
hostname for placement constraints. Everything the daemon owns is under one directory (data root, exec
root, socket, pidfile, its own ``--config-file`` so it never reads the default daemon's) and its
containers' cgroups sit under a ``--cgroup-parent`` named after the node, so cleanup can find every
process, mount and cgroup it left without guessing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.testbed import netns

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 3.0  # a daemon with running tasks takes longer; the cleanup after SIGKILL handles those
GPU_RESOURCE = "NVIDIA-GPU"


@dataclass(frozen=True)
class Node:
    """Where one node's daemon lives. ``name`` is its namespace, hostname and cgroup parent at once."""

    name: str
    index: int
    address: str  # on the bed's bridge, e.g. 10.213.0.10
    root: Path  # everything of this daemon is under it
    storage_driver: str = "overlay2"
    gpus: tuple[str, ...] = ()  # made-up GPU UUIDs advertised as NVIDIA-GPU generic resources
    labels: tuple[str, ...] = field(default=())  # engine labels, key=value
    nvidia: bool = False  # a stand-in for nvidia-container-toolkit: an "nvidia" runtime and the hook on PATH

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def docker_host(self) -> str:
        """The DOCKER_HOST value that reaches this daemon."""
        return f"unix://{self.socket}"

    @property
    def pidfile(self) -> Path:
        return self.root / "docker.pid"

    @property
    def log_file(self) -> Path:
        return self.root / "dockerd.log"

    @property
    def hook_dir(self) -> Path:
        """Where the stand-in ``nvidia-container-runtime-hook`` lives (first on the daemon's PATH)."""
        return self.root / "bin"

    @property
    def hook_log(self) -> Path:
        """One line per prestart call of the stand-in hook: the OCI state (container id, pid, bundle)."""
        return self.root / "nvidia-hook.log"

    @property
    def cgroup_parent(self) -> str:
        return f"/{self.name}"

    def daemon_config(self) -> dict[str, Any]:
        """The daemon's own config file: nothing from /etc/docker/daemon.json applies to it."""
        cfg: dict[str, Any] = {"storage-driver": self.storage_driver, "log-driver": "json-file",
                               "log-opts": {"max-size": "10m"}, "mtu": 1400}
        if self.gpus:
            cfg["node-generic-resources"] = [f"{GPU_RESOURCE}={u}" for u in self.gpus]
        if self.labels:
            cfg["labels"] = list(self.labels)
        if self.nvidia:  # what `nvidia-ctk runtime configure` writes, with runc standing in for the real runtime
            cfg["runtimes"] = {"nvidia": {"path": "runc"}}
        return cfg

    def argv(self) -> list[str]:
        """The command line: enter the namespace, take a hostname, become dockerd (one pid throughout)."""
        return ["nsenter", f"--net={netns.path(self.name)}", "--", "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', self.name,
                "dockerd", "--config-file", str(self.root / "daemon.json"),
                "--data-root", str(self.root / "data"), "--exec-root", str(self.root / "exec"),
                "--pidfile", str(self.pidfile), "-H", self.docker_host,
                "--cgroup-parent", self.cgroup_parent]


# The stand-in for NVIDIA's prestart hook: it records the OCI state runc hands it on stdin and mounts nothing.
HOOK_SCRIPT = """#!/bin/sh
# nvidia-container-runtime-hook stand-in (tests/testbed/daemon.py): no GPU here, so nothing to mount.
state=$(cat)
echo "$* $state" >> '{log}'
exit 0
"""


def install_nvidia_hook(node: Node) -> dict[str, str]:
    """Write the stand-in hook and return the daemon's environment with its directory first on PATH.

    moby (daemon/nvidia_linux.go) registers its built-in ``nvidia`` device driver at start-up only when
    ``exec.LookPath("nvidia-container-runtime-hook")`` finds the binary, and then adds it as a prestart hook
    to every container with a DeviceRequest of driver ``nvidia`` (after putting the requested IDs in
    ``NVIDIA_VISIBLE_DEVICES``). Without it, such a container fails to be created.
    """
    node.hook_dir.mkdir(parents=True, exist_ok=True)
    hook = node.hook_dir / "nvidia-container-runtime-hook"
    hook.write_text(HOOK_SCRIPT.format(log=node.hook_log))
    hook.chmod(0o755)
    return {**os.environ, "PATH": f"{node.hook_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"}


def start(node: Node) -> int:
    """Start the node's daemon in its (existing) namespace and return its pid once its socket answers.

    Raises:
        RuntimeError: it exited or did not answer within ``START_TIMEOUT_S``; the message ends with its log.
    """
    for sub in ("data", "exec"):
        (node.root / sub).mkdir(parents=True, exist_ok=True)
    (node.root / "daemon.json").write_text(json.dumps(node.daemon_config(), indent=1))
    env = install_nvidia_hook(node) if node.nvidia else None
    with open(node.log_file, "ab") as out:
        proc = subprocess.Popen(node.argv(), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, env=env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if node.socket.exists() and _answers(node):
            return proc.pid
        time.sleep(0.1)
    tail = node.log_file.read_text(errors="replace")[-3000:] if node.log_file.exists() else ""
    raise RuntimeError(f"dockerd of {node.name} did not answer on {node.socket} "
                       f"(exit status {proc.poll()}); its log ends:\n{tail}")


def _answers(node: Node) -> bool:
    try:
        done = subprocess.run(["docker", "-H", node.docker_host, "version", "--format", "{{.Server.Version}}"],
                              capture_output=True, timeout=10)
    except subprocess.TimeoutExpired:  # a daemon still starting on a loaded machine: ask again until the deadline
        return False
    return done.returncode == 0


def docker(node: Node, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``docker -H <node> ARGS`` with a deadline; raises ``RuntimeError`` with its stderr when ``check``."""
    done = subprocess.run(["docker", "-H", node.docker_host, *args], capture_output=True, text=True,
                          timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} on {node.name} failed: {done.stderr.strip()}")
    return done


def pid_of(node: Node) -> int | None:
    """The daemon's pid from its pidfile, if that process still runs."""
    try:
        pid = int(node.pidfile.read_text().strip())
    except (OSError, ValueError):
        return None
    return None if gone(pid) else pid


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited. Reaps it when it is our child (the fixtures start daemons, the registry
    and the forwarder from the test process itself): a zombie counts as gone."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def kill_until_gone(pids_of: Callable[[], set[int]], wait_s: float) -> set[int]:
    """SIGKILL what ``pids_of()`` names until it names nothing or ``wait_s`` passes; returns what is still there."""
    deadline = time.monotonic() + wait_s
    while True:
        left = pids_of()
        if not left or time.monotonic() > deadline:
            return left
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def stop(node: Node, grace_s: float = STOP_GRACE_S) -> None:
    """Stop the daemon by its pidfile: SIGTERM, then SIGKILL after ``grace_s``."""
    pid = pid_of(node)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    if not _wait_gone(pid, grace_s):
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, 5)


def cgroup_dirs(node: Node) -> list[Path]:
    """The node's cgroup-parent directory in every controller where it exists (cgroup v1 or v2)."""
    name = node.cgroup_parent.lstrip("/")
    found = [d / name for d in CGROUP_ROOT.iterdir() if (d / name).is_dir()] if CGROUP_ROOT.is_dir() else []
    if (CGROUP_ROOT / name).is_dir():
        found.append(CGROUP_ROOT / name)
    return found


def pids_in_cgroups(node: Node) -> set[int]:
    """Every process in the node's cgroup tree: its containers' processes."""
    pids: set[int] = set()
    for top in cgroup_dirs(node):
        for procs in top.rglob("cgroup.procs"):
            try:
                pids.update(int(p) for p in procs.read_text().split())
            except OSError:
                continue
    return pids


def remove_cgroups(node: Node) -> None:
    """rmdir the node's cgroup tree, deepest first (a cgroup directory goes only when empty)."""
    for top in cgroup_dirs(node):
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            try:
                d.rmdir()
            except OSError:
                pass
        try:
            top.rmdir()
        except OSError as exc:
            log.warning("could not remove cgroup %s: %s", top, exc)


def mounts_under(root: Path) -> list[str]:
    """Mount points at or under ``root`` (from /proc/self/mountinfo), deepest first."""
    prefix = str(root.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(set(points), key=lambda p: p.count("/"), reverse=True)


def unmount_all(root: Path) -> None:
    """Lazily unmount everything a daemon left under ``root`` (overlay layers, container namespaces)."""
    for _ in range(3):
        points = mounts_under(root)
        if not points:
            return
        for point in points:
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=20)


def remove_tree(root: Path) -> None:
    """Remove ``root`` once nothing is mounted under it (never crossing into a mount)."""
    unmount_all(root)
    if mounts_under(root):
        raise RuntimeError(f"still mounted under {root}: {mounts_under(root)}")
    # rm(1) rather than shutil.rmtree: a node that pulled the 1.5 GB image holds ~100k files, and the C loop
    # deletes them about twice as fast on this disk; --one-file-system never crosses into a mount.
    done = subprocess.run(["rm", "-rf", "--one-file-system", str(root)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and root.exists():
        shutil.rmtree(root, ignore_errors=True)
