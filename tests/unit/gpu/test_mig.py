"""Multi-Instance GPU on a stand-in machine with MIG enabled: MIG instances are listed, placed and leased like
whole GPUs, each by its own UUID, and a worker group on one sees only that UUID."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from launcher.backends import containers
from launcher.errors import BadInput, NoResources
from launcher.gpu import leaseholders, mig, nvml, planner, reservations
from launcher.gpu.placement import PlanRequest
from launcher.gpu.request import GpuRequest, parse_gpu_choice
from launcher.gpu.select import SelectionCriteria, select_gpus, worst_of
from tests.nvml_fixtures import GiB, LiveRun, NvmlStub, gpu, stub_uuid, wait_for

REPO = Path(__file__).resolve().parents[3]
MIG_A = "MIG-aaaaaaaa-0000-0000-0000-000000000001"
MIG_B = "MIG-aaaaaaaa-0000-0000-0000-000000000002"
OTHER_PID = 4_194_001  # not a process of this machine


def mig_machine(*, used_b: int = 0, processes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """GPU 0: an A100 80GB split into two 3g.40gb instances (GPU instances 1 and 2); GPU 1: a whole GPU."""
    instances = [
        {"uuid": MIG_A, "gpu_instance_id": 1, "memory_total_bytes": 40 * GiB, "memory_used_bytes": 0},
        {"uuid": MIG_B, "gpu_instance_id": 2, "memory_total_bytes": 40 * GiB, "memory_used_bytes": used_b},
    ]
    return {"driver_version": "550.54.15",
            "gpus": [gpu(0, mig_mode=1, mig_devices=instances, util_pct=None, processes=processes or []), gpu(1)]}


def test_inventory_lists_mig_instances_with_memory_and_their_processes(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure(mig_machine(used_b=3 * GiB, processes=[
        {"pid": OTHER_PID, "used_memory_bytes": 3 * GiB, "gpu_instance_id": 2, "compute_instance_id": 0}]))
    g0, g1 = nvml.read_inventory().gpus
    assert g0.mig_mode is True and g1.mig_mode is False
    a, b = g0.mig_devices
    assert (a.index, a.uuid, a.gpu_instance_id, a.memory_total_bytes, a.memory_free_bytes, a.processes) == (
        0, MIG_A, 1, 40 * GiB, 40 * GiB, ())
    assert (b.uuid, b.gpu_instance_id, b.memory_used_bytes, b.memory_free_bytes) == (MIG_B, 2, 3 * GiB, 37 * GiB)
    assert [(p.pid, p.gpu_instance_id) for p in b.processes] == [(OTHER_PID, 2)]


def test_placeable_puts_instances_in_place_of_their_gpu(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure(mig_machine())
    inv = nvml.read_inventory()
    units = mig.placeable(inv.gpus)
    assert [(u.uuid, u.index, u.parent_uuid, u.mig_index) for u in units] == [
        (MIG_A, 0, stub_uuid(0), 0), (MIG_B, 0, stub_uuid(0), 1), (stub_uuid(1), 1, None, None)]
    assert units[0].memory_free_bytes == 40 * GiB and units[0].gpu_utilization_pct is None
    assert mig.placeable(units) == units  # idempotent
    assert [mig.label(u) for u in units] == ["GPU 0 MIG 0", "GPU 0 MIG 1", "GPU 1"]


def test_selection_judges_each_instance_on_its_own(nvml_stub: NvmlStub) -> None:
    """A busy instance is left out, its idle sibling is used; a GPU in MIG mode without instances says why."""
    nvml_stub.configure(mig_machine(used_b=38 * GiB))
    inv = nvml.read_inventory()
    criteria = SelectionCriteria(min_free_memory_bytes=8 * GiB, user=nvml.current_user())
    chosen = select_gpus(worst_of([inv.gpus]), criteria)
    assert [g.uuid for g in chosen.gpus] == [stub_uuid(1), MIG_A]  # least loaded first: more free memory
    assert [g.uuid for g, _ in chosen.rejected] == [MIG_B]
    bare = [gpu_ for gpu_ in inv.gpus if gpu_.index == 0][0]
    empty = select_gpus([bare.__class__(**{**bare.to_dict(), "mig_devices": ()})], criteria)
    assert empty.gpus == () and "no MIG instance is configured" in empty.reasons[0]


def _request(choice: str, workers: int, lock_dir: Path) -> GpuRequest:
    return GpuRequest(choice=parse_gpu_choice(choice), placement=PlanRequest(workers=workers,
                      worker_memory_bytes=GiB), lock_dir=lock_dir, samples=1, interval_s=0.0)


def test_groups_are_placed_and_leased_on_mig_instances(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure(mig_machine())
    req = _request("auto", 40, nvml_stub.lock_dir)
    outcome = planner.plan_and_reserve(req, run_id="mig-a", cpu_count=4, check_containers=False)
    plan, lease = outcome.plan, outcome.reservation
    assert plan.kind == "gpu" and lease is not None
    try:
        assert set(plan.gpu_uuids) == {stub_uuid(1), MIG_A, MIG_B}
        assert set(lease.uuids) == set(plan.gpu_uuids)  # one lease per MIG UUID
        assert {p.name for p in lease.paths} == {f"{u}.lock" for u in plan.gpu_uuids}
        on_mig = [g for g in plan.groups if g.share.gpu_uuids[0].startswith("MIG-")]
        assert on_mig
        for g in on_mig:  # the group sees its MIG instance and nothing else, in a container and as a process
            (uuid,) = g.share.gpu_uuids
            docker_env = containers.worker_env(containers.Kind.DOCKER, g.share, master_addr="m:1")
            assert docker_env["NVIDIA_VISIBLE_DEVICES"] == uuid == docker_env["CUDA_VISIBLE_DEVICES"]
            process_env = containers.worker_env(containers.Kind.PROCESS, g.share, master_addr="m:1")
            assert process_env["CUDA_VISIBLE_DEVICES"] == uuid
            assert g.share.memory_limit_bytes is not None and g.share.memory_limit_bytes < 40 * GiB
        # A second run cannot have them; it is told who holds them.
        with pytest.raises(NoResources) as caught:
            planner.plan_and_reserve(_request(MIG_A, 1, nvml_stub.lock_dir), run_id="mig-b", cpu_count=4,
                                     check_containers=False)
        assert "held by launcher run mig-a" in caught.value.message
    finally:
        lease.release()
    outcome = planner.plan_and_reserve(_request(MIG_B, 2, nvml_stub.lock_dir), run_id="mig-b", cpu_count=4,
                                       check_containers=False)
    assert outcome.plan.gpu_uuids == (MIG_B,) and outcome.reservation is not None
    assert outcome.reservation.uuids == (MIG_B,)
    outcome.reservation.release()


def test_naming_a_gpu_in_mig_mode_is_bad_input(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure(mig_machine())
    with pytest.raises(BadInput) as caught:
        planner.plan_and_reserve(_request("0", 2, nvml_stub.lock_dir), run_id=None, cpu_count=2,
                                 check_containers=False)
    assert caught.value.message == (f"--gpus 0: GPU 0 is in MIG mode and runs nothing as a whole GPU; its MIG "
                                    f"instances: {MIG_A}, {MIG_B}")


def test_launcher_plan_and_gpus_on_a_mig_machine(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure(mig_machine())
    env = nvml_stub.env()

    def launcher(*args: str) -> Any:
        out = subprocess.run([sys.executable, "-m", "launcher", *args], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)

    plan = launcher("plan", "--workers", "8", "--gpus", f"{MIG_A},{MIG_B}", "--json")
    shares = [plan["master"], *[g["share"] for g in plan["groups"]]]
    assert {s["gpu_uuids"][0] for s in shares} <= {MIG_A, MIG_B}
    assert {p["env"]["CUDA_VISIBLE_DEVICES"] for p in plan["launch"]["parts"]} <= {MIG_A, MIG_B}
    assert set(plan["gpu_uuids"]) == {MIG_A, MIG_B}
    lease = reservations.reserve([MIG_B], "run-on-mig", nvml_stub.lock_dir)
    try:
        listed = launcher("gpus", "--json", "--no-docker")
        table = subprocess.run([sys.executable, "-m", "launcher", "gpus", "--no-docker"], env=env, cwd=REPO,
                               capture_output=True, text=True, timeout=60).stdout
    finally:
        lease.release()
    (g0,) = [g for g in listed["gpus"] if g["index"] == 0]
    assert [(m["uuid"], m["memory_total_bytes"]) for m in g0["mig_devices"]] == [(MIG_A, 40 * GiB), (MIG_B, 40 * GiB)]
    assert g0["mig_devices"][0]["lease"] is None
    assert g0["mig_devices"][1]["lease"]["run_id"] == "run-on-mig"
    assert g0["mig_devices"][1]["lease"]["pid"] == os.getpid()
    (mig_b_line,) = [line for line in table.splitlines() if MIG_B in line]
    assert "run run-on-mig (lease" in mig_b_line and f"pid {os.getpid()}" in mig_b_line
    assert os.environ.get("NVML_STUB_CONFIG") == str(nvml_stub.config_path)


def test_a_run_on_mig_instances_leases_them_and_its_groups_see_only_theirs(nvml_stub: NvmlStub,
                                                                            tmp_path: Path) -> None:
    """`launcher up` (process backend) on two MIG instances: a lease per MIG UUID held while it runs, each
    process's real environment names its instance, a foreign process in one instance is flagged against that
    instance, and the leases are free once the run has ended."""
    nvml_stub.configure(mig_machine())
    intruder = subprocess.Popen(["sleep", "120"])
    run = LiveRun(nvml_stub, tmp_path, "--gpus", f"{MIG_A},{MIG_B}")
    try:
        plan = json.loads((run.record_path.parent / "plan.json").read_text())
        assert set(plan["gpu_uuids"]) == {MIG_A, MIG_B}
        held = {h.uuid: h.pid for h in leaseholders.list_holders(nvml_stub.lock_dir)}
        assert set(held) == {MIG_A, MIG_B} and set(held.values()) == {run.proc.pid}
        shares = {"master": plan["master"], **{f"group-{g['index']}": g["share"] for g in plan["groups"]}}
        for name, pid in run.record["pids"].items():
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            assert env["CUDA_VISIBLE_DEVICES"] == shares[name]["gpu_uuids"][0], name
        cfg = mig_machine(processes=[{"pid": intruder.pid, "used_memory_bytes": GiB, "gpu_instance_id": 2,
                                      "compute_instance_id": 0}])
        run.describe(cfg)
        found = wait_for(lambda: run.read_record().get("gpu_watch", {}).get("foreign_processes"), 10, "the intruder")
        assert [(f["pid"], f["gpu_uuid"], f["gpu_index"]) for f in found] == [(intruder.pid, MIG_B, 0)]
    finally:
        code = run.close()
        intruder.kill()
        intruder.wait()
    assert code == 130, run.log.read_text()[-3000:]
    assert leaseholders.list_holders(nvml_stub.lock_dir) == []
