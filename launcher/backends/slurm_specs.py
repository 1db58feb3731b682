"""What a Slurm run is made of, as pure functions over typed data: the plan from Slurm's view of the cluster
(:func:`plan_slurm`), the job's ``sbatch`` arguments (:func:`sbatch_args`), each step's ``srun`` arguments,
task command and environment (:func:`srun_args`, :func:`task_command`, :func:`step_env`), where a lost group
starts again (:func:`restart_node`) and how a job and its steps read as parts (:func:`job_part`).
:mod:`launcher.backends.slurm` does the calls.

The layout: one job of N nodes, each node asked for the same CPUs and GPUs (``--nodes N --ntasks-per-node 1
--cpus-per-task C --gres gpu:G``), ``--no-kill`` so a lost node shrinks the job instead of ending it. Its
nodes are *slots* 0..N-1 in the order slurmctld lists them: the master runs on slot 0, group i on slot
(1 + i) mod N, so with two or more nodes the first groups land off the master's node. Every process gets
whole GPUs (Slurm does not share a GRES between steps): the master and each group one GPU when the
partition's nodes have GPUs (``--gpus auto``), none with ``--gpus none``. A node is asked for the most any
slot needs, so the other slots keep room in which a lost group starts again.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from launcher.backends.base import Part, PartState, PreparedRun
from launcher.backends.containers import UNPRIVILEGED_UID_GID, Kind, worker_env
from launcher.backends.envcheck import inherited_env
from launcher.backends.specs import HOST_ENV, LaunchSpecs, PartSpec
from launcher.backends.slurm_options import SLURM_RUNTIMES
from launcher.errors import BadInput, NoResources
from launcher.gpu.placement import GroupPlan, Plan, ProcessShare, split_evenly
from launcher.slurm.model import ClusterView, JobInfo, NodeInfo
from worker.contract import MASTER_ADDR_FILE, SECRET_FILE_ENV, SPEC_ENV, RunSpec

if TYPE_CHECKING:
    from launcher.config import RunConfig

MASTER_CPUS = 2  # the learner: TensorFlow's threads
GROUP_CPUS = 1  # a group: one vector env and a numpy policy on one thread
TIME_GRACE_S = 60.0  # the job's time limit is --timeout plus this: the launcher's own teardown comes first
RUNTIMES = SLURM_RUNTIMES  # --slurm-runtime
MASTER_ADDR_WAIT_S = 600  # a group step waits this long for the master to write its address


def job_name(run_id: str) -> str:
    return f"launcher-{run_id}"


def step_name(run_id: str, part: str) -> str:
    """The name of part ``master``/``group-N``'s step, as ``squeue -s`` shows it."""
    return f"launcher-{run_id}-{part}"


def part_of_step(run_id: str, name: str) -> str | None:
    """The part a step name belongs to (``master``, ``group-N``), None for another step."""
    prefix = f"launcher-{run_id}-"
    return name[len(prefix):] if name.startswith(prefix) else None


# ---------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class StepPlan:
    """One step of the run: which of the job's nodes (slot) and how many CPUs and GPUs."""

    name: str  # master | group-N
    slot: int
    cpus: int
    gpus: int
    workers: int = 0


@dataclass(frozen=True)
class SlurmPlan(Plan):
    """A :class:`~launcher.gpu.placement.Plan` made from Slurm's view: no GPU UUIDs (Slurm picks the GPUs of
    each step), the job's shape and each step's slot instead."""

    partition: str = ""
    nodes: int = 1
    node_cpus: int = 1
    node_gpus: int = 0
    steps: tuple[StepPlan, ...] = ()

    def step(self, name: str) -> StepPlan:
        return next(s for s in self.steps if s.name == name)


