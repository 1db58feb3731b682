"""``Backend.specs``: each backend's one pure step from a prepared run to what it starts (no process, engine or
swarm here; tests/unit/host/test_plan_is_what_runs.py and tests/docker/test_plan_is_what_runs_docker.py read a
real run's parts back)."""

from __future__ import annotations

import os
from pathlib import Path

from launcher.backends.base import PreparedRun
from launcher.backends.containers import container_user
from launcher.backends.docker import DockerBackend, container_specs
from launcher.backends.process import ProcessBackend
from launcher.backends.swarm import SwarmBackend
from launcher.backends.swarm_specs import assumed_placement, service_specs
from launcher.config import RunConfig
from launcher.gpu.nvml import GpuInfo
from launcher.gpu.placement import PlanRequest, make_plan
from launcher.runs import create_run_dir, new_secret
from launcher.up import build_spec

GiB = 1024**3


def gpu(index: int) -> GpuInfo:
    return GpuInfo(index, f"GPU-{index:08x}-aaaa-bbbb-cccc-{index:012x}", "Test GPU", f"0000:{index:02x}:00.0",
                   80 * GiB, 2 * GiB, 78 * GiB, 0, 0)


def prepared(tmp_path: Path, gpus: int = 3, workers: int = 8) -> PreparedRun:
    cfg = RunConfig(workers=workers, results=tmp_path, max_steps=10_000, port=5123)
    plan = make_plan(PlanRequest(workers=workers, max_workers_per_group=4), [gpu(i) for i in range(gpus)], 8)
    run_id = f"test-{os.urandom(3).hex()}"
    run_dir = create_run_dir(tmp_path, run_id)
    return PreparedRun(config=cfg, plan=plan, spec=build_spec(cfg, plan, run_id, run_dir.path), run_dir=run_dir,
                       secret=new_secret())


def test_process_specs_give_each_part_its_gpu_and_threads(tmp_path: Path) -> None:
    run = prepared(tmp_path)
    specs = ProcessBackend(python="/usr/bin/python3").specs(run)
    assert [p.name for p in specs.parts] == ["master", *(f"group-{g.index}" for g in run.plan.groups)]
    master = specs.part("master")
    assert master.command[:3] == ("/usr/bin/python3", "-m", "worker")
    assert master.command[-3:] == ("master", "--spec", str(run.run_dir.files.spec))
    (uuid,) = run.plan.master.gpu_uuids
    assert master.gpu_env == {"CUDA_VISIBLE_DEVICES": uuid, "NVIDIA_VISIBLE_DEVICES": uuid,
                              "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert master.thread_env == {"LAUNCHER_TF_THREADS": str(int(run.plan.master.cpus))}
    assert master.inherits == "host" and "LAUNCHER_LISTEN_FD" in master.at_start
    for g in run.plan.groups:
        part = specs.part(f"group-{g.index}")
        assert part.command[-5:] == ("group", "--index", str(g.index), "--spec", str(run.run_dir.files.spec))
        assert part.gpu_env["CUDA_VISIBLE_DEVICES"] == part.gpu_env["NVIDIA_VISIBLE_DEVICES"] == g.share.gpu_uuids[0]
        assert part.thread_env == {"LAUNCHER_TF_THREADS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        assert part.env["LAUNCHER_MASTER_ADDR"] == "127.0.0.1:5123"
    # start gives the address it bound
    bound = ProcessBackend(python="/usr/bin/python3").specs(run, master_addr="127.0.0.1:40000")
    assert bound.part("group-0").env["LAUNCHER_MASTER_ADDR"] == "127.0.0.1:40000"
    assert "SECRET" not in repr(specs.to_dict()).upper().replace("LAUNCHER_SECRET_FILE", "")


def test_docker_specs_are_the_containers_start_creates(tmp_path: Path) -> None:
    run = prepared(tmp_path)
    specs = DockerBackend(image="img:1").specs(run)
    master, groups = container_specs(run, image="img:1", gpu_runtime=True, uid_gid=container_user())
    for part, cs in zip(specs.parts, (master, *groups)):
        assert part.command == cs.command and dict(part.env) == dict(cs.environment) and part.image == "img:1"
        assert {(m.source, m.target, m.read_only) for m in part.mounts} == \
            {*((s, t, False) for s, t in cs.binds.items()), *((s, t, True) for s, t in cs.read_only_binds.items())}
        assert part.gpu_uuids == cs.gpu_uuids
    assert run.secret not in repr(specs.to_dict())


def test_swarm_specs_are_the_services_start_creates(tmp_path: Path) -> None:
    run = prepared(tmp_path)
    specs = SwarmBackend(image="img:1", master_placement="any").specs(run)
    master, groups = service_specs(run, image="img:1", placement=assumed_placement("any"), uid_gid=container_user())
    assert [p.name for p in specs.parts] == ["master", *(f"group-{g.index}" for g in run.plan.groups)]
    for part, svc in zip(specs.parts, (master, *groups)):
        assert part.command == svc.args and dict(part.env) == dict(svc.env)
    assert specs.part("master").mounts[0].source.startswith("volume:") and specs.note
    assert run.secret not in repr(specs.to_dict())


def test_slurm_specs_are_the_steps_start_runs(tmp_path: Path) -> None:
    import dataclasses

    from launcher.backends.slurm import SlurmBackend
    from launcher.backends.slurm_specs import SlurmRequest, plan_slurm, srun_args, step_env
    from tests.unit.host.test_slurm_plan import _view

    plan = plan_slurm(_view(), SlurmRequest(workers=4, gpus=False, groups=2, nodes=2))
    cfg = RunConfig(workers=4, results=tmp_path, max_steps=10_000)
    run_dir = create_run_dir(tmp_path, "slurm-run")
    run = PreparedRun(config=cfg, plan=plan, spec=build_spec(cfg, plan, "slurm-run", run_dir.path), run_dir=run_dir,
                      secret=new_secret())
    backend = SlurmBackend(runtime="process", python="/venv/bin/python")
    before = backend.specs(run)  # before the start: the job and the master's node stand in
    assert [p.name for p in before.parts] == [s.name for s in plan.steps] and "JOB-ID" in before.note
    assert all(p.command[:2] == ("srun", "--jobid=JOB-ID") for p in before.parts)
    assert '"master_host": "MASTER-NODE"' in before.part("master").env["LAUNCHER_SPEC"]
    # What start runs, with the job's id, nodes and the master's address: the same srun lines and the environment
    # step_env gives over the launcher's own.
    backend.nodes = {"master": "node1", "group-0": "node2", "group-1": "node2"}
    started = backend.specs(run, job_id="12", master_addr="10.0.0.1")
    spec = dataclasses.replace(run.spec, master_host="10.0.0.1", master_port=0, connect_host="10.0.0.1")
    base = {"PATH": "/bin", "HOME": "/home/me"}
    for step in plan.steps:
        part = started.part(step.name)
        srun = srun_args("12", step, backend.nodes[step.name], run_id="slurm-run")
        assert list(part.command[:len(srun)]) == srun
        assert {**base, **part.env} == step_env(base, step, spec)
        assert part.gpu_env == {"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "void"}
    assert run.secret not in repr(started.to_dict())
    backend.run, backend.job_id = run, "12"  # a restart's srun line is the spec's too, on the node it is given
    backend.nodes["group-1"] = "node1"
    assert backend._argv("group-1") == list(backend.specs(run, job_id="12").part("group-1").command)
    assert "--nodelist=node1" in backend._argv("group-1")
