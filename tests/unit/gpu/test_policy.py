"""Site policy: the pure functions on made-up GPUs, and `plan`/`up` on a simulated machine (stand-in NVML)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from launcher import schemas
from launcher.gpu import leaseholders, policy, reservations
from launcher.config import RunConfig
from launcher.errors import ConfigErrors
from launcher.gpu.nvml import GpuInfo
from launcher.gpu.policy import PolicyViolation, SitePolicy
from tests.nvml_fixtures import GiB, NvmlStub, machine, stub_uuid

REPO = Path(__file__).resolve().parents[3]


def gpu(index: int, free_gib: float = 70) -> GpuInfo:
    total = 80 * GiB
    free = int(free_gib * GiB)
    return GpuInfo(index, stub_uuid(index), "A100", f"0:{index}", total, total - free, free, 0, 0)


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "policy.toml"
    p.write_text(text)
    return p


# ---------------------------------------------------------------------------------------------- reading
def test_policy_file_is_read(tmp_path: Path) -> None:
    p = write(tmp_path, 'max_gpus_per_user = 2\nmin-free-memory = "8GiB"\nreserved_gpus = [0, "GPU-abc"]\n'
                        "max_workers_per_gpu = 16\n")
    site = policy.load_policy(p)
    assert site == SitePolicy(source=str(p), max_gpus_per_user=2, min_free_memory_bytes=8 * GiB,
                              reserved_gpus=("0", "GPU-abc"), max_workers_per_gpu=16)


def test_missing_default_policy_is_no_policy(tmp_path: Path) -> None:
    assert policy.load_policy(environ={}).empty or policy.DEFAULT_POLICY_PATH.exists()
    with pytest.raises(ConfigErrors, match="policy file not found"):
        policy.load_policy(environ={"LAUNCHER_POLICY": str(tmp_path / "nope.toml")})


@pytest.mark.parametrize(("text", "message"), [
    ("max_gpu_per_user = 2", "unknown key 'max_gpu_per_user' (did you mean 'max_gpus_per_user'?)"),
    ('max_gpus_per_user = "two"', "max_gpus_per_user = 'two': expected a whole number >= 0"),
    ("max_workers_per_gpu = 0", "max_workers_per_gpu = 0: expected a whole number >= 1"),
    ('min_free_memory = "lots"', "min_free_memory = 'lots': expected a memory size"),
    ("reserved_gpus = 3", "reserved_gpus = 3: expected a list of GPU indices or UUIDs"),
    ("reserved_gpus = [true]", "reserved_gpus = [True]: expected a list of GPU indices or UUIDs"),
    ("max_gpus_per_user = ", "cannot read the policy file"),
])
def test_policy_errors_name_file_key_and_value(tmp_path: Path, text: str, message: str) -> None:
    p = write(tmp_path, text + "\n")
    with pytest.raises(ConfigErrors) as err:
        policy.load_policy(p)
    assert err.value.exit_code == 2
    (problem,) = err.value.problems
    assert problem.startswith(f"{p}: ") and message in problem


# --------------------------------------------------------------------------------------------- applying
def test_reserved_gpus_are_dropped_by_index_and_uuid() -> None:
    site = SitePolicy(source="/etc/p.toml", reserved_gpus=("0", stub_uuid(2).upper()))
    kept, reasons = policy.filter_gpus([gpu(0), gpu(1), gpu(2), gpu(3)], site, explicit=False)
    assert [g.index for g in kept] == [1, 3]
    assert reasons == [f"GPU 0 ({stub_uuid(0)}) not used: reserved by site policy /etc/p.toml",
                       f"GPU 2 ({stub_uuid(2)}) not used: reserved by site policy /etc/p.toml"]
    with pytest.raises(PolicyViolation, match="--gpus names GPU 2 .* which site policy /etc/p.toml reserves"):
        policy.filter_gpus([gpu(1), gpu(2)], site, explicit=True)


def test_gpu_cap_counts_the_users_other_runs() -> None:
    site = SitePolicy(max_gpus_per_user=3)
    kept, reasons = policy.filter_gpus([gpu(i) for i in range(4)], site, explicit=False, held_by_user=1, user="ann")
    assert [g.index for g in kept] == [0, 1]
    assert reasons == ["site policy allows user ann 3 GPU(s) at once (1 held by your other runs): using 2, "
                       "not GPU(s) 2, 3"]
    kept, reasons = policy.filter_gpus([gpu(0)], site, explicit=False, held_by_user=3)
    assert kept == [] and "using 0" in reasons[0]
    with pytest.raises(PolicyViolation, match="names 3 GPU.*allows a user 3 at once .1 held"):
        policy.filter_gpus([gpu(0), gpu(1), gpu(2)], site, explicit=True, held_by_user=1)


def test_memory_floor() -> None:
    site = SitePolicy(min_free_memory_bytes=8 * GiB)
    assert policy.floor_min_free_memory(GiB, site) == (8 * GiB, [
        "site policy raises --min-free-memory from 1.0 GiB to 8.0 GiB"])
    assert policy.floor_min_free_memory(16 * GiB, site) == (16 * GiB, [])
    kept, reasons = policy.filter_gpus([gpu(0, free_gib=4), gpu(1)], site, explicit=False)
    assert [g.index for g in kept] == [1] and "4.0 GiB free < site policy min_free_memory 8.0 GiB" in reasons[0]
    with pytest.raises(PolicyViolation, match="GPU 0, which has 4.0 GiB free; site policy requires 8.0 GiB"):
        policy.filter_gpus([gpu(0, free_gib=4)], site, explicit=True)


def test_workers_per_gpu() -> None:
    from launcher.gpu.placement import PlanRequest, make_plan

    plan = make_plan(PlanRequest(workers=48), [gpu(0), gpu(1), gpu(2)], 8)
    assert policy.check_plan(plan, SitePolicy(max_workers_per_gpu=24)) == [
        "site policy: at most 24 workers per GPU (this plan: GPU 1: 24, GPU 2: 24)"]
    with pytest.raises(PolicyViolation, match="puts 24 workers on GPU 1; site policy allows 16 per GPU "
                                              r"\(at most 32 workers"):
        policy.check_plan(plan, SitePolicy(max_workers_per_gpu=16))
    cpu = make_plan(PlanRequest(workers=48), [], 8)
    assert policy.check_plan(cpu, SitePolicy(max_workers_per_gpu=1)) == []


def test_a_crowded_plan_is_made_again_with_the_master_sharing() -> None:
    """48 workers fit one GPU by memory, so placement isolates the master and crowds the other GPU; a cap of
    32 per GPU makes the planner spread them over both instead."""
    from dataclasses import replace

    from launcher.gpu.placement import PlanRequest, make_plan

    site = SitePolicy(max_workers_per_gpu=32)
    gpus = [gpu(0), gpu(1)]
    assert [g.share.gpu_indices for g in make_plan(PlanRequest(workers=48), gpus, 8).groups] == [(1,)] * 3
    plan, reservation, reasons = policy.plan_obeying(lambda r: (make_plan(r, gpus, 8), None), PlanRequest(workers=48),
                                                     site)
    per_gpu = {i: sum(g.workers for g in plan.groups if g.share.gpu_indices == (i,)) for i in (0, 1)}
    assert per_gpu == {0: 24, 1: 24} and reservation is None
    assert reasons[-1] == "the master shares a GPU so the workers spread over every GPU (site policy: at most 32 per GPU)"
    with pytest.raises(PolicyViolation, match="puts 40 workers on GPU 0.*at most 64 workers on the 2 GPU"):
        policy.plan_obeying(lambda r: (make_plan(r, gpus, 8), None), PlanRequest(workers=80), site)
    with pytest.raises(PolicyViolation, match="puts 48 workers on GPU 1"):  # isolation asked for: no second try
        policy.plan_obeying(lambda r: (make_plan(r, gpus, 8), None), replace(PlanRequest(workers=48),
                                                                             isolate_master=True), site)


# ------------------------------------------------------------------------- a simulated 4-GPU machine
def launcher(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "launcher", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_plan_obeys_the_policy_on_a_simulated_machine(nvml_stub: NvmlStub, tmp_path: Path) -> None:
    nvml_stub.configure(machine(4))
    p = write(tmp_path, 'max_gpus_per_user = 2\nreserved_gpus = [0]\nmin_free_memory = "8GiB"\n')
    env = nvml_stub.env(LAUNCHER_POLICY=str(p))
    out = launcher(env, "plan", "--workers", "8", "--json", "--sample-interval", "0")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    jsonschema.validate(doc, schemas.load(schemas.PLAN_SCHEMA))
    assert doc["kind"] == "gpu" and sorted(doc["gpu_uuids"]) == [stub_uuid(1), stub_uuid(2)]
    reasons = "\n".join(doc["reasons"])
    assert "raises --min-free-memory from 1.0 GiB to 8.0 GiB" in reasons
    assert f"GPU 0 ({stub_uuid(0)}) not used: reserved by site policy {p}" in reasons
    assert f"site policy {p} allows user" in reasons and "using 2, not GPU(s) 3" in reasons
    assert doc["policy"]["max_gpus_per_user"] == 2

    table = launcher(env, "plan", "--workers", "8", "--sample-interval", "0")
    assert table.returncode == 0 and f"reserved by site policy {p}" in table.stdout

    named = launcher(env, "plan", "--workers", "8", "--gpus", "0,1")
    assert named.returncode == 2
    assert named.stderr.startswith(f"launcher: error: --gpus names GPU 0 ({stub_uuid(0)}), which site policy {p} "
                                   "reserves\nHINT: ")

    p.write_text("max_workers_per_gpu = 1\n")
    crowded = launcher(env, "plan", "--workers", "8", "--sample-interval", "0")
    assert crowded.returncode == 2 and "allows 1 per GPU" in crowded.stderr

    p.write_text("max_gpu_per_user = 2\n")
    broken = launcher(env, "plan", "--workers", "8")
    assert broken.returncode == 2 and f"{p}: unknown key 'max_gpu_per_user'" in broken.stderr


def test_up_plans_within_the_policy(nvml_stub: NvmlStub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`launcher up`'s planning step (select, filter, plan, reserve) with another run of this user holding a GPU."""
    from launcher.up import make_plan

    nvml_stub.configure(machine(4))
    monkeypatch.setenv("LAUNCHER_POLICY", str(write(tmp_path, "max_gpus_per_user = 2\nreserved_gpus = [3]\n")))
    cfg = RunConfig(workers=8, lock_dir=nvml_stub.lock_dir)
    with reservations.reserve([stub_uuid(0)], "my-other-run", nvml_stub.lock_dir):
        plan, reservation = make_plan(cfg, "run-under-policy", cpu_count=4)
        try:
            assert reservation is not None and set(reservation.uuids) == set(plan.gpu_uuids)
            # 0 is held by my other run (which counts toward my 2), 3 is reserved: one GPU is left to me.
            assert plan.gpu_uuids == (stub_uuid(1),)
            assert any("reserved by site policy" in r for r in plan.reasons)
            assert any("allows user" in r and "(1 held by your other runs): using 1, not GPU(s) 2" in r
                       for r in plan.reasons)
        finally:
            reservation.release()
    monkeypatch.setenv("LAUNCHER_POLICY", str(write(tmp_path, "max_workers_per_gpu = 1\n")))
    with pytest.raises(PolicyViolation, match="allows 1 per GPU"):
        make_plan(cfg, "run-crowded", cpu_count=4)
    assert leaseholders.list_holders(nvml_stub.lock_dir) == []  # the refused plan's GPUs were released
