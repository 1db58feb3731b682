"""Typed snapshots of the GPUs, as :mod:`launcher.gpu.nvml` reads them: plain frozen data with units in the names.

Selection, placement, ``launcher gpus`` and the supervisor's watch work on these and never on NVML itself, so
they are tested with made-up inventories. They pickle, which is how they come back from the NVML helper
process (:mod:`launcher.gpu.nvml_call`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU, as NVML reports it, with the owner and command line from ``/proc``.

    ``user`` and ``command`` are None when the process is not visible from here (another PID namespace,
    e.g. inside a container without ``--pid host``) or has exited since NVML listed it.
    """

    pid: int
    used_memory_bytes: int | None  # None: NVML cannot tell (WDDM, some MIG setups)
    user: str | None = None
    command: str | None = None
    gpu_instance_id: int | None = None  # MIG GPU instance; None outside MIG
    compute_instance_id: int | None = None


@dataclass(frozen=True)
class MigDevice:
    """One MIG device (a slice of a GPU in MIG mode): leased and placed like a whole GPU, by its own UUID."""

    index: int  # the MIG slot on its GPU (nvmlDeviceGetMigDeviceHandleByIndex)
    uuid: str
    memory_total_bytes: int
    memory_used_bytes: int
    memory_free_bytes: int
    gpu_instance_id: int | None = None  # matches GpuProcess.gpu_instance_id of the processes running in it
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class GpuInfo:
    """One reading of one GPU.

    Memory comes from ``nvmlDeviceGetMemoryInfo_v2`` where the driver has it (``used`` then excludes
    the driver's reserved memory), else from v1. Utilisation is the percentage of the last sample
    period (1/6 s to 1 s depending on the product) during which a kernel ran / memory was read or
    written; None where the GPU does not report it (MIG mode).
    """

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_total_bytes: int
    memory_used_bytes: int
    memory_free_bytes: int
    gpu_utilization_pct: int | None
    memory_utilization_pct: int | None
    processes: tuple[GpuProcess, ...] = ()
    mig_mode: bool | None = None  # None: the GPU has no MIG support
    mig_devices: tuple[MigDevice, ...] = ()
    parent_uuid: str | None = None  # set on a MIG instance viewed as a GPU (launcher.gpu.mig.placeable)
    mig_index: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GpuError:
    """A GPU that NVML lists but could not read; it is left out of the inventory."""

    index: int
    uuid: str | None
    error: str  # NVML's message, e.g. "GPU is lost"


@dataclass(frozen=True)
class Inventory:
    """Every GPU NVML could read, at one moment.

    ``unavailable_reason`` is set (and ``gpus`` empty) when NVML itself is not usable; ``hint`` then says
    what to do about it.
    """

    gpus: tuple[GpuInfo, ...] = ()
    errors: tuple[GpuError, ...] = ()
    driver_version: str | None = None
    unavailable_reason: str | None = None
    hint: str | None = None

    @property
    def available(self) -> bool:
        return self.unavailable_reason is None
