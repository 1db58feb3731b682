"""make_plan on made-up GPUs: worked examples, then properties checked with hypothesis."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.errors import NoResources
from launcher.gpu.placement import GiB, MiB, Plan, PlanRequest, make_plan

A100_FREE = 81050 * MiB  # an idle 80 GB A100: 81920 MiB total, a little used by the driver


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    memory_free_bytes: int


def gpus(*free: int) -> list[Gpu]:
    return [Gpu(i, f"GPU-{i:04d}", f) for i, f in enumerate(free)]


def per_gpu(plan: Plan) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for g in plan.groups:
        out[g.share.gpu_uuids[0]].append(g.workers)
    return dict(out)


def test_32_workers_on_4x80gb_default_figures_isolate_the_master() -> None:
    plan = make_plan(PlanRequest(workers=32), gpus(*[A100_FREE] * 4), cpu_count=16)
    assert plan.kind == "gpu" and plan.master.gpu_uuids == ("GPU-0000",)
    assert per_gpu(plan) == {"GPU-0001": [11], "GPU-0002": [11], "GPU-0003": [10]}
    assert plan.reasons[0] == "master alone on GPU 0: the 32 worker(s) fit on the other GPUs"
    g = plan.groups[0]
    assert g.share.gpu_uuids == ("GPU-0001",)
    assert g.share.gpu_indices == (1,) and g.share.cpus == 5.5
    assert plan.master.cpus == 16.0
    usable = int(A100_FREE * 0.95)
    assert plan.master.memory_limit_bytes == usable - 512 * MiB  # the whole GPU, less its CUDA context


def test_32_workers_on_4x80gb_with_7gib_workers_is_the_classic_shape() -> None:
    """Each GPU holds 10 such workers, so 3 GPUs cannot take 32: the master shares GPU 0 with the 2 left."""
    plan = make_plan(PlanRequest(workers=32, worker_memory_bytes=7 * GiB), gpus(*[A100_FREE] * 4), cpu_count=16)
    assert plan.master.gpu_uuids == ("GPU-0000",)
    assert per_gpu(plan) == {"GPU-0000": [2], "GPU-0001": [10], "GPU-0002": [10], "GPU-0003": [10]}
    assert "master shares GPU 0 with 2 worker(s)" in plan.reasons[0]
    assert "workers per GPU: GPU 0: master + 2, GPU 1: 10, GPU 2: 10, GPU 3: 10" in plan.reasons


def test_master_goes_where_fewest_workers_must_sit_beside_it() -> None:
    # The big GPU comes first, but with the master on it 9 workers would sit beside it (the small GPU holds
    # only 2); with the master on the small GPU, only 1 does.
    plan = make_plan(PlanRequest(workers=11, worker_memory_bytes=7 * GiB), gpus(A100_FREE, 20 * GiB), cpu_count=4)
    assert plan.master.gpu_uuids == ("GPU-0001",)
    assert per_gpu(plan) == {"GPU-0000": [10], "GPU-0001": [1]}


def test_one_gpu_master_and_workers_share_it() -> None:
    plan = make_plan(PlanRequest(workers=20), gpus(A100_FREE), cpu_count=2)
    assert per_gpu(plan) == {"GPU-0000": [10, 10]}
    assert plan.reasons[0] == "master shares GPU 0, the only GPU, with 20 worker(s)"
    limits = [s.memory_limit_bytes or 0 for s in (plan.master, *(g.share for g in plan.groups))]
    assert sum(limits) + 3 * 512 * MiB <= int(A100_FREE * 0.95)


def test_unused_gpus_are_said_and_not_in_the_plan() -> None:
    plan = make_plan(PlanRequest(workers=2), gpus(*[A100_FREE] * 6), cpu_count=2)
    assert plan.gpu_uuids == ("GPU-0000", "GPU-0001", "GPU-0002")
    assert "GPU 5 not used: the workers fit on the other GPUs" in plan.reasons


def test_isolate_and_share_options() -> None:
    two = gpus(A100_FREE, A100_FREE)
    shared = make_plan(PlanRequest(workers=4, isolate_master=False), two, cpu_count=2)
    assert per_gpu(shared) == {"GPU-0000": [2], "GPU-0001": [2]}
    with pytest.raises(NoResources, match="master on a GPU of its own"):
        make_plan(PlanRequest(workers=32, worker_memory_bytes=7 * GiB, isolate_master=True), two, cpu_count=2)


def test_does_not_fit() -> None:
    with pytest.raises(NoResources) as exc:
        make_plan(PlanRequest(workers=64, worker_memory_bytes=7 * GiB), gpus(A100_FREE, A100_FREE), cpu_count=2)
    assert "cannot place the master and 64 worker(s) on 2 GPU(s)" in exc.value.message
    assert "--gpus none" in (exc.value.hint or "")


def test_forced_groups() -> None:
    plan = make_plan(PlanRequest(workers=10, groups=4), gpus(*[A100_FREE] * 3), cpu_count=2)
    assert sorted(g.workers for g in plan.groups) == [2, 2, 3, 3]
    assert "GPU-0000" not in per_gpu(plan)  # master alone


def test_no_gpus_is_the_cpu_plan_with_the_reason() -> None:
    plan = make_plan(PlanRequest(workers=8), [], cpu_count=2, reasons=["no GPUs: the NVIDIA kernel driver is not loaded"])
    assert plan.kind == "cpu" and plan.reasons[0] == "no GPUs: the NVIDIA kernel driver is not loaded"
    assert not plan.master.on_gpu and all(not g.share.on_gpu for g in plan.groups)


@pytest.mark.parametrize(("workers", "cores", "sizes"), [
    (8, 2, [8]),            # one core steps envs, the other learns
    (8, 1, [8]),
    (8, 4, [3, 3, 2]),      # cores - 1 groups
    (32, 2, [16, 16]),      # the group size still caps
    (2, 16, [1, 1]),        # never more groups than workers
])
def test_a_cpu_plan_leaves_one_core_to_the_learner(workers: int, cores: int, sizes: list[int]) -> None:
    plan = make_plan(PlanRequest(workers=workers, max_workers_per_group=16), [], cpu_count=cores)
    assert [g.workers for g in plan.groups] == sizes
    assert ("one core left to the learner" in plan.reasons[-1]) == (cores >= 2)
    forced = make_plan(PlanRequest(workers=workers, groups=len(sizes) + 1 if workers > len(sizes) else 1), [],
                       cpu_count=cores)
    assert len(forced.groups) == (len(sizes) + 1 if workers > len(sizes) else 1), "--groups still decides"
    turns = make_plan(PlanRequest(workers=workers, max_workers_per_group=16, learner_core=False), [], cpu_count=cores)
    assert len(turns.groups) == max(min(workers, cores), math.ceil(workers / 16)), "sync=true: a group per core"
    assert "learner" not in turns.reasons[-1]


def test_the_request_keeps_a_learner_core_unless_the_run_takes_turns() -> None:
    from launcher.config import RunConfig
    from launcher.gpu.request import request_from_options

    def core(**kw: object) -> bool:
        request, placement_problems, problems = request_from_options(RunConfig(workers=16, **kw))  # type: ignore[arg-type]
        assert request is not None and not placement_problems and not problems
        return request.placement.learner_core

    assert core() and core(algo="a3c")
    assert not core(hparams={"sync": True}), "--set sync=true"
    assert not core(env_id="launcher/Snake-v0"), "Snake's defaults are synchronous"


# ---- properties ----------------------------------------------------------------------------------------

@st.composite
def cases(draw: st.DrawFn) -> tuple[PlanRequest, list[Gpu]]:
    workers = draw(st.integers(1, 64))
    forced = draw(st.one_of(st.none(), st.integers(1, workers)))
    request = PlanRequest(
        workers=workers,
        max_workers_per_group=draw(st.integers(1, 16)),
        groups=forced,
        master_memory_bytes=draw(st.integers(0, 24)) * GiB,
        group_memory_bytes=draw(st.integers(0, 4 * 1024)) * MiB,
        worker_memory_bytes=draw(st.integers(0, 16 * 1024)) * MiB,
        process_overhead_bytes=draw(st.sampled_from([0, 300 * MiB, 512 * MiB])),
        memory_headroom_fraction=draw(st.sampled_from([0.0, 0.05, 0.2])),
        isolate_master=draw(st.sampled_from([None, None, True, False])),
    )
    free = draw(st.lists(st.integers(0, 96 * 1024), min_size=1, max_size=6))
    return request, gpus(*[f * MiB for f in free])


def brute_capacity(avail: int, r: PlanRequest) -> int:
    """Most workers that fit in ``avail`` bytes, by trying every count (independent of worker_capacity)."""
    best = 0
    for n in range(1, r.workers + 1):
        need = math.ceil(n / r.max_workers_per_group) * (r.process_overhead_bytes + r.group_memory_bytes) \
            + n * r.worker_memory_bytes
        if need <= avail:
            best = n
    return best


def check_invariants(request: PlanRequest, gs: list[Gpu], plan: Plan) -> None:
    # every worker placed exactly once, in groups numbered 0..n-1
    assert plan.total_workers == request.workers
    assert [g.index for g in plan.groups] == list(range(len(plan.groups)))
    assert all(g.workers >= 1 for g in plan.groups)
    if request.groups is not None:
        assert len(plan.groups) == request.groups
    else:
        assert all(g.workers <= request.max_workers_per_group for g in plan.groups)
    # one GPU per process
    free = {g.uuid: g.memory_free_bytes for g in gs}
    committed: dict[str, int] = defaultdict(int)
    for share in (plan.master, *(g.share for g in plan.groups)):
        assert len(share.gpu_uuids) == 1 and share.gpu_uuids[0] in free
        assert share.memory_limit_bytes is not None and share.memory_limit_bytes >= 0
        committed[share.gpu_uuids[0]] += share.memory_limit_bytes + request.process_overhead_bytes
    # no GPU's memory over-committed
    for uuid, total in committed.items():
        assert total <= free[uuid], (uuid, total, free[uuid])


@settings(max_examples=400, deadline=None)
@given(cases())
def test_plan_properties(case: tuple[PlanRequest, list[Gpu]]) -> None:
    request, gs = case
    try:
        plan = make_plan(request, gs, cpu_count=4)
    except NoResources:
        plan = None
    usable = [int(g.memory_free_bytes * (1 - request.memory_headroom_fraction)) for g in gs]
    master_cost = request.process_overhead_bytes + request.master_memory_bytes
    caps = [brute_capacity(u, request) for u in usable]
    can_isolate = len(gs) >= 2 and any(
        usable[i] >= master_cost and sum(caps) - caps[i] >= request.workers for i in range(len(gs))
    )
    if plan is None:
        if request.groups is None:
            # complete: it fails only when no layout can hold the workers
            can_share = any(
                usable[i] >= master_cost
                and brute_capacity(usable[i] - master_cost, request) + sum(caps) - caps[i] >= request.workers
                for i in range(len(gs))
            )
            if request.isolate_master is True:
                assert not can_isolate
            elif request.isolate_master is None:
                assert not can_isolate and not can_share
            else:
                assert not can_share
        return
    check_invariants(request, gs, plan)
    master_gpu = plan.master.gpu_uuids[0]
    beside = [g for g in plan.groups if g.share.gpu_uuids[0] == master_gpu]
    # the master is isolated whenever the request and the GPUs allow it
    if request.groups is None and request.isolate_master is not False and can_isolate:
        assert beside == []
    if request.isolate_master is True:
        assert beside == []
    # otherwise as few workers as possible sit beside it
    if request.groups is None and request.isolate_master is None and beside:
        feasible = [
            request.workers - (sum(caps) - caps[i])
            for i in range(len(gs))
            if usable[i] >= master_cost
            and brute_capacity(usable[i] - master_cost, request) + sum(caps) - caps[i] >= request.workers
        ]
        assert sum(g.workers for g in beside) == max(0, min(feasible))
    # deterministic for the same input
    assert make_plan(request, list(gs), cpu_count=4) == plan
