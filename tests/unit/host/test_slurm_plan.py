"""The Slurm backend's pure parts, without daemons: Slurm's output as typed data (recorded on the Slurm test bed,
tests/data/slurm), the plan from Slurm's view, the job's and steps' command lines, where a lost group starts
again, and the step prologue run by a real /bin/sh."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launcher.backends.base import PartState
from launcher.backends.slurm_parts import master_port_written, step_gpus_printed, step_number, step_part
from launcher.backends.slurm_specs import (SlurmRequest, job_part, node_lost_at, parse_gpus, part_of_step, plan_slurm,
                                           restart_node, sbatch_args, slot_nodes, srun_args, step_env, step_name,
                                           task_command, time_limit)
from launcher.config.checks import check_slurm_args
from launcher.errors import BadInput, MissingDependency, NoResources
from launcher.slurm import commands
from launcher.slurm.model import (ClusterView, JobInfo, NodeInfo, PartitionInfo, StepInfo, expand_hostlist, gres_gpus,
                                  index_list, node_details, parse_record, parse_records)
from worker.contract import RunSpec

DATA = Path(__file__).resolve().parents[2] / "data" / "slurm"


def _text(name: str) -> str:
    return (DATA / name).read_text()


def _view(nodes: int = 3, gpus: int = 2, cpus: int = 4, states: dict[str, str] | None = None) -> ClusterView:
    names = tuple(f"node{i + 1}" for i in range(nodes))
    return ClusterView((PartitionInfo("gpu", True, names, True),),
                       tuple(NodeInfo(n, f"10.0.0.{i}", (states or {}).get(n, "idle"), (), cpus, gpus, ("gpu",))
                             for i, n in enumerate(names)))


# ---------------------------------------------------------------------------------------------- parsing
def test_records_from_the_test_bed_parse_into_the_cluster_a_job_and_its_steps() -> None:
    view = ClusterView.parse(_text("partitions.txt"), _text("nodes.txt"))
    assert view.partition(None).name == "gpu" and view.partition(None).nodes == ("node1", "node2", "node3")
    n1 = view.node("node1")
    assert n1 is not None and (n1.addr, n1.state, n1.cpus, n1.gpus, n1.usable) == ("10.215.9.11", "mixed", 4, 2, True)
    running = JobInfo.from_record(parse_records(_text("job_running.txt"))[0])
    assert (running.job_id, running.state, running.nodes, running.gpus_per_node, running.running) == \
        ("1", "RUNNING", ("node1", "node2", "node3"), 2, True)
    pending = JobInfo.from_record(parse_records(_text("job_pending.txt"))[0])
    assert (pending.pending, pending.reason, pending.word, pending.nodes) == (True, "Resources", "PENDING (Resources)", ())
    steps = [StepInfo.from_record(r) for r in parse_records(_text("steps.txt"))]
    assert [(s.step_id, s.name, s.nodes) for s in steps] == [
        ("1.batch", "batch", ("node1",)), ("1.0", "launcher-x-master", ("node1",)),
        ("1.1", "launcher-x-group-0", ("node2",))]
    assert node_details(_text("job_running_d.txt")) == {"node1": (0, 1), "node2": (0, 1), "node3": (0, 1)}
    assert parse_records(_text("nojob.txt")) == []


def test_a_value_with_spaces_stays_whole_and_a_down_node_is_lost() -> None:
    rec = parse_record("NodeName=node3 State=DOWN+NOT_RESPONDING CPUTot=4 Gres=gpu:2 "
                       "Reason=Not responding [slurm@2026-11-25T16:29:33] Partitions=gpu")
    node = NodeInfo.from_record(rec)
    assert rec["Reason"] == "Not responding [slurm@2026-11-25T16:29:33]"
    assert (node.state, node.down, node.lost, node.usable, node.word) == ("down", True, True, False, "down*")
    assert node_lost_at(node, "now") == "2026-11-25T16:29:33"
    responding = NodeInfo.from_record(parse_record("NodeName=n State=MIXED+NOT_RESPONDING CPUTot=4"))
    assert (responding.down, responding.lost, responding.word) == (False, True, "mixed*")
    assert node_lost_at(NodeInfo("n", "n", "down"), "now") == "now"


@pytest.mark.parametrize("expr, names", [
    ("node[1-3,7]", ("node1", "node2", "node3", "node7")),
    ("gpu[08-10],login", ("gpu08", "gpu09", "gpu10", "login")),
    ("rack[1-2]-n[1-2]", ("rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2")),
    ("(null)", ()), ("", ()), ("single", ("single",)),
])
def test_host_lists_expand_as_slurm_writes_them(expr: str, names: tuple[str, ...]) -> None:
    assert expand_hostlist(expr) == names


@pytest.mark.parametrize("expr", ["node[1-3", "node1-3]", "node[a-b]"])
def test_a_broken_host_list_is_refused(expr: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(expr)


def test_gpus_are_counted_in_every_gres_form() -> None:
    assert [gres_gpus(g) for g in ("gpu:2", "gpu:a100:4(S:0-1)", "gpu:2,shard:8", "gres:gpu:3", "gres/gpu=6",
                                    "(null)", "shard:4", "gpu")] == [2, 4, 2, 3, 6, 0, 0, 1]
    assert index_list("0-1,3") == (0, 1, 3) and index_list("(null)") == ()


# -------------------------------------------------------------------------------------------------- plan
def test_the_plan_spreads_groups_over_nodes_and_asks_each_node_for_the_most_a_slot_needs() -> None:
    plan = plan_slurm(_view(), SlurmRequest(workers=8))
    assert [(s.name, s.slot, s.gpus, s.cpus, s.workers) for s in plan.steps] == [
        ("master", 0, 1, 2, 0), ("group-0", 1, 1, 1, 3), ("group-1", 2, 1, 1, 3), ("group-2", 0, 1, 1, 2)]
    assert (plan.nodes, plan.node_cpus, plan.node_gpus, plan.kind, plan.partition) == (3, 3, 2, "gpu", "gpu")
    assert plan.total_workers == 8 and plan.gpu_uuids == ()  # Slurm picks the GPUs: no UUIDs, no leases
    assert "node 1: master, group-2; node 2: group-0; node 3: group-1" in plan.reasons[0]
    d = plan.to_dict()
    assert d["node_gpus"] == 2 and d["steps"][0]["name"] == "master"


def test_no_gpus_and_forced_shapes() -> None:
    cpu = plan_slurm(_view(), SlurmRequest(workers=4, gpus=False, groups=2, nodes=2))
    assert (cpu.kind, cpu.node_gpus, [s.slot for s in cpu.steps]) == ("cpu", 0, [0, 1, 0])
    one = plan_slurm(_view(gpus=0), SlurmRequest(workers=2, groups=1))
    assert (one.kind, one.nodes, [s.slot for s in one.steps]) == ("cpu", 1, [0, 0])


def test_what_the_partition_can_never_hold_is_refused_with_what_it_has() -> None:
    with pytest.raises(NoResources, match="needs 3 node.s. with 4 CPUs and 3 GPU.s. each.*has 0 such"):
        plan_slurm(_view(), SlurmRequest(workers=8, groups=6))  # 2 groups beside the master on node 1
    with pytest.raises(NoResources, match="--slurm-nodes 4: partition gpu has 3"):
        plan_slurm(_view(), SlurmRequest(workers=8, nodes=4))
    with pytest.raises(NoResources, match="no node that can run jobs.*node1 down"):
        plan_slurm(_view(states={f"node{i}": "down" for i in (1, 2, 3)}), SlurmRequest(workers=2))
    with pytest.raises(BadInput, match="no such partition.*partitions: gpu"):
        plan_slurm(_view(), SlurmRequest(workers=2, partition="nope"))


def test_a_busy_or_down_node_shrinks_the_automatic_shape_not_the_partition() -> None:
    plan = plan_slurm(_view(states={"node3": "down"}), SlurmRequest(workers=8))
    assert (plan.nodes, len(plan.groups)) == (2, 2) and "2 usable node(s) of 3" in plan.reasons[0]


def test_inside_an_allocation_the_plan_uses_its_nodes() -> None:
    plan = plan_slurm(_view(), SlurmRequest(workers=4, allocation=("node2", "node3")))
    assert plan.nodes == 2 and plan.partition == ""


def test_gpus_on_slurm_are_auto_or_none() -> None:
    assert (parse_gpus("auto"), parse_gpus("none")) == (None, False)
    with pytest.raises(BadInput, match="names GPUs of this host"):
        parse_gpus("0,2")


# ------------------------------------------------------------------------------------------ command lines
def test_the_job_holds_the_nodes_with_no_kill_and_the_timeout_as_its_time_limit() -> None:
    plan = plan_slurm(_view(), SlurmRequest(workers=8))
    args = sbatch_args(plan, "run-1", log_path="/r/logs/job.log", timeout_s=600, extra=("--account=lab",))
    joined = " ".join(args)
    for want in ("--job-name launcher-run-1", "--nodes 3", "--ntasks-per-node 1", "--cpus-per-task 3", "--no-kill",
                 "--gres gpu:2", "--time 11", "--partition gpu", "--output /r/logs/job.log", "--account=lab"):
        assert want in joined, want
    assert args[-2] == "--wrap" and args.index("--account=lab") < args.index("--wrap")
    assert time_limit(None) is None and time_limit(1) == "2"
    cpu = plan_slurm(_view(), SlurmRequest(workers=2, gpus=False))
    assert "--gres" not in sbatch_args(cpu, "r", log_path="x", timeout_s=None)


def test_sbatch_options_the_plan_sets_cannot_be_given_again() -> None:
    assert check_slurm_args(["--account=lab", "--qos=normal", "-A", "lab"]) == [
        "--slurm-arg 'lab': not an sbatch option (e.g. --account=lab, --qos=normal)"]
    problems = check_slurm_args(["--nodes=4", "--gres=gpu:8", "--time=5"])
    assert len(problems) == 3 and all("sets" in p for p in problems)


def test_a_step_without_gpus_asks_for_none_and_sees_none() -> None:
    plan = plan_slurm(_view(), SlurmRequest(workers=4, gpus=False))
    step = plan.step("group-0")
    args = srun_args("12", step, "node2", run_id="r")
    assert args[:2] == ["srun", "--jobid=12"] and "--gres=none" in args and "--nodelist=node2" in args
    assert "--exact" in args and f"--job-name={step_name('r', 'group-0')}" in args and "--export=ALL" in args
    spec = RunSpec(run_id="r", env_id="CartPole-v1", algo="ppo")
    env = step_env({"PATH": "/bin", "LAUNCHER_SECRET": "leak", "LAUNCHER_RESULTS": "x"}, step, spec)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert env["LAUNCHER_SECRET_FILE"] == "/dev/stdin" and json.loads(env["LAUNCHER_SPEC"])["run_id"] == "r"
    assert "LAUNCHER_SECRET" not in env and "LAUNCHER_RESULTS" not in env and "LAUNCHER_MASTER_ADDR" not in env
    gpu = plan_slurm(_view(), SlurmRequest(workers=4)).step("group-0")
    assert "--gres=gpu:1" in srun_args("12", gpu, None, run_id="r")
    assert "CUDA_VISIBLE_DEVICES" not in step_env({}, gpu, spec)  # Slurm sets it from the step's GRES
    assert part_of_step("r", "launcher-r-group-0") == "group-0" and part_of_step("r", "batch") is None


def test_the_docker_runtime_runs_the_image_as_a_user_with_the_run_labels() -> None:
    plan = plan_slurm(_view(), SlurmRequest(workers=4))
    argv = task_command(plan.step("master"), run_id="r1", runtime="docker", python="/venv/bin/python",
                        results_dir="/shared/results/r1", image="launcher:0.1.0-cpu", unprivileged=(10001, 10001))
    script = argv[2]
    for want in ("docker run --rm -i", "--network host", '--user "$uid:$gid"', "--read-only", "--cap-drop ALL",
                 "no-new-privileges", "--label launcher.run=r1", "--label launcher.role=master",
                 "-v /shared/results/r1:/shared/results/r1", "launcher:0.1.0-cpu master", "uid=10001",
                 'device=${SLURM_STEP_GPUS}'):
        assert want in script, want
    assert "@" not in script.replace("$@", "").replace("@2", "")  # every placeholder was filled
    with pytest.raises(BadInput, match="--slurm-runtime"):
        task_command(plan.step("master"), run_id="r", runtime="podman", python="p", results_dir="/r", image="i",
                     unprivileged=(1, 1))


def test_the_group_prologue_waits_for_the_masters_address_in_a_real_shell(tmp_path: Path) -> None:
    plan = plan_slurm(_view(), SlurmRequest(workers=2, gpus=False))
    argv = task_command(plan.step("group-0"), run_id="r", runtime="process", python=sys.executable,
                        results_dir=str(tmp_path), image="i", unprivileged=(1, 1))
    assert argv[:2] == ["/bin/sh", "-c"] and argv[4] == str(tmp_path / "master.addr")
    assert argv[5:] == [sys.executable, "-m", "worker", "group", "--index", "0"]
    probe = [*argv[:5], "/bin/sh", "-c", 'echo "dial $LAUNCHER_MASTER_ADDR"']
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2", "SLURM_STEP_GPUS": "1"}
    proc = subprocess.Popen(probe, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    threading.Timer(0.6, lambda: (tmp_path / "master.addr").write_text("10.0.0.1:4321\n")).start()
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.strip() == "dial 10.0.0.1:4321" and time.monotonic() - t0 >= 0.5
    assert "launcher: step 7.2 on" in err and "SLURM_STEP_GPUS=1" in err and "runtime process" in err
    master = task_command(plan.step("master"), run_id="r", runtime="process", python=sys.executable,
                          results_dir=str(tmp_path), image="i", unprivileged=(1, 1))
    assert master[4] == "" and master[-1] == "master"  # the master waits for nothing


# ---------------------------------------------------------------------------------------- restarts, parts
def test_a_lost_group_starts_again_where_the_job_has_room() -> None:
    plan = plan_slurm(_view(), SlurmRequest(workers=8))  # 2 GPUs a node: master+group-2 | group-0 | group-1
    nodes = slot_nodes(plan, ("node1", "node2", "node3"))
    running = {k: v for k, v in nodes.items() if k != "group-1"}
    step = plan.step("group-1")
    assert restart_node(step, plan, ("node1", "node2"), {"node3"}, running, "node3") == "node2"
    assert restart_node(step, plan, ("node1", "node2", "node3"), set(), running, "node3") == "node3"  # a crash
    four = plan_slurm(_view(), SlurmRequest(workers=8, groups=4))  # master+group-2 | group-0+group-3 | group-1
    assert four.node_gpus == 2
    others = {k: v for k, v in slot_nodes(four, ("node1", "node2", "node3")).items() if k != "group-1"}
    assert restart_node(four.step("group-1"), four, ("node1", "node2"), {"node3"}, others, "node3") is None
    with pytest.raises(NoResources, match="holds 2 node"):
        slot_nodes(plan, ("node1", "node2"))


def test_a_queued_job_is_a_starting_part_with_slurms_reason() -> None:
    pending = JobInfo.from_record(parse_records(_text("job_pending.txt"))[0])
    part = job_part(pending)
    assert (part.name, part.state, part.word, part.reason, part.ident) == \
        ("job", PartState.STARTING, "PENDING (Resources)", "Resources", "2")
    assert part.to_dict()["reason"] == "Resources"
    done = job_part(JobInfo("3", "x", "CANCELLED", ""))
    assert done.state == PartState.EXITED and job_part(JobInfo("3", "x", "NODE_FAIL", "")).state == PartState.FAILED


# ------------------------------------------------------------------------------------------ the commands
def test_a_step_reads_back_as_its_number_its_gpus_and_a_part() -> None:
    """What the backend reads of a running step, turned into status by pure functions (slurm_parts)."""
    assert [step_number(s) for s in ("12.3", "12.10", "12.batch", "")] == [3, 10, -1, -1]
    head = "launcher: step 12.3 on node2: SLURM_STEP_GPUS=0,1 CUDA_VISIBLE_DEVICES=0,1\n"
    assert step_gpus_printed(head) == "0,1"
    assert step_gpus_printed(head.replace("=0,1 CUDA", "=none CUDA")) == ""
    assert step_gpus_printed("srun: job 12 queued\n") is None
    common = {"restarts": 1, "ident": "12.3", "node": "node2", "gpus": "0"}
    lost = step_part("group-0", started=True, code=None, lost="node node2 lost at T", lost_now=True, **common)
    assert (lost.state, lost.status, lost.lost, lost.gpus) == (PartState.FAILED, "lost", "node node2 lost at T", "")
    assert step_part("group-0", started=False, code=None, lost="", lost_now=False, **common).state \
        is PartState.STARTING
    running = step_part("group-0", started=True, code=None, lost="", lost_now=False, **common)
    assert (running.state, running.status, running.gpus) == (PartState.RUNNING, "running", "0")
    ended = step_part("master", started=True, code=0, lost="", lost_now=True, **common)
    assert (ended.state, ended.status, ended.exit_code) == (PartState.EXITED, "exited 0", 0)
    assert step_part("group-1", started=True, code=3, lost="", lost_now=False, **common).state is PartState.FAILED


def test_a_new_master_takes_the_port_the_dead_one_wrote_and_nothing_else() -> None:
    """master.addr is the run's file (untrusted): one line HOST:PORT on the address the master was told to bind."""
    assert master_port_written(b"10.216.0.11:41234\n", "10.216.0.11") == 41234
    assert master_port_written(b"10.216.0.11:41234", "10.216.0.11") == 41234
    for bad in (b"", b"\n", b"10.216.0.12:41234\n", b"10.216.0.11:0\n", b"10.216.0.11:70000\n", b"10.216.0.11:\n",
                b"10.216.0.11:41234\n10.216.0.11:41235\n", b"unix:/tmp/x.sock\n", b"10.216.0.11:41234 \n",
                b"10.216.0.11:4\xff\n", b"x" * 600):
        with pytest.raises(ValueError):
            master_port_written(bad, "10.216.0.11")


