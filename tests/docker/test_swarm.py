"""The Swarm backend: services from a plan (pure, no engine), and whole runs on a real single-node swarm.

The ``docker``-marked tests make the CI engine a one-node swarm advertising on 127.0.0.1 (nothing leaves the
machine) unless it already is a manager, and the module's fixture leaves the swarm again, with force, only if
it made it, even when a test fails; it also removes the ``docker_gwbridge`` network that ``swarm init``
creates when the engine had none. Each test works under its own results root and must leave no service,
network, secret, volume or container labelled with it (the ``swarm_runs_under`` fixture checks, cleans up and
fails the test if it had to). Overlay networking works here with DNS round-robin endpoints; the engine's
kernel has no IPVS, so a service VIP would not route (docs/scaling-out.md). About 3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from launcher.backends import swarm as sw
from launcher.backends import swarm_run
from launcher.backends import swarm_specs as specs
from launcher.backends.base import PartState, PreparedRun
from launcher.backends.containers import MASTER_PORT, group_name, master_name, network_name
from launcher.config import RunConfig
from launcher.engine import labels as dc
from launcher.engine.client import Engine
from launcher.errors import BadInput, MissingDependency, NoResources, RunFailed
from launcher.gpu.nvml import GpuInfo
from launcher.gpu.placement import PlanRequest, cpu_plan, make_plan
from launcher.runs import create_run_dir, new_secret
from launcher.engine.swarm import GPU_RESOURCE, NodeInfo, SwarmEngine, TaskInfo
from launcher.up import build_spec
from tests.docker_fixtures import as_invoker
from tests.helpers import ROOT, child_env, launcher_cmd, only_run, read_json, run_launcher, status_of, wait_for, run_dirs
from worker.gpu_setup import adopt_swarm_gpus
from worker.contract import RunSpec

GiB = 1024**3


# ------------------------------------------------------------------------------------ plans, no engine
def fake_gpu(index: int) -> GpuInfo:
    return GpuInfo(index, f"GPU-{index:08x}-aaaa-bbbb-cccc-{index:012x}", "Test GPU", f"0000:{index:02x}:00.0",
                   80 * GiB, 2 * GiB, 78 * GiB, 0, 0)


def prepared(root: Path, *, gpus: int = 0, workers: int = 8, budget: int = 3) -> PreparedRun:
    """A run as `up` prepares it: on ``gpus`` made-up GPUs, or on 2 CPU cores."""
    cfg = RunConfig(workers=workers, results=root, restart_budget=budget, max_steps=10_000)
    request = PlanRequest(workers=workers, max_workers_per_group=8)
    # On CPU, two groups as `up` made them on 2 cores before the learner kept a core (these tests are about several).
    plan = make_plan(request, [fake_gpu(i) for i in range(gpus)], 16) if gpus else \
        cpu_plan(replace(request, groups=min(2, workers)), 2)
    run_id = f"test-{os.urandom(3).hex()}"
    run_dir = create_run_dir(root, run_id)
    spec = build_spec(cfg, plan, run_id, run_dir.path)
    (run_dir.path / "spec.json").write_text(spec.to_json())
    return PreparedRun(config=cfg, plan=plan, spec=spec, run_dir=run_dir, secret=new_secret())


def node(nid: str = "n1", *, labels: dict[str, str] | None = None, gpus: int = 0, ready: bool = True) -> NodeInfo:
    return NodeInfo(nid, f"host-{nid}", "manager", ready, labels or {}, 2 * 10**9, gpus)


LOCAL = specs.master_placement("local", [node("n1")], "n1")


def test_cpu_plan_becomes_one_service_per_process_with_the_secret_as_a_file(tmp_path: Path) -> None:
    run = prepared(tmp_path)
    master, groups = specs.service_specs(run, image="img", placement=LOCAL, uid_gid=(1234, 5678), max_cpus=2)
    assert len(groups) == len(run.plan.groups) >= 2
    for cs in (master, *groups):
        assert "LAUNCHER_SECRET" not in cs.env, "the secret is never an environment variable on a swarm"
        assert cs.env["LAUNCHER_SECRET_FILE"] == "/run/secrets/launcher-secret"
        assert cs.env["NVIDIA_VISIBLE_DEVICES"] == "void" and cs.env["CUDA_VISIBLE_DEVICES"] == ""
        spec = RunSpec.from_json(cs.env["LAUNCHER_SPEC"])
        assert (spec.results_dir, spec.master_host, spec.master_port) == ("/results", "0.0.0.0", MASTER_PORT)
        assert spec.connect_host == master_name(run.run_id) == master.name
        assert cs.labels[dc.RUN_LABEL] == run.run_id and cs.labels[dc.GPUS_LABEL] == ""
        assert cs.labels[dc.RESULTS_LABEL] == str(run.results_dir.resolve()) and cs.labels[dc.USER_LABEL] == "1234"
        assert cs.network == network_name(run.run_id) and cs.user == "1234:5678" and cs.gpus == 0
        kw = cs.create_kwargs("sec-id", "sec-name", (1234, 5678))
        assert kw["container_labels"] == kw["labels"] == dict(cs.labels), "tasks' containers carry the labels"
        assert kw["endpoint_spec"]["Mode"] == "dnsrr" and kw["mode"] == {"replicated": {"Replicas": 1}}
        assert kw["read_only"] and kw["cap_drop"] == ["ALL"] and kw["args"] == list(cs.args)
        (ref,) = kw["secrets"]
        assert ref["SecretID"] == "sec-id" and ref["File"] == {"Name": "launcher-secret", "UID": "1234",
                                                              "GID": "5678", "Mode": 0o400}
        assert "GenericResources" not in kw["resources"].get("Reservations", {})
    assert master.args == ("master",) and master.labels[dc.ROLE_LABEL] == "master"
    assert master.constraints == ("node.id==n1",) and master.restart_policy() == {"Condition": "none"}
    assert [(m.kind, m.target, m.source) for m in master.mounts] == [
        ("bind", "/results", str(run.results_dir.resolve())), ("tmpfs", "/tmp", "")]
    for g, cs in zip(run.plan.groups, groups):
        assert cs.name == group_name(run.run_id, g.index) and cs.args == ("group", "--index", str(g.index))
        assert cs.labels[dc.ROLE_LABEL] == "group" and cs.labels[dc.GROUP_LABEL] == str(g.index)
        assert cs.env["LAUNCHER_MASTER_ADDR"] == f"{master.name}:{MASTER_PORT}"
        assert cs.restart_policy() == {"Condition": "on-failure", "MaxAttempts": 3, "Delay": 10**9}
        assert cs.constraints == () and [m.kind for m in cs.mounts] == ["tmpfs"], "groups need no storage"
        assert cs.nano_cpus == int(min(g.share.cpus, 2) * 1e9)


def test_a_restart_budget_of_zero_never_restarts(tmp_path: Path) -> None:
    """The swarm reads max_attempts 0 as "no limit": budget 0 must be condition none instead."""
    _, groups = specs.service_specs(prepared(tmp_path, budget=0), image="img", placement=LOCAL, uid_gid=(1, 1))
    assert all(g.restart_policy() == {"Condition": "none"} for g in groups)


def test_gpu_plan_reserves_generic_resources_and_pins_no_uuid(tmp_path: Path) -> None:
    run = prepared(tmp_path, gpus=4, workers=24)
    master, groups = specs.service_specs(run, image="img", placement=LOCAL, uid_gid=(1, 1))
    for g, cs in zip(run.plan.groups, groups):
        assert g.share.gpu_uuids and cs.gpus == len(g.share.gpu_uuids)
        assert "NVIDIA_VISIBLE_DEVICES" not in cs.env and "CUDA_VISIBLE_DEVICES" not in cs.env, \
            "the engine picks GPUs on the node it picks; UUIDs of this host mean nothing there"
        assert cs.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert cs.labels[specs.GPU_COUNT_LABEL] == str(cs.gpus) and cs.labels[dc.GPUS_LABEL] == ""
        res = cs.create_kwargs("s", "n", (1, 1))["resources"]
        assert res["Reservations"]["GenericResources"] == [
            {"DiscreteResourceSpec": {"Kind": GPU_RESOURCE, "Value": cs.gpus}}]
    needs = [s.gpus for s in (master, *groups) if s.gpus]
    assert "advertise 0" in (specs.gpu_shortfall(needs, [node(gpus=0)]) or "")
    assert specs.gpu_shortfall(needs, [node("a", gpus=sum(needs))]) is None
    assert "largest node" in (specs.gpu_shortfall([2], [node("a", gpus=1), node("b", gpus=1)]) or "")
    assert specs.gpu_shortfall([], [node()]) is None


def test_master_placement_follows_storage_labels(tmp_path: Path) -> None:
    store = node("s", labels={specs.STORAGE_LABEL: "true"})
    auto = specs.master_placement("auto", [node("n1"), store], "n1")
    assert auto.constraints == ("node.labels.launcher.storage==true",) and auto.results == "bind"
    assert specs.master_placement("auto", [node("n1"), node("n2")], "n1").constraints == ("node.id==n1",)
    assert specs.master_placement("auto", [node("n1"), node("s", labels={specs.STORAGE_LABEL: "true"}, ready=False)],
                               "n1").constraints == ("node.id==n1",), "a down storage node does not count"
    anywhere = specs.master_placement("any", [node("n1"), store], "n1")
    assert anywhere.constraints == () and anywhere.results == "volume"
    with pytest.raises(BadInput, match="no ready node is labelled launcher.storage=true"):
        specs.master_placement("storage", [node("n1")], "n1")
    with pytest.raises(BadInput):
        specs.master_placement("elsewhere", [node("n1")], "n1")
    run = prepared(tmp_path)
    master, _ = specs.service_specs(run, image="img", placement=anywhere, uid_gid=(7, 7))
    (vol,) = master.mounts
    assert (vol.kind, vol.target, vol.source) == ("volume", "/tmp", specs.volume_name(run.run_id))
    assert vol.labels[dc.RUN_LABEL] == run.run_id and vol.labels[dc.ROLE_LABEL] == "results"
    assert RunSpec.from_json(master.env["LAUNCHER_SPEC"]).results_dir == "/tmp/results"


def task(state: str, code: int | None = None, *, at: int = 0, err: str = "") -> TaskInfo:
    return TaskInfo(f"t{at}", "svc", "n1", state, "running", code, err, "c" * 64, (1_000 + at, 0))


@pytest.mark.parametrize("tasks,budget,restarts,expected", [
    ([], 3, 0, PartState.STARTING),
    ([task("pending", err="no suitable node")], 3, 0, PartState.STARTING),
    ([task("running")], 3, 0, PartState.RUNNING),
    ([task("complete", 0)], 3, 0, PartState.EXITED),
    ([task("failed", 137)], 3, 0, PartState.RESTARTING),  # the swarm starts another after its delay
    ([task("failed", 137), task("running", at=1)], 3, 1, PartState.RUNNING),  # the newest task counts
    ([task("failed", 137), task("ready", at=1)], 3, 1, PartState.STARTING),
    ([task("failed", 1, at=3), task("failed", 1, at=2), task("failed", 1, at=1), task("failed", 1)], 3, 3,
     PartState.FAILED),  # the swarm gave up; the supervisor's budget makes it LOST
    ([task("failed", 1)], 0, 0, PartState.FAILED),  # budget 0: never restarted
    ([task("failed", 5)], 3, 0, PartState.FAILED),  # the algorithm's code raised: another task would too
    ([task("failed", 4)], 3, 0, PartState.FAILED),  # refused by the master (wrong secret): likewise
    ([task("failed", 1)], None, 0, PartState.FAILED),  # the master
    ([task("rejected", err="No such image: x")], None, 0, PartState.FAILED),
])
def test_task_states_map_to_part_states_with_the_swarms_restart_policy(tasks: list[TaskInfo], budget: int | None,
                                                               restarts: int, expected: PartState) -> None:
    assert specs.service_state(tasks, budget, restarts)[0] == expected


class ScriptedSwarm:
    """Stands in for the swarm's API in the tests below: answers ``tasks`` from a script, records scaling."""

    def __init__(self, script: list[dict[str, list[TaskInfo]]]) -> None:
        self.script = script
        self.scaled: list[str] = []
        self.updated: list[tuple[str, tuple[str, ...] | None]] = []

    def tasks(self, ids: list[str]) -> dict[str, list[TaskInfo]]:
        return self.script.pop(0)

    def nodes(self) -> list[NodeInfo]:
        return [node("n1")]

    def scale_to_zero(self, sid: str) -> None:
        self.scaled.append(sid)

    def force_update(self, sid: str, *, constraints: tuple[str, ...] | None = None) -> None:
        self.updated.append((sid, constraints))


