"""GPU inventory: the one module that talks to NVML.

Every NVML call in the launcher goes through here (nvitop's ``api/libnvml.py`` is the model). Readings come
back as the frozen dataclasses of :mod:`launcher.gpu.snapshots` (re-exported here) with units in their names,
so selection and placement work on plain data.

A machine without the NVIDIA library or driver is not an error here: :func:`read_inventory` returns an
:class:`Inventory` with no GPUs, a one-line ``unavailable_reason`` and a ``hint``. A GPU that fails
(``GPU is lost``, ``Unknown Error``) is reported in ``Inventory.errors`` and left out of ``gpus``.

A driver that hangs is an error: the whole query sequence runs in a helper process under a deadline
(:mod:`launcher.gpu.nvml_call`), and :func:`read_inventory` raises :class:`~launcher.gpu.nvml_call.NvmlTimeout`
(exit 6) instead of hanging. NVML is initialised once in that helper (on first use, shut down when it stops),
never in the launcher itself; every call goes through :func:`_q`, which tells the deadline which call runs.

Similar to ``nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,memory.total,memory.used,memory.free,
utilization.gpu,utilization.memory,mig.mode.current --format=csv`` plus ``--query-compute-apps``.
"""

from __future__ import annotations

import logging
import os
import pwd
import threading
from typing import Any, Callable, TypeVar

import pynvml

from launcher.gpu import nvml_call
from launcher.gpu.nvml_call import NvmlTimeout
from launcher.gpu.snapshots import GpuError, GpuInfo, GpuProcess, Inventory, MigDevice

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Field-level errors that mean "this GPU cannot tell", not "this GPU is broken".
_UNKNOWN_VALUE_ERRORS: tuple[type[Exception], ...] = (
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_NoPermission,
)
# Newer entry point absent from an older driver or a structure version it does not know.
_FALLBACK_ERRORS: tuple[type[Exception], ...] = (
    pynvml.NVMLError_FunctionNotFound,
    pynvml.NVMLError_NotSupported,
    getattr(pynvml, "NVMLError_ArgumentVersionMismatch", pynvml.NVMLError_FunctionNotFound),
)

_NO_GPU_HINT = (
    "install the NVIDIA driver and check it with `nvidia-smi`; in a container, start it with the NVIDIA "
    "Container Toolkit (`docker run --gpus all ...`); to run on CPU, pass --gpus none"
)