@dataclass(frozen=True)
class SlurmRequest:
    """What the user asked, in Slurm's terms (:func:`request_from`)."""

    workers: int
    groups: int | None = None
    max_workers_per_group: int = 16
    gpus: bool | None = None  # None: one per process when the partition has GPUs; False: none
    partition: str | None = None
    nodes: int | None = None
    allocation: tuple[str, ...] | None = None  # running inside this allocation's nodes
    master_cpus: int = MASTER_CPUS
    group_cpus: int = GROUP_CPUS


def parse_gpus(value: str) -> bool | None:
    """``--gpus`` on Slurm: ``auto`` (None) or ``none`` (False).

    Raises:
        BadInput: indices or UUIDs, which name GPUs of this host, not the cluster's.
    """
    v = value.strip().lower()
    if v == "auto":
        return None
    if v == "none":
        return False
    raise BadInput(f"--gpus {value!r} names GPUs of this host; on Slurm the scheduler picks each step's GPUs",
                   hint="use --gpus auto (one GPU per process where the partition has them) or --gpus none")


def request_from(cfg: "RunConfig", *, allocation: tuple[str, ...] | None = None) -> SlurmRequest:
    """What ``plan_slurm`` is asked for, from the run's options; ``allocation``: the nodes of the job this
    launcher runs in (``salloc``, ``sbatch``), or None to submit one."""
    return SlurmRequest(workers=cfg.workers, groups=cfg.groups, max_workers_per_group=cfg.max_workers_per_group,
                        gpus=parse_gpus(cfg.gpus), partition=cfg.slurm_partition, nodes=cfg.slurm_nodes,
                        allocation=allocation)


def allocation_view(view: ClusterView, job: JobInfo) -> ClusterView:
    """The cluster as far as allocation ``job`` reaches: its nodes, each with the CPUs and GPUs the job holds
    there (not the whole node's)."""
    per_node_cpus = job.cpus // max(1, len(job.nodes))
    nodes = tuple(dataclasses.replace(n, cpus=per_node_cpus, gpus=job.gpus_per_node)
                  for n in view.nodes if n.name in job.nodes)
    return ClusterView(view.partitions, nodes)


def plan_slurm(view: ClusterView, req: SlurmRequest) -> SlurmPlan:
    """The plan for ``req`` on the cluster as ``view`` shows it. Pure.

    Raises:
        BadInput: an unknown partition.
        NoResources: the partition can never hold the job (too few nodes, or none with the GPUs/CPUs a node
            must have); a job that only has to wait for busy nodes is not refused: Slurm queues it.
    """
    if req.allocation is not None:
        names = req.allocation
        where = f"this allocation ({len(names)} node(s))"
        partition = req.partition or ""
    else:
        part = view.partition(req.partition)
        names, where, partition = part.nodes, f"partition {part.name}", part.name
    known = [n for n in (view.node(x) for x in names) if n is not None]
    usable = [n for n in known if n.usable]
    if not usable:
        states = ", ".join(f"{n.name} {n.word}" for n in known) or "no nodes"
        raise NoResources(f"{where} has no node that can run jobs ({states})",
                          hint="`sinfo -N -l` shows why; choose another --slurm-partition")
    use_gpus = any(n.gpus for n in usable) if req.gpus is None else req.gpus
    n_groups = req.groups or max(math.ceil(req.workers / req.max_workers_per_group), min(req.workers, len(usable)))
    n_nodes = req.nodes or max(1, min(len(usable), n_groups))
    if n_nodes > len(known):
        raise NoResources(f"--slurm-nodes {n_nodes}: {where} has {len(known)} node(s)",
                          hint="ask for fewer nodes, or choose another --slurm-partition")
    gpu = 1 if use_gpus else 0
    steps = [StepPlan("master", 0, req.master_cpus, gpu)]
    sizes = split_evenly(req.workers, n_groups)
    steps += [StepPlan(f"group-{i}", (1 + i) % n_nodes, req.group_cpus, gpu, n) for i, n in enumerate(sizes)]
    per_slot = [[s for s in steps if s.slot == k] for k in range(n_nodes)]
    node_cpus = max(sum(s.cpus for s in slot) for slot in per_slot)
    node_gpus = max(sum(s.gpus for s in slot) for slot in per_slot)
    fit = [n for n in known if n.cpus >= node_cpus and n.gpus >= node_gpus]
    if len(fit) < n_nodes:
        have = ", ".join(f"{n.name} ({n.cpus} CPUs, {n.gpus} GPUs)" for n in known)
        raise NoResources(f"the job needs {n_nodes} node(s) with {node_cpus} CPUs and {node_gpus} GPU(s) each, but "
                          f"{where} has {len(fit)} such node(s): {have}",
                          hint="use fewer groups per node (--slurm-nodes, --groups), --gpus none, or another "
                               "--slurm-partition")
    shares = {s.name: ProcessShare(cpus=float(s.cpus)) for s in steps}
    groups = tuple(GroupPlan(i, n, shares[f"group-{i}"]) for i, n in enumerate(sizes))
    layout = "; ".join(f"node {k + 1}: {', '.join(s.name for s in slot) or 'spare'}" for k, slot in enumerate(per_slot))
    reasons = (f"Slurm {where}: {len(usable)} usable node(s) of {len(known)}; one job of {n_nodes} node(s), each "
               f"asked for {node_cpus} CPU(s) and {node_gpus} GPU(s); {gpu} GPU per process "
               f"({'--gpus none' if req.gpus is False else 'the nodes have GPUs' if use_gpus else 'no GPUs there'}); "
               f"{req.workers} worker(s) in {n_groups} group(s): {layout}",)
    return SlurmPlan(master=shares["master"], groups=groups, kind="gpu" if use_gpus else "cpu", reasons=reasons,
                     partition=partition, nodes=n_nodes, node_cpus=node_cpus, node_gpus=node_gpus, steps=tuple(steps))