@pytest.mark.parametrize("code,scaled", [(5, True), (4, True), (137, False)])
def test_a_group_that_exited_4_or_5_is_scaled_to_zero_and_stays_failed(tmp_path: Path, code: int,
                                                                       scaled: bool) -> None:
    """The swarm's on-failure policy cannot tell exit codes apart: the backend stops it from starting a group
    whose next task would end the same way, and keeps reporting how the group ended (not the task the swarm may
    have started within its 1 s delay, killed by the scale-down). A crash (137) is left to the swarm."""
    backend = sw.SwarmBackend(image="img")
    backend.run = prepared(tmp_path)
    backend.master_service, backend.group_services = "m", {0: "g0", 1: "g1"}
    running = [task("running")]
    ended = [task("failed", code)]
    started_anyway = [task("failed", code), task("shutdown", 143, at=1)]
    backend.swarm = ScriptedSwarm([{"m": running, "g0": ended, "g1": running},
                                   {"m": running, "g0": started_anyway, "g1": running}])  # type: ignore[assignment]
    first = backend.poll()
    assert backend.swarm.scaled == (["g0"] if scaled else [])  # type: ignore[attr-defined]
    second = backend.poll()
    assert first.groups[1].state == second.groups[1].state == PartState.RUNNING
    if scaled:
        assert first.groups[0].state == second.groups[0].state == PartState.FAILED
        assert second.groups[0].exit_code == code and second.groups[0].restarts == 0
        assert backend.swarm.scaled == ["g0"]  # type: ignore[attr-defined]  # once
    else:
        assert first.groups[0].state == PartState.RESTARTING