def test_missing_clients_and_configuration_are_exit_6_with_what_to_do(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.environ.get("PATH", "")
    monkeypatch.setenv("PATH", str(tmp_path))  # a host without Slurm's clients
    with pytest.raises(MissingDependency, match="needs Slurm's `sbatch`, which is not on PATH") as err:
        commands.require("sbatch")
    assert "slurm-client" in (err.value.hint or "") and int(err.value.exit_code) == 6
    monkeypatch.setenv("PATH", path)
    monkeypatch.setenv("LAUNCHER_SLURM_TIMEOUT", "soon")
    with pytest.raises(BadInput, match="LAUNCHER_SLURM_TIMEOUT='soon'"):
        commands.timeout_s()
    if shutil.which("scontrol") is None:
        pytest.skip("no scontrol here (slurm-client) for the SLURM_CONF check")
    monkeypatch.delenv("LAUNCHER_SLURM_TIMEOUT")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing.conf"))
    t0 = time.monotonic()
    with pytest.raises(MissingDependency, match="SLURM_CONF=.*missing.conf names no file"):
        commands.cluster()  # at once: scontrol itself would retry for 60 s
    assert time.monotonic() - t0 < 2
    assert commands.in_allocation({"SLURM_JOB_ID": "42"}) == "42" and commands.in_allocation({}) is None
