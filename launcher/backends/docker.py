"""Docker backend: the master and each worker group as containers on a private network
(``launcher up --backend docker``).

One run is, on the engine:

* a bridge network ``launcher-<run id>``, created ``--internal``: containers reach each other by name,
  nothing outside (no route out, no published port unless asked);
* a master container ``launcher-<run id>-master`` with the run's results directory bind-mounted at
  ``/results``; it listens on 0.0.0.0:7100 of that network only. Killed by a signal, it is started again in place:
  by the supervisor (:meth:`DockerBackend.restart_master`) on an attached run, by the engine's ``on-failure``
  policy with ``--master-restarts`` on a detached one (:func:`~launcher.backends.docker_specs.master_restart_max`);
* one container per worker group ``launcher-<run id>-group-<N>``, its GPUs handed over by UUID
  (``NVIDIA_VISIBLE_DEVICES`` and a DeviceRequest), its CPUs limited (``nano_cpus``). A group that dies is
  restarted by the supervisor within the run's restart budget (no engine restart policy, so a group that
  exited 4 or 5 is never restarted: :func:`~launcher.backends.docker_specs.group_restart_max`); a detached run, which has no supervisor,
  gets the engine's ``on-failure`` policy with the budget instead.

Every container runs as the invoking user with no capabilities, ``no-new-privileges``, a read-only root
file system and memory and pids limits (:func:`~launcher.backends.containers.master_limits`), reads the run
secret from a 0400 file of its own user bind-mounted read-only (never its environment), and carries
``launcher.*`` labels, so :meth:`DockerBackend.find` finds a run's parts even after the launcher itself was
killed (:func:`teardown` is the one way they go away). Every call to the engine goes through
:mod:`launcher.engine`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from launcher.backends import envcheck
from launcher.backends.base import Backend, BackendStatus, Event, PreparedRun
from launcher.backends.containers import (MASTER_PORT, container_user, give_to, group_name, labels, master_name,
                                          network_name, write_secret_file)
from launcher.backends.specs import LaunchSpecs
from launcher.backends.docker_elastic import ElasticContainers, group_leases
from launcher.backends.docker_run import DockerRun, container_part, container_state, teardown
from launcher.backends.docker_specs import container_specs, launch_specs
from launcher.engine.client import Engine, engine_unavailable_reason
from launcher.engine.errors import ENGINE_RESTART_WINDOW_S, EngineUnreachable, outlast_outage
from launcher.engine.labels import RUN_LABEL, USER_LABEL
from launcher.config import RunConfig
from launcher.errors import BadInput, MissingDependency, NoResources
from launcher.gpu import handover
from launcher.gpu.placement import Plan
from launcher.runs import RunDir

log = logging.getLogger(__name__)

Progress = Callable[[str], None]

NVIDIA_TOOLKIT_HINT = (
    "install nvidia-container-toolkit and register it with Docker: "
    "`sudo apt-get install -y nvidia-container-toolkit && sudo nvidia-ctk runtime configure --runtime=docker "
    "&& sudo systemctl restart docker` (https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/"
    "latest/install-guide.html); or run on CPU with --gpus none"
)


def check_gpu_runtime(plan: Plan, runtimes: tuple[str, ...]) -> None:
    """Raise MissingDependency when ``plan`` uses GPUs and the engine has no NVIDIA runtime."""
    if plan.gpu_uuids and "nvidia" not in runtimes:
        raise MissingDependency(
            f"the plan puts processes on {len(plan.gpu_uuids)} GPU(s) ({', '.join(plan.gpu_uuids)}) but this Docker "
            f"engine has no NVIDIA runtime (runtimes: {', '.join(runtimes) or 'none'}); nothing was started",
            hint=NVIDIA_TOOLKIT_HINT)


class DockerBackend(ElasticContainers, Backend):
    """Runs a :class:`PreparedRun` as containers (like ``docker network create`` + ``docker run`` each)."""

    name = "docker"
    restart_grace_s = 0.0  # an attached run's groups have no engine restart policy: the supervisor restarts them
    outlives_launcher = True
    recovers_master = True

    def __init__(self, image: str | None = None, *, progress: Progress | None = None, engine: Engine | None = None,
                 gpu_runtime: bool | None = None, publish_port: int | None = None, build: str = "auto",
                 on_build: Callable[[Any], None] | None = None, with_packages: tuple[str, ...] = ()) -> None:
        """
        Args:
            image: the worker image; None: :func:`launcher.image.default_tag` of the plan's flavour.
            progress: receives human-readable lines (an image build, what was started).
            engine: a connected engine (default: ``docker.from_env()`` at start).
            gpu_runtime: override the NVIDIA runtime detection (tests); None: ask the engine.
            publish_port: publish the master's port on the host's 127.0.0.1 (off by default).
            build: how a missing image is built: ``auto``, ``online`` or ``offline`` (``--build``).
            on_build: receives a missing image's build progress (``launcher.image_build.BuildStatus``).
            with_packages: run on ``image`` with these added (``--with``): the derived image
                :func:`launcher.image_build.ensure_run_image` builds or finds.
        """
        self.image = image
        self.with_packages = tuple(with_packages)
        self._resolved: str | None = None  # the image the run's containers use, once made sure of
        self.progress = progress or (lambda line: None)
        self._engine = engine
        self.gpu_runtime = gpu_runtime
        self.publish_port = publish_port
        self.build = build
        self.on_build = on_build
        self.run: PreparedRun | None = None
        self._leases: tuple[tuple[str, ...], Any] = ((), None)  # (UUIDs handed to the master, their lease dir)
        self.ids: dict[str, str] = {}  # container name -> id
        self.group_ids: dict[int, str] = {}
        self.master_id: str | None = None
        self._stopped = False
        self._created = False  # whether this backend created anything on the engine that stop() must remove
        self._master_restarts = 0  # new masters started in place of a dead one (restart_master)
        self._own_restarts: dict[int, int] = {}  # group -> restarts done through restart_group
        self._master_stop_seen = False  # idle() saw the master stop; from then on it only sleeps
        self._owned: dict[int, tuple[str, ...]] = {}  # an elastic run's groups that hold their GPUs' leases
        self._yielding: set[int] = set()  # an elastic run's groups asked to leave (docker_elastic)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = Engine()
        return self._engine

    def _image(self, plan: Plan) -> str:
        from launcher import image as image_mod

        if self._resolved is not None:
            return self._resolved
        return self.image or image_mod.default_tag(image_mod.flavour_for(bool(plan.gpu_uuids)))

    def resolve_image(self, plan: Plan) -> str:
        """The image the run's containers use, built first when missing: the base (``--image`` or the default
        tag), and with ``--with`` the image derived from it (like ``launcher build --with``)."""
        from launcher import image as image_mod
        from launcher.image_build import ensure_run_image

        if self._resolved is None:
            self._resolved = ensure_run_image(
                self._image(plan), self.with_packages, mode=self.build, progress=self.progress,
                flavour=image_mod.flavour_for(bool(plan.gpu_uuids)), client=self.engine.client, on_build=self.on_build)
        return self._resolved

    def _check(self, run: PreparedRun) -> None:
        """Everything that can be known before creating anything; all problems at once."""
        runtimes = self.engine.runtimes()
        if self.gpu_runtime is None:
            check_gpu_runtime(run.plan, runtimes)
        leftovers = self.engine.containers({RUN_LABEL: run.run_id})
        nets = self.engine.networks({RUN_LABEL: run.run_id})
        if leftovers or nets:
            names = [c.name for c in leftovers] + [n for _, n, _ in nets]
            raise BadInput(f"run {run.run_id} still has containers or a network on the engine: {', '.join(names)}",
                           hint=f"`launcher down {run.run_id}` removes them (results are kept); then run again")

    def create(self, run: PreparedRun) -> None:
        """Create the network and every container, started none (like ``docker create``). ``start`` calls it;
        tests call it alone to inspect what a plan becomes."""
        self.run = run
        self._check(run)
        image = self.resolve_image(run.plan)
        gpu_runtime = self.engine.has_nvidia_runtime() if self.gpu_runtime is None else self.gpu_runtime
        uid, gid = container_user()
        give_to(run.results_dir, uid, gid)
        master, groups = container_specs(run, image=image, gpu_runtime=gpu_runtime, uid_gid=(uid, gid),
                                         publish_port=self.publish_port, engine_cpus=self.engine.cpu_count())
        # From here on stop() removes the run's parts; a refused start (above) must leave another
        # launcher's containers of the same run alone.
        self._created = True
        write_secret_file(run.run_id, run.secret, uid, gid)  # teardown removes it with the containers
        # Publishing needs a route out of the network; a private run stays --internal.
        self.engine.create_network(network_name(run.run_id), labels(run.run_id, run.results_dir, "network", uid=uid),
                                   internal=self.publish_port is None)
        self.master_id = self.engine.create(master)
        self.ids[master.name] = self.master_id
        for g, cs in zip(run.plan.groups, groups):
            cid = self.engine.create(cs)
            self.ids[cs.name] = cid
            self.group_ids[g.index] = cid

    def specs(self, run: PreparedRun) -> LaunchSpecs:
        """The run's containers (:func:`container_specs`) before any engine is asked: the image as resolved so
        far (``--image`` or the default tag until :meth:`resolve_image` made sure of it)."""
        master, groups = container_specs(run, image=self._image(run.plan), gpu_runtime=True,
                                         publish_port=self.publish_port)
        return launch_specs(run, master, groups)

    def start(self, run: PreparedRun) -> None:
        self.create(run)
        # The master takes the run's GPU leases first thing; the launcher lets go of them right before and
        # confirms from /proc/locks that the master holds them before the groups start (launcher.gpu.handover).
        # With a lease broker there is no gap: the launcher's lease stays until the broker has tied it to the master.
        lease = (run.reservation if run.reservation is not None and run.reservation.uuids
                 and not run.reservation.brokered else None)
        where = handover.lease_dir_of(lease) if lease else None
        uuids = handover.hand_over(lease) if lease else ()
        master_leases, owned = group_leases(run) if lease else (None, {})
        # The master holds them now (an elastic run's groups hold those of the GPUs the master does not use); a new
        # master (restart_master) takes its own again.
        self._leases = (uuids if master_leases is None else master_leases, where)
        self._owned = owned
        # Groups start with the master: they dial with back-off until it listens (it imports TF first).
        self._start_master()
        for cid in self.group_ids.values():
            self.engine.start(cid)
        for index, owned_uuids in owned.items():
            self._confirm_group_leases(index, owned_uuids)
        log.info("started run %s: master %s and %d group containers on network %s", run.run_id,
                 (self.master_id or "")[:12], len(self.group_ids), network_name(run.run_id))

    def poll(self) -> BackendStatus:
        """The master's and each group's state from ``docker inspect``; restarts as the engine counts them plus
        the supervisor's own. Only reads."""
        assert self.master_id is not None
        return BackendStatus(container_part("master", self.engine.inspect(self.master_id), self._master_restarts),
                             {i: self.yielded(i, container_part(f"group-{i}", self.engine.inspect(cid),
                                                                self._own_restarts.get(i, 0)))
                              for i, cid in self.group_ids.items()})

    def idle(self, seconds: float) -> None:
        """Block on the master's container (``docker wait``, up to ``seconds``): the run's end is seen at once,
        not at the next poll. Once it has been seen to stop, or when the engine does not answer, this sleeps
        (the next poll decides; a state the poll still counts alive must not turn this into a busy loop)."""
        t0 = time.monotonic()
        if self.master_id is not None and not self._master_stop_seen:
            if self.engine.wait_stopped(self.master_id, seconds):
                self._master_stop_seen = True
                return
        time.sleep(max(0.0, seconds - (time.monotonic() - t0)))

    def restart_master(self) -> None:
        """Start the dead master's container again (like ``docker start``): its name on the run's network, mounts,
        environment and secret are the same, so the groups reconnect to it. It takes the GPU leases again as at
        the start; one taken by another run in the gap ends this run (NoResources), as at the start."""
        self._master_stop_seen = False
        self._master_restarts += 1
        self._start_master()

    def _start_master(self) -> None:
        """Start the master's container and, when the run has GPU leases, confirm from ``/proc/locks`` that it
        holds them (:func:`launcher.gpu.handover.confirm_held_by_container`)."""
        assert self.master_id is not None
        master_id = self.master_id
        uuids, where = self._leases
        self.engine.start(master_id)
        reservation = self.run.reservation if self.run is not None else None
        if reservation is not None and reservation.brokered and reservation.uuids:
            self._tie_to_master(reservation, master_id)
        if uuids:
            def exit_code() -> int | None:
                c = self.engine.inspect(master_id)
                return -1 if c is None else c.exit_code
            handover.confirm_held_by_container(uuids, master_id, exit_code=exit_code, where=where)

    def _tie_to_master(self, reservation: Any, master_id: str) -> None:
        """With a lease broker: tie the run's leases to the master container's main process (its host pid from
        ``docker inspect``, State.Pid; it runs as this user's uid, :func:`container_user`), so they outlive a
        detached launcher and end when the master does. The launcher's own tie keeps them meanwhile: no gap.
        From then on the launcher's release leaves them (as after the file hand-over): they end when the master
        has exited and so has this launcher (the latter is at most the teardown's seconds later)."""
        info = self.engine.inspect(master_id)
        pid = info.pid if info is not None else 0
        if pid <= 0:
            code = None if info is None else info.exit_code
            raise NoResources(f"the master container {master_id[:12]} is not running (exit code {code}), so its GPU "
                              "leases cannot be tied to it", hint="see `launcher logs` for why the master stopped")
        reservation.tie(pid)
        reservation.hand_to_master()  # a detached launcher's exit must not release what the master now holds

    def restart_group(self, index: int) -> None:
        """Start group ``index``'s exited container again (like ``docker start``)."""
        self.engine.start(self.group_ids[index])  # counted once started: a start that failed spends no budget
        self._own_restarts[index] = self._own_restarts.get(index, 0) + 1

    def stop(self, *, grace_s: float = 8.0) -> None:
        if self._stopped or self.run is None or not self._created:
            return
        self._stopped = True
        run = self.run

        def again(exc: EngineUnreachable) -> None:
            log.warning("%s; waiting for the engine to remove run %s", exc.message, run.run_id)

        # An engine restarting right now is waited for: its containers and network must still go.
        restarted = {group_name(run.run_id, i): n for i, n in self._own_restarts.items()}
        restarted[master_name(run.run_id)] = self._master_restarts
        outlast_outage(lambda: teardown(self.engine, run.run_id, grace_s=grace_s, run_dir=run.run_dir,
                                        restarted=restarted),
                       window_s=ENGINE_RESTART_WINDOW_S, poll_s=2.0, on_wait=again)

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"backend": self.name, "launcher_pid": os.getpid()}
        if self.run is not None:
            d.update(network=network_name(self.run.run_id), image=self._image(self.run.plan),
                     containers={name: cid[:12] for name, cid in self.ids.items()})
        return d

    @classmethod
    def from_config(cls, cfg: RunConfig, *, on_event: Event | None = None) -> "DockerBackend":
        if on_event is None:
            return cls(image=cfg.image, build=cfg.build, with_packages=cfg.with_packages)
        return cls(image=cfg.image, build=cfg.build, progress=lambda line: on_event("event", {"message": line}),
                   on_build=lambda st: on_event("build", st.to_dict()), with_packages=cfg.with_packages)

    def check_env(self, cfg: RunConfig, plan: Plan, run_id: str) -> dict[str, Any]:
        """Make sure of the run's image (built when missing; the start uses the same one), then make the env in a
        throw-away container of it with the run's user, ``--env-dir`` mount and labels, and no network."""
        image = self.resolve_image(plan)
        uid, gid = container_user()
        probe = envcheck.probe_in_image(self.engine, image, cfg,
                                        labels(run_id, cfg.results / run_id, "envcheck", uid=uid), f"{uid}:{gid}")
        if not probe.ok:
            raise envcheck.refusal(cfg, probe, containers=True)
        return probe.info

    def preflight(self, plan: Plan) -> None:
        """An engine that answers and, for a plan on GPUs, its NVIDIA runtime (like ``docker info``)."""
        runtimes = self.engine.runtimes()
        if self.gpu_runtime is None:
            check_gpu_runtime(plan, runtimes)

    @classmethod
    def find(cls, run_id: str, run_dir: RunDir | None, record: dict[str, Any]) -> "DockerRun":
        return DockerRun(run_id, run_dir, record)

    @classmethod
    def live_run_ids(cls, root: Path, *, user: str | None) -> set[str]:
        """Every run with a labelled container or network on the engine (none when no engine answers)."""
        if engine_unavailable_reason() is not None:
            return set()
        engine = Engine()
        try:
            flt: dict[str, str | None] = {RUN_LABEL: None}
            if user is not None:
                flt[USER_LABEL] = user
            rids = {c.labels.get(RUN_LABEL, "") for c in engine.containers(flt)}
            rids |= {lab.get(RUN_LABEL, "") for _, _, lab in engine.networks(flt)}
        finally:
            engine.close()
        return {r for r in rids if r}


__all__ = ["MASTER_PORT", "DockerBackend", "DockerRun", "check_gpu_runtime", "container_part", "container_specs",
           "container_state", "group_name", "master_name", "network_name", "teardown"]
