"""The probes of ``launcher check``: each asks this machine one thing, within a deadline, and returns a typed
result of :mod:`launcher.check` (never raises for what it finds missing; that is the answer).

Deadlines: the Docker ping 3 s, NVML ``$LAUNCHER_NVML_TIMEOUT`` (5 s) through :mod:`launcher.gpu.nvml`, a
registry and a package index 5 s each (only when the image is missing), Slurm's ``sinfo`` 10 s, the GPU
container 60 s, a ``flock`` on the results directory 3 s.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.check_types import (DockerProbe, GpuContainerProbe, ImageProbe, NvmlProbe, Probes, PythonProbe,
                                  ResultsProbe, SlurmProbe, StoreProbe)
from launcher.errors import LauncherError, MissingDependency

if TYPE_CHECKING:
    from launcher.engine.client import Engine
    from launcher.gpu.snapshots import Inventory

log = logging.getLogger(__name__)

FLOCK_TIMEOUT_S = 3.0
SLURM_TIMEOUT_S = 10.0
GPU_CONTAINER_TIMEOUT_S = 60.0
CHECK_LABEL = "launcher.check"  # on the throw-away GPU container, so a leftover one can be found
# Device nodes a container given GPUs gets, one per GPU (/dev/nvidia0, ...); needs nothing but Python there.
_COUNT_DEVICES = ("import glob, re; "
                  "print(len([p for p in glob.glob('/dev/nvidia*') if re.fullmatch(r'/dev/nvidia[0-9]+', p)]))")


@dataclass(frozen=True)
class CheckRequest:
    """What to check: the backend (``auto``: Docker when an engine answers), the image (None: the default tag
    for the kind of run), the results directory, the build mode, and whether the run is CPU-only."""

    backend: str = "auto"
    image: str | None = None
    results: Path = Path("results")
    build: str = "auto"
    cpu: bool = False
    nvml_timeout_s: float | None = None
    backend_origin: str = "flag --backend"  # where the backend came from (``launcher config show``'s words)


def _requirements() -> dict[str, str]:
    """The launcher's dependencies and their ranges from its installed metadata (``pip show launcher``), extras
    left out; TensorFlow's range from the cpu extra. Empty when the launcher runs from a tree not installed."""
    try:
        lines = importlib.metadata.requires("launcher") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    wanted: dict[str, str] = {}
    for line in lines:
        spec, _, marker = line.partition(";")
        if marker and "extra == \"cpu\"" not in marker:
            continue
        m = re.match(r"\s*([A-Za-z0-9_.-]+)(\[[^]]*\])?\s*(.*)", spec)
        if m:
            wanted[m.group(1).lower()] = m.group(3).strip()
    return wanted


def probe_python() -> PythonProbe:
    """This interpreter and the versions of the distributions a run needs (``pip show``)."""
    from launcher.check import HOST_PACKAGES

    wanted = _requirements()
    packages: dict[str, str | None] = {}
    for name in (*(wanted or HOST_PACKAGES), "tensorflow", "tensorflow-cpu"):
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    v = sys.version_info
    return PythonProbe((v.major, v.minor, v.micro), sys.executable, packages, wanted)


def probe_docker() -> tuple[DockerProbe, "Engine | None"]:
    """The engine (``docker version`` and ``docker info``) and a connection to it, or why none answers."""
    from launcher.engine.client import PING_TIMEOUT_S, Engine
    from launcher.engine.errors import engine_call

    try:
        engine = Engine(timeout_s=PING_TIMEOUT_S)
        version = dict(engine_call("read docker version", engine.client.version))
        info = engine.info()
    except LauncherError as exc:
        return DockerProbe(error=exc.message), None
    swarm = info.get("Swarm") or {}
    security = [str(x) for x in info.get("SecurityOptions") or []]
    swarm_gpus = None
    if swarm.get("LocalNodeState") == "active" and swarm.get("ControlAvailable"):
        from launcher.engine.swarm import SwarmEngine

        try:
            swarm_gpus = sum(n.gpus for n in SwarmEngine(engine).nodes() if n.ready)
        except LauncherError as exc:
            log.debug("listing the swarm's nodes: %s", exc)
    return DockerProbe(server_version=str(version.get("Version") or "?"), api_version=str(version.get("ApiVersion")),
                       rootless=any("name=rootless" in s for s in security), runtimes=engine.runtimes(),
                       cdi_spec_dirs=tuple(info.get("CDISpecDirs") or ()),
                       swarm_state=swarm.get("LocalNodeState") or None,
                       swarm_manager=bool(swarm.get("ControlAvailable")), swarm_gpus=swarm_gpus), engine


