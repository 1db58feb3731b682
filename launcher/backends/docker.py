"""Docker backend: the master and each worker group as containers on a private network
(``launcher up --backend docker``).

One run is, on the engine:

* a bridge network ``launcher-<run id>``, created ``--internal``: containers reach each other by name,
  nothing outside (no route out, no published port unless asked);
* a master container ``launcher-<run id>-master`` with the run's results directory bind-mounted at
  ``/results``; it listens on 0.0.0.0:7100 of that network only;
* one container per worker group ``launcher-<run id>-group-<N>``, its GPUs handed over by UUID
  (``NVIDIA_VISIBLE_DEVICES`` and a DeviceRequest), its CPUs limited (``nano_cpus``), restarted by the
  engine (``on-failure`` with the run's restart budget), so the supervisor only watches
  (``restarts_groups = True``).

Every container runs as the invoking user with no capabilities, ``no-new-privileges`` and a read-only root
file system, and carries ``launcher.*`` labels, so ``launcher status``/``down`` find a run's parts even
after the launcher itself was killed (:func:`teardown` is the one way they go away). Every call to the
engine goes through :mod:`launcher.docker_client`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from launcher import docker_client as dc
from launcher.backends.base import Backend, BackendStatus, PreparedRun, ProcState, ProcStatus
from launcher.docker_client import ContainerSnapshot, ContainerSpec, Engine
from launcher.errors import BadInput, MissingDependency
from launcher.placement import Plan, ProcessShare
from launcher.runs import owner_uid_gid
from worker.spec import SECRET_ENV, SPEC_ENV, RunSpec

log = logging.getLogger(__name__)

MASTER_PORT = 7100  # inside the run's network; every run has its own network, so a fixed port is fine
RESULTS_MOUNT = "/results"
# The engine's on-failure back-off is 100 ms doubling per consecutive failure; a group still exited after
# this long was stopped in a way the policy ignores.
MANUAL_RESTART_AFTER_S = 5.0
Progress = Callable[[str], None]

NVIDIA_TOOLKIT_HINT = (
    "install nvidia-container-toolkit and register it with Docker: "
    "`sudo apt-get install -y nvidia-container-toolkit && sudo nvidia-ctk runtime configure --runtime=docker "
    "&& sudo systemctl restart docker` (https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/"
    "latest/install-guide.html); or run on CPU with --gpus none"
)


# The image's own unprivileged user (Dockerfile ARG UID). Containers normally run as the invoking user so
# their files on the bind mount are that user's; a launcher run by root itself (no sudo, so no SUDO_UID to
# act for) would make that root inside the container, so its containers run as this user instead.
UNPRIVILEGED_UID_GID = (10001, 10001)


def container_user() -> tuple[int, int]:
    """uid, gid the run's containers run as: the invoking user (``SUDO_UID`` under sudo), never root."""
    uid, gid = owner_uid_gid()
    return UNPRIVILEGED_UID_GID if uid == 0 else (uid, gid)


def network_name(run_id: str) -> str:
    return f"launcher-{run_id}"


def master_name(run_id: str) -> str:
    return f"launcher-{run_id}-master"


def group_name(run_id: str, index: int) -> str:
    return f"launcher-{run_id}-group-{index}"


def labels(run: PreparedRun, role: str, *, group: int | None = None, gpus: tuple[str, ...] = (),
           uid: int | None = None) -> dict[str, str]:
    """The ``launcher.*`` labels of one container (or, with role ``network``, the run's network)."""
    return {
        dc.RUN_LABEL: run.run_id,
        dc.ROLE_LABEL: role,
        dc.GROUP_LABEL: "" if group is None else str(group),
        dc.GPUS_LABEL: ",".join(gpus),
        dc.RESULTS_LABEL: str(run.results_dir.resolve()),
        dc.USER_LABEL: str(owner_uid_gid()[0] if uid is None else uid),
    }


