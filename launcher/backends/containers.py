"""What every backend's processes share: the worker environment per kind of backend, and, for the container
backends (Docker, Swarm), names, labels, the user they run as and keeping their output when they go.

:func:`worker_env` is the one place a plan's share (GPU UUIDs and a CPU share) becomes the
``*_VISIBLE_DEVICES`` and thread variables of a process, for each kind of backend.
"""

from __future__ import annotations

import enum
import logging
import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher import safefs
from launcher.backends.base import FoundRun
from launcher.engine.client import Engine, engine_unavailable_reason
from launcher.errors import LauncherError
from launcher.engine.labels import GPUS_LABEL, GROUP_LABEL, RESULTS_LABEL, ROLE_LABEL, RUN_LABEL, USER_LABEL
from launcher.gpu.placement import ProcessShare
from launcher.runs import RunDir, is_run_dir, owner_uid_gid
from worker.contract import LOGS_DIR, MASTER_ADDR_ENV, MASTER_LOG, TF_THREADS_ENV, group_log_name

log = logging.getLogger(__name__)

# A kept copy of a part's output (logs/master.log, logs/group-N.log) never grows past this; one older copy
# (.1) is kept beside it, as the process backend does (each --resume appends another container's output).
KEPT_LOG_CAP_BYTES = 64 * 1024 * 1024
MASTER_PORT = 7100  # inside a run's own network; every run has its own network, so a fixed port is fine
# The image's own unprivileged user (Dockerfile ARG UID). Containers normally run as the invoking user so
# their files on the bind mount are that user's; a launcher run by root itself (no sudo, so no SUDO_UID to
# act for) would make that root inside the container, so its containers run as this user instead.
UNPRIVILEGED_UID_GID = (10001, 10001)
# Quiet, unbuffered Python and TensorFlow in every process of a run, on every backend.
WORKER_BASE_ENV = {"PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0",
                   "MPLBACKEND": "Agg"}


class Kind(str, enum.Enum):
    """How a backend hands GPUs to a process."""

    PROCESS = "process"  # CUDA_VISIBLE_DEVICES (and, alike, NVIDIA_VISIBLE_DEVICES) by UUID; the host's devices are all there
    DOCKER = "docker"  # the NVIDIA runtime mounts the UUIDs in NVIDIA_VISIBLE_DEVICES
    SWARM = "swarm"  # the engine picks GPUs on the node it chooses; nothing is pinned by UUID
    SLURM = "slurm"  # Slurm sets each step's CUDA_VISIBLE_DEVICES from the GRES it allocated


def device_env(kind: Kind, gpu_uuids: tuple[str, ...]) -> dict[str, str]:
    """The device variables of a process given ``gpu_uuids`` (empty: CPU only, every GPU hidden).

    A process and a container get the same two variables (CUDA reads ``CUDA_VISIBLE_DEVICES``, the NVIDIA
    runtime ``NVIDIA_VISIBLE_DEVICES``), so a process never inherits a GPU list of the launcher's own environment
    (an ``NVIDIA_VISIBLE_DEVICES=all`` of a GPU image) that the plan does not give it."""
    joined = ",".join(gpu_uuids)
    if kind is Kind.SLURM:  # a step without GPUs is hidden from them by launcher.backends.slurm_specs.step_env
        return {}
    if not gpu_uuids:
        # "void": the NVIDIA runtime, if the engine has one, mounts no GPU at all (not even the default "all").
        return {"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": ""}
    order = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # so indices, where anything uses them, match nvidia-smi
    if kind in (Kind.PROCESS, Kind.DOCKER):
        return {"NVIDIA_VISIBLE_DEVICES": joined, "CUDA_VISIBLE_DEVICES": joined, **order}
    return dict(order)  # worker.gpu_setup.adopt_swarm_gpus sets CUDA_VISIBLE_DEVICES from what was assigned


def worker_env(kind: Kind, share: ProcessShare, *, master_addr: str | None) -> dict[str, str]:
    """The environment of one process of a run, beyond the spec and the secret.

    Args:
        kind: the backend's kind (how GPUs are handed over).
        share: the process's share of the plan (GPU UUIDs, CPUs).
        master_addr: ``host:port`` a worker group dials; None for the master itself, which gets TensorFlow
            threads for its CPU share while a group's numpy policy runs on one thread.
    """
    env = {**WORKER_BASE_ENV, **device_env(kind, tuple(share.gpu_uuids))}
    if master_addr is None:
        env[TF_THREADS_ENV] = str(max(1, int(share.cpus)))
    else:
        env.update({MASTER_ADDR_ENV: master_addr, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                    TF_THREADS_ENV: "1"})
    return env


# ------------------------------------------------------------------------------- container backends
def network_name(run_id: str) -> str:
    return f"launcher-{run_id}"


def master_name(run_id: str) -> str:
    return f"launcher-{run_id}-master"


def group_name(run_id: str, index: int) -> str:
    return f"launcher-{run_id}-group-{index}"


