"""Multi-Instance GPU: each MIG instance is placed, leased and handed to a process like a whole GPU.

A GPU in MIG mode cannot run a process as a whole; its instances can, each with its own UUID (``MIG-...``),
memory and processes. :func:`placeable` turns an inventory's GPUs into the units a run can be given: GPUs
not in MIG mode as they are, and in place of each MIG-mode GPU one :class:`GpuInfo` per instance. From there
selection, placement, leases (one per MIG UUID) and ``NVIDIA_VISIBLE_DEVICES`` (the MIG UUID, which the NVIDIA
container runtime and CUDA both accept) need nothing special. Pure functions over snapshots.

Similar to ``nvidia-smi -L``, which lists the MIG devices under their GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from launcher.gpu.snapshots import GpuInfo, MigDevice


def instance(gpu: GpuInfo, mig: MigDevice) -> GpuInfo:
    """MIG instance ``mig`` of ``gpu`` as a placeable unit. It keeps its GPU's index (NVML has no index of its
    own for it) and says which slot it is in its name; utilisation is not reported for MIG instances."""
    return replace(
        gpu,
        uuid=mig.uuid,
        name=f"{gpu.name} MIG {mig.index}",
        memory_total_bytes=mig.memory_total_bytes,
        memory_used_bytes=mig.memory_used_bytes,
        memory_free_bytes=mig.memory_free_bytes,
        gpu_utilization_pct=None,
        memory_utilization_pct=None,
        processes=mig.processes,
        mig_mode=None,
        mig_devices=(),
        parent_uuid=gpu.uuid,
        mig_index=mig.index,
    )


def placeable(gpus: Iterable[GpuInfo]) -> list[GpuInfo]:
    """The units a run can be placed on, in inventory order: whole GPUs, and MIG instances in place of a GPU in
    MIG mode (one with MIG on and no instance configured offers nothing). Idempotent."""
    units: list[GpuInfo] = []
    for gpu in gpus:
        if gpu.mig_mode:
            units.extend(instance(gpu, m) for m in gpu.mig_devices)
        else:
            units.append(gpu)
    return units


def label(gpu: GpuInfo) -> str:
    """How a unit is named to people: ``GPU 2``, or ``GPU 2 MIG 1`` for an instance."""
    return f"GPU {gpu.index}" + (f" MIG {gpu.mig_index}" if gpu.mig_index is not None else "")
