"""Swarm backend: the same plan as Docker services on a swarm (``launcher up --backend swarm``).

One run is, on the swarm:

* an attachable overlay network ``launcher-<run id>``, ``--internal``: tasks reach each other by service
  name on any node, nothing outside. Services use DNS round-robin endpoints (``dnsrr``), not a virtual IP:
  the master is one task, and VIPs need IPVS in every node's kernel, which not every kernel has;
* the run secret as a Docker secret ``launcher-<run id>-secret``, mounted read-only for the run's user at
  ``/run/secrets/launcher-secret``; ``LAUNCHER_SECRET_FILE`` points there (never an environment variable);
* the master as one service ``launcher-<run id>-master`` (one replica, never restarted by the swarm; a master
  killed by a signal gets a new task at the same name from the supervisor, :meth:`SwarmBackend.restart_master`,
  issue 27), placed by ``--swarm-master`` (:func:`master_placement`); its results go to the run's
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
through :class:`launcher.engine.swarm.SwarmEngine`; the pure parts are in
:mod:`launcher.backends.swarm_specs`, finding a run again and tearing it down in :mod:`launcher.backends.swarm_run`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from launcher.backends.base import Backend, BackendStatus, Event, Part, PartState, PreparedRun, event_lines
from launcher.backends.containers import container_user, give_to, network_name
from launcher.backends.swarm_run import SwarmRun, lost_node, teardown
from launcher.backends.specs import LaunchSpecs
from launcher.backends.swarm_specs import (START_TIMEOUT_S, Placement, assumed_placement, swarm_labels, gpu_shortfall,
                                           group_placement, launch_specs, master_placement, recovery_constraints, secret_name,
                                           service_specs, service_state, start_problem, volume_name)
from launcher.engine.client import Engine
from launcher.engine.labels import ROLE_LABEL, RUN_LABEL
from launcher.engine.swarm import PRE_RUNNING, STOP_GRACE_S, NodeInfo, SwarmEngine, TaskInfo, connect_swarm, latest
from launcher.config import RunConfig
from launcher.errors import BadInput, LauncherError, MissingDependency, NoResources
from launcher.gpu.placement import Plan
from launcher.runs import RunDir
from launcher.usercode import user_code
from worker.contract import NEVER_RESTARTED_EXITS

log = logging.getLogger(__name__)
NODE_WATCH_S = 5.0  # how often poll() asks the swarm for its nodes (to say when one is lost)
Progress = Callable[[str], None]


class SwarmBackend(Backend):
    """Runs a :class:`PreparedRun` as Swarm services (like ``docker network create -d overlay`` +
    ``docker secret create`` + ``docker service create`` each)."""

    name = "swarm"
    restart_grace_s = 5.0  # the swarm starts a failed group's next task after RESTART_DELAY_S
    outlives_launcher = True
    recovers_master = True  # a new master task at the same service name (restart_master)

    def __init__(self, image: str | None = None, *, progress: Progress | None = None, engine: Engine | None = None,
                 master_placement: str = "auto", group_placement: str = "spread",
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        """
        Args:
            image: the worker image; every node needs it. None: the default tag of the plan's flavour.
            progress: receives human-readable lines.
            engine: a connected engine on a manager (default: ``docker.from_env()`` at start).
            master_placement: ``--swarm-master`` (auto, local, storage, any); see :func:`master_placement`.
            group_placement: ``--swarm-groups`` (spread, any); see :func:`group_placement`.
            start_timeout_s: how long start() waits for every service's first task to run.
        """
        self.image = image
        self.progress = progress or (lambda line: None)
        self._engine = engine
        self.master_choice = master_placement
        self.group_choice = group_placement
        self.group_where = ""
        self.start_timeout_s = start_timeout_s
        self.run: PreparedRun | None = None
        self.swarm: SwarmEngine | None = None
        self.placement: Placement | None = None
        self.service_ids: dict[str, str] = {}  # service name -> id
        self.lost_nodes: dict[str, str] = {}  # hostname -> when the swarm marked it down (RFC 3339)
        self._back: set[str] = set()
        self._nodes: dict[str, NodeInfo] = {}
        self._nodes_at = float("-inf")
        self.group_services: dict[int, str] = {}  # group index -> service id
        self.master_service: str | None = None
        self._seen: dict[str, set[str]] = {}  # service id -> every task id seen (restarts = len - 1)
        self._held: dict[str, Part] = {}  # service id -> the group as it ended with a never-restarted exit
        self._copied = False
        self._stopped = False
        self._replaced: set[str] = set()  # the master's tasks before the last restart_master (dead, or gone)
        self._replaced_at = 0.0  # when restart_master asked for a new master task (monotonic)

    with_packages: tuple[str, ...] = ()  # --with: run on the image derived from the base with these
    _resolved: str | None = None

    def _image(self, plan: Plan) -> str:
        from launcher import image as image_mod

        if self._resolved is not None:
            return self._resolved
        base = self.image or image_mod.default_tag(image_mod.flavour_for(bool(plan.gpu_uuids)))
        if not self.with_packages:
            return base
        # The derived image is made on this engine (like `launcher build --with`); other nodes need it pushed.
        from launcher.image_build import build_extras_image

        self._resolved = build_extras_image(base, image_mod.parse_extras(self.with_packages),
                                            progress=self.progress).tag
        return self._resolved

    def _check(self, run: PreparedRun, swarm: SwarmEngine, nodes: list[NodeInfo], image: str) -> None:
        """Everything that can be known before creating anything; all problems at once, the gravest type."""
        problems: list[tuple[type[LauncherError], str, str]] = []
        ready = [n for n in nodes if n.ready]
        if len(ready) <= 1 and not swarm.image_here(image):
            problems.append((MissingDependency, f"image {image} is not on this engine (the swarm's only node)",
                             "`launcher build` makes it (--offline without a registry); or pass --image"))
        elif len(ready) > 1 and "/" not in image.split("@")[0]:  # localhost:5000/x and user/x name where to pull
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
        rid = {RUN_LABEL: run.run_id}
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
        give_to(run.results_dir, uid, gid)  # the master writes there as that user
        cpus = [n.nano_cpus for n in nodes if n.ready and n.nano_cpus]
        group_constraints, self.group_where = group_placement(
            self.group_choice, nodes, self.placement, [len(g.share.gpu_uuids) for g in run.plan.groups])
        master, groups = service_specs(run, image=image, placement=self.placement, uid_gid=(uid, gid),
                                       max_cpus=int(min(cpus) // 10**9) if cpus else None,
                                       group_constraints=group_constraints)
        self.progress(f"swarm: {len([n for n in nodes if n.ready])} ready node(s); {self.placement.why}; "
                      f"{self.group_where}")
        swarm.create_network(network_name(run.run_id), swarm_labels(run, "network", uid))
        sec = secret_name(run.run_id)
        sec_id = swarm.create_secret(sec, run.secret, swarm_labels(run, "secret", uid))
        for spec in (master, *groups):
            sid = swarm.create_service(spec, sec_id, sec, (uid, gid))
            self.service_ids[spec.name] = sid
            self._seen[sid] = set()
        self.master_service = self.service_ids[master.name]
        self.group_services = {g.index: self.service_ids[s.name] for g, s in zip(run.plan.groups, groups)}

    def specs(self, run: PreparedRun) -> LaunchSpecs:
        """The run's services (:func:`service_specs`) before any node is asked: the master's placement as
        ``--swarm-master`` implies it until the start resolves it over the nodes, the image as resolved so far."""
        from launcher import image as image_mod

        image = self._resolved or self.image or image_mod.default_tag(image_mod.flavour_for(bool(run.plan.gpu_uuids)))
        master, groups = service_specs(run, image=image, placement=self.placement or assumed_placement(self.master_choice),
                                       uid_gid=container_user())
        return launch_specs(master, groups)

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

    def _watch_nodes(self, tasks: dict[str, list[TaskInfo]]) -> dict[str, NodeInfo]:
        """The swarm's nodes (asked every ``NODE_WATCH_S``); says once, as a progress line, when a node that ran
        a task of this run goes down (which one, and when) and when it is back. Only reads."""
        assert self.swarm is not None
        now = time.monotonic()
        if now - self._nodes_at >= NODE_WATCH_S:
            self._nodes_at = now
            self._nodes = {n.id: n for n in self.swarm.nodes()}
            ours = {t.node_id for ts in tasks.values() for t in ts}
            for nid, n in self._nodes.items():
                if n.state == "down" and nid in ours and n.hostname not in self.lost_nodes:
                    self.lost_nodes[n.hostname] = f"{n.updated_at}Z" if n.updated_at else "unknown"
                    self.progress(f"swarm: node {n.hostname} lost at {self.lost_nodes[n.hostname]} (down); "
                                  "the swarm reschedules its groups on other nodes")
                elif n.state == "ready" and n.hostname in self.lost_nodes and n.hostname not in self._back:
                    self._back.add(n.hostname)
                    self.progress(f"swarm: node {n.hostname} is back (ready); its old tasks are not restarted")
        return self._nodes

    def poll(self) -> BackendStatus:
        """The master's and each group's state from their tasks (one ``docker service ps`` call); restarts are
        the tasks the swarm started after a service's first. Only reads."""
        assert self.swarm is not None and self.run is not None and self.master_service is not None
        tasks = self.swarm.tasks(list(self.service_ids.values()))
        nodes = self._watch_nodes(tasks)

        def part(name: str, sid: str, max_attempts: int | None) -> Part:
            if sid in self._held:  # scaled to 0: a task the swarm started before that is not the group's state
                return self._held[sid]
            ts = tasks.get(sid, [])
            self._seen.setdefault(sid, set()).update(t.id for t in ts)  # the swarm forgets old tasks; we do not
            restarts = max(0, len(self._seen[sid]) - 1)
            if sid == self.master_service and self._awaiting_new_master(ts):
                return Part(name, PartState.STARTING, None, restarts, "", "new")
            state, code = service_state(ts, max_attempts, restarts)
            t = latest(ts)
            node = nodes.get(t.node_id) if t else None
            seen = Part(name, state, code, restarts, t.container_id[:12] if t else "", t.state if t else "new",
                        node=node.hostname if node else "", lost=lost_node(ts, nodes))
            if max_attempts is not None and state == PartState.FAILED and code in NEVER_RESTARTED_EXITS:
                # The swarm's on-failure policy would start another task after RESTART_DELAY_S, which would end
                # the same way: no replica, so it starts none (or stops the one it started before this poll).
                assert self.swarm is not None
                self.swarm.scale_to_zero(sid)
                self._held[sid] = seen
            return seen

        budget = self.run.config.restart_budget or None  # budget 0: condition "none", never restarted
        return BackendStatus(part("master", self.master_service, None),
                             {i: part(f"group-{i}", sid, budget) for i, sid in self.group_services.items()})

    def fetch_results(self) -> None:
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

    def _awaiting_new_master(self, ts: list[TaskInfo]) -> bool:
        """Whether the swarm has yet to list the master task :meth:`restart_master` asked for (the update is
        asynchronous: until then the dead task is the newest, and must not be judged dead a second time). Past
        ``start_timeout_s`` the dead task is reported again, and the supervisor's budget decides."""
        if not self._replaced or time.monotonic() - self._replaced_at > self.start_timeout_s:
            return False
        return all(t.id in self._replaced for t in ts)

    def restart_master(self) -> None:
        """A new master task in place of the dead one (like ``docker service update --force``): the same service
        name on the run's network (the groups dial it and reconnect), image, environment, secret and mounts. A
        master whose results are in a named volume is pinned to the dead task's node, where the volume with its
        checkpoints is (:func:`recovery_constraints`); a bound results directory is where the placement already
        puts it."""
        assert self.swarm is not None and self.master_service is not None and self.placement is not None
        ts = self.swarm.tasks([self.master_service])[self.master_service]
        dead = latest(ts)
        self._replaced = {t.id for t in ts} | self._seen.get(self.master_service, set())
        self._replaced_at = time.monotonic()
        self.swarm.force_update(self.master_service,
                                constraints=recovery_constraints(self.placement, dead.node_id if dead else ""))

    def restart_group(self, index: int) -> None:
        """A new task for group ``index`` (like ``docker service update --force``)."""
        assert self.swarm is not None
        self.swarm.force_update(self.group_services[index])

    def stop(self, *, grace_s: float = STOP_GRACE_S) -> None:
        if self._stopped or self.run is None or self.swarm is None:
            return
        self._stopped = True
        teardown(self.swarm.engine, self.run.run_id, grace_s=grace_s, run_dir=self.run.run_dir,
                 image=self._image(self.run.plan))

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"backend": self.name, "launcher_pid": os.getpid()}
        if self.run is not None:
            d.update(network=network_name(self.run.run_id), secret=secret_name(self.run.run_id),
                     image=self._image(self.run.plan),
                     services={name: sid[:12] for name, sid in self.service_ids.items()})
            if self.placement is not None:
                d.update(master_placement=self.placement.why, results_mount=self.placement.results,
                         group_placement=self.group_where)
            if self.lost_nodes:
                d.update(lost_nodes=dict(self.lost_nodes))
        return d


    @classmethod
    def from_config(cls, cfg: RunConfig, *, on_event: Event | None = None) -> "SwarmBackend":
        backend = cls(image=cfg.image, progress=event_lines(on_event), master_placement=cfg.swarm_master,
                      group_placement=cfg.swarm_groups)
        backend.with_packages = tuple(cfg.with_packages)
        return backend

    def check_env(self, cfg: RunConfig, plan: Plan, run_id: str) -> dict[str, Any]:
        """``--env-dir`` is refused (a directory on this host is not on the other nodes); with the image on this
        engine, the env is made in a throw-away container of it, as for the Docker backend."""
        from launcher.backends import envcheck
        from launcher.engine.images import image_exists

        code = user_code(cfg)
        if code.dirs:
            what = f"--env-dir {cfg.env_dir}" if cfg.env_dir is not None else f"--algo/--model {code.code_dirs[0]}"
            raise BadInput(f"{what}: the swarm backend cannot mount a directory of this host on other nodes",
                           hint="make it a package (`pip wheel --no-deps -w dist DIR`), add it to the image with "
                           "`launcher up --with dist/<file>.whl` and name it as MODULE:Name; or use --backend docker")
        image = self._image(plan)  # the derived image of --with is made here once; start uses the same
        if self._engine is None:
            self._engine = Engine()  # kept for the start (connect_swarm)
        engine = self._engine
        if not image_exists(image, engine.client):
            return {}  # start() says the image is missing, or the nodes pull it
        uid, gid = container_user()
        probe = envcheck.probe_in_image(engine, image, cfg, {RUN_LABEL: run_id, ROLE_LABEL: "envcheck"},
                                        f"{uid}:{gid}")
        if not probe.ok:
            raise envcheck.refusal(cfg, probe, containers=True)
        return probe.info

    @classmethod
    def find(cls, run_id: str, run_dir: RunDir | None, record: dict[str, Any]) -> SwarmRun:
        return SwarmRun(run_id, run_dir, record)
