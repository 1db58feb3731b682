"""NVML under a deadline: a stand-in driver that hangs in a call must not hang the launcher.

The stub's ``"hang"`` makes one entry point sleep until a signal kills the process, like a driver stuck in an
ioctl. Every test here would hang (and hit pytest's timeout) without the deadline, so each can fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from launcher.errors import BadInput, ExitCode, MissingDependency
from launcher.gpu import leaseholders, nvml, nvml_call, planner
from launcher.gpu.placement import PlanRequest
from launcher.gpu.request import GpuRequest, parse_gpu_choice
from launcher.gpu.nvml_call import NvmlTimeout
from tests.nvml_fixtures import NvmlStub, machine

REPO = Path(__file__).resolve().parents[3]
HUNG_CALL = "nvmlDeviceGetUtilizationRates"


def _gone(pid: int, within_s: float = 2.0) -> bool:
    """The process has exited (no /proc entry, or a zombie nobody collected yet)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


def _processes_using(config: Path) -> list[int]:
    """Processes whose environment names this test's stub description (helpers left behind) and that are still
    alive 2 s later (a SIGKILLed helper takes a moment to die and be collected)."""
    found = []
    needle = f"NVML_STUB_CONFIG={config}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if not _gone(pid, 2.0)]


def test_a_hung_call_raises_within_the_deadline_and_names_the_call(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure({**machine(2), "hang": HUNG_CALL})
    started = time.monotonic()
    with pytest.raises(NvmlTimeout) as caught:
        nvml.read_inventory(timeout_s=0.5)
    took = time.monotonic() - started
    assert 0.5 <= took < 1.5, took
    err = caught.value
    assert isinstance(err, MissingDependency) and err.exit_code == ExitCode.MISSING_DEPENDENCY
    assert str(err) == (f"the NVIDIA driver did not answer within 0.5 s (NVML, stuck in {HUNG_CALL} (GPU 0)); "
                        "the GPUs cannot be read")
    assert err.hint and "nvidia-smi" in err.hint and "LAUNCHER_NVML_TIMEOUT" in err.hint


def test_a_hang_in_init_is_bounded_too(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure({**machine(1), "hang": "nvmlInitWithFlags"})
    with pytest.raises(NvmlTimeout, match=r"within 0.3 s \(NVML, stuck in nvmlInit\)"):
        nvml.read_inventory(timeout_s=0.3)


def test_stop_does_not_wait_for_a_thread_stuck_on_the_driver(nvml_stub: NvmlStub) -> None:
    """At exit (or when a test reconfigures) a daemon thread may be waiting on a hung helper: stop() kills the
    helper within its grace period instead of waiting out that thread's deadline."""
    import threading

    nvml_stub.configure({**machine(1), "hang": HUNG_CALL})
    errors: list[BaseException] = []

    def read() -> None:
        try:
            nvml.read_inventory(timeout_s=30)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    _wait_for(lambda: nvml_call.helper_pid() is not None)
    pid = nvml_call.helper_pid()
    time.sleep(0.2)  # the helper is in the hung call now
    started = time.monotonic()
    nvml_call.stop()
    reader.join(timeout=5)
    assert time.monotonic() - started < 2 and not reader.is_alive()
    assert pid is not None and _gone(pid)
    assert len(errors) == 1 and isinstance(errors[0], MissingDependency)


def _wait_for(pred: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_the_hung_helper_is_killed_and_the_next_read_starts_afresh(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure(machine(1))
    nvml.read_inventory()
    first = nvml_call.helper_pid()
    assert first is not None
    nvml_stub.configure({**machine(1), "hang": HUNG_CALL})  # stops the helper: a fresh one reads the new file
    with pytest.raises(NvmlTimeout):
        nvml.read_inventory(timeout_s=0.3)
    assert nvml_call.helper_pid() is None
    assert _processes_using(nvml_stub.config_path) == []  # SIGKILLed, not left sleeping
    nvml_stub.configure(machine(3))  # the driver recovered
    assert len(nvml.read_inventory(timeout_s=2).gpus) == 3
    assert nvml_call.helper_pid() not in (None, first)


def test_a_slow_driver_within_the_deadline_is_fine(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure({**machine(1), "hang": HUNG_CALL, "hang_s": 0.2})
    (g,) = nvml.read_inventory(timeout_s=3).gpus
    assert g.gpu_utilization_pct == 0


def test_the_helper_is_reused_between_reads(nvml_stub: NvmlStub) -> None:
    """One fork and one nvmlInit per process, not per read: the stub's per-call sequence carries on."""
    nvml_stub.configure(machine(1, util_pct=[5, 50, 70]))
    readings = [nvml.read_inventory().gpus[0].gpu_utilization_pct for _ in range(3)]
    assert readings == [5, 50, 70]


def test_the_helper_holds_no_inherited_descriptor(nvml_stub: NvmlStub, tmp_path: Path) -> None:
    """A copy of a GPU lease's descriptor in the helper would keep the flock after the launcher lets go."""
    nvml_stub.configure(machine(1))
    lease = os.open(tmp_path / "lease.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        nvml.read_inventory()
        pid = nvml_call.helper_pid()
        targets = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    finally:
        os.close(lease)
    assert str(tmp_path / "lease.lock") not in targets
    assert all(not t.startswith("socket:") for t in targets)


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "inf"])
def test_a_bad_deadline_setting_is_bad_input(raw: str) -> None:
    with pytest.raises(BadInput, match=f"LAUNCHER_NVML_TIMEOUT='{raw}' is not a positive number of seconds"):
        nvml_call.timeout_s({"LAUNCHER_NVML_TIMEOUT": raw})
    assert nvml_call.timeout_s({}) == nvml_call.DEFAULT_TIMEOUT_S == 5.0
    assert nvml_call.timeout_s({"LAUNCHER_NVML_TIMEOUT": "1.5"}) == 1.5


def _launcher(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "launcher", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    return proc, time.monotonic() - started


@pytest.mark.parametrize("command", [
    ["gpus"],
    ["gpus", "--json", "--no-docker"],
    ["plan", "--workers", "4"],
    ["up", "--backend", "process", "--workers", "2", "--max-steps", "1000"],
])
def test_cli_exits_6_within_the_deadline(nvml_stub: NvmlStub, tmp_path: Path, command: list[str]) -> None:
    """`launcher gpus`, `plan` and `up` with a driver hung in a call: exit 6, one clear message, nothing left."""
    nvml_stub.configure({**machine(4), "hang": HUNG_CALL})
    results = tmp_path / "results"
    extra = ["--results", str(results)] if command[0] == "up" else []
    proc, took = _launcher(nvml_stub.env(LAUNCHER_NVML_TIMEOUT="1"), *command, *extra)
    assert proc.returncode == 6, proc.stderr[-2000:]
    # Python's start and the launcher's imports take the rest; without the deadline this would never end.
    assert took < 1 + 5, took
    assert f"the NVIDIA driver did not answer within 1 s (NVML, stuck in {HUNG_CALL} (GPU 0))" in proc.stderr
    assert "HINT:" in proc.stderr and "Traceback" not in proc.stderr
    assert _processes_using(nvml_stub.config_path) == []
    if command[0] == "up":
        assert not any(results.glob("*/run.json")), "a run was started"


def test_a_crash_in_the_library_is_exit_6_not_a_dead_launcher(nvml_stub: NvmlStub) -> None:
    """Read in-process, a segfaulting driver library would kill the launcher; in the helper it is one message."""
    nvml_stub.configure({**machine(2), "crash": "nvmlDeviceGetName"})
    proc, _ = _launcher(nvml_stub.env(), "gpus")
    assert proc.returncode == 6, proc.stderr[-2000:]
    assert ("launcher: error: the NVIDIA library crashed the process reading the GPUs (killed by SIGSEGV in "
            "nvmlDeviceGetName (GPU 0))") in proc.stderr
    with pytest.raises(nvml_call.NvmlHelperFailed, match="killed by SIGSEGV"):
        nvml.read_inventory()
    nvml_stub.configure(machine(2))  # the library behaves again: the next reading forks a fresh helper
    assert len(nvml.read_inventory().gpus) == 2


def test_gpus_none_never_touches_nvml(nvml_stub: NvmlStub, tmp_path: Path) -> None:
    nvml_stub.configure({**machine(1), "hang": "nvmlInitWithFlags"})
    proc, _ = _launcher(nvml_stub.env(LAUNCHER_NVML_TIMEOUT="1"), "plan", "--workers", "2", "--gpus", "none", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_hang_after_locking_gives_the_gpus_back(nvml_stub: NvmlStub, monkeypatch: pytest.MonkeyPatch) -> None:
    """`up` re-reads NVML after locking; a hang there exits 6 with the leases released, not left to a dying
    launcher's descriptors (the first utilisation read answers, the re-check's hangs)."""
    nvml_stub.configure({**machine(1), "hang": HUNG_CALL, "hang_after_calls": 1})
    monkeypatch.setenv("LAUNCHER_NVML_TIMEOUT", "0.5")
    req = GpuRequest(choice=parse_gpu_choice("auto"), placement=PlanRequest(workers=1), lock_dir=nvml_stub.lock_dir,
                     samples=1, interval_s=0.0)
    with pytest.raises(NvmlTimeout, match="stuck in nvmlDeviceGetUtilizationRates"):
        planner.plan_and_reserve(req, run_id="r", cpu_count=1, check_containers=False)
    assert leaseholders.list_holders(nvml_stub.lock_dir) == []