@pytest.mark.parametrize("choice,pin", [("local", None), ("any", ("node.id==n1",))])
def test_a_dead_master_gets_a_new_task_where_its_checkpoints_are(tmp_path: Path, choice: str,
                                                                 pin: tuple[str, ...] | None) -> None:
    """Issue 27: the dead master task (exit 137, read as SIGKILL) is reported once; restart_master asks for a new
    task (a bound results directory keeps the placement, a volume pins the dead task's node), and until the swarm
    lists it the master is STARTING, not dead a second time; the new task counts as a restart."""
    from launcher.recovery import death_signal

    backend = sw.SwarmBackend(image="img")
    backend.run = prepared(tmp_path)
    backend.placement = specs.master_placement(choice, [node("n1")], "n1")
    backend.master_service, backend.group_services = "m", {0: "g0"}
    dead, running = [task("failed", 137)], [task("running")]
    fake = ScriptedSwarm([{"m": dead, "g0": running}, {"m": dead}, {"m": dead, "g0": running},
                          {"m": [*dead, task("running", at=1)], "g0": running}])
    backend.swarm = fake  # type: ignore[assignment]
    assert sw.SwarmBackend.recovers_master
    first = backend.poll()
    assert first.master.state == PartState.FAILED and death_signal(first.master.exit_code) == signal.SIGKILL
    backend.restart_master()
    assert fake.updated == [("m", pin)]
    assert backend.poll().master.state == PartState.STARTING, "the dead task is not judged twice"
    after = backend.poll().master
    assert (after.state, after.restarts) == (PartState.RUNNING, 1)
    assert specs.recovery_constraints(specs.master_placement("any", [node("n1")], "n1"), "") is None


