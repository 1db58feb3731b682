"""Foreign processes on leased GPUs: the rule (pure, made-up process trees), and a live run that flags one
within 5 s in its progress lines, its run.json and `launcher status` (process backend, stand-in NVML
rewritten while the run is live; the stub re-reads its JSON on every call)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from launcher.gpu import foreign
from launcher.gpu.foreign import ForeignProcess, LeaseParts
from launcher.gpu.snapshots import GpuInfo, GpuProcess, MigDevice
from launcher.gpu.watch import GpuWatch, Reading
from tests.nvml_fixtures import LiveRun, NvmlStub, machine, stub_uuid, wait_for

REPO = Path(__file__).resolve().parents[3]
CID_RUN = "a" * 64
CID_OTHER = "b" * 64
PARENTS = {100: 1, 101: 100, 102: 101, 200: 1, 300: 1, 400: 1}  # 100 holds; 101, 102 below it
CONTAINERS = {300: CID_RUN, 400: CID_OTHER}


def _gpu(uuid: str, pids: list[int], **kw: Any) -> GpuInfo:
    procs = tuple(GpuProcess(pid=p, used_memory_bytes=1 << 30, user="u", gpu_instance_id=kw.pop("gi", None))
                  for p in pids)
    return GpuInfo(0, uuid, "stub", "", 1, 0, 1, 0, 0, processes=procs, **kw)


def _find(gpus: list[GpuInfo], leases: dict[str, LeaseParts]) -> list[int]:
    found = foreign.find_foreign(gpus, leases, parent_of=PARENTS.get, container_of=CONTAINERS.get)
    return [f.pid for f in found]


def test_part_of_a_lease_is_holder_descendant_or_container_mate() -> None:
    lease = LeaseParts("run-a", frozenset({100}), frozenset({CID_RUN}))
    gpus = [_gpu("GPU-1", [100, 101, 102, 200, 300, 400]), _gpu("GPU-2", [200])]
    # 200: same user, unrelated; 400: another run's container. GPU-2 has no lease: nothing promised there.
    assert _find(gpus, {"GPU-1": lease}) == [200, 400]
    assert _find(gpus, {}) == []


def test_a_parent_loop_or_unknown_parent_ends_the_walk() -> None:
    lease = LeaseParts("r", frozenset({7}))
    looped = {5: 6, 6: 5}
    assert not foreign.part_of_lease(5, lease, parent_of=looped.get, container_of=lambda _: None)
    assert not foreign.part_of_lease(9, lease, parent_of=lambda _: None, container_of=lambda _: None)


def test_on_a_mig_gpu_each_process_answers_to_its_instance_lease() -> None:
    migs = (MigDevice(0, "MIG-1", 1, 0, 1, gpu_instance_id=1), MigDevice(1, "MIG-2", 1, 0, 1, gpu_instance_id=2))
    g = GpuInfo(0, "GPU-0", "stub", "", 1, 0, 1, None, None, mig_mode=True, mig_devices=migs, processes=(
        GpuProcess(pid=100, used_memory_bytes=1, gpu_instance_id=1), GpuProcess(pid=200, used_memory_bytes=1,
                                                                                gpu_instance_id=2)))
    lease = LeaseParts("r", frozenset({100}))
    assert _find([g], {"MIG-1": lease}) == []  # 200 runs in MIG-2, which nobody leases
    found = foreign.find_foreign([g], {"MIG-1": lease, "MIG-2": lease}, parent_of=PARENTS.get,
                                 container_of=CONTAINERS.get)
    assert [(f.pid, f.gpu_uuid) for f in found] == [(200, "MIG-2")]


def test_review_reports_arrivals_and_departures_once() -> None:
    f = ForeignProcess(4242, "eve", 2 << 30, "python steal.py", "GPU-1", 1, "run r")
    readings = [Reading(1.0), Reading(2.0, (f,)), Reading(3.0, (f,)), Reading(4.0, error="NVML timed out"),
                Reading(5.0)]
    events: list[str] = []
    records: list[dict[str, Any]] = []
    watch = GpuWatch("r", ["GPU-1"], look_once=lambda: readings[0])
    for r in readings:
        watch._latest = r
        watch.review(lambda kind, data: events.append(data["message"]), lambda **kw: records.append(kw))
    assert events == [
        "FOREIGN process on this run's GPU: pid 4242 (user eve, 2.0 GiB, python steal.py) on GPU 1 (GPU-1), "
        "leased by run r",
        "GPU watch: cannot read the GPUs: NVML timed out",
        "GPU watch: the GPUs can be read again",
        "foreign process pid 4242 left GPU GPU-1",
    ]
    assert [r["gpu_watch"]["foreign_processes"] for r in records] == [[], [asdict(f)], [], []]


def test_a_live_run_flags_a_foreign_process_within_5_s(nvml_stub: NvmlStub, tmp_path: Path) -> None:
    nvml_stub.configure(machine(2))
    intruder = subprocess.Popen(["sleep", "120"])  # a real process of this user, not part of the run
    run = LiveRun(nvml_stub, tmp_path)
    try:
        index = [stub_uuid(i) for i in range(2)].index(run.leased)
        master_pid = run.record["pids"]["master"]
        # The run's own master (the launcher's child) and an intruder appear on the leased GPU.
        cfg = machine(2)
        cfg["gpus"][index]["processes"] = [{"pid": master_pid, "used_memory_bytes": 1 << 30},
                                           {"pid": intruder.pid, "used_memory_bytes": 3 << 30}]
        appeared = time.monotonic()
        run.describe(cfg)
        watch = wait_for(lambda: run.read_record().get("gpu_watch", {}).get("foreign_processes"), 10,
                      "the foreign process in run.json")
        took = time.monotonic() - appeared
        print(f"flagged in run.json {took:.2f} s after it appeared")
        assert took < 5.0, took
        assert [(f["pid"], f["gpu_uuid"], f["used_memory_bytes"]) for f in watch] == [
            (intruder.pid, run.leased, 3 << 30)]
        assert watch[0]["user"] and watch[0]["command"] == "sleep 120"
        log = wait_for(lambda: "FOREIGN process" in (t := run.log.read_text()) and t, 5, "the event")
        assert f"pid {intruder.pid} " in log and f"pid {master_pid} " not in log.split("FOREIGN", 1)[1].split("\n")[0]
        status = subprocess.run([sys.executable, "-m", "launcher", "status", run.record_path.parent.name, "--json",
                                 "--results", str(run.results)], cwd=REPO, env=run.env, capture_output=True,
                                text=True, timeout=60)
        assert [f["pid"] for f in json.loads(status.stdout)["foreign_processes"]] == [intruder.pid]
        table = subprocess.run([sys.executable, "-m", "launcher", "status", run.record_path.parent.name,
                                "--results", str(run.results)], cwd=REPO, env=run.env, capture_output=True,
                               text=True, timeout=60).stdout
        assert f"  FOREIGN     pid {intruder.pid} ({watch[0]['user']}) on GPU {index} ({run.leased}), not part of " \
               "this run" in table
        # The intruder leaves: the event says so and run.json's set empties.
        run.describe(machine(2))
        wait_for(lambda: run.read_record()["gpu_watch"]["foreign_processes"] == [], 10, "departure")
        assert f"foreign process pid {intruder.pid} left GPU {run.leased}" in run.log.read_text()
    finally:
        code = run.close()
        intruder.kill()
        intruder.wait()
    assert code == 130, run.log.read_text()[-3000:]


def test_a_driver_that_hangs_mid_run_costs_readings_not_the_run(nvml_stub: NvmlStub, tmp_path: Path) -> None:
    nvml_stub.configure(machine(1))
    run = LiveRun(nvml_stub, tmp_path, LAUNCHER_NVML_TIMEOUT="1")
    try:
        wait_for(lambda: _status_steps(run) > 0, 120, "the learner to step")
        run.describe({**machine(1), "hang": "nvmlDeviceGetUtilizationRates"})
        wait_for(lambda: (run.read_record().get("gpu_watch") or {}).get("error"), 10, "the watch's error")
        assert "GPU watch: cannot read the GPUs: the NVIDIA driver did not answer within 1 s" in run.log.read_text()
        steps = _status_steps(run)
        time.sleep(3)  # the run goes on: progress lines keep coming and the learner keeps stepping
        assert run.proc.poll() is None and run.read_record()["state"] == "running"
        assert _status_steps(run) > steps
        run.describe(machine(1))  # the driver recovers: the next reading is clean again
        wait_for(lambda: (run.read_record().get("gpu_watch") or {}).get("error") is None, 10, "recovery")
    finally:
        code = run.close()
    assert code == 130, run.log.read_text()[-3000:]


def _status_steps(run: LiveRun) -> int:
    try:
        status = json.loads((run.record_path.parent / "status.json").read_text())
    except (OSError, ValueError):  # not written yet
        return 0
    return int(status.get("env_steps") or 0)


def test_launcher_gpus_flags_exactly_the_processes_outside_the_lease(nvml_stub: NvmlStub) -> None:
    """This test process holds GPU 0's lease. On GPU 0: itself (the holder) and its child are part of the lease;
    an orphan of the same user (its parent exited, so it is nobody's descendant) is foreign. The same orphan on
    unleased GPU 1 is not: nothing was promised there."""
    from launcher.gpu import reservations

    child = subprocess.Popen(["sleep", "60"])
    orphan = int(subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                                check=True).stdout)
    try:
        cfg = machine(2)
        cfg["gpus"][0]["processes"] = [{"pid": p, "used_memory_bytes": 1 << 30} for p in (os.getpid(), child.pid,
                                                                                         orphan)]
        cfg["gpus"][1]["processes"] = [{"pid": orphan, "used_memory_bytes": 1 << 30}]
        nvml_stub.configure(cfg)
        with reservations.reserve([stub_uuid(0)], "run-mine", nvml_stub.lock_dir):
            out = subprocess.run([sys.executable, "-m", "launcher", "gpus", "--json", "--no-docker"], cwd=REPO,
                                 env=nvml_stub.env(), capture_output=True, text=True, timeout=60)
            table = subprocess.run([sys.executable, "-m", "launcher", "gpus", "--no-docker"], cwd=REPO,
                                   env=nvml_stub.env(), capture_output=True, text=True, timeout=60).stdout
        assert out.returncode == 0, out.stderr
        g0, g1 = json.loads(out.stdout)["gpus"]
        assert {p["pid"]: p["foreign"] for p in g0["processes"]} == {os.getpid(): False, child.pid: False,
                                                                    orphan: True}
        assert g0["foreign_processes"] == [orphan]
        assert [p["foreign"] for p in g1["processes"]] == [False] and g1["foreign_processes"] == []
        flagged = [line for line in table.splitlines() if "FOREIGN" in line]
        assert len(flagged) == 1 and f"pid {orphan} " in flagged[0]
    finally:
        child.kill()
        child.wait()
        os.kill(orphan, 9)


@pytest.mark.docker
def test_launcher_gpus_counts_the_runs_containers_as_part_of_its_lease(nvml_stub: NvmlStub, docker_client: Any) -> None:
    """Real containers, real cgroups: a container labelled with the lease's run is part of the lease (the Docker
    backend's groups beside the master that holds it); a container of another run on the same GPU is foreign."""
    import uuid

    from launcher.gpu import reservations
    from launcher.image import Flavour, default_tag

    image = default_tag(Flavour.CPU)
    try:
        docker_client.images.get(image)
    except Exception:  # noqa: BLE001 - docker.errors.ImageNotFound; this test builds nothing
        pytest.skip(f"image {image} not built (the docker tests build it)")
    run_id, other = f"test-mine-{uuid.uuid4().hex[:8]}", f"test-other-{uuid.uuid4().hex[:8]}"
    started = []
    try:
        for rid in (run_id, other):
            c = docker_client.containers.run(image, ["60"], entrypoint=["sleep"], user="65534:65534", detach=True,
                                             network_disabled=True, labels={"launcher.run": rid})
            started.append(c)
            c.reload()
        mine, theirs = (int(c.attrs["State"]["Pid"]) for c in started)
        cfg = machine(1)
        cfg["gpus"][0]["processes"] = [{"pid": mine, "used_memory_bytes": 1 << 30},
                                       {"pid": theirs, "used_memory_bytes": 1 << 30}]
        nvml_stub.configure(cfg)
        with reservations.reserve([stub_uuid(0)], run_id, nvml_stub.lock_dir):
            out = subprocess.run([sys.executable, "-m", "launcher", "gpus", "--json"], cwd=REPO, env=nvml_stub.env(),
                                 capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        (g0,) = json.loads(out.stdout)["gpus"]
        by_pid = {p["pid"]: p for p in g0["processes"]}
        assert (by_pid[mine]["run_id"], by_pid[mine]["foreign"]) == (run_id, False)
        assert (by_pid[theirs]["run_id"], by_pid[theirs]["foreign"]) == (other, True)
        assert g0["foreign_processes"] == [theirs]
    finally:
        for c in started:
            c.remove(force=True)