# --------------------------------------------------------------------------------------------- the job
def time_limit(timeout_s: float | None) -> str | None:
    """``--timeout`` as the job's ``--time`` (whole minutes, Slurm's unit), with :data:`TIME_GRACE_S` for the
    launcher's own clean teardown; None: the partition's default."""
    if timeout_s is None:
        return None
    return str(max(1, math.ceil((timeout_s + TIME_GRACE_S) / 60.0)))


HOLD_SCRIPT = ('echo "launcher: job $SLURM_JOB_ID holds $SLURM_JOB_NODELIST for run {run}; its steps are started by '
               'the launcher"; exec sleep infinity')


def sbatch_args(plan: SlurmPlan, run_id: str, *, log_path: str, timeout_s: float | None,
                extra: Sequence[str] = ()) -> list[str]:
    """The arguments of ``sbatch`` for the run's job (after ``--parsable``). Its batch script only holds the
    allocation; the launcher starts the steps with ``srun --jobid``. Pure."""
    args = ["--job-name", job_name(run_id), "--nodes", str(plan.nodes), "--ntasks-per-node", "1",
            "--cpus-per-task", str(plan.node_cpus), "--no-kill", "--output", log_path, "--open-mode", "append"]
    if plan.partition:
        args += ["--partition", plan.partition]
    if plan.node_gpus:
        args += ["--gres", f"gpu:{plan.node_gpus}"]
    limit = time_limit(timeout_s)
    if limit is not None:
        args += ["--time", limit]
    return [*args, *extra, "--wrap", HOLD_SCRIPT.format(run=run_id)]


# -------------------------------------------------------------------------------------------- the steps
def srun_args(job_id: str, step: StepPlan, node: str | None, *, run_id: str) -> list[str]:
    """``srun`` and its options for ``step`` in job ``job_id`` on ``node`` (None: any node of the job with
    room). ``--gres=none`` for a step without GPUs: without it a step gets every GPU the job holds on its
    node. ``--exact``: only the CPUs asked for, so steps share a node. Pure."""
    args = ["srun", f"--jobid={job_id}", "--nodes=1", "--ntasks=1", f"--cpus-per-task={step.cpus}", "--exact",
            f"--gres=gpu:{step.gpus}" if step.gpus else "--gres=none", "--export=ALL",
            f"--job-name={step_name(run_id, step.name)}"]
    if node:
        args.append(f"--nodelist={node}")
    return args


