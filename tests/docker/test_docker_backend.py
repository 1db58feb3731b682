"""The Docker backend: containers from a plan (pure, no engine), and whole runs on a real engine.

The ``docker``-marked tests run the real CLI against the real engine with the image the session builds
once (``launcher_image``). Each test works under its own results root; the ``runs_under`` fixture removes,
at teardown, every container and network whose ``launcher.results`` label points into that root, and fails
the test if it had to (a test must leave nothing behind by itself). Serial, CPU only: ~4 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from launcher.backends.base import PartState, PreparedRun
from launcher.backends.containers import MASTER_PORT, SECRET_MOUNT, group_name, master_name, network_name
from launcher.backends.docker import DockerBackend, check_gpu_runtime, container_specs, container_state
from launcher.config import RunConfig
from launcher.engine import labels as dc
from launcher.engine.client import Container, Engine
from launcher.errors import BadInput, MissingDependency
from launcher.gpu.nvml import GpuInfo
from launcher.gpu.placement import PlanRequest, cpu_plan, make_plan
from launcher.runs import create_run_dir, new_secret
from launcher.supervisor import Budget
from launcher.up import build_spec
from tests.docker_fixtures import as_invoker, ours
from tests.helpers import ROOT, child_env, launcher_cmd, only_run, read_json, run_launcher, status_of, wait_for, run_dirs
from worker.contract import RunSpec

GiB = 1024**3


# ------------------------------------------------------------------------------------ plans, no engine
def fake_gpu(index: int, free_gib: int = 78) -> GpuInfo:
    total = 80 * GiB
    return GpuInfo(index, f"GPU-{index:08x}-aaaa-bbbb-cccc-{index:012x}", "Test GPU", f"0000:{index:02x}:00.0",
                   total, total - free_gib * GiB, free_gib * GiB, 0, 0)


def prepared(tmp_path: Path, *, gpus: int = 0, workers: int = 8, budget: int = 3) -> PreparedRun:
    """A run as `up` prepares it: on ``gpus`` fake GPUs (a GPU plan) or on 2 CPU cores."""
    cfg = RunConfig(workers=workers, results=tmp_path, restart_budget=budget, max_steps=10_000)
    request = PlanRequest(workers=workers, max_workers_per_group=8)
    # On CPU, two groups as `up` made them on 2 cores before the learner kept a core (these tests are about several).
    plan = make_plan(request, [fake_gpu(i) for i in range(gpus)], 16) if gpus else \
        cpu_plan(replace(request, groups=min(2, workers)), 2)
    run_id = f"test-{os.urandom(3).hex()}"
    run_dir = create_run_dir(tmp_path, run_id)
    spec = build_spec(cfg, plan, run_id, run_dir.path)
    (run_dir.path / "spec.json").write_text(spec.to_json())
    return PreparedRun(config=cfg, plan=plan, spec=spec, run_dir=run_dir, secret=new_secret())


def test_gpu_plan_gives_each_group_its_uuids(tmp_path: Path) -> None:
    run = prepared(tmp_path, gpus=4, workers=24)
    master, groups = container_specs(run, image="img", gpu_runtime=True, uid_gid=(1234, 5678))
    assert len(groups) == len(run.plan.groups) >= 3
    for g, cs in zip(run.plan.groups, groups):
        assert g.share.gpu_uuids, "the fake GPU plan should put every group on a GPU"
        assert cs.environment["NVIDIA_VISIBLE_DEVICES"] == ",".join(g.share.gpu_uuids)
        assert cs.environment["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert cs.gpu_uuids == g.share.gpu_uuids
        req = cs.create_kwargs()["device_requests"][0]
        assert req["Driver"] == "nvidia" and req["DeviceIDs"] == list(g.share.gpu_uuids)
        assert req["Capabilities"] == [["gpu"]]
        assert cs.labels[dc.GPUS_LABEL] == ",".join(g.share.gpu_uuids)
        assert cs.labels[dc.GROUP_LABEL] == str(g.index) and cs.labels[dc.ROLE_LABEL] == "group"
        assert cs.nano_cpus == int(g.share.cpus * 1e9)
        assert cs.restart_max is None and cs.user == "1234:5678"  # attached: the supervisor restarts groups
        assert cs.environment["LAUNCHER_MASTER_ADDR"] == f"{master_name(run.run_id)}:{MASTER_PORT}"
    _, clamped = container_specs(run, image="img", gpu_runtime=True, uid_gid=(1, 1), engine_cpus=2)
    assert all(cs.nano_cpus == 2 * 10**9 for cs in clamped), "a limit above the engine's CPUs is lowered to them"
    # The master's GPU is not a worker GPU when the plan isolates it.
    assert master.environment["NVIDIA_VISIBLE_DEVICES"] == ",".join(run.plan.master.gpu_uuids)
    # No NVIDIA runtime: the environment still names the GPUs, but no DeviceRequest is made.
    _, plain = container_specs(run, image="img", gpu_runtime=False, uid_gid=(1, 1))
    assert all("device_requests" not in cs.create_kwargs() for cs in plain)


def test_cpu_plan_hides_every_gpu_and_rewrites_the_spec(tmp_path: Path) -> None:
    run = prepared(tmp_path)
    master, groups = container_specs(run, image="img", gpu_runtime=True, uid_gid=(1, 2))
    for cs in (master, *groups):
        assert cs.environment["NVIDIA_VISIBLE_DEVICES"] == "void"
        assert "device_requests" not in cs.create_kwargs()
        assert cs.read_only and cs.cap_drop == ("ALL",) and cs.security_opt == ("no-new-privileges",)
        assert cs.network == network_name(run.run_id)
        spec = RunSpec.from_json(cs.environment["LAUNCHER_SPEC"])
        assert (spec.results_dir, spec.master_host, spec.master_port) == ("/results", "0.0.0.0", MASTER_PORT)
        assert spec.connect_host == master_name(run.run_id)
        assert "LAUNCHER_SECRET" not in cs.environment  # a 0400 file bind-mounted read-only (issue 14)
        assert cs.environment["LAUNCHER_SECRET_FILE"] == "/run/launcher/secret"
        assert cs.labels[dc.RESULTS_LABEL] == str(run.results_dir.resolve())
    assert master.binds == {str(run.results_dir.resolve()): "/results"}
    assert master.restart_max is None and master.ports == {}
    assert all(not cs.binds for cs in groups), "only the master writes results"
    assert master.create_kwargs()["restart_policy"] == {"Name": "no"}
    # Attached, the supervisor restarts a dead group (never one that exited 4 or 5); detached, nobody would: the
    # engine's on-failure policy with the budget does.
    assert groups[0].create_kwargs()["restart_policy"] == {"Name": "no"}
    detached = replace(run, config=replace(run.config, detach=True))
    _, dgroups = container_specs(detached, image="img", gpu_runtime=True, uid_gid=(1, 2))
    assert dgroups[0].create_kwargs()["restart_policy"] == {"Name": "on-failure", "MaximumRetryCount": 3}


def test_a_detached_runs_master_gets_on_failure_with_master_restarts(tmp_path: Path) -> None:
    """Issue 27 on a detached run: no supervisor, so the engine restarts a master that died (``--master-restarts``
    times); attached, the supervisor does. Docker reads a MaximumRetryCount of 0 as no limit: 0 is no policy."""
    run = prepared(tmp_path)
    detached = replace(run, config=replace(run.config, detach=True, master_restarts=2))
    master, _ = container_specs(detached, image="img", gpu_runtime=False, uid_gid=(1, 2))
    assert master.create_kwargs()["restart_policy"] == {"Name": "on-failure", "MaximumRetryCount": 2}
    attached = replace(run, config=replace(run.config, master_restarts=2))
    assert container_specs(attached, image="img", gpu_runtime=False, uid_gid=(1, 2))[0].restart_max is None
    none = replace(run, config=replace(run.config, detach=True, master_restarts=0, restart_budget=0))
    master, groups = container_specs(none, image="img", gpu_runtime=False, uid_gid=(1, 2))
    assert [cs.create_kwargs()["restart_policy"] for cs in (master, *groups)] == [{"Name": "no"}] * (1 + len(groups))


def test_gpu_plan_without_nvidia_runtime_says_how_to_install_it(tmp_path: Path) -> None:
    run = prepared(tmp_path, gpus=2, workers=8)
    with pytest.raises(MissingDependency) as err:
        check_gpu_runtime(run.plan, ("io.containerd.runc.v2", "runc"))
    assert "nvidia-container-toolkit" in (err.value.hint or "") and "GPU-" in err.value.message
    check_gpu_runtime(run.plan, ("nvidia", "runc"))
    check_gpu_runtime(prepared(tmp_path).plan, ("runc",))  # a CPU plan needs no NVIDIA runtime


def snap(status: str, code: int | None = None, restarts: int = 0) -> Container:
    return Container("c" * 64, "x", status, code, restarts, {})


@pytest.mark.parametrize("c,expected", [
    (snap("created"), PartState.STARTING),
    (snap("running"), PartState.RUNNING),
    (snap("restarting", 137, 1), PartState.RESTARTING),  # the engine's on-failure policy at work
    (snap("exited", 0), PartState.EXITED),
    (snap("exited", 137, 1), PartState.FAILED),  # the policy gave up, or ignores a `docker kill`
    (None, PartState.LOST),  # removed behind our back
])
def test_container_state_maps_to_part_state(c: Container | None, expected: PartState) -> None:
    assert container_state(c) == expected


class FakeEngine:
    """The lowest layer only: inspect answers from a table; start records the call."""

    def __init__(self, snaps: dict[str, Container]) -> None:
        self.snaps = snaps
        self.started: list[str] = []

    def inspect(self, cid: str) -> Container | None:
        return self.snaps.get(cid)

    def start(self, cid: str) -> None:
        self.started.append(cid)
        self.snaps[cid] = replace(self.snaps[cid], status="running", exit_code=None)


def test_a_dead_group_is_started_again_by_the_supervisor_within_budget(tmp_path: Path) -> None:
    """An attached run's groups have no engine restart policy (Docker's on-failure cannot tell exit codes apart):
    the supervisor's budget restarts a dead group at once (no grace to wait for an engine), through the backend;
    poll itself never starts anything; a group that exited 5 (its algorithm raised) is never restarted."""
    run = prepared(tmp_path, budget=1)
    engine = FakeEngine({"m": snap("running"), "g0": snap("exited", 137), "g1": snap("running")})
    backend = DockerBackend("img", engine=engine)  # type: ignore[arg-type]
    backend.run, backend.master_id, backend.group_ids = run, "m", {0: "g0", 1: "g1"}
    assert backend.restart_grace_s == 0
    budget = Budget(run.config.restart_budget, backend.restart_grace_s, clock=lambda: 0.0)
    events: list[str] = []
    emit = lambda kind, data: events.append(data["message"])  # noqa: E731
    st = backend.poll()
    assert st.groups[0].state == PartState.FAILED and engine.started == [], "poll only reads"
    assert budget.review(st, backend, emit).groups[0].state == PartState.RESTARTING and engine.started == ["g0"]
    assert backend.poll().groups[0].restarts == 1
    engine.snaps["g0"] = snap("exited", 137)
    seen = budget.review(backend.poll(), backend, emit)
    assert seen.groups[0].state == PartState.LOST and engine.started == ["g0"], "the budget (1) is spent"
    assert budget.lost == [0] and "restart budget (1) is spent" in events[-1]
    engine.snaps["g1"] = snap("exited", 5)
    seen = budget.review(backend.poll(), backend, emit)
    assert seen.groups[1].state == PartState.LOST and engine.started == ["g0"], "exit 5 is never restarted"
    assert "not restarted" in events[-1]


class LeftoverEngine(FakeEngine):
    """An engine on which the run still has containers (say, a detached run not yet brought down)."""

    def __init__(self) -> None:
        super().__init__({})
        self.calls: list[str] = []

    def runtimes(self) -> tuple[str, ...]:
        return ("runc",)

    def containers(self, labels: dict[str, str | None]) -> list[Container]:
        self.calls.append("containers")
        return [replace(snap("running"), name="launcher-x-master")]

    def networks(self, labels: dict[str, str | None]) -> list[tuple[str, str, dict[str, str]]]:
        return []

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a refused start must not call engine.{name}")


def test_a_refused_start_leaves_the_runs_containers_alone(tmp_path: Path) -> None:
    run = prepared(tmp_path)
    backend = DockerBackend("img", engine=LeftoverEngine())  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="still has containers") as err:
        backend.start(run)
    assert f"launcher down {run.run_id}" in (err.value.hint or "")
    backend.stop()  # what the supervisor's finally does: nothing of someone else's may be stopped or removed


# --------------------------------------------------------------------------------------- real engine
RESULT_FILES = ("summary.json", "status.json", "metrics.jsonl", "learning_curve.png", "model/final_model.keras",
                "model/policy.npz", "model/policy.json", "checkpoints/checkpoint", "logs/master.log",
                "logs/group-0.log")


def _container(engine: Engine, name: str) -> dict[str, Any]:
    return engine.inspect_raw(name)


def _recovered_once(run: Path) -> bool:
    """The run's master was replaced once and both of its two groups are connected to the new one."""
    st = status_of(run)
    groups = st.get("groups") or {}
    return len(st.get("recoveries") or []) == 1 and sum(bool(g.get("connected")) for g in groups.values()) == 2


