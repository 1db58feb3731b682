"""The typed results of ``launcher check``'s probes (:mod:`launcher.check_probes` makes them, :mod:`launcher.check`
judges them): plain frozen data, so the verdicts are tested with made-up machines."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from launcher.gpu.snapshots import Inventory


@dataclass(frozen=True)
class PythonProbe:
    """This interpreter and the distributions it has: name -> version (None: not installed); ``wanted``: name ->
    the version range the launcher's metadata asks for (``>=1.26,<3``), for the dependencies it has."""

    version: tuple[int, int, int]
    executable: str
    packages: Mapping[str, str | None]
    wanted: Mapping[str, str] = field(default_factory=dict)


def outside(version: str, spec: str) -> bool:
    """Whether ``version`` is outside the range ``spec`` (PEP 440, e.g. ``>=1.26,<3``); False when either cannot
    be read (``packaging``, which pip and matplotlib bring, is not there, or a version is not PEP 440)."""
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion
    except ImportError:
        return False
    try:
        return not SpecifierSet(spec).contains(version, prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return False


@dataclass(frozen=True)
class DockerProbe:
    """The engine as ``docker version``/``docker info`` see it; ``error``: why none answered."""

    error: str | None = None
    server_version: str | None = None
    api_version: str | None = None
    rootless: bool = False
    runtimes: tuple[str, ...] = ()
    cdi_spec_dirs: tuple[str, ...] = ()
    swarm_state: str | None = None  # LocalNodeState: inactive, active, pending, ...
    swarm_manager: bool = False
    swarm_gpus: int | None = None  # NVIDIA-GPU generic resources the swarm's ready nodes advertise (a manager only)


@dataclass(frozen=True)
class NvmlProbe:
    """The GPU inventory, or why it could not be read (``timed_out``: the driver hung past the deadline)."""

    inventory: Inventory | None = None
    error: str | None = None
    hint: str | None = None
    timed_out: bool = False
    timeout_s: float | None = None


@dataclass(frozen=True)
class GpuContainerProbe:
    """A throw-away container of the image given GPUs: how many it was given and how many device nodes it saw
    (``skipped``: why it was not started)."""

    image: str
    given: tuple[str, ...] = ()
    seen: int | None = None
    error: str | None = None
    skipped: str | None = None


@dataclass(frozen=True)
class StoreProbe:
    """The admin lease store (``launcher admin init``) and the site policy runs obey."""

    site_file: str | None = None
    store: str | None = None
    store_error: str | None = None
    policy_source: str | None = None
    policy: Mapping[str, Any] | None = None
    policy_error: str | None = None


@dataclass(frozen=True)
class ResultsProbe:
    """The results directory's filesystem, asked at ``probed`` (``path`` or its nearest existing parent)."""

    path: str
    probed: str
    writable: bool
    write_error: str | None = None
    free_bytes: int | None = None
    fstype: str | None = None
    mount_point: str | None = None
    flock_error: str | None = None


@dataclass(frozen=True)
class ImageProbe:
    """The run's image on the engine; when absent, which build path ``launcher up`` would take or why none."""

    name: str
    present: bool = False
    image_id: str | None = None
    build_why: str | None = None
    build_problem: str | None = None
    error: str | None = None
    tf_package: str | None = None  # the image's launcher.tf-package label: tensorflow-cpu or tensorflow[and-cuda]


@dataclass(frozen=True)
class SlurmProbe:
    """Slurm's client commands (name -> path, None: not on PATH) and whether the controller answered."""

    why: str
    commands: Mapping[str, str | None] = field(default_factory=dict)
    answer: str | None = None
    error: str | None = None
    hint: str | None = None  # what to do, when the error came with one (a missing dependency)
    gpus: int | None = None  # GPUs the partitions' nodes list in their GRES (``sinfo -o '%D %G'``)


@dataclass(frozen=True)
class Probes:
    """Everything :mod:`launcher.check_probes` found; None for what was not asked."""

    backend: str  # the resolved backend: process, docker, swarm or slurm
    backend_why: str
    python: PythonProbe
    docker: DockerProbe
    nvml: NvmlProbe
    store: StoreProbe
    results: ResultsProbe
    image: ImageProbe | None = None
    gpu_container: GpuContainerProbe | None = None
    slurm: SlurmProbe | None = None