def probe_nvml(timeout_s: float | None = None) -> NvmlProbe:
    """The GPU inventory through :func:`launcher.gpu.nvml.read_inventory`, under its deadline."""
    from launcher.gpu import nvml, nvml_call

    try:
        limit = nvml_call.timeout_s() if timeout_s is None else timeout_s
        return NvmlProbe(inventory=nvml.read_inventory(timeout_s=limit), timeout_s=limit)
    except nvml_call.NvmlTimeout as exc:
        return NvmlProbe(error=exc.message, hint=exc.hint, timed_out=True, timeout_s=exc.timeout_s)
    except LauncherError as exc:  # the helper crashed, or $LAUNCHER_NVML_TIMEOUT is not a number
        return NvmlProbe(error=exc.message, hint=exc.hint)
    finally:
        nvml.shutdown()


def probe_store() -> StoreProbe:
    """The admin lease store (:func:`launcher.gpu.store.find_site`) and the policy (:func:`load_policy`)."""
    from launcher.gpu.policy import load_policy
    from launcher.gpu.store import find_site

    site_file = store = store_error = None
    try:
        site = find_site()
        if site is not None:
            site_file, store = str(site.site_file), str(site.store)
    except LauncherError as exc:
        store_error = exc.message
    try:
        policy = load_policy()
    except LauncherError as exc:
        return StoreProbe(site_file, store, store_error, policy_error=exc.message)
    return StoreProbe(site_file, store, store_error, policy.source, policy.to_dict())


def _mount_of(path: Path) -> tuple[str | None, str | None]:
    """(mount point, filesystem type) holding ``path``, from /proc/self/mountinfo (like ``findmnt -T``)."""
    best: tuple[str | None, str | None] = (None, None)
    target = str(path.resolve())
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return best
    for row in text.splitlines():
        left, _, right = row.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        point = fields[4].encode().decode("unicode_escape")  # \040 is a space
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0] or ""):
            best = (point, right.split()[0])
    return best


def _try_flock(fd: int) -> str | None:
    """Take and drop an exclusive flock on ``fd`` within :data:`FLOCK_TIMEOUT_S`; None when it worked."""
    outcome: list[str | None] = []

    def attempt() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            outcome.append(None)
        except OSError as exc:
            outcome.append(f"{type(exc).__name__}: {exc.strerror or exc}")

    thread = threading.Thread(target=attempt, daemon=True, name="check-flock")
    thread.start()
    thread.join(FLOCK_TIMEOUT_S)
    return outcome[0] if outcome else f"no answer within {FLOCK_TIMEOUT_S:g} s"


def probe_results(path: Path) -> ResultsProbe:
    """The results directory (or its nearest existing parent): write a file there, flock it, measure free space
    (``df``) and the filesystem type."""
    path = path.expanduser().absolute()
    probed = path
    while not probed.exists() and probed.parent != probed:
        probed = probed.parent
    point, fstype = _mount_of(probed)
    free = None
    try:
        st = os.statvfs(probed)
        free = st.f_bavail * st.f_frsize
    except OSError:
        pass
    try:
        fd, name = tempfile.mkstemp(prefix=".launcher-check-", dir=probed)
    except OSError as exc:
        return ResultsProbe(str(path), str(probed), False, f"{exc.strerror or exc} (uid {os.getuid()})", free,
                            fstype, point)
    try:
        flock_error = _try_flock(fd)
    finally:
        os.close(fd)
        os.unlink(name)
    return ResultsProbe(str(path), str(probed), True, None, free, fstype, point, flock_error)


def probe_image(engine: "Engine", name: str, *, gpu: bool, build: str) -> ImageProbe:
    """The image on the engine (``docker image inspect``); when absent, the build path ``launcher up`` would
    take (:func:`launcher.image.choose_build_path`, a registry and index asked for a few seconds) or why none."""
    from launcher import image as image_mod
    from launcher.engine.images import image_exists, inspect_image

    try:
        if image_exists(name, engine.client):
            attrs = inspect_image(name, engine.client)
            labels = (attrs.get("Config") or {}).get("Labels") or {}
            return ImageProbe(name, True, str(attrs.get("Id")), tf_package=labels.get("launcher.tf-package"))
    except LauncherError as exc:
        return ImageProbe(name, error=exc.message)
    try:
        options = image_mod.BuildOptions(tag=name, flavour=image_mod.flavour_for(gpu))
        return ImageProbe(name, build_why=image_mod.choose_build_path(build, options, engine.client).why)
    except LauncherError as exc:
        return ImageProbe(name, build_problem=exc.message)


