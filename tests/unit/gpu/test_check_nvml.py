"""`launcher check` against the stand-in NVML (tests/nvml_stub): a healthy driver, one that hangs, and none.

Each runs the real command in a subprocess that loads the stub (``LD_LIBRARY_PATH``), with the process backend
and no Docker engine in reach, so only the NVML lines and the host's own lines decide the verdict.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema

from launcher import schemas
from tests.nvml_fixtures import GiB, NvmlStub, gpu, machine, stub_uuid

REPO = Path(__file__).resolve().parents[3]


def _check(stub: NvmlStub, tmp_path: Path, *args: str, **env: str) -> tuple[int, dict[str, Any], float]:
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "launcher", "check", "--json", "--backend", "process",
                          "--results", str(tmp_path / "results"), *args], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={**stub.env(DOCKER_HOST="unix:///nonexistent/docker.sock"), **env})
    took = time.monotonic() - started
    assert out.stdout, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    jsonschema.validate(doc, schemas.load(schemas.CHECK_SCHEMA))
    assert out.returncode == (0 if doc["ready"] else 6), (out.returncode, doc["blocking"])
    return out.returncode, doc, took


def _by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["checks"]}


def _host_blockers() -> list[str]:
    """What blocks a GPU run of the process backend on this host apart from NVML: a CPU-only TensorFlow."""
    def have(name: str) -> bool:
        try:
            return bool(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            return False
    return ["tensorflow"] if have("tensorflow-cpu") and not have("tensorflow") else []


def test_a_healthy_driver_lists_each_gpu_and_mig_and_blocks_nothing(nvml_stub: NvmlStub, tmp_path: Path) -> None:
    cfg = machine(2)
    cfg["gpus"][1]["memory_used_bytes"] = 60 * GiB
    cfg["gpus"].append(gpu(2, mig_mode=1, mig_devices=[{"uuid": "MIG-aaaa", "gpu_instance_id": 1,
                                                         "memory_total_bytes": 10 * GiB, "memory_used_bytes": 0}]))
    nvml_stub.configure(cfg)
    code, doc, _ = _check(nvml_stub, tmp_path)
    checks = _by_name(doc)
    assert checks["nvml"]["status"] == "ok" and checks["nvml"]["detail"] == "driver 550.54.15, 3 GPU(s), 3 usable"
    assert checks["GPU 0"]["detail"].startswith(f"NVIDIA A100-SXM4-80GB, {stub_uuid(0)}, 80.0 of 80.0 GiB free")
    assert "20.0 of 80.0 GiB free, MIG off" in checks["GPU 1"]["detail"]
    assert checks["GPU 2"]["detail"].endswith("MIG on, 1 instance(s)")
    assert doc["blocking"] == _host_blockers() and code == (0 if not doc["blocking"] else 6)


def test_a_hung_driver_is_reported_within_its_deadline(nvml_stub: NvmlStub, tmp_path: Path) -> None:
    nvml_stub.configure({**machine(2), "hang": "nvmlDeviceGetUtilizationRates"})
    code, doc, took = _check(nvml_stub, tmp_path, LAUNCHER_NVML_TIMEOUT="0.5")
    line = _by_name(doc)["nvml (deadline)"]
    assert code == 6 and "nvml (deadline)" in doc["blocking"]
    assert line["status"] == "broken" and line["needed_for"] == ["gpu"]
    assert "did not answer within 0.5 s" in line["detail"] and "nvmlDeviceGetUtilizationRates (GPU 0)" in line["detail"]
    assert "nvidia-smi" in line["next_step"] and "dmesg" in line["next_step"]
    assert took < 20, took  # a hang would run into the subprocess timeout instead
    # a CPU-only run does not ask NVML at all, so the hung driver cannot stop it
    code, doc, _ = _check(nvml_stub, tmp_path, "--cpu", LAUNCHER_NVML_TIMEOUT="0.5")
    assert code == 0 and doc["target"] == "cpu" and not any(c["name"].startswith("nvml") for c in doc["checks"])


def test_no_driver_says_how_to_load_it(nvml_stub: NvmlStub, tmp_path: Path) -> None:
    nvml_stub.configure({"init_error": "DRIVER_NOT_LOADED"})
    code, doc, _ = _check(nvml_stub, tmp_path)
    line = _by_name(doc)["nvml"]
    assert code == 6 and doc["blocking"] == [*_host_blockers(), "nvml"]
    assert (line["status"], line["detail"]) == ("missing", "no GPUs: the NVIDIA kernel driver is not loaded")
    assert "sudo modprobe nvidia" in line["next_step"] and "--gpus none" in line["next_step"]


def test_a_lost_gpu_is_broken_and_the_others_still_count(nvml_stub: NvmlStub, tmp_path: Path) -> None:
    cfg = machine(2)
    cfg["gpus"][0]["error"] = "GPU_IS_LOST"
    nvml_stub.configure(cfg)
    code, doc, _ = _check(nvml_stub, tmp_path)
    checks = _by_name(doc)
    assert checks["nvml"]["detail"] == "driver 550.54.15, 1 GPU(s), 1 usable"
    assert checks["GPU 0"]["status"] == "broken" and "nvidia-smi -r -i 0" in checks["GPU 0"]["next_step"]
    assert checks["GPU 1"]["status"] == "ok" and doc["blocking"] == _host_blockers()
