"""Pytest plugin: a stand-in NVML (tests/nvml_stub/nvml_stub.c) in front of the real pynvml.

The session builds the stub with gcc into ``tests/nvml_stub/build/`` (gitignored): ``current/`` has every
entry point the wrapper uses, ``legacy/`` lacks the newer ones (``_v3`` processes, ``_v2`` memory) as an old
driver would. Both are named ``libnvidia-ml.so.1``, the name pynvml opens with ``CDLL``.

Two ways in:
  * subprocesses: :meth:`NvmlStub.env` sets ``LD_LIBRARY_PATH`` to the build directory, which the dynamic
    loader reads at process start, so ``python -m launcher gpus`` loads the stub.
  * this process: the ``nvml_stub`` fixture loads the stub once by path. Its SONAME is
    ``libnvidia-ml.so.1``, and glibc's ``dlopen("libnvidia-ml.so.1")`` returns an already loaded object with
    that SONAME, so pynvml gets the stub when it first loads NVML (pynvml keeps that handle in
    ``pynvml.nvmlLib`` for the life of the process, so the in-process variant cannot change).

What the stub simulates is a JSON file (``NVML_STUB_CONFIG``) that it re-reads on every call::

    {
      "init_error": "DRIVER_NOT_LOADED",        # or LIBRARY_NOT_FOUND, NO_PERMISSION, ...; omit for a working driver
      "driver_version": "550.54.15",
      "missing_functions": ["nvmlDeviceGetComputeRunningProcesses_v3"],   # answer FUNCTION_NOT_FOUND
      "hang": "nvmlDeviceGetUtilizationRates",  # (or a list) sleep in that call until killed, like a hung driver
      "hang_s": 0.2,                            # ... or only this long (a slow driver)
      "hang_after_calls": 1,                    # ... after answering that many such calls
      "crash": "nvmlDeviceGetName",             # that call dies of SIGSEGV (a broken library)
      "gpus": [{
        "uuid": "GPU-...", "name": "NVIDIA A100-SXM4-80GB", "pci_bus_id": "00000000:07:00.0",
        "memory_total_bytes": 85899345920, "memory_used_bytes": 0, "memory_reserved_bytes": 0,
        "gpu_utilization_pct": 0, "memory_utilization_pct": 0,     # null: NOT_SUPPORTED
        "processes": [{"pid": 1234, "used_memory_bytes": 1073741824,
                       "gpu_instance_id": 1, "compute_instance_id": 0}],   # the IDs only on a MIG GPU
        "mig_mode": 0,                                              # null/absent: no MIG support
        "mig_devices": [{"uuid": "MIG-...", "gpu_instance_id": 1,  # (default: the slot)
                         "memory_total_bytes": 1, "memory_used_bytes": 0}],
        "error": "GPU_IS_LOST",                                     # every query on this GPU fails so
        "handle_error": "GPU_IS_LOST"                               # getting its handle fails so
      }]
    }

A list in place of a number (``"gpu_utilization_pct": [0, 97]``), or a list of lists for ``processes``, is a
sequence: each read of that device takes the next value and the last one sticks; counting restarts when
NVML is initialised anew. Without ``NVML_STUB_CONFIG`` the stub acts like a machine with no driver.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.host_guard import skip_beside_an_admin_store

REPO = Path(__file__).resolve().parents[1]
STUB_SOURCE = Path(__file__).parent / "nvml_stub" / "nvml_stub.c"
BUILD_DIR = STUB_SOURCE.parent / "build"
LIB_NAME = "libnvidia-ml.so.1"
GiB = 1024**3
A100_80GB_TOTAL_BYTES = 81920 * 1024**2  # what an 80 GB A100/H100 reports


def build_stub(variant: str = "current") -> Path:
    """Compile the stub (if the source is newer than the library); return the directory holding it."""
    out_dir = BUILD_DIR / variant
    lib = out_dir / LIB_NAME
    newest = max(p.stat().st_mtime for p in STUB_SOURCE.parent.glob("*.[ch]"))  # the stub and its json.h
    if lib.exists() and lib.stat().st_mtime >= newest:
        return out_dir
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        if os.environ.get("CI"):
            pytest.fail("gcc is needed to build the NVML stub (tests/nvml_stub) and CI must run these tests")
        pytest.skip("no C compiler to build the NVML stub")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{LIB_NAME}.{os.getpid()}"
    flags = ["-DNVML_STUB_LEGACY"] if variant == "legacy" else []
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", *flags, f"-Wl,-soname,{LIB_NAME}",
         "-o", str(tmp), str(STUB_SOURCE), "-lpthread"],
        check=True,
    )
    os.replace(tmp, lib)  # atomic: a parallel session never loads a half-written library
    return out_dir


def gpu(
    index: int,
    *,
    total_bytes: int = A100_80GB_TOTAL_BYTES,
    used_bytes: int | list[int] = 0,
    util_pct: int | list[int] | None = 0,
    processes: list[Any] | None = None,
    name: str = "NVIDIA A100-SXM4-80GB",
    **extra: Any,
) -> dict[str, Any]:
    """One GPU of a stub description, with a UUID and PCI bus id derived from ``index``."""
    entry: dict[str, Any] = {
        "uuid": stub_uuid(index),
        "name": name,
        "pci_bus_id": f"00000000:{0x07 + index:02X}:00.0",
        "memory_total_bytes": total_bytes,
        "memory_used_bytes": used_bytes,
        "gpu_utilization_pct": util_pct,
        "memory_utilization_pct": 0 if util_pct is not None else None,
        "processes": processes or [],
        "mig_mode": 0,
    }
    entry.update(extra)
    return entry


def stub_uuid(index: int) -> str:
    return f"GPU-{index:08x}-1111-2222-3333-{index:012x}"


def machine(n_gpus: int, **per_gpu: Any) -> dict[str, Any]:
    """A description of ``n_gpus`` identical idle 80 GB GPUs (keyword arguments go to every :func:`gpu`)."""
    return {"driver_version": "550.54.15", "gpus": [gpu(i, **per_gpu) for i in range(n_gpus)]}


class NvmlStub:
    """A test's handle on the stub: write the description, and give subprocesses the environment."""

    def __init__(self, lib_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lib_dir = lib_dir
        self.config_path = tmp_path / "nvml_stub.json"
        self.lock_dir = tmp_path / "locks"
        self._monkeypatch = monkeypatch

    def configure(self, config: dict[str, Any]) -> Path:
        """Write ``config`` (see the module docstring) and start NVML afresh on the next read."""
        from launcher.gpu import nvml

        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(config))
        os.replace(tmp, self.config_path)
        self._monkeypatch.setenv("NVML_STUB_CONFIG", str(self.config_path))
        nvml.shutdown()  # the next read initialises again, which restarts the stub's sequences
        return self.config_path

    def env(self, *, lib_dir: Path | None = None, **extra: str) -> dict[str, str]:
        """Environment for a subprocess that should load the stub with the current description."""
        env = dict(os.environ)
        env.update(
            LD_LIBRARY_PATH=str(lib_dir or self.lib_dir),
            NVML_STUB_CONFIG=str(self.config_path),
            LAUNCHER_LOCK_DIR=str(self.lock_dir),
            PYTHONPATH=str(Path(__file__).resolve().parents[1]),
        )
        env.update(extra)
        return env


