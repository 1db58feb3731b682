"""`launcher gpus` and `launcher plan` run for real as subprocesses, with the NVML stub in front of pynvml."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from launcher.gpu import nvml, reservations
from launcher.cli.main import build_parser
from tests.nvml_fixtures import A100_80GB_TOTAL_BYTES, GiB, NvmlStub, gpu, machine, stub_uuid

REPO = Path(__file__).resolve().parents[3]


def launcher(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "launcher", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def real_nvml_present() -> bool:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return "libnvidia-ml.so.1" in out


@pytest.fixture
def no_nvml_env(tmp_path: Path) -> dict[str, str]:
    """This machine as it is: no libnvidia-ml anywhere the loader looks."""
    if real_nvml_present():
        pytest.skip("this machine has a real libnvidia-ml.so.1")
    empty = tmp_path / "empty-lib"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "NVML_STUB_CONFIG"}
    env.update(LD_LIBRARY_PATH=str(empty), LAUNCHER_LOCK_DIR=str(tmp_path / "locks"), PYTHONPATH=str(REPO))
    return env


def test_commands_are_registered() -> None:
    parser = build_parser()
    args = parser.parse_args(["plan", "--workers", "4", "--gpus", "0,1", "--min-free-memory", "8GiB", "--json"])
    assert (args.command, args.workers, args.gpus, args.min_free_memory, args.json) == ("plan", "4", "0,1", "8GiB", True)
    assert parser.parse_args(["gpus", "--json"]).json is True


def test_gpus_json_field_by_field(nvml_stub: NvmlStub) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        nvml_stub.configure({
            "driver_version": "550.54.15",
            "gpus": [
                gpu(0, used_bytes=5 * GiB, util_pct=37, processes=[{"pid": sleeper.pid, "used_memory_bytes": 4 * GiB}]),
                gpu(1),
            ],
        })
        with reservations.reserve([stub_uuid(1)], "run-x", nvml_stub.lock_dir):
            out = launcher(nvml_stub.env(), "gpus", "--json", "--no-docker")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["schema"] == "launcher.gpus/v1"
    assert doc["nvml"] == {"available": True, "driver_version": "550.54.15", "reason": None, "hint": None}
    assert doc["errors"] == [] and doc["docker"] == {"available": False, "reason": "--no-docker"}
    g0, g1 = doc["gpus"]
    assert {k: g0[k] for k in ("index", "uuid", "name", "pci_bus_id", "memory_total_bytes", "memory_used_bytes",
                               "memory_free_bytes", "gpu_utilization_pct", "memory_utilization_pct", "mig_mode",
                               "mig_devices", "holders")} == {
        "index": 0, "uuid": stub_uuid(0), "name": "NVIDIA A100-SXM4-80GB", "pci_bus_id": "00000000:07:00.0",
        "memory_total_bytes": A100_80GB_TOTAL_BYTES, "memory_used_bytes": 5 * GiB,
        "memory_free_bytes": A100_80GB_TOTAL_BYTES - 5 * GiB, "gpu_utilization_pct": 37, "memory_utilization_pct": 0,
        "mig_mode": False, "mig_devices": [], "holders": [],
    }
    (proc,) = g0["processes"]
    assert proc["pid"] == sleeper.pid and proc["used_memory_bytes"] == 4 * GiB
    assert proc["user"] and "time.sleep(60)" in proc["command"]
    assert proc["container_id"] is None and proc["run_id"] is None
    (holder,) = g1["holders"]
    assert holder["source"] == "lock" and holder["run_id"] == "run-x" and holder["uuid"] == stub_uuid(1)
    assert holder["pid"] == os.getpid() and holder["user"] == proc["user"] and holder["host"]
    assert [lock["run_id"] for lock in doc["locks"]] == ["run-x"]


def test_gpus_table_with_a_lost_gpu(nvml_stub: NvmlStub) -> None:
    cfg = machine(3)
    cfg["gpus"][1]["error"] = "GPU_IS_LOST"
    nvml_stub.configure(cfg)
    with reservations.reserve([stub_uuid(2)], "run-y", nvml_stub.lock_dir):
        out = launcher(nvml_stub.env(DOCKER_HOST="unix:///nonexistent/docker.sock"), "gpus")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["GPU", "NAME", "MEMORY", "USED", "/", "TOTAL", "UTIL", "HELD", "BY"]
    me = nvml.current_user()
    assert any(line.startswith("2 ") and f"run run-y (lease, {me}, pid {os.getpid()}, since 20" in line
               for line in lines)
    assert "(no admin lease store (/etc/launcher/site.toml): GPU leases hold between this user's runs only; " \
           "`sudo launcher admin init` makes them hold between users)" in lines
    assert "1    skipped: GPU is lost (uuid unknown)" in lines
    assert lines[-1].startswith("(containers not checked: Docker engine not reachable")

    js = json.loads(launcher(nvml_stub.env(), "gpus", "--json", "--no-docker").stdout)
    assert [g["index"] for g in js["gpus"]] == [0, 2]
    assert js["errors"] == [{"index": 1, "uuid": None, "error": "GPU is lost"}]


@pytest.mark.parametrize(
    ("init_error", "message", "hint"),
    [
        ("DRIVER_NOT_LOADED", "no GPUs: the NVIDIA kernel driver is not loaded", "sudo modprobe nvidia"),
        ("LIBRARY_NOT_FOUND", "no GPUs: the NVIDIA driver library libnvidia-ml.so.1 was not found", "nvidia-smi"),
    ],
)
def test_gpus_without_a_driver(nvml_stub: NvmlStub, init_error: str, message: str, hint: str) -> None:
    nvml_stub.configure({"init_error": init_error, "gpus": [gpu(0)]})
    out = launcher(nvml_stub.env(), "gpus", "--no-docker")
    assert out.returncode == 6  # MISSING_DEPENDENCY
    assert out.stdout == ""
    err = out.stderr.splitlines()
    assert err[0] == f"launcher: error: {message}"
    assert err[1].startswith("HINT: ") and hint in err[1] and len(err) == 2  # one line each, no traceback
    js = launcher(nvml_stub.env(), "gpus", "--json", "--no-docker")
    assert js.returncode == 6
    doc = json.loads(js.stdout)
    assert doc["nvml"]["available"] is False and doc["nvml"]["reason"] == message and doc["gpus"] == []


def test_gpus_on_this_machine_without_nvml(no_nvml_env: dict[str, str]) -> None:
    out = launcher(no_nvml_env, "gpus", "--no-docker")
    assert out.returncode == 6
    assert out.stderr.startswith("launcher: error: no GPUs: the NVIDIA driver library libnvidia-ml.so.1 was not found\nHINT:")
    assert "Traceback" not in out.stderr


def _per_gpu(doc: dict[str, Any]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for g in doc["groups"]:
        out.setdefault(g["share"]["gpu_indices"][0], []).append(g["workers"])
    return out


def test_plan_32_workers_on_4x80gb_json(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure(machine(4, used_bytes=870 * 2**20))
    out = launcher(nvml_stub.env(), "plan", "--workers", "32", "--json", "--sample-interval", "0")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["schema"] == "launcher.plan/v2" and doc["kind"] == "gpu" and doc["total_workers"] == 32
    assert doc["gpu_uuids"] == [stub_uuid(i) for i in range(4)]
    master = doc["master"]
    assert master["gpu_uuids"] == [stub_uuid(0)] and master["gpu_indices"] == [0]
    assert "env" not in master  # a share has no environment: each backend's specs give it (doc["launch"])
    launch = {p["name"]: p for p in doc["launch"]["parts"]}
    assert launch["master"]["env"]["CUDA_VISIBLE_DEVICES"] == stub_uuid(0)
    assert launch["master"]["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert 70 * GiB < master["memory_limit_bytes"] < 80 * GiB
    assert [g["index"] for g in doc["groups"]] == [0, 1, 2]
    assert _per_gpu(doc) == {1: [11], 2: [11], 3: [10]}
    for g in doc["groups"]:
        share = g["share"]
        assert launch[f"group-{g['index']}"]["env"]["CUDA_VISIBLE_DEVICES"] == share["gpu_uuids"][0]
        assert share["memory_limit_bytes"] > 0 and share["cpus"] > 0
    assert doc["reasons"][0] == "took the worst of 3 readings 0 s apart"
    assert "master alone on GPU 0: the 32 worker(s) fit on the other GPUs" in doc["reasons"]
    assert doc["request"]["workers"] == 32 and doc["request"]["max_workers_per_group"] == 16
    assert [g["index"] for g in doc["selected_gpus"]] == [0, 1, 2, 3]
    assert doc["selected_gpus"][0]["memory_free_bytes"] == A100_80GB_TOTAL_BYTES - 870 * 2**20


def test_plan_32_workers_classic_shape_and_table(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure(machine(4, used_bytes=870 * 2**20))
    out = launcher(nvml_stub.env(), "plan", "--workers", "32", "--worker-memory", "7GiB", "--samples", "1")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("Plan: 32 worker(s) in 4 group(s) on 4 GPU(s)\n")
    assert "workers per GPU: GPU 0: master + 2, GPU 1: 10, GPU 2: 10, GPU 3: 10" in text
    assert "master shares GPU 0 with 2 worker(s)" in text
    rows = [line.split() for line in text.splitlines()[1:6]]
    assert [r[0] for r in rows] == ["master", "group", "group", "group", "group"]
    assert rows[1][:4] == ["group", "0", "GPU", "0"] and rows[1][-2:] == ["2", "worker(s)"]


def test_plan_on_this_machine_is_a_cpu_plan_with_the_reason(no_nvml_env: dict[str, str]) -> None:
    out = launcher(no_nvml_env, "plan", "--workers", "32")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Plan: 32 worker(s) in ")
    assert " on CPU\n" in out.stdout.splitlines()[0] + "\n"
    assert "  - no GPUs: the NVIDIA driver library libnvidia-ml.so.1 was not found" in out.stdout
    doc = json.loads(launcher(no_nvml_env, "plan", "--workers", "32", "--json").stdout)
    assert doc["kind"] == "cpu" and doc["gpu_uuids"] == [] and doc["selected_gpus"] == []
    assert doc["reasons"][0] == "no GPUs: the NVIDIA driver library libnvidia-ml.so.1 was not found"
    assert all(p["env"]["CUDA_VISIBLE_DEVICES"] == "" for p in doc["launch"]["parts"])
    assert doc["total_workers"] == 32


def test_plan_errors_and_exit_codes(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure(machine(2))
    env = nvml_stub.env()
    bad = launcher(env, "plan", "--workers", "4", "--gpus", "0,9")
    assert bad.returncode == 2
    assert bad.stderr.splitlines()[0] == (
        f"launcher: error: --gpus: no GPU 9 on this machine; GPUs here: 0 ({stub_uuid(0)}), 1 ({stub_uuid(1)})")
    sizes = launcher(env, "plan", "--workers", "0", "--min-free-memory", "lots")
    assert sizes.returncode == 2
    assert sizes.stderr.splitlines()[:2] == [  # the same message `up` gives: both read the one declaration
        "launcher: error: invalid configuration:",
        "  - flag --min-free-memory 'lots': expected a memory size such as 8GiB, 500MB or a byte count"]
    assert "Traceback" not in sizes.stderr
    workers = launcher(env, "plan", "--workers", "0", "--isolate-master", "--share-master-gpu")
    assert workers.returncode == 2
    assert workers.stderr.splitlines()[0] == (
        "launcher: error: workers must be >= 1, got 0; --isolate-master and --share-master-gpu contradict each "
        "other; give at most one")
    too_big = launcher(env, "plan", "--workers", "500", "--worker-memory", "7GiB", "--samples", "1")
    assert too_big.returncode == 5 and "cannot place the master and 500 worker(s)" in too_big.stderr
    nvml_stub.configure({"init_error": "DRIVER_NOT_LOADED"})
    explicit = launcher(env, "plan", "--workers", "4", "--gpus", "0")
    assert explicit.returncode == 6 and "driver is not loaded" in explicit.stderr
    auto = launcher(env, "plan", "--workers", "4")
    assert auto.returncode == 0 and "no GPUs: the NVIDIA kernel driver is not loaded" in auto.stdout


BLOCK_HEAVY = """
import importlib.abc, runpy, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tensorflow", "gymnasium", "docker", "keras", "matplotlib"):
            raise ImportError("not installed here: " + name)
sys.meta_path.insert(0, Block())
sys.argv = ["launcher", *sys.argv[1:]]
runpy.run_module("launcher", run_name="__main__", alter_sys=True)
"""


def test_gpus_and_plan_need_only_nvml_and_numpy(nvml_stub: NvmlStub, tmp_path: Path) -> None:
    """What a GPU machine without TensorFlow, gymnasium or the Docker SDK runs: `gpus --json`, `plan --json`."""
    nvml_stub.configure(machine(4))
    runner = tmp_path / "block_heavy.py"
    runner.write_text(BLOCK_HEAVY)
    for args in (["gpus", "--json"], ["plan", "--workers", "32", "--json", "--sample-interval", "0"]):
        out = subprocess.run([sys.executable, str(runner), *args], env=nvml_stub.env(), cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert doc["schema"] in ("launcher.gpus/v1", "launcher.plan/v2")
        if args[0] == "gpus":
            assert doc["docker"]["available"] is False and "not installed" in doc["docker"]["reason"]
            assert doc["store"]["mode"] == "single-user" and len(doc["gpus"]) == 4
        else:
            assert doc["kind"] == "gpu" and doc["total_workers"] == 32
