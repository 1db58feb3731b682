"""launcher.nvml against the NVML stub, through the real pynvml (nothing in pynvml is mocked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.gpu import nvml
from launcher.gpu.nvml import GpuProcess, Inventory
from tests.nvml_fixtures import A100_80GB_TOTAL_BYTES, GiB, NvmlStub, gpu, machine, stub_uuid

MISSING_PID = 4_194_000  # above any default pid_max: a process nobody can see


def test_inventory_fields(nvml_stub: NvmlStub) -> None:
    me = os.getpid()
    nvml_stub.configure({
        "driver_version": "550.54.15",
        "gpus": [
            gpu(0, used_bytes=3 * GiB, util_pct=12, processes=[{"pid": me, "used_memory_bytes": 2 * GiB}]),
            gpu(1, name="NVIDIA H100 80GB HBM3", util_pct=None),
        ],
    })
    inv = nvml.read_inventory()
    assert inv.available and inv.unavailable_reason is None and inv.errors == ()
    assert inv.driver_version == "550.54.15"
    g0, g1 = inv.gpus
    assert (g0.index, g0.uuid, g0.name, g0.pci_bus_id) == (0, stub_uuid(0), "NVIDIA A100-SXM4-80GB", "00000000:07:00.0")
    assert g0.memory_total_bytes == A100_80GB_TOTAL_BYTES
    assert g0.memory_used_bytes == 3 * GiB
    assert g0.memory_free_bytes == A100_80GB_TOTAL_BYTES - 3 * GiB
    assert (g0.gpu_utilization_pct, g0.memory_utilization_pct) == (12, 0)
    (proc,) = g0.processes
    assert proc.pid == me and proc.used_memory_bytes == 2 * GiB
    assert proc.user == nvml.current_user()
    argv0 = Path(f"/proc/{me}/cmdline").read_bytes().split(b"\0")[0].decode()
    assert proc.command is not None and proc.command.split()[0] == argv0  # from /proc/<pid>/cmdline
    assert proc.gpu_instance_id is None and proc.compute_instance_id is None  # 0xFFFFFFFF: not in MIG
    assert g0.mig_mode is False and g0.mig_devices == ()
    # NOT_SUPPORTED utilisation is "unknown", not a broken GPU
    assert g1.name == "NVIDIA H100 80GB HBM3" and g1.gpu_utilization_pct is None and g1.memory_utilization_pct is None


def test_process_not_visible_and_memory_unavailable(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure(machine(1, processes=[{"pid": MISSING_PID, "used_memory_bytes": None}]))
    (g,) = nvml.read_inventory().gpus
    assert g.processes == (GpuProcess(pid=MISSING_PID, used_memory_bytes=None, user=None, command=None),)


def test_mig_devices(nvml_stub: NvmlStub) -> None:
    migs = [
        {"uuid": "MIG-aaaaaaaa-0000-0000-0000-000000000001", "memory_total_bytes": 10 * GiB, "memory_used_bytes": GiB},
        {"uuid": "MIG-aaaaaaaa-0000-0000-0000-000000000002", "memory_total_bytes": 20 * GiB, "memory_used_bytes": 0},
    ]
    nvml_stub.configure({"gpus": [gpu(0, mig_mode=1, mig_devices=migs), gpu(1, mig_mode=None)]})
    g0, g1 = nvml.read_inventory().gpus
    assert g0.mig_mode is True
    assert [(m.index, m.uuid, m.memory_total_bytes, m.memory_used_bytes, m.memory_free_bytes) for m in g0.mig_devices] == [
        (0, migs[0]["uuid"], 10 * GiB, GiB, 9 * GiB),
        (1, migs[1]["uuid"], 20 * GiB, 0, 20 * GiB),
    ]
    assert g1.mig_mode is None  # no MIG support (NOT_SUPPORTED), not "off"


def test_fallbacks_when_newer_entry_points_are_missing(nvml_stub: NvmlStub) -> None:
    """An old driver: no _v3 processes and no _v2 memory; the wrapper uses _v2 processes and v1 memory."""
    nvml_stub.configure({
        "missing_functions": ["nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetMemoryInfo_v2"],
        "gpus": [gpu(0, used_bytes=GiB, memory_reserved_bytes=GiB // 2, processes=[{"pid": MISSING_PID, "used_memory_bytes": 5}])],
    })
    (g,) = nvml.read_inventory().gpus
    assert [p.pid for p in g.processes] == [MISSING_PID]
    # v1 counts the driver-reserved memory as used; v2 would have said 1 GiB
    assert g.memory_used_bytes == GiB + GiB // 2
    assert g.memory_free_bytes == A100_80GB_TOTAL_BYTES - GiB - GiB // 2


def test_memory_v2_excludes_reserved(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure({"gpus": [gpu(0, used_bytes=GiB, memory_reserved_bytes=GiB // 2)]})
    (g,) = nvml.read_inventory().gpus
    assert g.memory_used_bytes == GiB
    assert g.memory_free_bytes == A100_80GB_TOTAL_BYTES - GiB - GiB // 2


def test_legacy_driver_library_in_a_subprocess(nvml_stub: NvmlStub, nvml_stub_legacy_dir: Path) -> None:
    """The same fallbacks where the symbols are really absent from the library (dlsym fails)."""
    nvml_stub.configure({"gpus": [gpu(0, used_bytes=GiB, memory_reserved_bytes=GiB, processes=[{"pid": 1, "used_memory_bytes": 7}])]})
    code = (
        "from launcher.gpu import nvml; g = nvml.read_inventory().gpus[0]; "
        "print(g.memory_used_bytes, [p.pid for p in g.processes])"
    )
    out = subprocess.run([sys.executable, "-c", code], env=nvml_stub.env(lib_dir=nvml_stub_legacy_dir),
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(2 * GiB), "[1]"]


def test_lost_gpu_is_reported_and_skipped(nvml_stub: NvmlStub) -> None:
    cfg = machine(3)
    cfg["gpus"][1]["error"] = "GPU_IS_LOST"
    nvml_stub.configure(cfg)
    inv = nvml.read_inventory()
    assert [g.index for g in inv.gpus] == [0, 2]
    (err,) = inv.errors
    assert (err.index, err.uuid, err.error) == (1, None, "GPU is lost")


def test_gpu_whose_handle_fails(nvml_stub: NvmlStub) -> None:
    cfg = machine(2)
    cfg["gpus"][0]["handle_error"] = "GPU_IS_LOST"
    nvml_stub.configure(cfg)
    inv = nvml.read_inventory()
    assert [g.index for g in inv.gpus] == [1]
    assert inv.errors[0].index == 0 and inv.errors[0].error == "GPU is lost"


@pytest.mark.parametrize(
    ("init_error", "reason", "hint_word"),
    [
        ("DRIVER_NOT_LOADED", "no GPUs: the NVIDIA kernel driver is not loaded", "modprobe"),
        ("LIBRARY_NOT_FOUND", "no GPUs: the NVIDIA driver library libnvidia-ml.so.1 was not found", "nvidia-smi"),
        ("NO_PERMISSION", "no GPUs: no permission to open the NVIDIA devices (/dev/nvidia*)", "group"),
        ("LIB_RM_VERSION_MISMATCH", "no GPUs: the NVIDIA library and kernel driver versions differ", "reboot"),
    ],
)
def test_no_driver_is_no_gpus_with_a_reason(nvml_stub: NvmlStub, init_error: str, reason: str, hint_word: str) -> None:
    nvml_stub.configure({"init_error": init_error, "gpus": [gpu(0)]})
    inv = nvml.read_inventory()
    assert inv == Inventory(unavailable_reason=reason, hint=inv.hint)
    assert not inv.available and inv.hint and hint_word in inv.hint and "\n" not in reason


def test_initialises_once_and_recovers_after_shutdown(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure(machine(1, util_pct=[5, 50, 70]))
    assert [nvml.read_inventory().gpus[0].gpu_utilization_pct for _ in range(3)] == [5, 50, 70]
    nvml.shutdown()
    nvml.shutdown()  # idempotent
    assert nvml.read_inventory().gpus[0].gpu_utilization_pct == 5  # a fresh init restarts the sequence
