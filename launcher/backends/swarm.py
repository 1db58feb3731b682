"""Swarm backend: the same plan as Docker services on a swarm (``launcher up --backend swarm``).

One run is, on the swarm:

* an attachable overlay network ``launcher-<run id>``, ``--internal``: tasks reach each other by service
  name on any node, nothing outside. Services use DNS round-robin endpoints (``dnsrr``), not a virtual IP:
  the master is one task, and VIPs need IPVS in every node's kernel, which not every kernel has;
* the run secret as a Docker secret ``launcher-<run id>-secret``, mounted read-only for the run's user at
  ``/run/secrets/launcher-secret``; ``LAUNCHER_SECRET_FILE`` points there (never an environment variable);
* the master as one service ``launcher-<run id>-master`` (one replica, never restarted, like the Docker
  backend's master), placed by ``--swarm-master`` (:func:`master_placement`); its results go to the run's
  results directory by bind mount when it runs on this node or on a ``launcher.storage=true`` node, else to
  a named volume ``launcher-<run id>-results`` on its node;
* one service per worker group ``launcher-<run id>-group-<N>`` (one replica each, so per-group GPU
  reservations stay per group), restarted by the swarm on failure at most ``--restart-budget`` times
  (condition ``on-failure``, ``max_attempts`` = budget; budget 0: condition ``none``), which is the Docker
  backend's budget: a group whose last task failed with the budget spent is LOST;
* GPUs as ``NVIDIA-GPU`` generic resources: each service reserves as many as the plan gives its process,
  the engine picks which GPUs on which node, and names them to the task in ``DOCKER_RESOURCE_NVIDIA-GPU``
  (:func:`worker.gpu_setup.adopt_swarm_gpus` turns that into ``CUDA_VISIBLE_DEVICES``).

Services, their task containers, the network, the secret and the volume carry the Docker backend's
``launcher.*`` labels, so ``launcher status``/``logs``/``down``/``gpus`` find a swarm run as they find a
Docker one. docs/scaling-out.md has the node setup and what works across nodes. Every Swarm call goes
through :class:`launcher.swarm_client.SwarmEngine`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from launcher import docker_client as dc
from launcher.backends.base import Backend, BackendStatus, PreparedRun, ProcState, ProcStatus
from launcher.backends.docker import (MASTER_PORT, _give_to, container_user, group_name, labels, master_name,
                                      network_name)
from launcher.errors import BadInput, LauncherError, MissingDependency, NoResources, RunFailed
from launcher.placement import Plan, ProcessShare
from launcher.swarm_client import (ENDED, GPU_RESOURCE, PRE_RUNNING, RESTART_DELAY_S, SECRET_FILE, STOP_GRACE_S,
                                   MountSpec, NodeInfo, ServiceSpec, SwarmEngine, TaskInfo, connect_swarm, latest,
                                   parse_timestamp)
from worker.spec import SECRET_FILE_ENV, SPEC_ENV, RunSpec

log = logging.getLogger(__name__)
Progress = Callable[[str], None]

STORAGE_LABEL = "launcher.storage"  # a node label: this node holds the results root at the same path
GPU_COUNT_LABEL = "launcher.gpu-count"  # GPUs a service reserves; which ones is the engine's choice
MASTER_PLACEMENTS = ("auto", "local", "storage", "any")
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
def service_state(tasks: list[TaskInfo], budget: int | None, restarts: int) -> tuple[ProcState, int | None]:
    """Map a one-replica service's tasks to a :class:`ProcState` and exit code.

    ``restarts``: tasks the swarm started after the first (the backend counts every task it ever saw, as the
    swarm keeps only a few in its history). A newest task that ended non-zero is RESTARTING while restarts are
    below ``budget`` (the swarm starts another after its delay), LOST once they reach it; with ``budget``
    None (the master: never restarted) it is FAILED. No task yet: STARTING.
    """
    t = latest(tasks)
    if t is None or t.state in PRE_RUNNING:
        return ProcState.STARTING, None
    if t.state == "running":
        return ProcState.RUNNING, None
    if t.state == "complete" or (t.state == "shutdown" and t.exit_code == 0):
        return ProcState.EXITED, 0
    code = t.exit_code
    if budget is None:
        return ProcState.FAILED, code
    return (ProcState.LOST if restarts >= budget else ProcState.RESTARTING), code


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


def swarm_run_spec(spec: RunSpec, results_dir: str) -> RunSpec:
    """The spec as the tasks see it: the master on 0.0.0.0:7100 of the overlay network, groups dialling the
    master service by name (DNS round-robin: its one task's address)."""
    return dataclasses.replace(spec, results_dir=results_dir, master_host="0.0.0.0", master_port=MASTER_PORT,
                               connect_host=master_name(spec.run_id))


def device_env(share: ProcessShare) -> dict[str, str]:
    """A process's device environment on a swarm: no GPU pinned by UUID (the engine picks them on the node it
    chooses); a CPU process hides every GPU, as on Docker."""
    env = dict(share.env)
    if share.gpu_uuids:
        env.pop("NVIDIA_VISIBLE_DEVICES", None)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    else:
        env.update(NVIDIA_VISIBLE_DEVICES="void", CUDA_VISIBLE_DEVICES="")
    return env


def _swarm_labels(run: PreparedRun, role: str, uid: int, *, group: int | None = None, gpus: int = 0) -> dict[str, str]:
    out = labels(run, role, group=group, uid=uid)  # launcher.gpus stays empty: the engine picks GPUs
    if gpus:
        out[GPU_COUNT_LABEL] = str(gpus)
    return out


def service_specs(run: PreparedRun, *, image: str, placement: Placement, uid_gid: tuple[int, int],
                  max_cpus: int | None = None) -> tuple[ServiceSpec, list[ServiceSpec]]:
    """The master's and each worker group's service, from the plan. Pure: no engine is asked.

    Args:
        placement: from :func:`master_placement`.
        uid_gid: who the tasks run as (the invoking user); the secret file belongs to them.
        max_cpus: CPUs of the smallest node; CPU limits above it are lowered to it.
    """
    uid, gid = uid_gid
    results_dir = BIND_RESULTS if placement.results == "bind" else VOLUME_RESULTS
    spec_json = swarm_run_spec(run.spec, results_dir).to_json()
    base = {SPEC_ENV: spec_json, SECRET_FILE_ENV: SECRET_PATH, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
            "TF_ENABLE_ONEDNN_OPTS": "0", "MPLBACKEND": "Agg"}
    net, user = network_name(run.run_id), f"{uid}:{gid}"

    def cpus(share: ProcessShare) -> int:
        c = share.cpus if max_cpus is None else min(share.cpus, float(max_cpus))
        return max(0, int(round(c * 1e9)))

    m = run.plan.master
    if placement.results == "bind":
        mounts: tuple[MountSpec, ...] = (MountSpec("bind", BIND_RESULTS, str(run.results_dir.resolve())),
                                         MountSpec("tmpfs", "/tmp"))
    else:
        mounts = (MountSpec("volume", VOLUME_MOUNT, volume_name(run.run_id), _swarm_labels(run, "results", uid)),)
    master = ServiceSpec(
        name=master_name(run.run_id), image=image, args=("master",),
        env={**base, **device_env(m), "LAUNCHER_TF_THREADS": str(max(1, int(m.cpus)))},
        labels=_swarm_labels(run, "master", uid, gpus=len(m.gpu_uuids)), network=net, user=user,
        nano_cpus=cpus(m), gpus=len(m.gpu_uuids), restart_max=None, constraints=placement.constraints, mounts=mounts)
    groups = []
    for g in run.plan.groups:
        env = {**base, **device_env(g.share), "LAUNCHER_MASTER_ADDR": f"{master.name}:{MASTER_PORT}",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "LAUNCHER_TF_THREADS": "1"}
        groups.append(ServiceSpec(
            name=group_name(run.run_id, g.index), image=image, args=("group", "--index", str(g.index)), env=env,
            labels=_swarm_labels(run, "group", uid, group=g.index, gpus=len(g.share.gpu_uuids)), network=net,
            user=user, nano_cpus=cpus(g.share), gpus=len(g.share.gpu_uuids),
            restart_max=run.config.restart_budget, mounts=(MountSpec("tmpfs", "/tmp"),)))
    return master, groups


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


# ------------------------------------------------------------------------------------------ the backend
class SwarmBackend(Backend):
    """Runs a :class:`PreparedRun` as Swarm services (like ``docker network create -d overlay`` +
    ``docker secret create`` + ``docker service create`` each)."""

    name = "swarm"
    restarts_groups = True

    def __init__(self, image: str | None = None, *, progress: Progress | None = None, engine: dc.Engine | None = None,
                 master_placement: str = "auto", start_timeout_s: float = START_TIMEOUT_S) -> None:
        """
        Args:
            image: the worker image; every node needs it. None: the default tag of the plan's flavour.
            progress: receives human-readable lines.
            engine: a connected engine on a manager (default: ``docker.from_env()`` at start).
            master_placement: ``--swarm-master`` (auto, local, storage, any); see :func:`master_placement`.
            start_timeout_s: how long start() waits for every service's first task to run.
        """
        self.image = image
        self.progress = progress or (lambda line: None)
        self._engine = engine
        self.master_choice = master_placement
        self.start_timeout_s = start_timeout_s
        self.run: PreparedRun | None = None
        self.swarm: SwarmEngine | None = None
        self.placement: Placement | None = None
        self.service_ids: dict[str, str] = {}  # service name -> id
        self.group_services: dict[int, str] = {}  # group index -> service id
        self.master_service: str | None = None
        self._seen: dict[str, set[str]] = {}  # service id -> every task id seen (restarts = len - 1)
        self._copied = False
        self._stopped = False

    def _image(self, plan: Plan) -> str:
        from launcher import image as image_mod

        if self.image:
            return self.image
        return image_mod.default_tag(image_mod.Flavour.GPU if plan.gpu_uuids else image_mod.Flavour.CPU)

    def _check(self, run: PreparedRun, swarm: SwarmEngine, nodes: list[NodeInfo], image: str) -> None:
        """Everything that can be known before creating anything; all problems at once, the gravest type."""
        problems: list[tuple[type[LauncherError], str, str]] = []
        ready = [n for n in nodes if n.ready]
        if len(ready) <= 1 and not swarm.image_here(image):
            problems.append((MissingDependency, f"image {image} is not on this engine (the swarm's only node)",
                             "`launcher build` makes it (--offline without a registry); or pass --image"))
        elif len(ready) > 1 and "/" not in image.split(":")[0]:
            self.progress(f"image {image} names no registry: every node must already have it "
                          "(`launcher build --push REGISTRY`, docs/scaling-out.md)")
        shares = [run.plan.master, *(g.share for g in run.plan.groups)]
        short = gpu_shortfall([len(s.gpu_uuids) for s in shares if s.gpu_uuids], nodes)
        if short:
            problems.append((NoResources, short, "advertise each node's GPUs as NVIDIA-GPU generic resources "
                             "(docs/scaling-out.md), use fewer groups (--groups), or --gpus none"))
        if run.config.resume and self.placement is not None and self.placement.results == "volume":
            problems.append((BadInput, f"--resume {run.config.resume} with --swarm-master {self.master_choice}: the "
                             "master would not see the run's checkpoints from a fresh volume",
                             "resume with --swarm-master local or storage"))
        rid = {dc.RUN_LABEL: run.run_id}
        left = ([s["Spec"]["Name"] for s in swarm.services(rid)] + [n for _, n, _ in swarm.engine.networks(rid)]
                + [n for _, n in swarm.secrets(rid)])
        if left:
            problems.append((BadInput, f"run {run.run_id} still has services, networks or secrets on the swarm: "
                             f"{', '.join(left)}", f"`launcher down {run.run_id}` removes them (results are kept)"))
        if problems:
            order = (BadInput, MissingDependency, NoResources)
            kind = min((p[0] for p in problems), key=lambda k: order.index(k) if k in order else len(order))
            raise kind("; ".join(p[1] for p in problems), hint="; ".join(p[2] for p in problems))

    def create(self, run: PreparedRun) -> None:
        """Create the network, the secret and every service (their tasks start at once)."""
        self.run = run
        swarm = self.swarm = connect_swarm(self._engine)
        self._engine = swarm.engine
        nodes = swarm.nodes()
        image = self._image(run.plan)
        self.placement = master_placement(self.master_choice, nodes, swarm.local_node())
        self._check(run, swarm, nodes, image)
        uid, gid = container_user()  # the invoking user, never root (as the Docker backend)
        _give_to(run.results_dir, uid, gid)  # the master writes there as that user
        cpus = [n.nano_cpus for n in nodes if n.ready and n.nano_cpus]
        master, groups = service_specs(run, image=image, placement=self.placement, uid_gid=(uid, gid),
                                       max_cpus=int(min(cpus) // 10**9) if cpus else None)
        self.progress(f"swarm: {len([n for n in nodes if n.ready])} ready node(s); {self.placement.why}")
        swarm.create_network(network_name(run.run_id), _swarm_labels(run, "network", uid))
        sec = secret_name(run.run_id)
        sec_id = swarm.create_secret(sec, run.secret, _swarm_labels(run, "secret", uid))
        for spec in (master, *groups):
            sid = swarm.create_service(spec, sec_id, sec, (uid, gid))
            self.service_ids[spec.name] = sid
            self._seen[sid] = set()
        self.master_service = self.service_ids[master.name]
        self.group_services = {g.index: self.service_ids[s.name] for g, s in zip(run.plan.groups, groups)}

    def start(self, run: PreparedRun) -> None:
        self.create(run)
        self.wait_started()
        log.info("started run %s: %d services on overlay network %s", run.run_id, len(self.service_ids),
                 network_name(run.run_id))

    def wait_started(self) -> None:
        """Wait until every service's first task runs; raise what stops one from starting (no image on a node,
        no node with the GPUs). A task still preparing after ``start_timeout_s`` (a slow image pull) is left to
        :meth:`poll`."""
        assert self.swarm is not None and self.run is not None
        t0 = time.monotonic()
        names = {sid: name for name, sid in self.service_ids.items()}
        image = self._image(self.run.plan)
        while time.monotonic() - t0 < self.start_timeout_s:
            tasks = self.swarm.tasks(list(names))
            waiting = []
            for sid, ts in tasks.items():
                problem = start_problem(names[sid], ts, time.monotonic(), t0, image)
                if problem is not None:
                    raise problem
                t = latest(ts)
                if t is None or t.state in PRE_RUNNING:
                    waiting.append(names[sid])
            if not waiting:
                return
            time.sleep(0.5)
        log.warning("services still starting after %.0f s: %s", self.start_timeout_s, ", ".join(waiting))

    def poll(self) -> BackendStatus:
        """The master's and each group's state from their tasks (one ``docker service ps`` call); restarts are
        the tasks the swarm started after a service's first."""
        assert self.swarm is not None and self.run is not None and self.master_service is not None
        tasks = self.swarm.tasks(list(self.service_ids.values()))

        def status(name: str, sid: str, budget: int | None) -> ProcStatus:
            ts = tasks.get(sid, [])
            self._seen.setdefault(sid, set()).update(t.id for t in ts)
            restarts = max(0, len(self._seen[sid]) - 1)
            state, code = service_state(ts, budget, restarts)
            t = latest(ts)
            return ProcStatus(name, state, code, restarts, t.container_id[:12] if t else "")

        master = status("master", self.master_service, None)
        groups = {i: status(f"group-{i}", sid, self.run.config.restart_budget)
                  for i, sid in self.group_services.items()}
        if master.state in (ProcState.EXITED, ProcState.FAILED, ProcState.LOST):
            self._copy_back()
        return BackendStatus(master, groups)

    def _copy_back(self) -> None:
        """Volume results: once the master ended, bring them into the results directory when the volume is on
        this node; otherwise say where they are."""
        if self._copied or self.placement is None or self.placement.results != "volume" or self.run is None:
            return
        assert self.swarm is not None
        self._copied = True
        uid, gid = container_user()
        vol = volume_name(self.run.run_id)
        if self.swarm.copy_volume(vol, self.run.results_dir, self._image(self.run.plan), f"{uid}:{gid}",
                                  self.run.run_id):
            self.progress(f"results copied from volume {vol} into {self.run.results_dir}")
        else:
            self.progress(f"results stay in volume {vol} on the master's node (not this one); see docs/scaling-out.md")

    def restart_group(self, index: int) -> None:
        """The swarm's restart policy restarts groups; a manual restart is a forced update (new task)."""
        assert self.swarm is not None
        self.swarm._api(f"restart group {index}", lambda: self.swarm.client.services.get(  # type: ignore[union-attr]
            self.group_services[index]).force_update())

    def stop(self, *, grace_s: float = STOP_GRACE_S) -> None:
        if self._stopped or self.run is None or self.swarm is None:
            return
        self._stopped = True
        teardown(self.swarm.engine, self.run.run_id, grace_s=grace_s, logs_dir=self.run.run_dir.files.logs,
                 image=self._image(self.run.plan))

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"backend": self.name, "launcher_pid": os.getpid()}
        if self.run is not None:
            d.update(network=network_name(self.run.run_id), secret=secret_name(self.run.run_id),
                     image=self._image(self.run.plan),
                     services={name: sid[:12] for name, sid in self.service_ids.items()})
            if self.placement is not None:
                d.update(master_placement=self.placement.why, results_mount=self.placement.results)
        return d


# ---------------------------------------------------------------------------- status, logs and teardown
@dataclass(frozen=True)
class ServicePart:
    """A run's service as ``launcher status`` shows it, in the Docker backend's words."""

    name: str  # master, group-N
    state: str  # running, created (not yet running), restarting, exited, rejected
    ident: str  # the newest task's container id (12)
    restarts: int
    exit_code: int | None
    node: str
    gpus: tuple[str, ...]


def _part_name(svc_labels: Mapping[str, str]) -> str:
    return "master" if svc_labels.get(dc.ROLE_LABEL) == "master" else f"group-{svc_labels.get(dc.GROUP_LABEL, '?')}"


def service_parts(engine: dc.Engine, run_id: str) -> list[ServicePart]:
    """Each service of ``run_id`` and its newest task, across nodes; empty off a swarm manager."""
    swarm = SwarmEngine(engine)
    if swarm.manager_problem():
        return []
    services = swarm.services({dc.RUN_LABEL: run_id})
    tasks = swarm.tasks([s["ID"] for s in services])
    nodes = {n.id: n.hostname for n in swarm.nodes()}
    parts = []
    for s in services:
        svc_labels = s["Spec"].get("Labels") or {}
        ts = tasks.get(s["ID"], [])
        budget = None if svc_labels.get(dc.ROLE_LABEL) == "master" else \
            (s["Spec"]["TaskTemplate"].get("RestartPolicy") or {}).get("MaxAttempts", 0)
        restarts = max(0, len(ts) - 1)
        st, code = service_state(ts, budget, restarts)
        word = {ProcState.STARTING: "created", ProcState.RUNNING: "running", ProcState.RESTARTING: "restarting",
                ProcState.EXITED: "exited", ProcState.FAILED: "exited", ProcState.LOST: "exited"}[st]
        t = latest(ts)
        if t is not None and t.state == "rejected":
            word = "rejected"
        parts.append(ServicePart(_part_name(svc_labels), word, t.container_id[:12] if t else "", restarts, code,
                                 nodes.get(t.node_id, t.node_id[:12]) if t else "", t.gpus if t else ()))
    return sorted(parts, key=lambda p: (p.name != "master", len(p.name), p.name))


def _service_of(swarm: SwarmEngine, run_id: str, part: str) -> str | None:
    for s in swarm.services({dc.RUN_LABEL: run_id}):
        if _part_name(s["Spec"].get("Labels") or {}) == part:
            return str(s["Spec"]["Name"])
    return None


def read_service_logs(engine: dc.Engine, run_id: str, part: str) -> bytes:
    """What ``part`` (master, group-N) printed, every task of it (like ``docker service logs``)."""
    swarm = SwarmEngine(engine)
    name = _service_of(swarm, run_id, part)
    return swarm.service_logs(name) if name else b""


def follow_service_logs(engine: dc.Engine, run_id: str, part: str, *, poll_s: float = 1.0) -> Iterator[bytes]:
    """``part``'s output as it is written, until its service has no live task (like ``docker service logs -f``,
    which never ends by itself). Lines are read by timestamp, so none is printed twice."""
    swarm = SwarmEngine(engine)
    name = _service_of(swarm, run_id, part)
    if name is None:
        return
    since: str | None = None
    seen: set[bytes] = set()
    ended_at: float | None = None
    while True:
        fresh = []
        for line in swarm.service_logs(name, since=since, timestamps=True).splitlines(keepends=True):
            stamp, _, text = line.partition(b" ")
            if line in seen:
                continue
            seen.add(line)
            fresh.append(text)
            since = _since(stamp.decode(errors="replace")) or since
        if fresh:
            yield b"".join(fresh)
        if len(seen) > 10_000:
            seen = set(sorted(seen)[-2_000:])
        services = swarm.services({dc.RUN_LABEL: run_id})
        sid = next((s["ID"] for s in services if s["Spec"]["Name"] == name), None)
        t = latest(swarm.tasks([sid])[sid]) if sid else None
        if t is None:
            return  # the service is gone
        if t.state in ENDED:  # over, unless the swarm starts another task after its restart delay
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > 3 * RESTART_DELAY_S + poll_s:
                return
        else:
            ended_at = None
        time.sleep(poll_s)


def _since(stamp: str) -> str | None:
    secs, nanos = parse_timestamp(stamp)
    return f"{secs}.{nanos:09d}" if secs else None


@dataclass
class SwarmDown:
    """What :func:`teardown` found and removed."""

    services: list[str] = field(default_factory=list)
    secrets: int = 0
    networks: int = 0
    logs: list[Path] = field(default_factory=list)


def _save_logs(swarm: SwarmEngine, services: list[dict[str, Any]], tasks: dict[str, list[TaskInfo]],
               logs_dir: Path, early: Mapping[str, bytes]) -> list[Path]:
    """Append each service's whole output (every task still in the swarm's history) to
    ``logs_dir/<master|group-N>.log`` before the service is removed: the swarm's copy goes with it.
    ``early``: output read before a service was scaled down (its tasks, and their output, are gone)."""
    written: list[Path] = []
    try:
        logs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("cannot keep service logs in %s: %s", logs_dir, exc)
        return written
    for s in services:
        svc_labels = s["Spec"].get("Labels") or {}
        ts = tasks.get(s["ID"], [])
        t = latest(ts)
        path = logs_dir / f"{_part_name(svc_labels)}.log"
        header = (f"--- launcher: output of service {s['Spec']['Name']}, {len(ts)} task(s), {max(0, len(ts) - 1)} "
                  f"restart(s), last {t.state if t else 'none'} exit {t.exit_code if t else None} ---\n").encode()
        data = early.get(s["ID"]) or swarm.service_logs(s["ID"])
        try:
            with open(path, "ab") as fh:
                fh.write(header + data)
            owner = svc_labels.get(dc.USER_LABEL, "")
            if os.geteuid() == 0 and owner.isdigit() and int(owner) != 0:
                os.chown(path, int(owner), logs_dir.stat().st_gid)
        except OSError as exc:
            log.warning("cannot write %s: %s", path, exc)
            continue
        written.append(path)
    return written


def _wait(pred: Callable[[], bool], timeout_s: float, interval: float = 0.3) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def _volume_of(service: Mapping[str, Any]) -> str | None:
    mounts = service["Spec"]["TaskTemplate"]["ContainerSpec"].get("Mounts") or []
    return next((str(m["Source"]) for m in mounts if m.get("Type") == "volume"), None)


def _remove_secrets_and_networks(swarm: Any, flt: dict[str, str | None], down: Any) -> None:
    """Remove the run's secrets and overlay networks (after its services), counting them in ``down``."""
    for sec_id, _ in swarm.secrets(flt):
        swarm.remove_secret(sec_id)
        down.secrets += 1
    for nid, _ in swarm.overlay_networks(flt):
        swarm.remove_network(nid)
        down.networks += 1


def teardown(engine: dc.Engine, run_id: str | None, *, grace_s: float = STOP_GRACE_S, logs_dir: Path | None = None,
             user: str | None = None, image: str | None = None) -> SwarmDown:
    """Stop and remove every service, secret and overlay network of ``run_id`` (None: of every run), found
    by label; results stay. Off a swarm manager it does nothing.

    Order, as on Docker: the master first, with ``grace_s`` to checkpoint and tell its groups to stop (on
    this node ``docker stop -t``; on another node the service is scaled to 0 and the task gets the service's
    stop grace period); groups then end by themselves (exit 0: not restarted); each service's output is
    appended to the run's ``logs/`` (``logs_dir`` or the ``launcher.results`` label's); a results volume on
    this node is copied into the results directory and then removed (one on another node is kept); then
    services, secret and network are removed. Idempotent.
    """
    swarm = SwarmEngine(engine)
    down = SwarmDown()
    if swarm.manager_problem():
        return down
    flt: dict[str, str | None] = {dc.RUN_LABEL: run_id}
    if user is not None:
        flt[dc.USER_LABEL] = user
    services = swarm.services(flt)
    if not services:  # a Docker run's containers and bridge network are not the swarm's to remove
        _remove_secrets_and_networks(swarm, flt, down)
        return down
    ids = [s["ID"] for s in services]
    here = swarm.local_node()
    early: dict[str, bytes] = {}
    for s in services:
        if (s["Spec"].get("Labels") or {}).get(dc.ROLE_LABEL) != "master":
            continue
        for t in swarm.tasks([s["ID"]])[s["ID"]]:
            if t.state not in ("running", *PRE_RUNNING):
                continue
            if t.node_id == here and t.container_id:
                engine.stop(t.container_id, max(1.0, grace_s - 2.0))
            else:  # another node: only the swarm can stop it, and the task's output goes with it
                early[s["ID"]] = swarm.service_logs(s["ID"])
                swarm.scale_to_zero(s["ID"])

    def live() -> bool:
        return any(t.state in ("running", *PRE_RUNNING) for ts in swarm.tasks(ids).values() for t in ts)

    _wait(lambda: not live(), min(5.0, max(1.0, grace_s)))  # the groups got STOP from the master
    tasks = swarm.tasks(ids)
    by_run: dict[str, list[dict[str, Any]]] = {}
    for s in services:
        by_run.setdefault((s["Spec"].get("Labels") or {}).get(dc.RUN_LABEL, "?"), []).append(s)
    copied: list[str] = []
    for rid, group in by_run.items():
        svc_labels = group[0]["Spec"].get("Labels") or {}
        results = Path(svc_labels[dc.RESULTS_LABEL]) if svc_labels.get(dc.RESULTS_LABEL) else None
        target = logs_dir if logs_dir is not None and rid == run_id else (results / "logs" if results else None)
        if target is not None and target.parent.is_dir():
            down.logs += _save_logs(swarm, group, tasks, target, early)
        vol = next((v for v in map(_volume_of, group) if v), None)
        if vol and results is not None and results.is_dir():
            img = image or str(group[0]["Spec"]["TaskTemplate"]["ContainerSpec"]["Image"]).split("@")[0]
            owner = svc_labels.get(dc.USER_LABEL) or str(os.getuid())
            if swarm.copy_volume(vol, results, img, f"{owner}:{owner}", rid):
                copied.append(vol)
            else:
                log.warning("results of run %s stay in volume %s on the master's node", rid, vol)
    for s in services:
        swarm.remove_service(s["ID"])
        down.services.append(str(s["Spec"]["Name"]))
    _wait(lambda: not engine.containers(flt), 20.0)
    _remove_secrets_and_networks(swarm, flt, down)
    for vol in copied:
        swarm.remove_volume(vol)
    return down