# The prologue of every step, on its node: one line naming the step, its node and the GPUs Slurm gave it; for a
# group, wait for the master's address on the shared file system; then the runtime.
PROLOGUE = r'''
echo "launcher: step ${SLURM_JOB_ID}.${SLURM_STEP_ID} on $(hostname): SLURM_STEP_GPUS=${SLURM_STEP_GPUS:-none} CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}" >&2
addr_file=$1; shift
if [ -n "$addr_file" ]; then
  n=0
  while [ ! -s "$addr_file" ]; do
    n=$((n + 1))
    if [ "$n" -gt {wait_ticks} ]; then echo "launcher: the master wrote no address to $addr_file in {wait_s} s" >&2; exit 3; fi
    sleep 0.25
  done
  LAUNCHER_MASTER_ADDR=$(cat "$addr_file"); export LAUNCHER_MASTER_ADDR
fi
'''
# Where the node has a Docker engine (auto) or always (docker): the run's image, as the step's user, on the
# node's network (the master's address is the node's); the step's GPUs by Slurm's global ids. The container is
# stopped when the step is (a trap: Slurm signals the step's processes, and the container is not one of them).
DOCKER_RUN = r'''
use_docker() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }
if [ "@RUNTIME@" = docker ] || { [ "@RUNTIME@" = auto ] && use_docker; }; then
  uid=$(id -u); gid=$(id -g); [ "$uid" = 0 ] && uid=@UNPRIV_UID@ && gid=@UNPRIV_GID@
  name="launcher-@RUN@-@PART@-${SLURM_JOB_ID}-${SLURM_STEP_ID}"
  gpus=""
  if [ -n "${SLURM_STEP_GPUS:-}" ]; then gpus="--gpus=\"device=${SLURM_STEP_GPUS}\""; fi
  echo "launcher: runtime docker (@IMAGE@) as $uid:$gid, container $name" >&2
  trap 'docker stop -t 8 "$name" >/dev/null 2>&1' TERM INT
  exec 3<&0
  docker run --rm -i --name "$name" --network host --user "$uid:$gid" --read-only --tmpfs /tmp \
    --cap-drop ALL --security-opt no-new-privileges \
    --label launcher.run=@RUN@ --label launcher.role=@ROLE@ --label launcher.group=@GROUP@ \
    --label launcher.results=@RESULTS@ --label "launcher.user=$uid" \
    -e @SPEC_ENV@ -e @SECRET_ENV@=/dev/stdin -e LAUNCHER_MASTER_ADDR -e LAUNCHER_TF_THREADS -e OMP_NUM_THREADS \
    -e OPENBLAS_NUM_THREADS -e PYTHONUNBUFFERED -e TF_CPP_MIN_LOG_LEVEL -e TF_ENABLE_ONEDNN_OPTS -e MPLBACKEND \
    -e CUDA_VISIBLE_DEVICES -e SLURM_JOB_ID -e SLURM_STEP_ID -e SLURM_STEP_GPUS @BINDS@ $gpus @IMAGE@ @ARGS@ <&3 &
  wait $!; code=$?; wait $! 2>/dev/null
  if [ "$code" = 125 ]; then echo "launcher: docker on $(hostname) could not start the container (exit 125): the node needs image @IMAGE@ (docs/scaling-out.md)" >&2; fi
  exit $code
fi
echo "launcher: runtime process ($1)" >&2
exec "$@"
'''