def probe_gpu_container(engine: "Engine | None", image: ImageProbe | None, docker: DockerProbe,
                        inventory: "Inventory | None") -> GpuContainerProbe | None:
    """Start a throw-away container of the image given every whole GPU NVML lists and count the GPU device
    nodes it sees (like ``docker run --rm --gpus all IMAGE nvidia-smi -L``). Skipped, saying why, unless the
    engine, the image, a GPU runtime and GPUs are all there."""
    if image is None:
        return None
    gpus = tuple(g.uuid for g in (inventory.gpus if inventory else ()) if not g.mig_mode)
    skipped = ("no Docker engine" if engine is None else
               f"the image {image.name} is not on the engine" if not image.present else
               "the engine has no nvidia runtime" if "nvidia" not in docker.runtimes else
               "no GPUs to give it (NVML lists none without MIG)" if not gpus else None)
    if skipped or engine is None:
        return GpuContainerProbe(image.name, gpus, skipped=f"not started: {skipped}")
    try:
        code, out, err = engine.run_capture(image.name, ["python3", "-c", _COUNT_DEVICES],
                                            user=f"{os.getuid()}:{os.getgid()}",
                                            labels={CHECK_LABEL: "gpus"}, timeout_s=GPU_CONTAINER_TIMEOUT_S,
                                            gpu_uuids=gpus)
    except LauncherError as exc:
        return GpuContainerProbe(image.name, gpus, error=exc.message.splitlines()[0])
    if code != 0 or not out.strip().isdigit():
        tail = (err or out).strip().splitlines()[-1:] or [f"exit status {code}"]
        return GpuContainerProbe(image.name, gpus, error=f"exit status {code}: {tail[0]}")
    return GpuContainerProbe(image.name, gpus, seen=int(out.strip()))


def probe_slurm(backend: str) -> SlurmProbe | None:
    """Slurm's clients and a ``sinfo`` answer, when Slurm is the backend or ``sbatch`` is on PATH."""
    from launcher.slurm import commands

    if backend != "slurm" and not shutil.which("sbatch"):
        return None
    why = "--backend slurm" if backend == "slurm" else "sbatch is on PATH"
    found = {c: shutil.which(c) for c in ("sinfo", "sbatch", "srun", "scontrol")}
    if not all(found.values()):
        return SlurmProbe(why, found)
    try:
        out = commands.run(["sinfo", "-h", "-o", "%P %a %D %G"], what="listing the partitions",
                           deadline_s=SLURM_TIMEOUT_S)
    except MissingDependency as exc:  # no controller, no answer in time, SLURM_CONF naming no file
        return SlurmProbe(why, found, error=exc.message, hint=exc.hint)
    except LauncherError as exc:  # Slurm answered, refusing
        return SlurmProbe(why, found, error=exc.message)
    from launcher.slurm.model import gres_gpus

    rows = [r.split() for r in out.splitlines() if r.strip()]
    gpus = sum(int(r[2]) * gres_gpus(r[3]) for r in rows if len(r) >= 4 and r[2].isdigit())
    return SlurmProbe(why, found, answer=f"{len(rows)} partition(s): " + "; ".join(" ".join(r) for r in rows[:4]),
                      gpus=gpus)


def probe_all(req: CheckRequest) -> Probes:
    """Every probe, in the order a run needs them; the Docker connection is closed at the end."""
    docker, engine = probe_docker()
    if req.backend == "auto":
        backend, why = ("docker", "auto: a Docker engine answered") if engine is not None else \
            ("process", "auto: no Docker engine, so local processes")
    else:
        backend, why = req.backend, f"from {req.backend_origin}"
    try:
        nvml = NvmlProbe() if req.cpu else probe_nvml(req.nvml_timeout_s)
        image = None
        if backend in ("docker", "swarm") and engine is not None:
            from launcher import image as image_mod

            name = req.image or image_mod.default_tag(image_mod.flavour_for(not req.cpu))
            image = probe_image(engine, name, gpu=not req.cpu, build=req.build)
        # on a swarm the tasks' GPUs are the nodes': a container here proves nothing about them
        container = None if req.cpu or backend != "docker" else probe_gpu_container(engine, image, docker,
                                                                                    nvml.inventory)
        return Probes(backend, why, probe_python(), docker, nvml, probe_store(), probe_results(req.results),
                      image=image, gpu_container=container, slurm=probe_slurm(backend))
    finally:
        if engine is not None:
            engine.close()