def _kill_hard(engine: Engine, name: str) -> None:
    """SIGKILL the container's main process from the host, as a crash or the OOM killer would: the restart
    policy applies (a `docker kill` would count as a manual stop and would not be restarted)."""
    snapshot = engine.inspect(name)
    assert snapshot is not None and snapshot.pid > 0, f"{name} is not running"
    os.kill(snapshot.pid, signal.SIGKILL)


@pytest.mark.docker
def test_idle_wakes_when_the_master_container_stops(launcher_image: str, docker_client: Any, engine: Engine) -> None:
    """The supervisor's wait between polls ends when the master's container stops (``docker wait``), not a
    poll period later; before that it times out as a sleep would; after it, it only sleeps."""
    c = docker_client.containers.run(launcher_image, entrypoint=["sleep", "120"], detach=True, network_disabled=True,
                                     labels={dc.RUN_LABEL: f"test-{os.urandom(3).hex()}"})
    try:
        assert engine.wait_stopped(c.id, 0.3) is False, "a running container is not reported stopped"
        backend = DockerBackend(launcher_image, engine=engine)
        backend.master_id = c.id
        backend.idle(0.3)  # still running: a plain wait
        assert (engine.inspect(c.id) or snap("gone")).status == "running"
        killer = threading.Timer(1.0, lambda: engine.kill(c.id))
        killer.start()
        t0 = time.monotonic()
        backend.idle(120)
        woke_after = time.monotonic() - t0
        killer.join()
        assert (engine.inspect(c.id) or snap("gone")).status != "running"
        assert woke_after < 60, f"idle(120) returned {woke_after:.1f} s after the start, not when the master stopped"
        assert engine.wait_stopped(c.id, 5) is True, "a stopped container: at once"
    finally:
        c.remove(force=True)
    assert engine.wait_stopped(c.id, 5) is True, "a removed container counts as stopped"