@pytest.fixture(scope="session")
def nvml_stub_dir() -> Path:
    """Directory holding the built ``libnvidia-ml.so.1`` stub (every entry point)."""
    return build_stub("current")


@pytest.fixture(scope="session")
def nvml_stub_legacy_dir() -> Path:
    """Directory holding the stub built without the ``_v3``/``_v2`` entry points, like an old driver."""
    return build_stub("legacy")


_loaded_in_process: Path | None = None


@pytest.fixture
def nvml_stub(nvml_stub_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NvmlStub]:
    """The stub loaded into this process (and ready for subprocesses); configure it with ``.configure()``.

    ``LAUNCHER_LOCK_DIR`` points into the test's temporary directory so tests never touch real locks (skipped
    where the host's admin store is in view: the launcher would refuse it, see tests/host_guard.py).
    """
    global _loaded_in_process
    import pynvml

    from launcher.gpu import nvml

    skip_beside_an_admin_store()
    lib = nvml_stub_dir / LIB_NAME
    if _loaded_in_process is None:
        if pynvml.nvmlLib is not None:
            pytest.skip("pynvml already loaded another libnvidia-ml.so.1 in this process")
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        _loaded_in_process = lib
    stub = NvmlStub(nvml_stub_dir, tmp_path, monkeypatch)
    monkeypatch.setenv("LAUNCHER_LOCK_DIR", str(stub.lock_dir))
    nvml.shutdown()
    yield stub
    nvml.shutdown()


# ------------------------------------------------------------------------------ a live run on the stand-in
def wait_for(pred: Any, timeout: float, what: str) -> Any:
    """Poll ``pred`` every 0.1 s until it returns something true (returned), else fail naming ``what``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class LiveRun:
    """`launcher up` on the process backend with the stand-in NVML, its stderr in a file; ended in ``close``
    (SIGTERM: the launcher tears the run down and exits 130). ``describe`` rewrites the stand-in mid-run."""

    def __init__(self, stub: NvmlStub, tmp_path: Path, *up_args: str, **env: str) -> None:
        self.stub, self.results, self.log = stub, tmp_path / "results", tmp_path / "stderr.log"
        self.env = {**stub.env(TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1"), **env}
        self._err = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher", "up", "--backend", "process", "--workers", "2", "--max-steps",
             "10000000", "--progress", "plain", "--results", str(self.results), *up_args],
            cwd=REPO, env=self.env, stdout=subprocess.DEVNULL, stderr=self._err)
        self.record_path: Path = wait_for(lambda: next(iter(self.results.glob("*/run.json")), None), 60, "run.json")
        self.record: dict[str, Any] = wait_for(
            lambda: (r := self.read_record()).get("state") == "running" and r, 120, "the run to be running")
        plan = json.loads((self.record_path.parent / "plan.json").read_text())
        self.leased: str = plan["master"]["gpu_uuids"][0]

    def read_record(self) -> dict[str, Any]:
        record: dict[str, Any] = json.loads(self.record_path.read_text())
        return record

    def describe(self, cfg: dict[str, Any]) -> None:
        """Rewrite the stand-in's JSON while the run is live (atomically: the stub re-reads it on every call)."""
        tmp = self.stub.config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cfg))
        os.replace(tmp, self.stub.config_path)

    def close(self) -> int:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()
        return self.proc.returncode