def task_command(step: StepPlan, *, run_id: str, runtime: str, python: str, results_dir: str, image: str,
                 unprivileged: tuple[int, int]) -> list[str]:
    """What the step runs on its node: ``/bin/sh -c SCRIPT`` with the prologue and the runtime (``process``:
    ``python -m worker …`` from the shared venv; ``docker``: the run's image on the node's engine; ``auto``:
    docker where the node's engine answers, else process). Pure."""
    if runtime not in RUNTIMES:
        raise BadInput(f"--slurm-runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")
    group = step.name.partition("-")[2]
    worker_args = ["master"] if step.name == "master" else ["group", "--index", group]
    addr_file = "" if step.name == "master" else f"{results_dir}/{MASTER_ADDR_FILE}"
    ticks = int(MASTER_ADDR_WAIT_S / 0.25)
    script = PROLOGUE.replace("{wait_ticks}", str(ticks)).replace("{wait_s}", str(MASTER_ADDR_WAIT_S))
    if runtime == "process":
        script += 'echo "launcher: runtime process ($1)" >&2\nexec "$@"\n'
    else:
        binds = f"-v {shlex.quote(results_dir)}:{shlex.quote(results_dir)}" if step.name == "master" else ""
        fields = {"RUNTIME": runtime, "RUN": run_id, "PART": step.name, "ROLE": "master" if step.name == "master"
                  else "group", "GROUP": group, "RESULTS": shlex.quote(results_dir), "IMAGE": shlex.quote(image),
                  "SPEC_ENV": SPEC_ENV, "SECRET_ENV": SECRET_FILE_ENV, "BINDS": binds,
                  "ARGS": " ".join(shlex.quote(a) for a in worker_args), "UNPRIV_UID": str(unprivileged[0]),
                  "UNPRIV_GID": str(unprivileged[1])}
        docker = DOCKER_RUN
        for key, value in fields.items():
            docker = docker.replace(f"@{key}@", value)
        script += docker
    return ["/bin/sh", "-c", script, "launcher-step", addr_file, python, "-m", "worker", *worker_args]