def container_user() -> tuple[int, int]:
    """uid, gid the run's containers run as: the invoking user (``SUDO_UID`` under sudo), never root."""
    uid, gid = owner_uid_gid()
    return UNPRIVILEGED_UID_GID if uid == 0 else (uid, gid)


def labels(run_id: str, results_dir: Path, role: str, *, group: int | None = None, gpus: tuple[str, ...] = (),
           uid: int | None = None) -> dict[str, str]:
    """The ``launcher.*`` labels of one container or service (role ``network``, ``secret``, ``results``: of the
    run's network, secret, volume)."""
    return {
        RUN_LABEL: run_id,
        ROLE_LABEL: role,
        GROUP_LABEL: "" if group is None else str(group),
        GPUS_LABEL: ",".join(gpus),
        RESULTS_LABEL: str(results_dir.resolve()),
        USER_LABEL: str(owner_uid_gid()[0] if uid is None else uid),
    }


def nano_cpus(cpus: float, limit: int | None) -> int:
    """A CPU share as the engine's ``nano_cpus``, lowered to ``limit`` CPUs (the engine refuses more)."""
    if limit is not None:
        cpus = min(cpus, float(limit))
    return max(0, int(round(cpus * 1e9)))


# ----------------------------------------------------------------------------- limits of every container/task
GIB = 1024 ** 3
MASTER_MEMORY_BYTES = 8 * GIB  # TensorFlow, the learner, checkpoints and the inbox's byte budget, on the host
MASTER_GPU_EXTRA_BYTES = 8 * GIB  # CUDA's host-side context and pinned buffers
GROUP_BASE_BYTES = GIB  # a group's interpreter, numpy policy and its queues
GROUP_PER_WORKER_BYTES = 256 * 1024 ** 2  # one environment and its rollout buffers
MASTER_PIDS = 4096  # TensorFlow's thread pools count as pids; a fork bomb stops here
GROUP_PIDS = 1024


@dataclass(frozen=True)
class HostLimits:
    """The host memory (bytes, swap included) and process/thread count one container or task may use."""

    memory_bytes: int
    pids: int


def master_limits(share: ProcessShare) -> HostLimits:
    """The master's limits from its share of the plan. Pure."""
    return HostLimits(MASTER_MEMORY_BYTES + (MASTER_GPU_EXTRA_BYTES if share.gpu_uuids else 0), MASTER_PIDS)


def group_limits(share: ProcessShare, workers: int) -> HostLimits:
    """A worker group's limits from its share and its number of workers. Pure."""
    gpu = MASTER_GPU_EXTRA_BYTES if share.gpu_uuids else 0
    return HostLimits(GROUP_BASE_BYTES + GROUP_PER_WORKER_BYTES * max(1, workers) + gpu, GROUP_PIDS)


# ------------------------------------------------------------------------------------------ the run secret
SECRET_MOUNT = "/run/launcher/secret"  # where a Docker container reads it (read-only bind of one file)