def container_run_spec(spec: RunSpec) -> RunSpec:
    """The spec as the containers see it: results at /results, the master on 0.0.0.0:7100 of the run's
    network, groups dialling the master container by name."""
    return dataclasses.replace(spec, results_dir=RESULTS_MOUNT, master_host="0.0.0.0", master_port=MASTER_PORT,
                               connect_host=master_name(spec.run_id))


def _device_env(share: ProcessShare) -> dict[str, str]:
    env = {k: v for k, v in share.env.items()}
    if share.gpu_uuids:
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(share.gpu_uuids)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    else:
        # "void": the NVIDIA runtime, if the engine has one, mounts no GPU at all (not even the default "all").
        env["NVIDIA_VISIBLE_DEVICES"] = "void"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _nano_cpus(cpus: float, limit: int | None) -> int:
    if limit is not None:
        cpus = min(cpus, float(limit))
    return max(0, int(round(cpus * 1e9)))


def container_specs(run: PreparedRun, *, image: str, gpu_runtime: bool, uid_gid: tuple[int, int] | None = None,
                    publish_port: int | None = None,
                    engine_cpus: int | None = None) -> tuple[ContainerSpec, list[ContainerSpec]]:
    """The master's and each worker group's container, from the plan. Pure: no engine is asked.

    Args:
        image: the worker image.
        gpu_runtime: whether the engine has the NVIDIA runtime; only then do containers get DeviceRequests.
        uid_gid: who the containers run as (default: :func:`container_user`, the invoking user, never root).
        publish_port: publish the master's port on the host's 127.0.0.1 at this port (None: not published).
        engine_cpus: CPUs of the engine's host; a CPU limit above it is lowered to it (the engine refuses
            more, and a plan made on this host may meet a remote engine).
    """
    uid, gid = uid_gid or container_user()
    user = f"{uid}:{gid}"
    cspec = container_run_spec(run.spec)
    spec_json = cspec.to_json()
    net = network_name(run.run_id)
    base_env = {SPEC_ENV: spec_json, SECRET_ENV: run.secret, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                "TF_ENABLE_ONEDNN_OPTS": "0", "MPLBACKEND": "Agg"}
    m = run.plan.master
    menv = {**base_env, **_device_env(m), "LAUNCHER_TF_THREADS": str(max(1, int(m.cpus)))}
    master = ContainerSpec(
        name=master_name(run.run_id), image=image, command=("master",), environment=menv,
        labels=labels(run, "master", gpus=m.gpu_uuids, uid=uid), network=net, user=user,
        nano_cpus=_nano_cpus(m.cpus, engine_cpus), gpu_uuids=m.gpu_uuids if gpu_runtime else (), restart_max=None,
        binds={str(run.results_dir.resolve()): RESULTS_MOUNT},
        ports={MASTER_PORT: publish_port} if publish_port is not None else {},
    )
    groups = []
    for g in run.plan.groups:
        genv = {**base_env, **_device_env(g.share), "LAUNCHER_MASTER_ADDR": f"{cspec.connect_host}:{MASTER_PORT}",
                "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "LAUNCHER_TF_THREADS": "1"}
        groups.append(ContainerSpec(
            name=group_name(run.run_id, g.index), image=image, command=("group", "--index", str(g.index)),
            environment=genv, labels=labels(run, "group", group=g.index, gpus=g.share.gpu_uuids, uid=uid),
            network=net, user=user, nano_cpus=_nano_cpus(g.share.cpus, engine_cpus),
            gpu_uuids=g.share.gpu_uuids if gpu_runtime else (), restart_max=run.config.restart_budget,
        ))
    return master, groups


def check_gpu_runtime(plan: Plan, runtimes: tuple[str, ...]) -> None:
    """Raise MissingDependency when ``plan`` uses GPUs and the engine has no NVIDIA runtime."""
    if plan.gpu_uuids and "nvidia" not in runtimes:
        raise MissingDependency(
            f"the plan puts processes on {len(plan.gpu_uuids)} GPU(s) ({', '.join(plan.gpu_uuids)}) but this Docker "
            f"engine has no NVIDIA runtime (runtimes: {', '.join(runtimes) or 'none'}); nothing was started",
            hint=NVIDIA_TOOLKIT_HINT)


def proc_state(snap: ContainerSnapshot | None, restart_budget: int | None, extra_restarts: int = 0) -> ProcState:
    """Map a container's Docker state to a :class:`ProcState`.

    A group that exited non-zero with restarts left is RESTARTING: the engine's ``on-failure`` policy starts
    it again after a short back-off (or, after a ``docker kill``, which the engine counts as a manual stop,
    :meth:`DockerBackend.poll` does). With the budget spent (``RestartCount`` plus ``extra_restarts``, the
    backend's own restarts, reached it) it is LOST. A container that vanished (removed behind our back) is
    LOST too: nothing will bring it back.
    """
    if snap is None:
        return ProcState.LOST
    if snap.status == "created":
        return ProcState.STARTING
    if snap.status in ("running", "paused"):
        return ProcState.RUNNING
    if snap.status == "restarting":
        return ProcState.RESTARTING
    if snap.exit_code == 0:
        return ProcState.EXITED
    if restart_budget is None:
        return ProcState.FAILED
    return ProcState.LOST if snap.restart_count + extra_restarts >= restart_budget else ProcState.RESTARTING


class DockerBackend(Backend):
    """Runs a :class:`PreparedRun` as containers (like ``docker network create`` + ``docker run`` each)."""

    name = "docker"
    restarts_groups = True

    def __init__(self, image: str | None = None, *, progress: Progress | None = None, engine: Engine | None = None,
                 gpu_runtime: bool | None = None, publish_port: int | None = None) -> None:
        """
        Args:
            image: the worker image; None: :func:`launcher.image.default_tag` of the plan's flavour.
            progress: receives human-readable lines (an image build, what was started).
            engine: a connected engine (default: ``docker.from_env()`` at start).
            gpu_runtime: override the NVIDIA runtime detection (tests); None: ask the engine.
            publish_port: publish the master's port on the host's 127.0.0.1 (off by default).
        """
        self.image = image
        self.progress = progress or (lambda line: None)
        self._engine = engine
        self.gpu_runtime = gpu_runtime
        self.publish_port = publish_port
        self.run: PreparedRun | None = None
        self.ids: dict[str, str] = {}  # container name -> id
        self.group_ids: dict[int, str] = {}
        self.master_id: str | None = None
        self._stopped = False
        self._created = False  # whether this backend created anything on the engine that stop() must remove
        self._own_restarts: dict[int, int] = {}  # group -> restarts the backend did itself (see poll)
        self._exited_since: dict[int, float] = {}

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = Engine()
        return self._engine

    def _image(self, plan: Plan) -> str:
        from launcher import image as image_mod

        if self.image:
            return self.image
        flavour = image_mod.Flavour.GPU if plan.gpu_uuids else image_mod.Flavour.CPU
        return image_mod.default_tag(flavour)

    def _ensure_image(self, plan: Plan) -> str:
        from launcher import image as image_mod

        name = self._image(plan)
        if image_mod.image_exists(name, self.engine.client):
            return name
        # A host that built the debootstrap base before has no registry, most likely; build offline there too.
        offline = image_mod.image_exists(image_mod.OFFLINE_BASE_IMAGE, self.engine.client)
        flavour = image_mod.Flavour.GPU if plan.gpu_uuids else image_mod.Flavour.CPU
        return image_mod.ensure_image(name, offline=offline, progress=self.progress, flavour=flavour,
                                      client=self.engine.client)

    def _check(self, run: PreparedRun) -> None:
        """Everything that can be known before creating anything; all problems at once."""
        runtimes = self.engine.runtimes()
        if self.gpu_runtime is None:
            check_gpu_runtime(run.plan, runtimes)
        leftovers = self.engine.containers({dc.RUN_LABEL: run.run_id})
        nets = self.engine.networks({dc.RUN_LABEL: run.run_id})
        if leftovers or nets:
            names = [c.name for c in leftovers] + [n for _, n, _ in nets]
            raise BadInput(f"run {run.run_id} still has containers or a network on the engine: {', '.join(names)}",
                           hint=f"`launcher down {run.run_id}` removes them (results are kept); then run again")

    def create(self, run: PreparedRun) -> None:
        """Create the network and every container, started none (like ``docker create``). ``start`` calls it;
        tests call it alone to inspect what a plan becomes."""
        self.run = run
        self._check(run)
        image = self._ensure_image(run.plan)
        gpu_runtime = self.engine.has_nvidia_runtime() if self.gpu_runtime is None else self.gpu_runtime
        uid, gid = container_user()
        _give_to(run.results_dir, uid, gid)
        master, groups = container_specs(run, image=image, gpu_runtime=gpu_runtime, uid_gid=(uid, gid),
                                         publish_port=self.publish_port, engine_cpus=self.engine.cpu_count())
        # From here on stop() removes the run's parts; a refused start (above) must leave another
        # launcher's containers of the same run alone.
        self._created = True
        # Publishing needs a route out of the network; a private run stays --internal.
        self.engine.create_network(network_name(run.run_id), labels(run, "network", uid=uid),
                                   internal=self.publish_port is None)
        self.master_id = self.engine.create(master)
        self.ids[master.name] = self.master_id
        for g, cs in zip(run.plan.groups, groups):
            cid = self.engine.create(cs)
            self.ids[cs.name] = cid
            self.group_ids[g.index] = cid

    def start(self, run: PreparedRun) -> None:
        self.create(run)
        assert self.master_id is not None
        # Groups start with the master: they dial with back-off until it listens (it imports TF first).
        self.engine.start(self.master_id)
        for cid in self.group_ids.values():
            self.engine.start(cid)
        log.info("started run %s: master %s and %d group containers on network %s", run.run_id,
                 self.master_id[:12], len(self.group_ids), network_name(run.run_id))

    def poll(self) -> BackendStatus:
        """The master's and each group's state from ``docker inspect``; restarts counted by the engine.

        A group that stays exited with a non-zero code and budget left for ``MANUAL_RESTART_AFTER_S`` was
        stopped in a way the restart policy ignores (``docker kill`` counts as a manual stop); the backend
        then starts it itself and counts that restart against the same budget.
        """
        assert self.run is not None and self.master_id is not None
        budget = self.run.config.restart_budget
        mstate = self._snap_status("master", self.engine.inspect(self.master_id), None, 0)
        groups = {}
        for i, cid in self.group_ids.items():
            snap = self.engine.inspect(cid)
            own = self._own_restarts.get(i, 0)
            st = self._snap_status(f"group-{i}", snap, budget, own)
            if snap is not None and snap.status in ("exited", "dead") and st.state == ProcState.RESTARTING:
                first = self._exited_since.setdefault(i, time.monotonic())
                if time.monotonic() - first > MANUAL_RESTART_AFTER_S:
                    log.info("group %d stayed exited (code %s); starting it again", i, snap.exit_code)
                    self._own_restarts[i] = own + 1
                    self._exited_since.pop(i, None)
                    self.engine.start(cid)
                    st.restarts += 1
            else:
                self._exited_since.pop(i, None)
            groups[i] = st
        return BackendStatus(mstate, groups)

    @staticmethod
    def _snap_status(name: str, snap: ContainerSnapshot | None, budget: int | None, own: int) -> ProcStatus:
        return ProcStatus(name, proc_state(snap, budget, own), None if snap is None else snap.exit_code,
                          own + (0 if snap is None else snap.restart_count), "" if snap is None else snap.short_id)

    def restart_group(self, index: int) -> None:
        """Restart group ``index`` (like ``docker restart``). The engine's policy normally does this itself."""
        self.engine.restart(self.group_ids[index])

    def stop(self, *, grace_s: float = 8.0) -> None:
        if self._stopped or self.run is None or not self._created:
            return
        self._stopped = True
        teardown(self.engine, self.run.run_id, grace_s=grace_s, logs_dir=self.run.run_dir.files.logs)

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"backend": self.name, "launcher_pid": os.getpid()}
        if self.run is not None:
            d.update(network=network_name(self.run.run_id), image=self._image(self.run.plan),
                     containers={name: cid[:12] for name, cid in self.ids.items()})
        return d