def test_start_problems_name_the_missing_image_and_the_missing_resources() -> None:
    rejected = [task("rejected", err="No such image: launcher:9")]
    err = specs.start_problem("svc", rejected, 10.0, 9.0, "launcher:9")
    assert isinstance(err, MissingDependency) and "launcher build --push" in (err.hint or "")
    pending = [task("pending", err="no suitable node (insufficient resources on 1 node)")]
    assert specs.start_problem("svc", pending, 10.0, 9.0, "img") is None, "the scheduler may still place it"
    err = specs.start_problem("svc", pending, 100.0, 9.0, "img")
    assert isinstance(err, NoResources) and "insufficient resources" in err.message
    assert specs.start_problem("svc", [task("running")], 100.0, 0.0, "img") is None
    no_path = [task("rejected", err='invalid mount config for type "bind": bind source path does not exist: /r/x')]
    err = specs.start_problem("svc", no_path, 1.0, 0.0, "img")
    assert isinstance(err, MissingDependency) and "same path" in (err.hint or "")
    assert isinstance(specs.start_problem("svc", [task("rejected", err="other")], 1.0, 0.0, "img"), RunFailed)


def test_snapshots_read_generic_resources_and_timestamps() -> None:
    n = NodeInfo.from_attrs({"ID": "x", "Spec": {"Role": "worker", "Availability": "active", "Labels": {"a": "b"}},
                             "Status": {"State": "ready"}, "Description": {"Hostname": "gpu1", "Resources": {
                                 "NanoCPUs": 4 * 10**9, "GenericResources": [
                                     {"NamedResourceSpec": {"Kind": GPU_RESOURCE, "Value": "GPU-a"}},
                                     {"NamedResourceSpec": {"Kind": GPU_RESOURCE, "Value": "GPU-b"}},
                                     {"DiscreteResourceSpec": {"Kind": "other", "Value": 9}}]}}})
    assert (n.hostname, n.ready, n.gpus, n.nano_cpus, dict(n.labels)) == ("gpu1", True, 2, 4 * 10**9, {"a": "b"})
    t = TaskInfo.from_attrs({"ID": "t", "ServiceID": "s", "NodeID": "x", "DesiredState": "running",
                             "CreatedAt": "2026-11-22T00:41:23.5Z", "AssignedGenericResources": [
                                 {"NamedResourceSpec": {"Kind": GPU_RESOURCE, "Value": "GPU-b"}}],
                             "Status": {"State": "failed", "Err": "task: non-zero exit (137)",
                                        "ContainerStatus": {"ContainerID": "abc", "ExitCode": 137}}})
    assert (t.state, t.exit_code, t.gpus, t.container_id) == ("failed", 137, ("GPU-b",), "abc")
    later = TaskInfo.from_attrs({"CreatedAt": "2026-11-22T00:41:23.51Z", "Status": {"State": "running"}})
    assert later.created > t.created and later.exit_code is None