def secrets_dir(euid: int | None = None) -> Path:
    """The directory of run secrets of the launcher running as ``euid`` (default: this one): in ``/dev/shm``
    (memory, never on disk) where there is one. Mode 0700, so a host account that happens to have a
    container's uid cannot reach the files."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    return base / f"launcher-secrets-{os.geteuid() if euid is None else euid}"


def secret_path(run_id: str) -> Path:
    return secrets_dir() / run_id


def write_secret_file(run_id: str, secret: str, uid: int, gid: int) -> Path:
    """Write the run secret to a file only the containers' user can read (0400, theirs), in
    :func:`secrets_dir` (0700, this user's); the Docker backend bind-mounts it read-only at
    :data:`SECRET_MOUNT`. The secret is then in no environment and not in ``docker inspect``.

    Raises:
        LauncherError: the directory exists but is not this user's private directory (someone planted it).
    """
    d = secrets_dir()
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise LauncherError(f"{d} is not a private directory of uid {os.geteuid()} (owner uid {st.st_uid}, mode "
                            f"{stat.S_IMODE(st.st_mode):o}); the run secret is not written there",
                            hint=f"remove {d} (someone else may have made it) and run again")
    path = d / run_id
    path.unlink(missing_ok=True)  # a resumed run gets a new secret
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
    try:
        os.write(fd, secret.encode())
        if os.geteuid() == 0:
            os.fchown(fd, uid, gid)
    finally:
        os.close(fd)
    return path


def remove_secret_file(run_id: str, owners: tuple[int, ...] = ()) -> None:
    """Remove run ``run_id``'s secret file (teardown); nothing there is fine. ``owners``: other launcher uids
    whose secrets directory may hold it (a root ``down`` of a run its user started: the run's ``launcher.user``
    label). Each directory is opened without following a link and must be its uid's and private."""
    if not run_id or "/" in run_id or run_id in (".", ".."):
        return
    for euid in dict.fromkeys((os.geteuid(), *owners)):
        try:
            fd = os.open(secrets_dir(euid), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid == euid and not st.st_mode & 0o077:
                os.unlink(run_id, dir_fd=fd)
        except OSError:
            pass
        finally:
            os.close(fd)


def give_to(path: Path, uid: int, gid: int) -> None:
    """Make the results directory the invoking user's when the launcher runs as root for someone (sudo):
    the containers run as that user and must write there. Walks by directory descriptors and skips files
    with several links (:func:`launcher.safefs.chown_tree`): the user can write the tree, root must change
    nothing outside it."""
    if os.geteuid() != 0 or uid == 0:
        return
    for line in safefs.chown_tree(path, uid, gid):
        log.warning("cannot hand to uid %d: %s", uid, line)


@dataclass(frozen=True)
class LogCopy:
    """The whole output of one part, read from the engine before it is removed (its copy goes with it)."""

    part_labels: Mapping[str, str]  # the container's or service's launcher.* labels
    header: str  # one line saying what it was and how it ended
    data: bytes


def log_file_name(part_labels: Mapping[str, str], fallback: str) -> str:
    """``master.log`` or ``group-N.log`` in the run's ``logs/``."""
    if part_labels.get(ROLE_LABEL) == "master":
        return MASTER_LOG
    return group_log_name(part_labels.get(GROUP_LABEL) or fallback)


def save_logs(copies: list[LogCopy], logs_dir: Path) -> list[Path]:
    """Append each copy, after its header, to ``logs_dir/<master|group-N>.log``; files a root launcher writes
    go to the run's owner (the ``launcher.user`` label). Returns the files written.

    ``logs_dir`` is inside a directory the master container can write: every file is opened relative to the
    run directory's descriptor without following links, regular files only, and handed over by ``fchown``
    (:mod:`launcher.safefs`), so a planted ``logs/master.log -> ~/.ssh/authorized_keys`` is refused.
    """
    written: list[Path] = []
    root = logs_dir.parent
    try:
        gid = os.stat(root).st_gid
    except OSError as exc:
        log.warning("cannot keep the run's output in %s: %s", logs_dir, exc.strerror)
        return written
    for c in copies:
        name = log_file_name(c.part_labels, "unknown")
        owner_label = c.part_labels.get(USER_LABEL, "")
        owner = (int(owner_label), gid) if os.geteuid() == 0 and owner_label.isdigit() and int(owner_label) != 0 \
            else None
        try:
            safefs.append(root, f"{logs_dir.name}/{name}", f"--- launcher: {c.header} ---\n".encode() + c.data,
                          owner=owner, cap_bytes=KEPT_LOG_CAP_BYTES)
        except OSError as exc:
            log.warning("cannot write %s: %s", logs_dir / name, exc)
            continue
        written.append(logs_dir / name)
    return written


def labelled_results(part_labels: Mapping[str, str]) -> Path | None:
    """The results directory a part's labels name, when it is on this host and trustworthy: owned by the
    labelled user (or root) and not writable by everyone (:func:`launcher.safefs.distrust`). Anyone with the
    engine can label a container; a root ``down --all`` must not write where such a label points."""
    results = part_labels.get(RESULTS_LABEL)
    if not results:
        return None
    path = Path(results)
    user = part_labels.get(USER_LABEL, "")
    why = safefs.distrust(path, int(user) if user.isdigit() else None)
    if why is not None:
        if path.exists():
            log.warning("not using %s named by a container's label: it %s", path, why)
        return None
    return path


def logs_dir_for(run_dir: RunDir | None, part_labels: Mapping[str, str]) -> Path | None:
    """Where a run's output is kept: its results directory's ``logs/``, else the one its labels name; None
    when that directory is not on this host or is not to be trusted."""
    if run_dir is not None:
        return run_dir.files.logs
    results = labelled_results(part_labels)
    return None if results is None else results / LOGS_DIR


def run_dir_from_labels(run_id: str, found_labels: list[Mapping[str, str]]) -> RunDir | None:
    """The results directory a run's labels name, when it is on this host (and trustworthy)."""
    for lab in found_labels:
        path = labelled_results(lab)
        if path is not None and is_run_dir(path):
            return RunDir(run_id, path)
    return None


class EngineRun(FoundRun):
    """A container backend's run found again on the Docker engine (``engine``: a connected engine to use;
    default: one is connected on first need, and why none answers is :attr:`unreachable`)."""

    def __init__(self, run_id: str, run_dir: RunDir | None, record: dict[str, Any], *,
                 engine: Engine | None = None) -> None:
        super().__init__(run_id, run_dir, record)
        self._engine = engine
        self._own_engine = engine is None
        self._tried = engine is not None

    @property
    def engine(self) -> Engine | None:
        if not self._tried:
            self._tried = True
            reason = engine_unavailable_reason()
            try:
                self._engine = Engine() if reason is None else None
            except LauncherError as exc:
                reason = exc.message
            self.unreachable = reason or ""
        return self._engine

    def close(self) -> None:
        if self._own_engine and self._engine is not None:
            self._engine.close()
            self._engine = None
