"""GPU selection: the pure functions over made-up snapshots, and resolve_gpus over the NVML stub."""

from __future__ import annotations

import os
from typing import Any

import pytest

from launcher.errors import BadInput, MissingDependency, NoResources
from launcher.gpu import nvml, planner, reservations
from launcher.gpu.nvml import GpuError, GpuInfo, GpuProcess, Inventory
from launcher.gpu.placement import PlanRequest
from launcher.gpu.request import GpuChoice, GpuRequest, parse_gpu_choice
from launcher.gpu.select import SelectionCriteria, pick_explicit, select_gpus, worst_of
from launcher.units import parse_size
from tests.nvml_fixtures import A100_80GB_TOTAL_BYTES, GiB, NvmlStub, gpu, machine, stub_uuid

MISSING_PID = 4_194_000


def info(index: int, *, free_gib: float = 80, util: int | None = 0, procs: tuple[GpuProcess, ...] = (),
         mig: bool | None = False) -> GpuInfo:
    total = 80 * GiB
    free = int(free_gib * GiB)
    return GpuInfo(index, f"GPU-{index}", "Test GPU", f"0000:{index:02x}:00.0", total, total - free, free,
                   util, util, procs, mig, ())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 2**30), ("8 GiB", 8 * 2**30), ("8gib", 8 * 2**30), ("500MB", 500_000_000),
        ("500MiB", 500 * 2**20), ("1.5g", int(1.5 * 2**30)), ("2G", 2 * 2**30), ("1TB", 10**12),
        ("1024", 1024), ("0", 0), ("3kb", 3000), ("3K", 3072), ("12b", 12), (4096, 4096),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "8 GiBs", "-1GiB", "8 XB", "1,5GB", "eight"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(BadInput, match="--min-free-memory"):
        parse_size(text, what="--min-free-memory")


def test_parse_gpu_choice() -> None:
    assert parse_gpu_choice("auto") == GpuChoice("auto")
    assert parse_gpu_choice(" NONE ") == GpuChoice("none")
    assert parse_gpu_choice("2,0") == GpuChoice("explicit", ("2", "0"))
    uuid = stub_uuid(3)
    assert parse_gpu_choice(f"1,{uuid}") == GpuChoice("explicit", ("1", uuid))
    for bad in ("", "0,,1", "first", "0;1", "GPU-"):
        with pytest.raises(BadInput, match="--gpus"):
            parse_gpu_choice(bad)
    with pytest.raises(BadInput, match="more than once"):
        parse_gpu_choice("1,1")


def test_thresholds_and_order() -> None:
    mine = GpuProcess(10, GiB, user="alice", command="python")
    theirs = GpuProcess(11, GiB, user="bob", command="python")
    hidden = GpuProcess(12, GiB)  # another PID namespace: owner unknown
    gpus = [
        info(0, free_gib=4),  # too little memory
        info(1, util=80),  # too busy
        info(2, procs=(theirs,)),  # another user's job
        info(3, procs=(hidden,)),  # a job whose owner cannot be seen
        info(4, free_gib=60, util=10, procs=(mine,)),  # ok: own process
        info(5, free_gib=70, util=10),  # ok, more free memory than 4
        info(6, util=None),  # ok: utilisation unknown is not a reason to refuse
        info(7, mig=True),  # MIG mode
        info(8),  # held by another run
        info(9, free_gib=8, util=50),  # exactly at both thresholds: ok
    ]
    criteria = SelectionCriteria(min_free_memory_bytes=8 * GiB, max_utilization_pct=50, user="alice")
    sel = select_gpus(gpus, criteria, held_by={"GPU-8": "launcher run r1 (pid 1, user bob)"})
    assert [g.index for g in sel.gpus] == [6, 5, 4, 9]  # least utilised, then most free memory
    why = {g.index: reason for g, reason in sel.rejected}
    assert set(why) == {0, 1, 2, 3, 7, 8}
    assert "4.0 GiB free < --min-free-memory 8.0 GiB" in why[0]
    assert "80% utilization > --max-utilization 50%" in why[1]
    assert "process 11 of bob" in why[2]
    assert "not visible from here" in why[3]
    assert "MIG" in why[7]
    assert why[8] == "held by launcher run r1 (pid 1, user bob)"
    assert sel.reasons[0].startswith("GPU 0 (GPU-0) not used: ")

    allow = select_gpus(gpus, SelectionCriteria(min_free_memory_bytes=8 * GiB, max_utilization_pct=50,
                                                exclude_other_users=False, user="alice"))
    assert {2, 3}.issubset({g.index for g in allow.gpus})


