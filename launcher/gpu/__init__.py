"""The GPU subsystem behind one small facade: inventory, selection, placement, leases and site policy.

``launcher up`` and ``launcher plan`` each make one call with the :class:`GpuRequest` that
:func:`launcher.config.gpu_request` built from the options; ``launcher gpus`` calls :func:`inventory`.

Inside (each module one concern, pure where it can be):

* :mod:`~launcher.gpu.nvml` – the only module that calls NVML; typed snapshots (:class:`GpuInfo`,
  :mod:`~launcher.gpu.snapshots`), read in a helper process under a deadline (:mod:`~launcher.gpu.nvml_call`).
* :mod:`~launcher.gpu.mig` – MIG instances as units placed and leased like GPUs (pure).
* :mod:`~launcher.gpu.foreign` / :mod:`~launcher.gpu.watch` – processes on a leased GPU outside its lease; a
  running run's watch.
* :mod:`~launcher.gpu.request` – :class:`GpuRequest` and the ``--gpus`` parser.
* :mod:`~launcher.gpu.select` – pure selection over snapshots (thresholds, worst of N readings).
* :mod:`~launcher.gpu.placement` – pure ``make_plan`` -> :class:`Plan` (GPU UUIDs and CPU shares per process).
* :mod:`~launcher.gpu.reservations` – per-GPU ``flock`` leases; :mod:`~launcher.gpu.leaseholders` – who holds them.
* :mod:`~launcher.gpu.policy` – the administrator's site policy as pure functions.
* :mod:`~launcher.gpu.planner` – the impure sequence that ties them together.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from launcher.gpu.nvml import GpuInfo, Inventory
    from launcher.gpu.placement import Plan, PlanRequest, ProcessShare
    from launcher.gpu.planner import Outcome
    from launcher.gpu.request import GpuChoice, GpuRequest, parse_gpu_choice

_LAZY = {"GpuInfo": "launcher.gpu.nvml", "Inventory": "launcher.gpu.nvml", "Outcome": "launcher.gpu.planner",
         "Plan": "launcher.gpu.placement", "PlanRequest": "launcher.gpu.placement",
         "ProcessShare": "launcher.gpu.placement", "GpuChoice": "launcher.gpu.request",
         "GpuRequest": "launcher.gpu.request", "parse_gpu_choice": "launcher.gpu.request"}


def __getattr__(name: str) -> Any:
    """The facade's names load on first use: a process that only takes or reads leases (a racer, the
    master's hand-over) imports neither pynvml nor the planner."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'launcher.gpu' has no attribute {name!r}")

__all__ = ["GpuChoice", "GpuInfo", "GpuRequest", "Inventory", "Outcome", "Plan", "PlanRequest", "ProcessShare",
           "cpu_count", "inventory", "parse_gpu_choice", "plan_and_reserve", "preview"]


def cpu_count() -> int:
    """Cores this process may run on (respects a container's or taskset's CPU set)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


_cores = cpu_count  # the parameters below are named cpu_count too

def inventory() -> Inventory:
    """Every GPU NVML can read now (similar to ``nvidia-smi -q``); never raises for a missing driver.

    Raises:
        NvmlTimeout: the driver did not answer within ``$LAUNCHER_NVML_TIMEOUT`` (a MissingDependency, exit 6).
    """
    from launcher.gpu.nvml import read_inventory

    return read_inventory()


def plan_and_reserve(request: GpuRequest, *, run_id: str, cpu_count: int | None = None,
                     report: Callable[[str], None] | None = None) -> Outcome:
    """Choose GPUs, plan on them within the site policy, and lease the ones the plan uses (``launcher up``).

    With ``request.wait_s`` (``--wait``), busy GPUs put the run in the fair queue (:mod:`launcher.gpu.queue`)
    until they free or the time is up; ``report`` receives the queue's progress lines. Hold
    ``outcome.reservation`` (None for a CPU plan) for the life of the run: ``with`` or ``.release()``.

    Raises:
        BadInput: an explicit GPU that does not exist, or a request the site policy refuses (exit 2).
        NoResources: the plan does not fit, or other runs hold the GPUs (exit 5; with --wait, when time is up).
        MissingDependency: explicit GPUs were named but NVML is unavailable (exit 6).
    """
    from launcher.gpu import leaseholders, planner, queue, reservations

    cores = cpu_count or _cores()
    if request.wait_s is None or request.on_cpu:
        return planner.plan_and_reserve(request, run_id=run_id, cpu_count=cores)
    ld = reservations.lease_dir(request.lock_dir)
    if ld.site is None:
        reservations.ensure_shared_dir(ld.path)
        reservations.ensure_shared_dir(ld.queue)

    def busy() -> str:
        held = leaseholders.list_holders(ld)
        return "held: " + ("; ".join(f"{h.uuid} by {h.describe()}" for h in held) if held else "none (GPUs busy "
                                                                                             "outside the launcher)")

    want = "GPUs " + str(request.choice) if request.choice.mode == "explicit" else "free GPUs"
    return queue.wait_in_queue(
        ld.queue, run_id=run_id, want=want, wait_s=request.wait_s, report=report, busy=busy,
        gpus=list(request.choice.items) if request.choice.mode == "explicit" else "auto",
        attempt=lambda: planner.plan_and_reserve(request, run_id=run_id, cpu_count=cores, cpu_fallback=False))


def preview(request: GpuRequest, *, cpu_count: int | None = None) -> Outcome:
    """The plan ``launcher up`` would make now, leasing nothing (``launcher plan``). Raises as
    :func:`plan_and_reserve`."""
    from launcher.gpu import planner

    return planner.plan_and_reserve(request, run_id=None, cpu_count=cpu_count or _cores())