def test_worker_adopts_the_gpus_the_swarm_assigned() -> None:
    env = {"DOCKER_RESOURCE_NVIDIA-GPU": "GPU-aaa,GPU-bbb"}
    assert adopt_swarm_gpus(env) == ("GPU-aaa", "GPU-bbb")
    assert env["NVIDIA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == "GPU-aaa,GPU-bbb"
    by_index = {"DOCKER_RESOURCE_NVIDIA-GPU": "2"}
    assert adopt_swarm_gpus(by_index) == ("2",) and "CUDA_VISIBLE_DEVICES" not in by_index, \
        "an index outside the container is not the index inside it"
    nothing: dict[str, str] = {}
    assert adopt_swarm_gpus(nothing) == () and nothing == {}


# ------------------------------------------------------------------------------------- a real swarm
@pytest.fixture(scope="module")
def swarm(docker_client: Any) -> Iterator[SwarmEngine]:
    """This engine as a swarm manager; made a one-node swarm on 127.0.0.1 (and left again) only if it was not."""
    state = (docker_client.info().get("Swarm") or {}).get("LocalNodeState")
    made = False
    if state == "inactive":
        had_gwbridge = bool(docker_client.networks.list(names=["docker_gwbridge"]))
        docker_client.swarm.init(advertise_addr="127.0.0.1", listen_addr="127.0.0.1:2377")
        made = True
    elif state != "active":
        pytest.skip(f"the engine's swarm state is {state!r}; not touching it")
    engine = Engine()
    try:
        problem = SwarmEngine(engine).manager_problem()
        if problem:
            pytest.skip(problem)
        yield SwarmEngine(engine)
    finally:
        engine.close()
        if made:
            docker_client.swarm.leave(force=True)
            if not had_gwbridge:
                for _ in range(20):  # the bridge is released a moment after the swarm is left
                    nets = docker_client.networks.list(names=["docker_gwbridge"])
                    try:
                        for net in nets:
                            net.remove()
                        break
                    except Exception:  # noqa: BLE001 - still in use; try again
                        time.sleep(0.5)


def _ours(swarm: SwarmEngine, root: Path) -> list[str]:
    """Everything on the engine labelled with a run under ``root``: services, networks, secrets, volumes,
    containers."""
    prefix = str(root.resolve())
    mine = lambda labels: (labels or {}).get(dc.RESULTS_LABEL, "").startswith(prefix)  # noqa: E731
    flt = {dc.RUN_LABEL: None}
    found = [f"service {s['Spec']['Name']}" for s in swarm.services(flt) if mine(s["Spec"].get("Labels"))]
    found += [f"network {n}" for _, n, labels in swarm.engine.networks(flt) if mine(labels)]
    found += [f"secret {s.name}" for s in swarm.client.secrets.list(filters={"label": dc.RUN_LABEL}) if mine(s.attrs[
        "Spec"].get("Labels"))]
    found += [f"volume {v.name}" for v in swarm.client.volumes.list(filters={"label": dc.RUN_LABEL})
              if mine(v.attrs.get("Labels"))]
    found += [f"container {c.name}" for c in swarm.engine.containers(flt) if mine(c.labels)]
    return found


@pytest.fixture
def swarm_runs_under(tmp_path: Path, swarm: SwarmEngine) -> Iterator[Path]:
    """A results root; at teardown nothing labelled with it may remain (removed, and the test fails)."""
    root = tmp_path / "results"
    root.mkdir()
    root.chmod(0o777)  # runs act as another user (see as_invoker)
    yield root
    left = _ours(swarm, root)
    for run in run_dirs(root):
        swarm_run.teardown(swarm.engine, run.name, grace_s=1)
    for v in swarm.client.volumes.list(filters={"label": dc.RUN_LABEL}):
        if v.attrs.get("Labels", {}).get(dc.RESULTS_LABEL, "").startswith(str(root.resolve())):
            v.remove(force=True)
    assert _ours(swarm, root) == []
    assert not left, f"the test left {left} behind"


def _service(swarm: SwarmEngine, name: str) -> dict[str, Any]:
    (s,) = [s for s in swarm.services({dc.RUN_LABEL: None}) if s["Spec"]["Name"] == name]
    return s


def _tasks(swarm: SwarmEngine, name: str) -> list[TaskInfo]:
    sid = _service(swarm, name)["ID"]
    return swarm.tasks([sid])[sid]


def _running_container(swarm: SwarmEngine, name: str) -> dict[str, Any]:
    t = wait_for(lambda: next((t for t in _tasks(swarm, name) if t.state == "running"), None), 60, f"{name} to run")
    return swarm.engine.inspect_raw(t.container_id)


@pytest.mark.docker
@pytest.mark.slow
def test_solves_cartpole_on_a_swarm_through_a_killed_task(launcher_image: str, swarm: SwarmEngine,
                                                          swarm_runs_under: Path) -> None:
    root = swarm_runs_under
    env, uid = as_invoker()
    proc = subprocess.Popen(
        # One worker per group (~16 s to 475 here): the checks, the kill and the replacement must not be outrun.
        launcher_cmd("up", "--backend", "swarm", "--image", launcher_image, "--workers", "2", "--groups", "2", "--env", "CartPole-v1",
                     "--until-return", "475", "--max-steps", "600000", "--results", str(root), "--json"),
        cwd=ROOT, env=child_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run = wait_for(lambda: next(iter(run_dirs(root)), None), 30, "the run directory")
        run_id = run.name
        wait_for(lambda: (status_of(run).get("env_steps") or 0) >= 2000, 150, "training to start")
        plan = read_json(run / "plan.json")

        # One service per process, labelled like Docker containers, on the run's overlay network.
        net = swarm.client.networks.get(network_name(run_id)).attrs
        assert (net["Driver"], net["Scope"], net["Attachable"], net["Internal"]) == ("overlay", "swarm", True, True)
        assert net["Labels"][dc.RUN_LABEL] == run_id and net["Labels"][dc.ROLE_LABEL] == "network"
        (secret,) = swarm.client.secrets.list(filters={"label": f"{dc.RUN_LABEL}={run_id}"})
        assert secret.name == specs.secret_name(run_id) and secret.attrs["Spec"]["Labels"][dc.USER_LABEL] == str(uid)
        names = [master_name(run_id)] + [group_name(run_id, g["index"]) for g in plan["groups"]]
        for name in names:
            s = _service(swarm, name)
            spec, tmpl = s["Spec"], s["Spec"]["TaskTemplate"]
            role = "master" if name == names[0] else "group"
            assert spec["Labels"][dc.RUN_LABEL] == run_id and spec["Labels"][dc.ROLE_LABEL] == role
            assert tmpl["ContainerSpec"]["Labels"] == spec["Labels"]
            assert [n["Target"] for n in tmpl["Networks"]] == [net["Id"]]
            assert spec["EndpointSpec"]["Mode"] == "dnsrr"
            (ref,) = tmpl["ContainerSpec"]["Secrets"]
            assert ref["SecretName"] == secret.name and ref["File"]["UID"] == str(uid) and ref["File"]["Mode"] == 0o400
            policy = {k: tmpl["RestartPolicy"].get(k) for k in ("Condition", "MaxAttempts")}
            assert policy == ({"Condition": "none", "MaxAttempts": 0} if role == "master" else
                              {"Condition": "on-failure", "MaxAttempts": 3}), "the budget is --restart-budget (3)"
            c = _running_container(swarm, name)
            env_vars = dict(e.split("=", 1) for e in c["Config"]["Env"])
            assert env_vars["LAUNCHER_SECRET_FILE"] == "/run/secrets/launcher-secret"
            assert "LAUNCHER_SECRET" not in env_vars
            assert c["Config"]["Labels"][dc.RUN_LABEL] == run_id and c["Config"]["User"] == f"{uid}:{uid}"
            assert c["Config"]["Labels"][dc.GROUP_LABEL] == ("" if role == "master" else name.rsplit("-", 1)[1])
            assert c["HostConfig"]["ReadonlyRootfs"] and c["HostConfig"]["CapDrop"] == ["ALL"]
        master = _service(swarm, names[0])["Spec"]["TaskTemplate"]
        assert master["Placement"]["Constraints"] == [f"node.id=={swarm.local_node()}"]
        assert [(m["Type"], m["Target"]) for m in master["ContainerSpec"]["Mounts"]] == [
            ("bind", "/results"), ("tmpfs", "/tmp")]

        st = json.loads(run_launcher("status", run_id, "--json", "--results", str(root), timeout=30).stdout)
        assert st["backend"] == "swarm" and st["live"]
        assert sorted(p["name"] for p in st["parts"]) == sorted(["master"] + [f"group-{g['index']}"
                                                                              for g in plan["groups"]])
        logs = run_launcher("logs", run_id, "--master", "--results", str(root), timeout=30)
        assert logs.returncode == 0 and "listening on 0.0.0.0:7100" in logs.stdout

        # A worker group's task is killed: the swarm replaces it and the new task rejoins the master.
        victim = _running_container(swarm, group_name(run_id, 0))
        swarm.engine.kill(victim["Id"])
        wait_for(lambda: any(t.state == "running" and t.container_id != victim["Id"]
                             for t in _tasks(swarm, group_name(run_id, 0))), 60, "the swarm to replace group 0")
        wait_for(lambda: (status_of(run).get("groups", {}).get("0", {}).get("connects") or 0) >= 2, 90,
                 "group 0 to rejoin")
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    assert proc.returncode == 0, err[-4000:]
    result = json.loads(out)
    assert result["state"] == "finished" and result["summary"]["target_reached"]
    assert result["restarts"].get("0") == 1 and result["lost_groups"] == []
    assert _ours(swarm, root) == [], "the attached up removes its services, network and secret"
    for name in ("summary.json", "model/final_model.keras", "model/policy.npz", "checkpoints/checkpoint",
                 "learning_curve.png", "logs/master.log", "logs/group-0.log"):
        assert (run / name).is_file() and (run / name).stat().st_size > 0, f"missing {name}"
    written = [p for p in run.rglob("*") if p.name not in ("run.json", "config.json", "plan.json", "spec.json",
                                                             "result.json")]
    assert all(p.stat().st_uid == uid for p in written), [str(p) for p in written if p.stat().st_uid != uid]
    assert (run / "logs" / "master.log").read_text().count("group 0 joined") >= 2
    assert "2 task(s), 1 restart(s)" in (run / "logs" / "group-0.log").read_text()
    record = read_json(run / "run.json")
    assert record["backend"] == "swarm" and record["results_mount"] == "bind"


@pytest.mark.docker
@pytest.mark.slow
def test_a_killed_master_task_is_replaced_in_place_and_the_run_finishes(launcher_image: str, swarm: SwarmEngine,
                                                                        swarm_runs_under: Path) -> None:
    """Issue 27 on a swarm: the master task's container SIGKILLed on its node's engine (as the OOM killer would)
    is replaced by a new task of the same service, which restores the newest checkpoint; the groups' tasks
    (same containers, same start times) reconnect to it by the service's name, and the run finishes."""
    root = swarm_runs_under
    env, _ = as_invoker()
    proc = subprocess.Popen(
        launcher_cmd("up", "--backend", "swarm", "--image", launcher_image, "--workers", "2", "--groups", "2",
                     "--env", "CartPole-v1", "--max-steps", "40000", "--checkpoint-every", "5",
                     "--results", str(root), "--json"),
        cwd=ROOT, env=child_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run = wait_for(lambda: next(iter(run_dirs(root)), None), 30, "the run directory")
        run_id = run.name
        wait_for(lambda: ((status_of(run).get("checkpoint") or {}).get("updates") or 0) >= 5, 150, "a checkpoint")
        groups = {g: _running_container(swarm, group_name(run_id, g)) for g in (0, 1)}
        dead = _running_container(swarm, master_name(run_id))
        swarm.engine.kill(dead["Id"])
        t_kill = time.monotonic()
        (failed,) = wait_for(lambda: [t for t in _tasks(swarm, master_name(run_id))
                                      if t.container_id == dead["Id"] and t.state == "failed"] or None, 30,
                             "the dead master's task to fail")
        assert failed.exit_code == 128 + signal.SIGKILL, "death_signal reads 128+N as signal N"

        def recovered() -> bool:
            st = status_of(run)
            return len(st.get("recoveries") or []) == 1 and all(
                g.get("connected") for g in (st.get("groups") or {}).values())

        wait_for(lambda: recovered() or proc.poll() is not None, 120, "a new master task and both groups back")
        print(f"\n[recovery swarm] new master task up and both groups back {time.monotonic() - t_kill:.1f} s "
              "after the kill")
        new = _running_container(swarm, master_name(run_id))
        assert new["Id"] != dead["Id"] and new["Name"] != dead["Name"]
        for g, before in groups.items():
            now = swarm.engine.inspect_raw(before["Id"])
            assert now["State"]["StartedAt"] == before["State"]["StartedAt"], f"group {g} was restarted"
            assert [t.container_id for t in _tasks(swarm, group_name(run_id, g))] == [before["Id"]]
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    assert proc.returncode == 0, err[-4000:]
    assert "the master died (killed by SIGKILL" in err and "the new master is up" in err
    print("[recovery swarm]", next(line for line in err.splitlines() if "the new master is up" in line))
    result = json.loads(out)
    assert result["state"] == "finished" and result["summary"]["outcome"] == "max_steps"  # trained on to the end
    assert result["summary"]["env_steps"] >= 40000
    (rec,) = result["summary"]["recoveries"]
    assert rec["checkpoint"] and rec["restored_updates"] >= 5 and rec["steps_lost"] >= 0, rec
    assert not any(result["restarts"].values()) and result["lost_groups"] == []
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(e.get("event") == "master_recovered" for e in events) == 1
    assert read_json(run / "run.json")["master_recoveries"][0]["signal"] == "SIGKILL"
    assert _ours(swarm, root) == [], "the attached up removes its services, network and secret"


@pytest.mark.docker
def test_detached_run_with_results_in_a_volume_then_down(launcher_image: str, swarm: SwarmEngine,
                                                         swarm_runs_under: Path) -> None:
    """--swarm-master any: the master's results go to a named volume; `down` stops the master first, keeps
    every service's output, copies the volume into the results directory and removes everything."""
    root = swarm_runs_under
    env, uid = as_invoker()
    common = ("--results", str(root))
    up = run_launcher("up", "--backend", "swarm", "--swarm-master", "any", "--detach", "--image", launcher_image,
                      "--workers", "4", "--groups", "2", "--max-steps", "5000000", *common, timeout=150, **env)
    assert up.returncode == 0, up.stderr[-3000:]
    run = only_run(root)
    assert f"launcher down {run.name}" in up.stdout
    master = _service(swarm, master_name(run.name))["Spec"]["TaskTemplate"]
    (vol,) = master["ContainerSpec"]["Mounts"]
    assert (vol["Type"], vol["Source"], vol["Target"]) == ("volume", specs.volume_name(run.name), "/tmp")
    assert "Constraints" not in master.get("Placement", {})

    def master_log() -> str:
        return run_launcher("logs", run.name, "--master", *common, timeout=30).stdout

    # Joined, and the learner is built: a master stopped while it still imports TensorFlow (the groups play from
    # before that) may not finish its summary within the swarm's stop grace.
    wait_for(lambda: "group 1 joined" in (text := master_log()) and "learner ready" in text, 120,
             "the groups to join and the learner to be ready", interval=2)
    st = json.loads(run_launcher("status", run.name, "--json", *common, timeout=30).stdout)
    assert st["state"] == "running" and st["live"] and all(p["state"] == "running" for p in st["parts"])
    assert not (run / "summary.json").exists(), "results are in the volume while the run lives"

    follow = subprocess.Popen(launcher_cmd("logs", run.name, "--follow", *common), cwd=ROOT, env=child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    down = run_launcher("down", run.name, *common, timeout=120)
    try:
        followed, _ = follow.communicate(timeout=30)
    finally:
        follow.kill()
    assert follow.returncode == 0 and "listening on" in followed and "received SIGTERM" in followed, \
        "logs --follow prints the master's output to its end, then returns"
    assert down.returncode == 0, down.stderr
    assert "removed 3 service(s), 1 network(s), 1 secret(s)" in down.stdout, down.stdout
    assert _ours(swarm, root) == []
    summary = read_json(run / "summary.json")
    assert summary["outcome"] == "interrupted", "the master was stopped first and checkpointed"
    assert (run / "checkpoints" / "checkpoint").is_file() and (run / "summary.json").stat().st_uid == uid
    assert "listening on" in (run / "logs" / "master.log").read_text(), "down keeps the services' output"
    again = run_launcher("down", run.name, *common, timeout=60)
    assert again.returncode == 0 and "nothing was running" in again.stdout
    st = json.loads(run_launcher("status", run.name, "--json", *common, timeout=30).stdout)
    assert st["state"] == "interrupted" and st["parts"] == []


@pytest.mark.docker
def test_a_new_master_task_with_results_in_a_volume_is_pinned_to_its_node(launcher_image: str, swarm: SwarmEngine,
                                                                          swarm_runs_under: Path) -> None:
    """With ``--swarm-master any`` the checkpoints are in a volume on the dead task's node: the new task is pinned
    there by the same update that starts it (the real engine call), with the same volume."""
    backend = sw.SwarmBackend(launcher_image, engine=swarm.engine, master_placement="any")
    run = prepared(swarm_runs_under, workers=2)
    try:
        backend.start(run)
        dead = _running_container(swarm, master_name(run.run_id))
        swarm.engine.kill(dead["Id"])
        st = wait_for(lambda: (lambda s: s if s.master.state == PartState.FAILED else None)(backend.poll()), 30,
                      "the master's task to fail")
        assert st.master.exit_code == 128 + signal.SIGKILL
        backend.restart_master()
        assert backend.poll().master.state in (PartState.STARTING, PartState.RUNNING)
        new = _running_container(swarm, master_name(run.run_id))
        assert new["Id"] != dead["Id"]
        spec = _service(swarm, master_name(run.run_id))["Spec"]["TaskTemplate"]
        assert spec["Placement"]["Constraints"] == [f"node.id=={swarm.local_node()}"]
        assert [(m["Type"], m["Source"]) for m in spec["ContainerSpec"]["Mounts"]] == [
            ("volume", specs.volume_name(run.run_id))]
        assert wait_for(lambda: backend.poll().master.state == PartState.RUNNING or None, 30, "the new task")
        assert backend.poll().master.restarts == 1
    finally:
        backend.stop(grace_s=1)


@pytest.mark.docker
def test_a_missing_image_fails_early_here_and_on_other_nodes(launcher_image: str, swarm: SwarmEngine,
                                                             swarm_runs_under: Path, monkeypatch: Any) -> None:
    root = swarm_runs_under
    missing = "launcher-not-built:0"
    up = run_launcher("up", "--backend", "swarm", "--image", missing, "--workers", "2", "--max-steps", "1000",
                      "--results", str(root), timeout=60)
    assert up.returncode == 6, up.stderr  # MissingDependency
    assert f"image {missing} is not on this engine" in up.stderr and "launcher build" in up.stderr
    assert _ours(swarm, root) == [], "nothing is created when the check fails"

    # As a node without the image would: skip the local check and let the swarm reject the task.
    monkeypatch.setattr(SwarmEngine, "image_here", lambda self, image: True)
    backend = sw.SwarmBackend(missing, engine=swarm.engine)
    with pytest.raises(MissingDependency, match="No such image") as err:
        backend.start(prepared(root, workers=2))
    assert "launcher build --push" in (err.value.hint or "")
    backend.stop(grace_s=1)
    backend.stop(grace_s=1)  # idempotent


@pytest.mark.docker
def test_gpu_services_need_nodes_that_advertise_gpus(launcher_image: str, swarm: SwarmEngine, swarm_runs_under: Path,
                                                     monkeypatch: Any) -> None:
    run = prepared(swarm_runs_under, gpus=2, workers=8)
    with pytest.raises(NoResources, match="advertise 0"):
        sw.SwarmBackend(launcher_image, engine=swarm.engine).start(run)
    assert _ours(swarm, swarm_runs_under) == [], "nothing is created when the check fails"

    # Past the count check, the engine itself keeps the tasks pending: no node has NVIDIA-GPU resources.
    monkeypatch.setattr(sw, "gpu_shortfall", lambda needs, nodes: None)
    monkeypatch.setattr(specs, "PENDING_LIMIT_S", 2.0)
    backend = sw.SwarmBackend(launcher_image, engine=swarm.engine)
    try:
        backend.create(run)
        for g in run.plan.groups:
            res = _service(swarm, group_name(run.run_id, g.index))["Spec"]["TaskTemplate"]["Resources"]
            assert res["Reservations"]["GenericResources"] == [
                {"DiscreteResourceSpec": {"Kind": GPU_RESOURCE, "Value": len(g.share.gpu_uuids)}}]
        with pytest.raises(NoResources, match="insufficient resources"):
            backend.wait_started()
    finally:
        backend.stop(grace_s=1)


@pytest.mark.docker
def test_swarm_teardown_leaves_a_docker_run_alone(swarm: SwarmEngine, swarm_runs_under: Path) -> None:
    """On an engine that is a swarm manager, `down` of a Docker run may reach the swarm teardown first: with no
    service of that run it must return at once and leave the run's bridge network to the Docker teardown."""
    rid = "test-docker-run"
    labels = {dc.RUN_LABEL: rid, dc.ROLE_LABEL: "network", dc.RESULTS_LABEL: str(swarm_runs_under / rid)}
    nid = swarm.engine.create_network(network_name(rid), labels)
    try:
        t0 = time.monotonic()
        down = swarm_run.teardown(swarm.engine, rid, grace_s=1)
        assert (down.services, down.networks, down.secrets) == ([], 0, 0) and time.monotonic() - t0 < 5
        assert swarm.engine.networks({dc.RUN_LABEL: rid}), "a bridge network is not the swarm's to remove"
    finally:
        swarm.engine.remove_network(nid)


@pytest.mark.docker
def test_a_results_volume_the_master_never_wrote_is_copied_as_nothing(launcher_image: str, swarm: SwarmEngine,
                                                                      swarm_runs_under: Path, docker_client: Any) -> None:
    """A master killed before its first file leaves a volume with no ``results/``: the copy succeeds with nothing
    to copy, so the volume is removed instead of left behind "with the results" (the CI run of 8d5477f left
    one); once ``results/`` exists, its files are copied."""
    rid = f"test-{os.urandom(3).hex()}"
    dest = swarm_runs_under / rid
    dest.mkdir()
    dest.chmod(0o777)
    vol = docker_client.volumes.create(specs.volume_name(rid), labels={
        dc.RUN_LABEL: rid, dc.RESULTS_LABEL: str(dest.resolve())})
    try:
        assert swarm.copy_volume(vol.name, dest, launcher_image, "10001:10001", rid)
        assert list(dest.iterdir()) == []
        write = "import os; os.makedirs('/v/results'); open('/v/results/summary.json', 'w').write('{}')"
        assert swarm.engine.run_once(launcher_image, ["python", "-c", write], user="0:0",
                                     labels={dc.RUN_LABEL: rid}, mounts=[("volume", vol.name, "/v", False)])
        assert swarm.copy_volume(vol.name, dest, launcher_image, "10001:10001", rid)
        assert (dest / "summary.json").read_text() == "{}"
    finally:
        vol.remove(force=True)