class NvmlUnavailable(Exception):
    """Internal: NVML cannot be initialised; carries the user-facing reason and hint."""

    def __init__(self, reason: str, hint: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.hint = hint


# In the helper process only (launcher.gpu.nvml_call): NVML's state there, and the GPU being read.
_lock = threading.Lock()
_initialised = False
_where = ""


def _q(fn: Callable[..., _T], *args: Any) -> _T:
    """The one gate every NVML call goes through: names the call for a deadline's message, then makes it."""
    nvml_call.note_call(f"{fn.__name__}{_where}")
    return fn(*args)


def _describe_init_failure(exc: pynvml.NVMLError) -> NvmlUnavailable:
    if isinstance(exc, pynvml.NVMLError_LibraryNotFound):
        return NvmlUnavailable("no GPUs: the NVIDIA driver library libnvidia-ml.so.1 was not found", _NO_GPU_HINT)
    if isinstance(exc, pynvml.NVMLError_DriverNotLoaded):
        return NvmlUnavailable(
            "no GPUs: the NVIDIA kernel driver is not loaded",
            "check `nvidia-smi`; load the module (`sudo modprobe nvidia`) or reboot after a driver install; "
            "to run on CPU, pass --gpus none",
        )
    if isinstance(exc, pynvml.NVMLError_NoPermission):
        return NvmlUnavailable(
            "no GPUs: no permission to open the NVIDIA devices (/dev/nvidia*)",
            "add your user to the group that owns /dev/nvidia* (often `video`), or pass --gpus none",
        )
    if isinstance(exc, pynvml.NVMLError_LibRmVersionMismatch):
        return NvmlUnavailable(
            "no GPUs: the NVIDIA library and kernel driver versions differ",
            "reboot after a driver upgrade (or reload the nvidia kernel modules)",
        )
    return NvmlUnavailable(f"no GPUs: NVML failed to start: {exc}", _NO_GPU_HINT)


def _ensure_initialised() -> None:
    """Start NVML once per helper process; raise :class:`NvmlUnavailable` when it cannot start."""
    global _initialised
    with _lock:
        if _initialised:
            return
        try:
            _q(pynvml.nvmlInit)
        except pynvml.NVMLError as exc:
            raise _describe_init_failure(exc) from exc
        _initialised = True


def _shutdown_here() -> None:
    """In the helper, when it is told to stop: shut NVML down if it was started."""
    global _initialised
    with _lock:
        if not _initialised:
            return
        _initialised = False
        try:
            _q(pynvml.nvmlShutdown)
        except pynvml.NVMLError as exc:  # nothing useful to do at exit
            logger.debug("nvmlShutdown failed: %s", exc)


def shutdown() -> None:
    """Stop the NVML helper (it shuts NVML down). Safe to call more than once; the next read starts a new one."""
    nvml_call.stop()


def _optional(fn: Callable[..., _T], *args: Any) -> _T | None:
    """Call an NVML query whose answer the GPU may not support; None when it does not."""
    try:
        return _q(fn, *args)
    except _UNKNOWN_VALUE_ERRORS:
        return None


def _text(value: str | bytes) -> str:
    # pynvml returns str since 11.x but bytes in some builds; take both.
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _memory(handle: Any) -> tuple[int, int, int]:
    """(total, used, free) bytes: ``nvmlDeviceGetMemoryInfo_v2`` where the driver has it, else v1."""
    version = getattr(pynvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            mem = _q(pynvml.nvmlDeviceGetMemoryInfo, handle, version)
            return int(mem.total), int(mem.used), int(mem.free)
        except _FALLBACK_ERRORS as exc:
            logger.debug("nvmlDeviceGetMemoryInfo_v2 unavailable (%s); using v1", exc)
    mem = _q(pynvml.nvmlDeviceGetMemoryInfo, handle)
    return int(mem.total), int(mem.used), int(mem.free)


def _running_processes(handle: Any) -> list[Any]:
    """Compute processes: ``..._v3`` (drivers >= 510), falling back to ``..._v2`` on older drivers."""
    for name in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"):
        fn = getattr(pynvml, name, None)
        if fn is None:  # an older pynvml without this binding
            continue
        try:
            return list(_q(fn, handle))
        except pynvml.NVMLError_FunctionNotFound:
            logger.debug("%s not in this driver; trying an older version", name)
        except _UNKNOWN_VALUE_ERRORS:
            return []
    return []


def _proc_owner_and_command(pid: int) -> tuple[str | None, str | None]:
    """User name and command line of ``pid`` from /proc; (None, None) when it is not visible here."""
    user: str | None = None
    command: str | None = None
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    uid = int(line.split()[1])
                    try:
                        user = pwd.getpwuid(uid).pw_name
                    except KeyError:
                        user = str(uid)
                    break
        with open(f"/proc/{pid}/cmdline", "rb") as fb:
            argv = [a.decode(errors="replace") for a in fb.read().split(b"\0") if a]
        command = " ".join(argv) if argv else None
    except (OSError, ValueError):
        pass
    return user, command


def _instance_id(value: Any) -> int | None:
    # NVML reports 0xFFFFFFFF for "not in a MIG instance".
    return None if value is None or int(value) == 0xFFFFFFFF else int(value)


def _processes(handle: Any) -> tuple[GpuProcess, ...]:
    procs = []
    for p in _running_processes(handle):
        user, command = _proc_owner_and_command(int(p.pid))
        used = getattr(p, "usedGpuMemory", None)
        procs.append(
            GpuProcess(
                pid=int(p.pid),
                used_memory_bytes=None if used is None else int(used),
                user=user,
                command=command,
                gpu_instance_id=_instance_id(getattr(p, "gpuInstanceId", None)),
                compute_instance_id=_instance_id(getattr(p, "computeInstanceId", None)),
            )
        )
    return tuple(sorted(procs, key=lambda q: q.pid))


def _mig(handle: Any, processes: tuple[GpuProcess, ...]) -> tuple[bool | None, tuple[MigDevice, ...]]:
    """MIG mode and the MIG devices, each with the GPU's processes that run in its GPU instance (NVML lists a
    MIG GPU's processes on the parent, tagged with ``gpuInstanceId``)."""
    mode = _optional(pynvml.nvmlDeviceGetMigMode, handle)
    if mode is None:
        return None, ()
    enabled = int(mode[0]) == getattr(pynvml, "NVML_DEVICE_MIG_ENABLE", 1)
    if not enabled:
        return False, ()
    devices = []
    for slot in range(int(_q(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle))):
        try:
            mig = _q(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
        except pynvml.NVMLError_NotFound:
            continue  # an empty slot
        total, used, free = _memory(mig)
        gi = _optional(pynvml.nvmlDeviceGetGpuInstanceId, mig)
        mine = tuple(p for p in processes if gi is not None and p.gpu_instance_id == gi)
        devices.append(MigDevice(slot, _text(_q(pynvml.nvmlDeviceGetUUID, mig)), total, used, free,
                                 None if gi is None else int(gi), mine))
    return True, tuple(devices)


def _read_gpu(index: int) -> GpuInfo:
    global _where
    _where = f" (GPU {index})"
    handle = _q(pynvml.nvmlDeviceGetHandleByIndex, index)
    uuid = _text(_q(pynvml.nvmlDeviceGetUUID, handle))
    try:
        name = _text(_q(pynvml.nvmlDeviceGetName, handle))
        pci = _optional(pynvml.nvmlDeviceGetPciInfo, handle)
        total, used, free = _memory(handle)
        util = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle)
        processes = _processes(handle)
        mig_mode, mig_devices = _mig(handle, processes)
    except pynvml.NVMLError as exc:
        raise _GpuReadError(uuid, exc) from exc
    return GpuInfo(
        index=index,
        uuid=uuid,
        name=name,
        pci_bus_id=_text(pci.busId) if pci is not None else "",
        memory_total_bytes=total,
        memory_used_bytes=used,
        memory_free_bytes=free,
        gpu_utilization_pct=None if util is None else int(util.gpu),
        memory_utilization_pct=None if util is None else int(util.memory),
        processes=processes,
        mig_mode=mig_mode,
        mig_devices=mig_devices,
    )


class _GpuReadError(Exception):
    def __init__(self, uuid: str | None, exc: pynvml.NVMLError) -> None:
        super().__init__(str(exc))
        self.uuid = uuid
        self.nvml_error = exc


def _read_inventory_here() -> Inventory:
    """The whole query sequence, in the helper process (see :func:`read_inventory`). It logs nothing above
    debug: a handler's lock may have been held by another thread of the launcher at the fork."""
    global _where
    _where = ""
    try:
        _ensure_initialised()
        count = int(_q(pynvml.nvmlDeviceGetCount))
        driver = _optional(pynvml.nvmlSystemGetDriverVersion)
    except NvmlUnavailable as exc:
        return Inventory(unavailable_reason=exc.reason, hint=exc.hint)
    except pynvml.NVMLError as exc:
        return Inventory(unavailable_reason=f"no GPUs: NVML failed: {exc}", hint=_NO_GPU_HINT)
    gpus: list[GpuInfo] = []
    errors: list[GpuError] = []
    for index in range(count):
        try:
            gpus.append(_read_gpu(index))
        except _GpuReadError as exc:
            errors.append(GpuError(index, exc.uuid, str(exc)))
        except pynvml.NVMLError as exc:  # the handle or UUID query itself failed
            errors.append(GpuError(index, None, str(exc)))
    return Inventory(
        gpus=tuple(gpus),
        errors=tuple(errors),
        driver_version=None if driver is None else _text(driver),
    )


def read_inventory(*, timeout_s: float | None = None) -> Inventory:
    """Read every GPU once (similar to ``nvidia-smi -q``), within a deadline.

    Never raises for a missing library or driver: the returned inventory then has no GPUs and says why
    in ``unavailable_reason`` and ``hint``. A GPU that errors (lost, needs a reset) is listed in
    ``errors`` and left out of ``gpus``. MIG instances are in each GPU's ``mig_devices``.

    Args:
        timeout_s: the deadline for the whole sequence; None: ``$LAUNCHER_NVML_TIMEOUT`` or 5 s.

    Returns:
        An :class:`Inventory` with the GPUs in NVML index order.

    Raises:
        NvmlTimeout: the driver did not answer in time (a MissingDependency, exit 6); the message names the
            call it was stuck in.
    """
    inventory = nvml_call.call(_read_inventory_here, on_exit=_shutdown_here, timeout=timeout_s)
    for e in inventory.errors:  # logged here, not in the helper: a fork must not take the parent's log locks
        logger.warning("GPU %d (%s) skipped: %s", e.index, e.uuid or "uuid unknown", e.error)
    return inventory


def current_user() -> str:
    """The user name this process runs as (the owner other GPU processes are compared with)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


__all__ = ["GpuError", "GpuInfo", "GpuProcess", "Inventory", "MigDevice", "NvmlTimeout", "current_user",
           "read_inventory", "shutdown"]