def test_criteria_validation() -> None:
    with pytest.raises(BadInput, match="within 0..100"):
        SelectionCriteria(max_utilization_pct=120)
    with pytest.raises(BadInput, match=">= 0"):
        SelectionCriteria(min_free_memory_bytes=-1)


def test_worst_of_takes_the_worst_reading() -> None:
    p1, p2 = GpuProcess(1, GiB), GpuProcess(2, 3 * GiB)
    first = [info(0), info(1), info(2)]
    second = [info(0, free_gib=10, util=90, procs=(p1,)), info(1, util=None, procs=(p2,))]  # GPU 2 errored
    third = [info(0, free_gib=50, util=5, procs=(p2,)), info(1, util=30), info(2)]
    merged = worst_of([first, second, third])
    assert [g.index for g in merged] == [0, 1]
    g0, g1 = merged
    assert (g0.memory_free_bytes, g0.memory_used_bytes, g0.gpu_utilization_pct) == (10 * GiB, 70 * GiB, 90)
    assert [p.pid for p in g0.processes] == [1, 2]
    assert g1.gpu_utilization_pct == 30 and [p.pid for p in g1.processes] == [2]
    assert worst_of([]) == []


def test_pick_explicit() -> None:
    inv = Inventory(gpus=(info(0), info(1, util=99), info(2)), errors=(GpuError(3, "GPU-3", "GPU is lost"),))
    criteria = SelectionCriteria(max_utilization_pct=50)
    picked, reasons = pick_explicit(GpuChoice("explicit", ("2", "gpu-1")), inv, criteria)
    assert [g.index for g in picked] == [2, 1]  # the order given
    assert reasons == ["GPU 1 used because --gpus names it, although it is 99% utilization > --max-utilization 50%"]
    with pytest.raises(BadInput) as exc:
        pick_explicit(GpuChoice("explicit", ("0", "7", "GPU-nope")), inv, criteria)
    assert exc.value.message == "--gpus: no GPU 7, GPU-nope on this machine; GPUs here: 0 (GPU-0), 1 (GPU-1), 2 (GPU-2)"
    with pytest.raises(NoResources, match="GPU 3 cannot be read: GPU is lost"):
        pick_explicit(GpuChoice("explicit", ("3",)), inv, criteria)
    with pytest.raises(NoResources, match=r"GPU 0 \(GPU-0\) is held by launcher run r9"):
        pick_explicit(GpuChoice("explicit", ("0",)), inv, criteria, held_by={"GPU-0": "launcher run r9"})
    with pytest.raises(BadInput, match="twice"):
        pick_explicit(GpuChoice("explicit", ("0", "GPU-0")), inv, criteria)


# ---- resolve_gpus over the stub ------------------------------------------------------------------------

FAST: dict[str, Any] = {"interval_s": 0.0}


def resolve_gpus(choice: str, *, samples: int = 3, min_free_memory: str = "1GiB", lock_dir: Any = None,
                 interval_s: float = 0.0) -> tuple[list[GpuInfo], list[str]]:
    """planner.resolve_gpus with a request built the way config builds it."""
    request = GpuRequest(choice=parse_gpu_choice(choice), placement=PlanRequest(workers=1), samples=samples,
                         min_free_memory_bytes=parse_size(min_free_memory), interval_s=interval_s, lock_dir=lock_dir)
    return planner.resolve_gpus(request, check_containers=False)


def test_sampling_catches_a_gpu_that_turns_busy(nvml_stub: NvmlStub) -> None:
    cfg = machine(4)
    cfg["gpus"][1]["gpu_utilization_pct"] = [0, 95, 95]  # a job starts between the first and second read
    cfg["gpus"][2]["memory_used_bytes"] = [0, 0, 75 * GiB]  # ... allocates late
    cfg["gpus"][3]["processes"] = [[], [{"pid": MISSING_PID, "used_memory_bytes": GiB}]]  # ... appears
    nvml_stub.configure(cfg)
    once, _ = resolve_gpus("auto", samples=1, **FAST)
    assert [g.index for g in once] == [0, 1, 2, 3]  # one reading is fooled

    nvml_stub.configure(cfg)
    gpus, reasons = resolve_gpus("auto", samples=3, min_free_memory="8GiB", **FAST)
    assert [g.index for g in gpus] == [0]
    text = "\n".join(reasons)
    assert "GPU 1 (" in text and "95% utilization > --max-utilization 50%" in text
    assert "GPU 2 (" in text and "< --min-free-memory 8.0 GiB" in text
    assert "GPU 3 (" in text and f"process {MISSING_PID}" in text
    assert "took the worst of 3 readings" in text