@pytest.mark.docker
@pytest.mark.slow
def test_solves_cartpole_in_containers_through_a_group_crash(launcher_image: str, runs_under: Path,
                                                             engine: Engine) -> None:
    env, uid = as_invoker()
    proc = subprocess.Popen(
        # One worker per group (~6 k env-steps/s, ~16 s to 475): with 8 a run ends ~5 s after training starts,
        # close to what the checks and the crash below take.
        launcher_cmd("up", "--backend", "docker", "--image", launcher_image, "--workers", "2", "--groups", "2", "--env", "CartPole-v1",
                     "--until-return", "475", "--max-steps", "600000", "--results", str(runs_under), "--json"),
        cwd=ROOT, env=child_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run = wait_for(lambda: next(iter(run_dirs(runs_under)), None), 30, "the run directory")
        run_id = run.name
        wait_for(lambda: (status_of(run).get("env_steps") or 0) >= 8000, 120, "training to start")

        # Every worker-group container is what the plan says.
        plan = read_json(run / "plan.json")
        for g in plan["groups"]:
            c = _container(engine, group_name(run_id, g["index"]))
            env_list = dict(e.split("=", 1) for e in c["Config"]["Env"])
            assert env_list["NVIDIA_VISIBLE_DEVICES"] == (",".join(g["share"]["gpu_uuids"]) or "void")
            assert env_list["LAUNCHER_MASTER_ADDR"] == f"{master_name(run_id)}:{MASTER_PORT}"
            assert "LAUNCHER_SPEC" in env_list and "LAUNCHER_SECRET_FILE" in env_list
            labels = c["Config"]["Labels"]
            assert labels[dc.RUN_LABEL] == run_id and labels[dc.ROLE_LABEL] == "group"
            assert labels[dc.GROUP_LABEL] == str(g["index"]) and labels[dc.USER_LABEL] == str(uid)
            assert labels[dc.RESULTS_LABEL] == str(run.resolve())
            hc = c["HostConfig"]
            assert hc["NanoCpus"] == int(g["share"]["cpus"] * 1e9)
            assert hc["RestartPolicy"]["Name"] == "no"  # the supervisor restarts groups (group_restart_max)
            assert hc["CapDrop"] == ["ALL"] and hc["SecurityOpt"] == ["no-new-privileges"] and hc["ReadonlyRootfs"]
            assert c["Config"]["User"] == f"{uid}:{uid}"
            assert list(c["NetworkSettings"]["Networks"]) == [network_name(run_id)]
        net = engine.client.networks.get(network_name(run_id)).attrs
        assert net["Internal"] is True and net["Labels"][dc.RUN_LABEL] == run_id
        assert _container(engine, master_name(run_id))["HostConfig"]["PortBindings"] in (None, {})

        # A worker group crashes: the supervisor restarts its container and it rejoins the master.
        _kill_hard(engine, group_name(run_id, 0))
        wait_for(lambda: (status_of(run).get("groups", {}).get("0", {}).get("connects") or 0) >= 2, 90,
                 "group 0 to rejoin")
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    assert proc.returncode == 0, err[-4000:]
    result = json.loads(out)
    assert result["state"] == "finished" and result["summary"]["target_reached"]
    assert result["restarts"].get("0") == 1 and result["lost_groups"] == []
    for name in RESULT_FILES:
        assert (run / name).is_file() and (run / name).stat().st_size > 0, f"missing {name}"
    assert list((run / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events"
    assert list((run / "checkpoints").glob("ckpt-*.index"))
    # Everything the containers wrote belongs to the invoking user, not root.
    written = [p for p in run.rglob("*") if p.name not in ("run.json", "config.json", "plan.json", "spec.json",
                                                             "result.json")]
    assert written and all(p.stat().st_uid == uid for p in written), \
        [str(p) for p in written if p.stat().st_uid != uid]
    master_log = (run / "logs" / "master.log").read_text()
    assert master_log.count("group 0 joined") >= 2, master_log[-2000:]
    assert "1 restart(s)" in (run / "logs" / "group-0.log").read_text()


@pytest.mark.docker
def test_gpu_plan_containers_and_missing_nvidia_runtime(launcher_image: str, runs_under: Path, engine: Engine) -> None:
    run = prepared(runs_under, gpus=4, workers=24)
    assert "nvidia" not in engine.runtimes(), "this test expects an engine without the NVIDIA runtime"
    with pytest.raises(MissingDependency) as err:
        DockerBackend(launcher_image, engine=engine).start(run)
    assert "nvidia-container-toolkit" in (err.value.hint or "")
    assert ours(engine, runs_under) == ([], []), "nothing may be created before the check"

    # As if the runtime were there: create (not start) the containers and read them back from the engine.
    backend = DockerBackend(launcher_image, engine=engine, gpu_runtime=True)
    backend.create(run)
    try:
        for g in run.plan.groups:
            c = _container(engine, group_name(run.run_id, g.index))
            env = dict(e.split("=", 1) for e in c["Config"]["Env"])
            assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(g.share.gpu_uuids)
            assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
            assert c["Config"]["Labels"][dc.GPUS_LABEL] == ",".join(g.share.gpu_uuids)
            (req,) = c["HostConfig"]["DeviceRequests"]
            assert req["Driver"] == "nvidia" and req["DeviceIDs"] == list(g.share.gpu_uuids)
            assert c["HostConfig"]["NanoCpus"] == int(min(g.share.cpus, engine.cpu_count()) * 1e9)
        m = _container(engine, master_name(run.run_id))
        # The results directory, and the run's secret as a read-only file (never in the environment).
        assert sorted(mt["Destination"] for mt in m["Mounts"]) == ["/results", SECRET_MOUNT]
        assert [mt["RW"] for mt in m["Mounts"] if mt["Destination"] == SECRET_MOUNT] == [False]
    finally:
        backend.stop(grace_s=1)
        backend.stop(grace_s=1)  # idempotent
    assert ours(engine, runs_under) == ([], [])


@pytest.mark.docker
def test_a_killed_master_is_replaced_in_place_then_given_up_then_resumed(launcher_image: str, runs_under: Path,
                                                                         engine: Engine) -> None:
    """Issue 27 on Docker: the master container's process SIGKILLed from the host (as the OOM killer would) is
    started again in place (the group containers are not restarted: same start time, restart count 0) and
    restores its checkpoint; killed again within 60 s of that start with ``--master-restarts 1``, it is not
    replaced: exit 7, and ``up --resume`` continues from the newest checkpoint."""
    common = ("--image", launcher_image, "--results", str(runs_under))
    proc = subprocess.Popen(
        launcher_cmd("up", "--backend", "docker", *common, "--workers", "4", "--groups", "2", "--max-steps", "2000000",
                     "--checkpoint-every", "5", "--master-restarts", "1"),
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run = wait_for(lambda: next(iter(run_dirs(runs_under)), None), 30, "the run directory")
        wait_for(lambda: ((status_of(run).get("checkpoint") or {}).get("updates") or 0) >= 5, 120, "a checkpoint")
        started = {g: _container(engine, group_name(run.name, g))["State"]["StartedAt"] for g in (0, 1)}
        _kill_hard(engine, master_name(run.name))
        t_kill = time.monotonic()

        wait_for(lambda: _recovered_once(run) or proc.poll() is not None, 120,
                 "the master replaced and both groups back")
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        print(f"\n[recovery docker] master replaced and both groups back {time.monotonic() - t_kill:.1f} s after the kill")
        for g in (0, 1):
            c = _container(engine, group_name(run.name, g))
            assert c["State"]["StartedAt"] == started[g] and c["RestartCount"] == 0, f"group {g} was restarted"
        (rec,) = status_of(run)["recoveries"]
        assert rec["checkpoint"] and rec["restored_updates"] >= 5 and rec["steps_lost"] >= 0, rec
        base = rec["restored_updates"]
        wait_for(lambda: ((status_of(run).get("checkpoint") or {}).get("updates") or 0) >= base + 5, 60,
                 "a checkpoint of the new master")
        _kill_hard(engine, master_name(run.name))  # within 60 s of its start: the budget of 1 is spent
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 7, err[-3000:]  # RUN_FAILED
    assert "the master died (killed by SIGKILL" in err and "not replaced: it died 2 times in a row" in out + err
    assert f"launcher up --resume {run.name}" in out + err
    assert ours(engine, runs_under) == ([], []), "the attached up must remove what it started"
    last = read_json(run / "status.json")
    checkpointed = last["checkpoint"]["updates"]

    resumed = run_launcher("up", "--resume", run.name, *common, "--max-steps", str(last["env_steps"] + 6000), "--json",
                           timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    starts = [e for e in events if e.get("event") == "master_started"]
    assert len(starts) == 3 and starts[0]["updates"] == 0, starts
    assert starts[2]["updates"] >= checkpointed >= 10 and starts[2]["env_steps"] > 0, starts
    summary = read_json(run / "summary.json")
    assert summary["outcome"] == "max_steps" and summary["updates"] > starts[2]["updates"]
    assert len(summary["recoveries"]) == 2, "the resumed master records the second death too"
    assert "resumed from" in (run / "logs" / "master.log").read_text()


@pytest.mark.docker
def test_a_detached_runs_killed_master_is_replaced_in_place_by_the_engine(launcher_image: str, runs_under: Path,
                                                                          engine: Engine) -> None:
    """Issue 27 on a detached run, which has no supervisor: the master container's process SIGKILLed from the host
    is restarted by the engine (``on-failure`` with ``--master-restarts``; a ``docker kill`` would be a manual stop,
    never restarted), restores its checkpoint and records the recovery in status.json; the group containers are not
    restarted; the run reaches ``--max-steps`` and ``launcher status`` says finished; ``launcher down`` leaves
    nothing."""
    common = ("--results", str(runs_under))
    max_steps = 60_000
    up = run_launcher("up", "--backend", "docker", "--detach", "--image", launcher_image, "--workers", "2", "--groups",
                      "2", "--max-steps", str(max_steps), "--checkpoint-every", "5", "--master-restarts", "1", *common,
                      timeout=60)
    assert up.returncode == 0, up.stderr[-3000:]
    run = only_run(runs_under)
    try:
        wait_for(lambda: ((status_of(run).get("checkpoint") or {}).get("updates") or 0) >= 5, 120, "a checkpoint")
        started = {g: _container(engine, group_name(run.name, g))["State"]["StartedAt"] for g in (0, 1)}
        steps_at_kill = status_of(run).get("env_steps") or 0
        assert steps_at_kill < max_steps // 2, f"the run is too fast for this test: {steps_at_kill} steps already"
        _kill_hard(engine, master_name(run.name))
        t_kill = time.monotonic()

        wait_for(lambda: _recovered_once(run), 120, "the engine to restart the master and both groups back")
        print(f"\n[recovery docker detached] master restarted by the engine and both groups back "
              f"{time.monotonic() - t_kill:.1f} s after the kill")
        assert _container(engine, master_name(run.name))["RestartCount"] == 1
        for g in (0, 1):
            c = _container(engine, group_name(run.name, g))
            assert c["State"]["StartedAt"] == started[g] and c["RestartCount"] == 0, f"group {g} was restarted"
        (rec,) = status_of(run)["recoveries"]
        assert rec["checkpoint"] and rec["restored_updates"] >= 5 and rec["steps_lost"] >= 0, rec

        def state() -> str:
            st = run_launcher("status", run.name, "--json", *common, timeout=30)
            return json.loads(st.stdout).get("state", "") if st.stdout.strip() else ""

        wait_for(lambda: state() in ("finished", "failed", "stale"), 240, "the run to end")
        st = run_launcher("status", run.name, "--json", *common, timeout=30)
        assert st.returncode == 0 and json.loads(st.stdout)["state"] == "finished", st.stdout + st.stderr
        print(f"[recovery docker detached] the run reached --max-steps {time.monotonic() - t_kill:.1f} s after the kill")
        summary = read_json(run / "summary.json")
        assert summary["outcome"] == "max_steps" and len(summary["recoveries"]) == 1, summary
        events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert sum(e.get("event") == "master_started" for e in events) == 2
        assert sum(e.get("event") == "master_recovered" for e in events) == 1
    finally:
        down = run_launcher("down", run.name, *common, timeout=60)
    assert down.returncode == 0, down.stderr
    assert ours(engine, runs_under) == ([], [])


@pytest.mark.docker
def test_a_detached_runs_master_that_recorded_its_failure_is_not_trained_again(launcher_image: str,
                                                                               runs_under: Path,
                                                                               engine: Engine) -> None:
    """The engine's on-failure policy restarts the master that raised (summary.json: failed) and exited 1; the
    restarted master sees the recorded end and exits 0 at once (worker.__main__.ended_already), so the engine stops
    restarting it; summary.json stays as the failure wrote it and ``launcher status`` says failed."""
    common = ("--results", str(runs_under))
    algo = f"{ROOT / 'tests' / 'data' / 'usercode' / 'reinforce.py'}:Reinforce"
    up = run_launcher("up", "--backend", "docker", "--detach", "--image", launcher_image, "--gpus", "none",
                      "--workers", "2", "--groups", "1", "--algo", algo, "--set", "fault=update", "--max-steps",
                      "100000", "--master-restarts", "2", *common, timeout=240)
    assert up.returncode == 0, up.stderr[-3000:]
    run = only_run(runs_under)
    try:
        def master() -> dict[str, Any]:
            return _container(engine, master_name(run.name))

        wait_for(lambda: master()["RestartCount"] >= 1 and master()["State"]["Status"] == "exited", 180,
                 "the failed master restarted by the engine, then exited")
        time.sleep(3)  # a further restart would show by now (the engine's first back-off is 0.1 s)
        m = master()
        assert (m["State"]["Status"], m["State"]["ExitCode"], m["RestartCount"]) == ("exited", 0, 1), m["State"]
        summary = read_json(run / "summary.json")
        assert summary["outcome"] == "failed" and "ZeroDivisionError" in json.dumps(summary["error"]), summary
        logs = run_launcher("logs", run.name, "--master", *common, timeout=30)
        assert "already ended (summary.json: outcome failed)" in logs.stdout + logs.stderr
        st = run_launcher("status", run.name, "--json", *common, timeout=30)
        doc = json.loads(st.stdout)
        assert doc["state"] == "failed", doc
    finally:
        down = run_launcher("down", run.name, *common, timeout=60)
    assert down.returncode == 0, down.stderr
    assert ours(engine, runs_under) == ([], [])


@pytest.mark.docker
def test_detach_status_logs_down(launcher_image: str, runs_under: Path, engine: Engine) -> None:
    common = ("--results", str(runs_under))
    up = run_launcher("up", "--backend", "docker", "--detach", "--image", launcher_image, "--workers", "4", "--groups", "2",
                      "--max-steps", "5000000", *common, timeout=60)
    assert up.returncode == 0, up.stderr[-3000:]
    run = only_run(runs_under)
    assert f"launcher down {run.name}" in up.stdout
    wait_for(lambda: (status_of(run).get("env_steps") or 0) > 0, 90, "the detached run to train")

    st = run_launcher("status", run.name, "--json", *common, timeout=30)
    assert st.returncode == 0, st.stderr
    doc = json.loads(st.stdout)
    assert doc["state"] == "running" and doc["live"] and doc["backend"] == "docker"
    assert sorted(p["name"] for p in doc["parts"]) == ["group-0", "group-1", "master"]
    assert all(p["state"] == "running" for p in doc["parts"])
    logs = run_launcher("logs", run.name, "--master", *common, timeout=30)
    assert logs.returncode == 0 and "listening on 0.0.0.0:7100" in logs.stdout
    missing = run_launcher("logs", run.name, "--group", "9", *common, timeout=30)
    assert missing.returncode == 2 and "group-9" in missing.stderr

    down = run_launcher("down", run.name, *common, timeout=60)
    assert down.returncode == 0, down.stderr
    assert "removed 3 container(s)" in down.stdout
    assert ours(engine, runs_under) == ([], [])
    assert read_json(run / "summary.json")["outcome"] == "interrupted", "the master checkpointed on SIGTERM"
    assert "listening on" in (run / "logs" / "master.log").read_text(), "down keeps the containers' output"
    again = run_launcher("down", run.name, *common, timeout=60)
    assert again.returncode == 0 and "nothing was running" in again.stdout
    st = json.loads(run_launcher("status", run.name, "--json", *common, timeout=30).stdout)
    assert st["state"] == "interrupted" and st["parts"] == []


@pytest.mark.docker
def test_launch_latency_and_down_after_the_launcher_was_killed(launcher_image: str, runs_under: Path,
                                                              engine: Engine) -> None:
    """32 workers: time from `up` to all connected (docs/docker-backend.md quotes it); then the launcher is
    SIGKILLed and `launcher down RUN` finds the run's containers and network by label."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        launcher_cmd("up", "--backend", "docker", "--image", launcher_image, "--workers", "32", "--max-steps",
                     "5000000", "--results", str(runs_under)),
        cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run = wait_for(lambda: next(iter(run_dirs(runs_under)), None), 30, "the run directory")

        def connected() -> int:
            groups = status_of(run).get("groups") or {}
            return sum(g.get("workers", 0) for g in groups.values() if g.get("connected"))

        wait_for(lambda: connected() == 32, 120, "32 workers to connect", interval=0.1)
        latency = time.monotonic() - t0
        print(f"\nlaunch latency (docker backend, image present): {latency:.1f} s from `up` to 32 workers connected")
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    snaps, nets = ours(engine, runs_under)
    assert len(snaps) == 3 and len(nets) == 1, "a killed launcher leaves its containers running"
    st = json.loads(run_launcher("status", run.name, "--json", "--results", str(runs_under), timeout=30).stdout)
    assert st["live"] and st["workers_connected"] == 32
    down = run_launcher("down", run.name, "--results", str(runs_under), timeout=60)
    assert down.returncode == 0 and "removed 3 container(s), 1 network(s)" in down.stdout, down.stdout + down.stderr
    assert ours(engine, runs_under) == ([], [])
    assert latency < 60