def _give_to(path: Path, uid: int, gid: int) -> None:
    """Make the results directory the invoking user's when the launcher runs as root for someone (sudo):
    the containers run as that user and must write there."""
    if os.geteuid() != 0 or uid == 0:
        return
    for p in (path, *path.rglob("*")):
        try:
            os.chown(p, uid, gid, follow_symlinks=False)
        except OSError as exc:
            log.warning("cannot hand %s to uid %d: %s", p, uid, exc)


def save_logs(engine: Engine, snaps: list[ContainerSnapshot], logs_dir: Path) -> list[Path]:
    """Append each container's whole output (all its restarts) to ``logs_dir/<role>.log`` before the container
    is removed: the engine's copy goes with it. Returns the files written."""
    written: list[Path] = []
    try:
        logs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("cannot keep container logs in %s: %s", logs_dir, exc)
        return written
    uid = os.geteuid()
    for s in snaps:
        role = s.labels.get(dc.ROLE_LABEL, "")
        fname = "master.log" if role == "master" else f"group-{s.labels.get(dc.GROUP_LABEL, s.short_id)}.log"
        path = logs_dir / fname
        data = engine.logs(s.id)
        header = (f"--- launcher: output of container {s.name} ({s.short_id}), {s.restart_count} restart(s), "
                  f"ended {s.status} exit {s.exit_code} ---\n").encode()
        try:
            with open(path, "ab") as fh:
                fh.write(header + data)
            owner = s.labels.get(dc.USER_LABEL, "")
            if uid == 0 and owner.isdigit() and int(owner) != 0:
                os.chown(path, int(owner), logs_dir.stat().st_gid)
        except OSError as exc:
            log.warning("cannot write %s: %s", path, exc)
            continue
        written.append(path)
    return written


