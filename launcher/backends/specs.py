"""What a backend starts for each part of a run (the master, each worker group), as typed data.

Every backend has one pure step, :meth:`launcher.backends.base.Backend.specs`, from a prepared run to
:class:`LaunchSpecs`: per part its command, the environment the launcher sets, its mounts and its GPUs.
``start`` launches exactly that, ``launcher plan --backend X [--json]`` prints it and ``plan.json`` records it
(its ``launch`` member), so what the plan says is what the processes and containers get.

Two things only ``start`` knows are named, not given: a process's inherited descriptors (the master's listening
socket, the secret's pipe; :attr:`PartSpec.at_start`). The secret itself is in no spec: it is handed over in a
pipe or a read-only file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from worker.contract import TF_THREADS_ENV

GPU_VARS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
THREAD_VARS = (TF_THREADS_ENV, "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")
HOST_ENV = "host"  # PartSpec.inherits: the launcher's own environment, less its LAUNCHER_* settings


@dataclass(frozen=True)
class Mount:
    """A bind mount of a container: host ``source`` at ``target``."""

    source: str
    target: str
    read_only: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "target": self.target, "read_only": self.read_only}


@dataclass(frozen=True)
class PartSpec:
    """One part of a run as its backend starts it.

    Attributes:
        name: ``master`` or ``group-N``.
        command: a process's whole argv; a container's arguments after its image's entrypoint.
        env: the variables the launcher sets (over :attr:`inherits`).
        inherits: ``host``: the part also gets the launcher's environment (less ``LAUNCHER_*``) beneath
            :attr:`env`; ``""``: nothing else (a container's image defaults aside).
        at_start: variables ``start`` adds for descriptors it hands over (their numbers are known only then).
        mounts: bind mounts (containers).
        gpu_uuids: the GPUs the part is given.
        cpus: its CPU share (a container's limit; a process's thread count).
        image: the container image, ``""`` for a process.
    """

    name: str
    command: tuple[str, ...]
    env: Mapping[str, str]
    inherits: str = ""
    at_start: tuple[str, ...] = ()
    mounts: tuple[Mount, ...] = ()
    gpu_uuids: tuple[str, ...] = ()
    cpus: float = 1.0
    image: str = ""

    @property
    def gpu_env(self) -> dict[str, str]:
        """The device variables it gets (:data:`GPU_VARS`)."""
        return {k: self.env[k] for k in GPU_VARS if k in self.env}

    @property
    def thread_env(self) -> dict[str, str]:
        """The thread-count variables it gets (:data:`THREAD_VARS`)."""
        return {k: self.env[k] for k in THREAD_VARS if k in self.env}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "command": list(self.command), "env": dict(self.env), "inherits": self.inherits,
                "at_start": list(self.at_start), "mounts": [m.to_dict() for m in self.mounts],
                "gpu_uuids": list(self.gpu_uuids), "cpus": self.cpus, "image": self.image}


@dataclass(frozen=True)
class LaunchSpecs:
    """Every part of a run as backend :attr:`backend` starts it, the master first."""

    backend: str
    parts: tuple[PartSpec, ...] = ()
    note: str = ""  # what the specs leave to the backend's system (a scheduler picking nodes or GPUs)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def part(self, name: str) -> PartSpec:
        """The part called ``name``. Raises KeyError."""
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"backend": self.backend, "parts": [p.to_dict() for p in self.parts]}
        if self.note:
            d["note"] = self.note
        d.update(self.extra)
        return d


def binds(read_write: Mapping[str, str], read_only: Mapping[str, str]) -> tuple[Mount, ...]:
    """Bind mounts from ``host -> container`` maps (a container spec's ``binds`` and ``read_only_binds``)."""
    return (*(Mount(s, t, False) for s, t in read_write.items()), *(Mount(s, t, True) for s, t in read_only.items()))


def format_specs(specs: LaunchSpecs) -> list[str]:
    """The specs as lines people read (``launcher plan --backend X``): each part's command and GPU and thread
    variables."""
    lines = [f"Launch ({specs.backend}):"]
    for p in specs.parts:
        where = f"image {p.image}: " if p.image else ""
        lines.append(f"  {p.name:<9} {where}{' '.join(p.command)}")
        shown = {**p.gpu_env, **p.thread_env}
        if shown:
            lines.append("            " + " ".join(f"{k}={v!r}" if not v else f"{k}={v}" for k, v in shown.items()))
    if specs.note:
        lines.append(f"  ({specs.note})")
    return lines