def step_env(base: Mapping[str, str], step: StepPlan, spec: RunSpec) -> dict[str, str]:
    """The environment ``srun`` exports to the step's task (``--export=ALL``): ``base`` (the launcher's, without
    its own ``LAUNCHER_*`` settings), the worker's variables, the spec as the step sees it, the secret read
    from stdin (``srun`` forwards its stdin to the task), and no GPU for a step without GPUs. Pure."""
    env = inherited_env(base)
    env.update(worker_env(Kind.SLURM, ProcessShare(cpus=float(step.cpus)),
                          master_addr=None if step.name == "master" else "pending"))
    env.pop("LAUNCHER_MASTER_ADDR", None)  # a group reads it from the master's file (PROLOGUE)
    env.update({SPEC_ENV: spec.to_json(), SECRET_FILE_ENV: "/dev/stdin"})
    if not step.gpus:  # Slurm sets CUDA_VISIBLE_DEVICES only for steps with GPUs
        env.update({"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "void"})
    return env


JOB_PLACEHOLDER = "JOB-ID"  # before the start: stands for the job's id
MASTER_NODE_PLACEHOLDER = "MASTER-NODE"  # before the start: stands for the master's node's address


def step_command(step: StepPlan, *, job_id: str, node: str | None, run_id: str, runtime: str, python: str,
                 results_dir: str, image: str) -> list[str]:
    """The whole argv of ``step``'s ``srun`` (:func:`srun_args` then :func:`task_command`). Pure."""
    return [*srun_args(job_id, step, node, run_id=run_id),
            *task_command(step, run_id=run_id, runtime=runtime, python=python, results_dir=results_dir, image=image,
                          unprivileged=UNPRIVILEGED_UID_GID)]


def step_specs(run: PreparedRun, plan: SlurmPlan, *, job_id: str, nodes: Mapping[str, str], master_addr: str,
               runtime: str, python: str, image: str, master_port: int = 0) -> LaunchSpecs:
    """Each step's ``srun`` argv and the environment the launcher sets over its own (``--export=ALL`` passes
    both; :func:`step_env` over nothing). ``nodes``: part -> node (none: any node of the job with room). The spec
    as the steps see it: the master on its node's address (``master_addr``) and ``master_port`` (0: any free
    one; a master started in place of a dead one takes the dead one's, which the groups dial); the groups read
    the port from ``master.addr``. Pure."""
    spec = dataclasses.replace(run.spec, master_host=master_addr, master_port=master_port, connect_host=master_addr)
    results_dir = str(run.results_dir.resolve())
    parts = tuple(PartSpec(s.name, tuple(step_command(s, job_id=job_id, node=nodes.get(s.name) or None,
                                                      run_id=run.run_id, runtime=runtime, python=python,
                                                      results_dir=results_dir, image=image)),
                           step_env({}, s, spec), inherits=HOST_ENV, cpus=float(s.cpus)) for s in plan.steps)
    note = "Slurm picks each step's GPUs (SLURM_STEP_GPUS, by count)"
    if job_id == JOB_PLACEHOLDER:
        note += (f" and the job's nodes at the start; {JOB_PLACEHOLDER} and {MASTER_NODE_PLACEHOLDER} stand for the "
                 "job's id and the master's node")
    return LaunchSpecs("slurm", parts, note=note)


# ------------------------------------------------------------------------------------------- restarts
def restart_node(step: StepPlan, plan: SlurmPlan, job_nodes: Sequence[str], lost: set[str],
                 running: Mapping[str, str], prefer: str | None) -> str | None:
    """Where a step that ended (its node lost, or it crashed) starts again: a node of the job that is not lost
    and has room for it beside the steps ``running`` there (step name -> node), ``prefer`` first (its old node),
    then the node with the most room. None: no node of the job has room. Pure."""
    def room(node: str) -> tuple[int, int]:
        here = [plan.step(name) for name, n in running.items() if n == node and name != step.name]
        return plan.node_cpus - sum(s.cpus for s in here), plan.node_gpus - sum(s.gpus for s in here)

    fits = [n for n in job_nodes if n not in lost and room(n)[0] >= step.cpus and room(n)[1] >= step.gpus]
    if prefer in fits:
        return prefer
    return max(fits, key=lambda n: (room(n)[1], room(n)[0]), default=None)


def slot_nodes(plan: SlurmPlan, job_nodes: Sequence[str]) -> dict[str, str]:
    """Each step's node: slot k is the job's k-th node (slurmctld's order). Pure.

    Raises:
        NoResources: the job has fewer nodes than the plan's slots (an allocation too small).
    """
    if len(job_nodes) < plan.nodes:
        raise NoResources(f"the job holds {len(job_nodes)} node(s) ({', '.join(job_nodes)}) but the plan spreads its "
                          f"processes over {plan.nodes}", hint="ask the allocation for more nodes, or --slurm-nodes")
    return {s.name: job_nodes[s.slot] for s in plan.steps}


# ------------------------------------------------------------------------------------------ as parts
def job_part(job: JobInfo) -> Part:
    """The job as a part of ``launcher status``: Slurm's own state and pending reason. Pure."""
    if job.pending:
        state = PartState.STARTING
    elif job.running or job.state == "COMPLETING":
        state = PartState.RUNNING
    else:
        state = PartState.EXITED if job.state in ("COMPLETED", "CANCELLED") else PartState.FAILED
    return Part("job", state, ident=job.job_id, status=job.state, node=compress(job.nodes), reason=job.reason)


def compress(nodes: Sequence[str]) -> str:
    """Node names joined by commas (what a person reads; Slurm accepts it back)."""
    return ",".join(nodes)


def lost_text(node: str, when: str) -> str:
    return f"node {node} lost at {when}"


def node_lost_at(node: NodeInfo, now: str) -> str:
    """When slurmctld lost ``node``: the time in its reason (``Not responding [slurm@2026-…]``), else ``now``."""
    reason = node.reason
    if "@" in reason and reason.endswith("]"):
        return reason.rsplit("@", 1)[1].rstrip("]")
    return now