def teardown(engine: Engine, run_id: str | None, *, grace_s: float = 8.0, logs_dir: Path | None = None,
             user: str | None = None) -> list[ContainerSnapshot]:
    """Stop and remove every container and network of ``run_id`` (None: of every run), found by label.

    The master gets SIGTERM first and ``grace_s`` seconds to checkpoint and tell its groups to stop (like
    ``docker stop -t``); then the groups; each container's output is appended to the run's ``logs/``
    (``logs_dir``, or the ``launcher.results`` label's directory) before it is removed. Results stay.
    Idempotent. ``user``: only runs labelled with this uid. Returns the containers it found.
    """
    flt: dict[str, str | None] = {dc.RUN_LABEL: run_id}
    if user is not None:
        flt[dc.USER_LABEL] = user
    snaps = engine.containers(flt)
    masters = [s for s in snaps if s.labels.get(dc.ROLE_LABEL) == "master"]
    others = [s for s in snaps if s not in masters]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda s: engine.stop(s.id, max(1.0, grace_s - 2.0)), masters))
        list(pool.map(lambda s: engine.stop(s.id, 2.0), others))
    final = [engine.inspect(s.id) or s for s in snaps]
    by_run: dict[str, list[ContainerSnapshot]] = {}
    for s in final:
        by_run.setdefault(s.labels.get(dc.RUN_LABEL, "?"), []).append(s)
    for rid, group in by_run.items():
        target = logs_dir if logs_dir is not None and rid == run_id else None
        if target is None and group[0].labels.get(dc.RESULTS_LABEL):
            target = Path(group[0].labels[dc.RESULTS_LABEL]) / "logs"
        if target is not None and Path(target).parent.is_dir():
            save_logs(engine, group, Path(target))
    for s in final:
        engine.remove(s.id)
    engine.wait_removed([s.id for s in final])
    for nid, name, _ in engine.networks(flt):
        engine.remove_network(nid)
    return final


def engine_unavailable_reason() -> str | None:
    """None when a Docker engine answers (cheap ping, short timeout), else why not, with DOCKER_HOST."""
    return dc.engine_unavailable_reason()