def test_no_driver(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure({"init_error": "DRIVER_NOT_LOADED", "gpus": [gpu(0)]})
    assert resolve_gpus("auto", **FAST) == ([], ["no GPUs: the NVIDIA kernel driver is not loaded"])
    assert resolve_gpus("none", **FAST) == ([], ["--gpus none: CPU only"])
    with pytest.raises(MissingDependency) as exc:
        resolve_gpus("0", **FAST)
    assert "driver is not loaded" in exc.value.message and "modprobe" in (exc.value.hint or "")


def test_lost_gpu_is_skipped_with_a_reason(nvml_stub: NvmlStub) -> None:
    cfg = machine(2)
    cfg["gpus"][0]["error"] = "GPU_IS_LOST"
    nvml_stub.configure(cfg)
    gpus, reasons = resolve_gpus("auto", samples=2, **FAST)
    assert [g.index for g in gpus] == [1]
    assert reasons[0] == "GPU 0 (uuid unknown) skipped: GPU is lost"


def test_gpus_locked_by_another_run_are_not_selected(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure(machine(3))
    with reservations.reserve([stub_uuid(1)], "other-run", nvml_stub.lock_dir):
        gpus, reasons = resolve_gpus("auto", samples=1, lock_dir=nvml_stub.lock_dir, **FAST)
        assert [g.index for g in gpus] == [0, 2]
        assert f"GPU 1 ({stub_uuid(1)}) not used: held by launcher run other-run (pid {os.getpid()}" in reasons[-1]
        with pytest.raises(NoResources, match="held by launcher run other-run"):
            resolve_gpus("1", lock_dir=nvml_stub.lock_dir, **FAST)
    gpus, _ = resolve_gpus("auto", samples=1, lock_dir=nvml_stub.lock_dir, **FAST)
    assert len(gpus) == 3  # released


def test_explicit_unknown_gpu_lists_what_exists(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure(machine(2))
    with pytest.raises(BadInput) as exc:
        resolve_gpus("0,5", **FAST)
    assert exc.value.message == f"--gpus: no GPU 5 on this machine; GPUs here: 0 ({stub_uuid(0)}), 1 ({stub_uuid(1)})"


def test_plan_and_reserve_takes_disjoint_gpus_and_rechecks(nvml_stub: NvmlStub) -> None:
    cfg = machine(4)
    # GPU 0 looks idle in the three selection readings, then is busy when re-read after locking
    cfg["gpus"][0]["gpu_utilization_pct"] = [0, 0, 0, 99]
    nvml_stub.configure(cfg)
    request = PlanRequest(workers=1)  # master on one GPU, the worker on another
    req = GpuRequest(choice=parse_gpu_choice("auto"), placement=request, lock_dir=nvml_stub.lock_dir, samples=3,
                     interval_s=0.0)
    kw: dict[str, Any] = dict(cpu_count=2, cpu_fallback=False, check_containers=False)

    def plan_and_reserve(run_id: str) -> tuple[Any, Any]:
        outcome = planner.plan_and_reserve(req, run_id=run_id, **kw)
        return outcome.plan, outcome.reservation

    plan_a, res_a = plan_and_reserve("a")
    assert res_a is not None and plan_a.kind == "gpu"
    assert stub_uuid(0) not in res_a.uuids  # rechecked after locking, released, selected again
    assert set(res_a.uuids) == set(plan_a.gpu_uuids) and len(res_a.uuids) == 2
    plan_b, res_b = plan_and_reserve("b")
    assert res_b is not None and len(res_b.uuids) == 1  # the one GPU left: master and worker share it
    assert not set(res_a.uuids) & set(res_b.uuids)
    with pytest.raises(NoResources, match="no GPU is free") as exc:
        plan_and_reserve("c")
    assert "held by launcher run a" in exc.value.message and "held by launcher run b" in exc.value.message
    res_a.release()
    res_b.release()


def test_plan_and_reserve_on_cpu(nvml_stub: NvmlStub) -> None:
    nvml_stub.configure({"init_error": "LIBRARY_NOT_FOUND"})
    req = GpuRequest(choice=parse_gpu_choice("auto"), placement=PlanRequest(workers=3), interval_s=0.0)
    outcome = planner.plan_and_reserve(req, run_id="c", cpu_count=2, check_containers=False)
    plan, res = outcome.plan, outcome.reservation
    assert plan.kind == "cpu" and res is None
    assert plan.reasons[0] == "no GPUs: the NVIDIA driver library libnvidia-ml.so.1 was not found"


def test_current_user_matches_proc() -> None:
    assert nvml.current_user()
    assert A100_80GB_TOTAL_BYTES == 80 * GiB
