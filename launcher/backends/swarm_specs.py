"""What a Swarm run is made of, as pure functions over plain data: where the master goes
(:func:`master_placement`) and where the groups go (:func:`group_placement`), the services of a plan (:func:`service_specs`), whether the swarm's nodes can hold
them (:func:`gpu_shortfall`), and what a service's tasks say about it (:func:`service_state`,
:func:`start_problem`). :mod:`launcher.backends.swarm` does the calls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from launcher.backends.base import PartState, PreparedRun
from launcher.backends.specs import LaunchSpecs, Mount, PartSpec
from launcher.backends.swarm_options import SWARM_GROUPS
from launcher.backends.containers import (MASTER_PORT, Kind, group_limits, group_name, labels, master_limits,
                                          master_name, nano_cpus, network_name, worker_env)
from launcher.engine.labels import part_name
from launcher.engine.swarm import (GPU_RESOURCE, PRE_RUNNING, SECRET_FILE, MountSpec, NodeInfo, ServiceSpec,
                                   TaskInfo, latest)
from launcher.errors import BadInput, LauncherError, MissingDependency, NoResources, RunFailed
from worker.contract import NEVER_RESTARTED_EXITS, SECRET_FILE_ENV, SPEC_ENV, SWARM_MASTER, RunSpec

STORAGE_LABEL = "launcher.storage"  # a node label: this node holds the results root at the same path
GPU_COUNT_LABEL = "launcher.gpu-count"  # GPUs a service reserves; which ones is the engine's choice
MASTER_PLACEMENTS = SWARM_MASTER
SECRET_PATH = f"/run/secrets/{SECRET_FILE}"
BIND_RESULTS = "/results"
# A new named volume takes the owner and mode of the image directory it is mounted on. /tmp is the one
# directory of the image every uid may write (1777), so a volume mounted there is writable by the run's user.
VOLUME_MOUNT = "/tmp"
VOLUME_RESULTS = "/tmp/results"
START_TIMEOUT_S = 120.0  # start() waits this long for every service's first task to run
PENDING_LIMIT_S = 20.0  # a task the scheduler cannot place for this long will not be placed


def secret_name(run_id: str) -> str:
    return f"launcher-{run_id}-secret"


def volume_name(run_id: str) -> str:
    return f"launcher-{run_id}-results"


# ------------------------------------------------------------------------------------------ task states
def service_state(tasks: list[TaskInfo], max_attempts: int | None, restarts: int) -> tuple[PartState, int | None]:
    """Map a one-replica service's tasks to a :class:`PartState` and exit code. Pure.

    ``restarts``: tasks the swarm started after the first (the backend counts every task it ever saw, as the
    swarm keeps only a few in its history). A newest task that ended non-zero is RESTARTING while the service's
    restart policy has attempts left (``max_attempts``; None: never restarted, like the master): the swarm
    starts another after its delay. Otherwise it is FAILED, and the supervisor decides; so is a task that exited
    with one of :data:`~worker.contract.NEVER_RESTARTED_EXITS` (refused by the master, or the algorithm's code
    raised: another task would end the same way; the backend scales its service to 0 when it sees one, as the
    swarm's on-failure policy cannot tell exit codes apart). No task yet: STARTING.
    """
    t = latest(tasks)
    if t is None or t.state in PRE_RUNNING:
        return PartState.STARTING, None
    if t.state == "running":
        return PartState.RUNNING, None
    if t.state == "complete" or (t.state == "shutdown" and t.exit_code == 0):
        return PartState.EXITED, 0
    code = t.exit_code
    if max_attempts is None or restarts >= max_attempts or code in NEVER_RESTARTED_EXITS:
        return PartState.FAILED, code
    return PartState.RESTARTING, code


def start_problem(name: str, tasks: list[TaskInfo], now: float, first_seen: float,
                  image: str) -> LauncherError | None:
    """Why service ``name`` will not start, as the error ``up`` should fail with; None while it may still.

    A task rejected for a missing image is a MissingDependency (the image is not on that node); one the
    scheduler could not place for :data:`PENDING_LIMIT_S` is NoResources (no node has the GPUs, or none
    matches the placement constraints).
    """
    t = latest(tasks)
    if t is None:
        return None
    if t.state == "rejected" and "no such image" in t.err.lower():
        return MissingDependency(
            f"service {name}: a node has no image {image} ({t.err})",
            hint="every node needs the image: `launcher build --push REGISTRY` and `launcher up --image "
                 "REGISTRY/...`, or `docker save IMAGE | ssh NODE docker load` (docs/scaling-out.md)")
    if t.state == "rejected" and "bind source path does not exist" in t.err:
        return MissingDependency(
            f"service {name}: the results directory is not on the node the swarm chose ({t.err})",
            hint="a launcher.storage=true node must have the results root at the same path (shared storage, "
                 "docs/scaling-out.md); or use --swarm-master local")
    if t.state == "rejected" and "no longer meets constraints" in t.err:
        return RunFailed(f"service {name}: the swarm rejected its task: {t.err}",
                         hint="Docker 20.10's swarm rejects a running task that holds NVIDIA-GPU generic resources "
                              "whenever its node's record changes (docs/scaling-out.md, GPUs on a swarm); run GPU "
                              "plans with --backend docker on one machine, or CPU plans (--gpus none) on the swarm")
    if t.state == "rejected":
        return RunFailed(f"service {name}: the swarm rejected its task: {t.err or 'no reason given'}",
                         hint=f"`docker service ps --no-trunc {name}` shows every attempt")
    if t.state == "pending" and t.err and now - first_seen > PENDING_LIMIT_S:
        return NoResources(
            f"service {name}: no node can run it after {now - first_seen:.0f} s ({t.err})",
            hint="GPUs: nodes must advertise NVIDIA-GPU generic resources (docs/scaling-out.md); placement: check "
                 "node labels (`docker node ls`, `docker node inspect`) and --swarm-master")
    return None


# --------------------------------------------------------------------------------------- service specs
@dataclass(frozen=True)
class Placement:
    """Where the master runs and where its results go: ``bind`` (the results directory, same path) or
    ``volume`` (a named volume on the master's node)."""

    constraints: tuple[str, ...]
    results: str  # bind | volume
    why: str


def master_placement(choice: str, nodes: list[NodeInfo], local_node: str) -> Placement:
    """Resolve ``--swarm-master`` over the swarm's nodes. Pure.

    * ``local``: the node this launcher talks to; results bind-mounted (the launcher reads them as they come).
    * ``storage``: a node labelled ``launcher.storage=true`` (``docker node update --label-add``): one whose
      results root is at the same path as here (this node, or a shared NFS mount); results bind-mounted.
    * ``any``: wherever the scheduler likes; results in a named volume on that node.
    * ``auto``: ``storage`` when a ready node carries the label, else ``local``.

    Raises:
        BadInput: an unknown choice, or ``storage`` with no labelled node.
    """
    storage = [n for n in nodes if n.ready and n.labels.get(STORAGE_LABEL) == "true"]
    if choice not in MASTER_PLACEMENTS:
        raise BadInput(f"--swarm-master {choice!r} is not one of {', '.join(MASTER_PLACEMENTS)}")
    if choice == "storage" and not storage:
        raise BadInput(f"--swarm-master storage: no ready node is labelled {STORAGE_LABEL}=true",
                       hint=f"`docker node update --label-add {STORAGE_LABEL}=true NODE` on the node that holds the "
                            "results root, or use --swarm-master local")
    if choice == "storage" or (choice == "auto" and storage):
        names = ", ".join(n.hostname for n in storage)
        return Placement((f"node.labels.{STORAGE_LABEL}==true",), "bind", f"master on a storage node ({names})")
    if choice == "any":
        return Placement((), "volume", "master on any node; results in volume (copied back when it is this node)")
    host = next((n.hostname for n in nodes if n.id == local_node), local_node[:12])
    return Placement((f"node.id=={local_node}",), "bind", f"master on this node ({host})")


def recovery_constraints(master: Placement, dead_node: str) -> tuple[str, ...] | None:
    """Where a new master task may run in place of a dead one (issue 27), so that it finds the run's
    checkpoints: None keeps the placement (a bind mount: ``local`` pins the node already, and every
    ``storage`` node holds the results root at the same path); results in a named volume (``any``) live on the
    dead task's node only, so the new task is pinned there (``node.id==<dead_node>``). Pure."""
    if master.results == "bind" or not dead_node:
        return None
    return (f"node.id=={dead_node}",)


def _holds_master(master: Placement, node: NodeInfo) -> bool:
    """Whether ``node`` matches the master's constraint (``node.id==X`` or the storage label); any node does
    when the master has none."""
    for c in master.constraints:
        key, _, value = c.partition("==")
        if key == "node.id" and node.id != value:
            return False
        if key.startswith("node.labels.") and node.labels.get(key[len("node.labels."):]) != value:
            return False
    return True


def group_placement(choice: str, nodes: list[NodeInfo], master: Placement,
                    group_gpus: list[int] | None = None) -> tuple[tuple[str, ...], str]:
    """Resolve ``--swarm-groups`` to the groups' constraints and a line saying why. Pure.

    * ``spread`` (default): off the master's node(s) when other ready nodes exist and advertise the GPUs
      the groups reserve, so the learner keeps its node's cores and the groups share the rest. The
      scheduler spreads one-replica services over the nodes it may use by their task counts.
    * ``any``: wherever the scheduler likes, the master's node included (one machine's worth of groups).

    Raises:
        BadInput: an unknown choice.
    """
    if choice not in SWARM_GROUPS:
        raise BadInput(f"--swarm-groups {choice!r} is not one of {', '.join(SWARM_GROUPS)}")
    if choice == "any" or not master.constraints:
        return (), "groups on any node"
    others = [n for n in nodes if n.ready and not _holds_master(master, n)]
    if not others:
        return (), "groups on the master's node (no other ready node)"
    needs = [g for g in (group_gpus or []) if g]
    if needs and gpu_shortfall(needs, others) is not None:
        return (), "groups on any node (the other nodes lack the GPUs the groups reserve)"
    names = ", ".join(sorted(n.hostname for n in others))
    return tuple(c.replace("==", "!=", 1) for c in master.constraints), f"groups spread over {names}"


def swarm_run_spec(spec: RunSpec, results_dir: str) -> RunSpec:
    """The spec as the tasks see it: the master on 0.0.0.0:7100 of the overlay network, groups dialling the
    master service by name (DNS round-robin: its one task's address)."""
    return dataclasses.replace(spec, results_dir=results_dir, master_host="0.0.0.0", master_port=MASTER_PORT,
                               connect_host=master_name(spec.run_id))


def swarm_labels(run: PreparedRun, role: str, uid: int, *, group: int | None = None, gpus: int = 0) -> dict[str, str]:
    out = labels(run.run_id, run.results_dir, role, group=group, uid=uid)  # launcher.gpus stays empty: the engine picks
    if gpus:
        out[GPU_COUNT_LABEL] = str(gpus)
    return out


def service_specs(run: PreparedRun, *, image: str, placement: Placement, uid_gid: tuple[int, int],
                  max_cpus: int | None = None,
                  group_constraints: tuple[str, ...] = ()) -> tuple[ServiceSpec, list[ServiceSpec]]:
    """The master's and each worker group's service, from the plan. Pure: no engine is asked.

    Args:
        placement: from :func:`master_placement`.
        group_constraints: every group's placement constraints, from :func:`group_placement`.
        uid_gid: who the tasks run as (the invoking user); the secret file belongs to them.
        max_cpus: CPUs of the smallest node; CPU limits above it are lowered to it.
    """
    uid, gid = uid_gid
    results_dir = BIND_RESULTS if placement.results == "bind" else VOLUME_RESULTS
    secret_env = {SPEC_ENV: swarm_run_spec(run.spec, results_dir).to_json(), SECRET_FILE_ENV: SECRET_PATH}
    net, user = network_name(run.run_id), f"{uid}:{gid}"

    m = run.plan.master
    mlim = master_limits(m)
    if placement.results == "bind":
        mounts: tuple[MountSpec, ...] = (MountSpec("bind", BIND_RESULTS, str(run.results_dir.resolve())),
                                         MountSpec("tmpfs", "/tmp"))
    else:
        mounts = (MountSpec("volume", VOLUME_MOUNT, volume_name(run.run_id), swarm_labels(run, "results", uid)),)
    master = ServiceSpec(
        name=master_name(run.run_id), image=image, args=("master",),
        env={**secret_env, **worker_env(Kind.SWARM, m, master_addr=None)},
        labels=swarm_labels(run, "master", uid, gpus=len(m.gpu_uuids)), network=net, user=user,
        nano_cpus=nano_cpus(m.cpus, max_cpus), gpus=len(m.gpu_uuids), restart_max=None,
        constraints=placement.constraints, mounts=mounts, memory_bytes=mlim.memory_bytes, pids_limit=mlim.pids)
    groups = []
    for g in run.plan.groups:
        env = {**secret_env, **worker_env(Kind.SWARM, g.share, master_addr=f"{master.name}:{MASTER_PORT}")}
        glim = group_limits(g.share, g.workers)
        groups.append(ServiceSpec(
            name=group_name(run.run_id, g.index), image=image, args=("group", "--index", str(g.index)), env=env,
            labels=swarm_labels(run, "group", uid, group=g.index, gpus=len(g.share.gpu_uuids)), network=net,
            user=user, nano_cpus=nano_cpus(g.share.cpus, max_cpus), gpus=len(g.share.gpu_uuids),
            restart_max=run.config.restart_budget, constraints=group_constraints, mounts=(MountSpec("tmpfs", "/tmp"),),
            memory_bytes=glim.memory_bytes, pids_limit=glim.pids))
    return master, groups


def assumed_placement(choice: str) -> Placement:
    """Where the master's results go for ``--swarm-master choice`` before the swarm's nodes are known (``launcher
    plan``): ``any`` in a volume, else bound at the same path. No constraints: the nodes decide those. Pure."""
    return Placement((), "volume" if choice == "any" else "bind", "")


def launch_specs(master: ServiceSpec, groups: list[ServiceSpec]) -> LaunchSpecs:
    """The services :func:`service_specs` gives, as :class:`~launcher.backends.specs.LaunchSpecs`. A bind's
    source is its host path; a volume's is ``volume:NAME``, a tmpfs's ``tmpfs``. Pure."""
    def part(name: str, svc: ServiceSpec) -> PartSpec:
        mounts = tuple(Mount(m.source if m.kind == "bind" else f"{m.kind}:{m.source}" if m.source else m.kind,
                             m.target, False) for m in svc.mounts)
        return PartSpec(name, tuple(svc.args), dict(svc.env), mounts=mounts, cpus=svc.nano_cpus / 1e9, image=svc.image)

    return LaunchSpecs("swarm", tuple(part(part_name(svc.labels), svc) for svc in (master, *groups)),
                       note="the swarm picks each task's node, and its GPUs by count (DOCKER_RESOURCE_NVIDIA-GPU), "
                            "at the start")


def gpu_shortfall(needs: list[int], nodes: list[NodeInfo]) -> str | None:
    """Why the swarm cannot hold services needing ``needs`` GPUs each (None: it can, as far as counts go).
    A generic resource is never shared: two groups that share a GPU in the plan need two here."""
    ready = [n for n in nodes if n.ready]
    total, biggest, want = sum(n.gpus for n in ready), max((n.gpus for n in ready), default=0), sum(needs)
    if not want:
        return None
    if want > total:
        return (f"the plan's processes reserve {want} {GPU_RESOURCE} in all ({', '.join(map(str, needs))} per "
                f"service) but the swarm's ready nodes advertise {total}")
    if max(needs) > biggest:
        return f"a service needs {max(needs)} GPUs on one node but the largest node advertises {biggest}"
    return None


