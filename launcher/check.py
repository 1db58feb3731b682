"""``launcher check``: what a run on this machine needs, what it has, and the next step for each gap.

Two halves, like nvitop's API under its CLI. :mod:`launcher.check_probes` asks the machine (Python, the Docker
engine, NVML under its deadline, a container of the image, the admin store, the results directory, the image,
Slurm or Swarm) and returns the typed probe results of :mod:`launcher.check_types` (re-exported here). The
functions here are pure: each turns one probe into report :class:`Line` s (ok / missing / broken, with the exact
next step for every problem and the kind of run it blocks), and :func:`build_report` decides whether a GPU run
(or with ``cpu=True`` a CPU-only run) can start. Tests feed them made-up probes; the probes themselves run
against the real engine and the stand-in NVML.

Similar to ``sky check`` or ``nvidia-smi`` plus ``docker run --gpus all IMAGE nvidia-smi``, in one place.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, replace
from typing import Any

from launcher.check_types import (DockerProbe, GpuContainerProbe, ImageProbe, NvmlProbe, Probes, PythonProbe,
                                  ResultsProbe, SlurmProbe, StoreProbe, outside)
from launcher.gpu.snapshots import Inventory
from launcher.schemas import CHECK_SCHEMA as SCHEMA

GPU, CPU = "gpu", "cpu"
BOTH = (GPU, CPU)
MIN_FREE_BYTES = 1024**3  # below this the results directory cannot hold one run's checkpoints and logs
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse.sshfs", "9p", "afs", "ncpfs", "glusterfs",
              "fuse.glusterfs", "ceph", "fuse.ceph", "fuse.s3fs", "fuse.gcsfuse", "beegfs", "gpfs")
# pyproject's dependencies, for a tree that is not installed (installed: its metadata names them, with ranges)
HOST_PACKAGES = ("numpy", "gymnasium", "docker", "nvidia-ml-py", "matplotlib", "rich")
TOOLKIT_STEP = ("install the NVIDIA Container Toolkit (https://docs.nvidia.com/datacenter/cloud-native/"
                "container-toolkit/latest/install-guide.html), then `sudo nvidia-ctk runtime configure "
                "--runtime=docker && sudo systemctl restart docker`")


class Status(str, enum.Enum):
    """One line's verdict. ``skipped``: not checked, because what it needs is missing (the line says which)."""

    OK = "ok"
    MISSING = "missing"
    BROKEN = "broken"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Line:
    """One line of the report.

    Attributes:
        name: what was checked (``docker engine``, ``GPU 0``).
        status: ok / missing / broken / skipped.
        detail: what was seen (versions, values, the error's text).
        next_step: the exact thing to do about a problem; None when there is none.
        needed_for: the kinds of run (``gpu``, ``cpu``) that cannot start while this line is not ok; empty: advice.
    """

    name: str
    status: Status
    detail: str
    next_step: str | None = None
    needed_for: tuple[str, ...] = ()

    def blocks(self, target: str) -> bool:
        return self.status in (Status.MISSING, Status.BROKEN) and target in self.needed_for


# ---------------------------------------------------------------------------------------------- verdicts
def python_lines(p: PythonProbe, backend: str, *, gpu: bool = True) -> list[Line]:
    """Python and the host's packages; TensorFlow on the host only where groups run on it (process backend),
    and for a GPU run there a TensorFlow that is not the CPU-only build."""
    version = ".".join(map(str, p.version))
    lines = [Line("python", Status.OK if p.version[:2] == (3, 11) else Status.BROKEN, f"{version} ({p.executable})",
                  None if p.version[:2] == (3, 11) else "use Python 3.11 (`scripts/setup.sh` makes .venv with it)",
                  BOTH)]
    lines.append(_packages_line(p))
    tf = p.packages.get("tensorflow") or p.packages.get("tensorflow-cpu")
    on_host = backend == "process"
    if not tf:
        lines.append(Line("tensorflow", Status.MISSING if on_host else Status.OK,
                          "not on this host" + ("" if on_host else " (not needed: the groups run in the image)"),
                          f"`{p.executable} -m pip install -e '.[cpu]'` (GPU: `.[gpu]`)" if on_host else None,
                          BOTH if on_host else ()))
    elif on_host and outside(tf, p.wanted.get("tensorflow-cpu", "")):
        lines.append(Line("tensorflow", Status.BROKEN, f"{tf}: outside the launcher's range "
                          f"{p.wanted['tensorflow-cpu']}", f"`{p.executable} -m pip install -e '.[cpu]'` (GPU: "
                          "`.[gpu]`)", BOTH))
    elif p.packages.get("tensorflow-cpu") and not p.packages.get("tensorflow") and on_host and gpu:
        lines.append(Line("tensorflow", Status.BROKEN, f"tensorflow-cpu {tf}: the CPU build, so the process "
                          "backend's groups could not use a GPU",
                          f"for GPU runs on this host: `{p.executable} -m pip install -e '.[gpu]'`", (GPU,)))
    else:
        which = "tensorflow" if p.packages.get("tensorflow") else "tensorflow-cpu"
        lines.append(Line("tensorflow", Status.OK, f"{which} {tf}", None, BOTH if on_host else ()))
    return lines


def _packages_line(p: PythonProbe) -> Line:
    """The launcher's own dependencies: each installed, in the range its metadata asks for."""
    names = [n for n in (p.wanted or HOST_PACKAGES) if not n.startswith("tensorflow")]
    missing = [n for n in names if not p.packages.get(n)]
    wrong = [n for n in names if p.packages.get(n) and outside(str(p.packages[n]), p.wanted.get(n, ""))]
    problems = [f"not installed: {', '.join(missing)}"] if missing else []
    if wrong:
        problems.append("outside the launcher's range: " + ", ".join(f"{n} {p.packages[n]} (wants {p.wanted[n]})"
                                                                       for n in wrong))
    have = ", ".join(f"{n} {p.packages[n]}" for n in names if p.packages.get(n) and n not in wrong)
    pins = " ".join(f"'{n}{p.wanted.get(n, '')}'" for n in (*missing, *wrong))
    return Line("packages", Status.MISSING if missing else Status.BROKEN if wrong else Status.OK,
                "; ".join(x for x in (*problems, have) if x),
                f"`{p.executable} -m pip install {pins}` (or `scripts/setup.sh`)" if problems else None, BOTH)


def docker_lines(d: DockerProbe, backend: str, *, gpu: bool = True) -> list[Line]:
    """The engine (version, rootless or not) and, for a GPU run, the NVIDIA runtime or CDI."""
    containers = backend in ("docker", "swarm")
    need = BOTH if containers else ()
    if d.error:
        step = ("start the engine (`sudo systemctl start docker`) or point DOCKER_HOST at one; your user needs its "
                "socket (the docker group)" + ("" if containers else "; runs use local processes meanwhile"))
        return [Line("docker engine", Status.MISSING, d.error, step, need)]
    mode = "rootless" if d.rootless else "rootful"
    lines = [Line("docker engine", Status.OK, f"{d.server_version} (API {d.api_version}), {mode}", None, need)]
    if not gpu:
        return lines
    # `up` hands GPUs to containers through the nvidia runtime and refuses without it
    # (launcher.backends.docker.check_gpu_runtime); CDI alone is reported, not counted.
    cdi = f"CDI spec dirs {', '.join(d.cdi_spec_dirs)}" if d.cdi_spec_dirs else "CDI off"
    need_gpu = (GPU,) if containers else ()
    if "nvidia" in d.runtimes:
        lines.append(Line("gpu runtime", Status.OK, f"nvidia runtime registered; {cdi}", None, need_gpu))
    else:
        rootless = (" (rootless: `nvidia-ctk runtime configure --runtime=docker --config=$HOME/.config/docker/"
                    "daemon.json`, and no-cgroups = true in /etc/nvidia-container-runtime/config.toml)")
        lines.append(Line("gpu runtime", Status.MISSING,
                          f"no nvidia runtime (runtimes: {', '.join(d.runtimes) or '-'}; {cdi}): `launcher up` gives "
                          "containers GPUs through the nvidia runtime", TOOLKIT_STEP + (rootless if d.rootless else ""),
                          need_gpu))
    return lines


def nvml_lines(n: NvmlProbe) -> list[Line]:
    """NVML: the driver, then one line per GPU (memory, MIG mode) and per GPU that failed. A GPU run needs at
    least one GPU it can use (a GPU without MIG, or a MIG instance)."""
    if n.timed_out or n.error:
        name = "nvml" + (" (deadline)" if n.timed_out else "")
        return [Line(name, Status.BROKEN, n.error or "the driver did not answer",
                     n.hint or "check `nvidia-smi` and `dmesg`", (GPU,))]
    inv = n.inventory or Inventory(unavailable_reason="no inventory")
    if not inv.available:
        return [Line("nvml", Status.MISSING, inv.unavailable_reason or "no NVML", inv.hint, (GPU,))]
    usable = sum(len(g.mig_devices) if g.mig_mode else 1 for g in inv.gpus)
    lines = [Line("nvml", Status.OK if usable else Status.MISSING,
                  f"driver {inv.driver_version or '?'}, {len(inv.gpus)} GPU(s), {usable} usable",
                  None if usable else "no GPU to run on: check `nvidia-smi`; to run on CPU, `launcher check --cpu` "
                                      "and `launcher up --gpus none`", (GPU,))]
    for g in inv.gpus:
        memory = f"{g.memory_free_bytes / 1024**3:.1f} of {g.memory_total_bytes / 1024**3:.1f} GiB free"
        mig = {None: "MIG not supported", False: "MIG off"}.get(g.mig_mode, f"MIG on, {len(g.mig_devices)} instance(s)")
        if g.mig_mode and not g.mig_devices:
            lines.append(Line(f"GPU {g.index}", Status.MISSING, f"{g.name}, {g.uuid}, {memory}, {mig}",
                              f"create MIG instances (`sudo nvidia-smi mig -i {g.index} -cgi PROFILE -C`) or turn MIG "
                              f"off (`sudo nvidia-smi -i {g.index} -mig 0`, then reset the GPU)"))
        else:
            lines.append(Line(f"GPU {g.index}", Status.OK, f"{g.name}, {g.uuid}, {memory}, {mig}"))
    for e in inv.errors:
        lines.append(Line(f"GPU {e.index}", Status.BROKEN, f"{e.uuid or 'uuid unknown'}: {e.error}",
                          f"check `nvidia-smi -i {e.index}` and `dmesg` for Xid errors; the GPU may need a reset "
                          f"(`sudo nvidia-smi -r -i {e.index}`) or the machine a reboot"))
    return lines


def gpu_container_lines(c: GpuContainerProbe | None) -> list[Line]:
    """Whether a container of the image sees every GPU it was given (``docker run --gpus``)."""
    name = "gpus in a container"
    if c is None:
        return []
    if c.skipped:
        return [Line(name, Status.SKIPPED, c.skipped)]
    if c.error:
        return [Line(name, Status.BROKEN, f"a container of {c.image} given {len(c.given)} GPU(s) failed: {c.error}",
                     f"{TOOLKIT_STEP}; check with `docker run --rm --gpus all {c.image} nvidia-smi -L`", (GPU,))]
    if c.seen != len(c.given):
        return [Line(name, Status.BROKEN, f"a container of {c.image} was given {len(c.given)} GPU(s) and saw "
                                          f"{c.seen} device node(s)",
                     f"check `docker run --rm --gpus all {c.image} nvidia-smi -L` and the toolkit's log "
                     "(`nvidia-container-cli -k -d /dev/tty info`)", (GPU,))]
    return [Line(name, Status.OK, f"a container of {c.image} sees the {c.seen} GPU(s) it was given", None, (GPU,))]


def store_lines(s: StoreProbe) -> list[Line]:
    """The admin lease store and the site policy. No store is advice (leases hold for this user only); a store or
    policy that cannot be trusted or read stops every run, CPU-only ones too (the planner loads the policy first)."""
    if s.store_error:
        lines = [Line("lease store", Status.BROKEN, s.store_error,
                      "ask the administrator to run `sudo launcher admin init` again (it fixes owners and modes)",
                      BOTH)]
    elif s.store:
        lines = [Line("lease store", Status.OK, f"{s.store} (site file {s.site_file})")]
    else:
        lines = [Line("lease store", Status.MISSING, "no admin lease store: GPU leases hold between this user's runs "
                                                     "only", "to share GPUs between users: `sudo launcher admin init`")]
    if s.policy_error:
        lines.append(Line("site policy", Status.BROKEN, s.policy_error,
                          "fix the policy file it names (docs/gpus.md, Placement policy)", BOTH))
    else:
        limits = ", ".join(f"{k} {v}" for k, v in (s.policy or {}).items() if v not in (None, [], ()) and k != "source")
        lines.append(Line("site policy", Status.OK, f"{s.policy_source or 'none'}" + (f": {limits}" if limits else "")))
    return lines


def results_lines(r: ResultsProbe) -> list[Line]:
    """The results directory: writable, enough free space, and a filesystem whose flock works."""
    where = r.path if r.probed == r.path else f"{r.path} (not there yet; {r.probed} is)"
    if not r.writable:
        return [Line("results dir", Status.BROKEN, f"{where} is not writable: {r.write_error}",
                     f"choose another with `--results DIR`, or `chmod u+w {r.probed}`", BOTH)]
    lines = []
    fs = f"{r.fstype or '?'} on {r.mount_point or '?'}"
    free = "?" if r.free_bytes is None else f"{r.free_bytes / 1024**3:.1f} GiB free"
    if r.free_bytes is not None and r.free_bytes < MIN_FREE_BYTES:
        lines.append(Line("results dir", Status.BROKEN, f"{where}: {free} ({fs}), under "
                          f"{MIN_FREE_BYTES / 1024**3:.0f} GiB", f"free space there (`du -sh {r.probed}/*`) or pass "
                          "`--results DIR` on a larger disk", BOTH))
    elif r.flock_error:
        lines.append(Line("results dir", Status.BROKEN, f"{where}: {fs}: flock fails there ({r.flock_error})",
                          "put results on a local disk (`--results /local/dir`, or `results = ...` in launcher.toml)",
                          BOTH))
    else:
        note = " (a network filesystem: flock works here, but keep runs of one machine on it)" \
            if (r.fstype or "") in NETWORK_FS else ""
        lines.append(Line("results dir", Status.OK, f"{where}: writable, {free}, {fs}{note}", None, BOTH))
    return lines


def image_lines(i: ImageProbe | None, backend: str, *, gpu: bool = True) -> list[Line]:
    """The image a container run uses: present (for a GPU run, not with the CPU-only TensorFlow), or buildable by
    ``launcher up`` (online or offline)."""
    if i is None:
        return []
    need = BOTH if backend in ("docker", "swarm") else ()
    if i.error:
        return [Line("image", Status.BROKEN, f"{i.name}: {i.error}", f"`docker image inspect {i.name}`", need)]
    if i.present and gpu and i.tf_package == "tensorflow-cpu":
        return [Line("image", Status.BROKEN, f"{i.name} ({(i.image_id or '?')[:19]}) has tensorflow-cpu: its "
                     "processes would not use the GPUs", "build the GPU image (`launcher build --gpu`) and run "
                     "without --image, or pass `--image` with a GPU image", (GPU,) if need else ())]
    if i.present:
        tf = f", {i.tf_package}" if i.tf_package else ""
        return [Line("image", Status.OK, f"{i.name} ({(i.image_id or '?')[:19]}{tf})", None, need)]
    if i.build_problem:
        return [Line("image", Status.MISSING, f"{i.name} is not on the engine and cannot be built here: "
                     f"{i.build_problem}", "`docker pull`/`docker load` an image and pass `--image NAME`, or make a "
                     "build path work: a registry for `docker pull python:3.11-slim-bookworm` (online), or "
                     "`sudo apt-get install mmdebstrap` and a package index or a copied docker/wheels/ (offline)",
                     need)]
    return [Line("image", Status.MISSING, f"{i.name} is not on the engine; `launcher up` builds it first "
                 f"(minutes): {i.build_why}", f"build it ahead: `launcher build --tag {i.name}"
                 + (" --gpu`" if i.name.endswith("-gpu") else "`"), ())]


def slurm_lines(s: SlurmProbe | None, backend: str, *, gpu: bool = True) -> list[Line]:
    """Slurm's clients and its controller, when Slurm is the backend or its clients are here; for a GPU run on
    Slurm, a partition whose nodes have GPUs (the GPUs are the nodes', not this host's)."""
    if s is None:
        return []
    need = BOTH if backend == "slurm" else ()
    absent = [c for c, path in s.commands.items() if not path]
    if absent:
        return [Line("slurm", Status.MISSING, f"{s.why}; not on PATH: {', '.join(absent)}",
                     "install Slurm's client commands (Debian: `apt-get install slurm-client`) or `module load slurm`",
                     need)]
    if s.error:
        return [Line("slurm", Status.BROKEN, f"{s.why}; {s.error}",
                     s.hint or "check that slurmctld and munged run and this host reaches them (`scontrol ping`); "
                               "SLURM_CONF must name the cluster's slurm.conf", need)]
    lines = [Line("slurm", Status.OK, f"{s.why}; sinfo answers: {s.answer}", None, need)]
    if gpu and backend == "slurm" and s.gpus == 0:
        lines.append(Line("slurm gpus", Status.MISSING, "no partition's nodes list a GPU in their GRES",
                          "ask the cluster's admin for a partition with GPUs (`sinfo -o '%P %D %G'`), pass "
                          "`--slurm-partition NAME`, or run on CPU (`--gpus none`; `launcher check --cpu`)", (GPU,)))
    return lines


def swarm_lines(d: DockerProbe, backend: str, *, gpu: bool = True) -> list[Line]:
    """Swarm, when it is the backend or the engine is in a swarm: this engine must be a manager; for a GPU run on
    the swarm, nodes that advertise NVIDIA-GPU resources (the GPUs are the nodes', not this host's)."""
    if d.error or (backend != "swarm" and d.swarm_state in (None, "inactive")):
        return []
    need = BOTH if backend == "swarm" else ()
    if d.swarm_state != "active":
        return [Line("swarm", Status.MISSING, f"this engine is not in a swarm (state {d.swarm_state or 'unknown'})",
                     "`docker swarm init` here, or `docker swarm join` an existing one (docs/swarm.md)", need)]
    if not d.swarm_manager:
        return [Line("swarm", Status.BROKEN, "this engine is a swarm worker, not a manager",
                     "run `launcher` on a manager node, or `docker node promote NODE` on a manager", need)]
    lines = [Line("swarm", Status.OK, f"this engine is a swarm manager; its ready nodes advertise "
                                      f"{'?' if d.swarm_gpus is None else d.swarm_gpus} GPU(s)", None, need)]
    if gpu and backend == "swarm" and d.swarm_gpus == 0:
        lines.append(Line("swarm gpus", Status.MISSING, "no ready node advertises an NVIDIA-GPU resource",
                          "on each GPU node: `node-generic-resources` with its GPU UUIDs in /etc/docker/daemon.json "
                          "and the nvidia runtime (docs/scaling-out.md), then restart its engine", (GPU,)))
    return lines


@dataclass(frozen=True)
class Report:
    """Every line, the kind of run asked about, and whether that run can start here."""

    target: str
    backend: str
    backend_why: str
    lines: tuple[Line, ...]

    @property
    def blocking(self) -> tuple[Line, ...]:
        return tuple(line for line in self.lines if line.blocks(self.target))

    @property
    def ready(self) -> bool:
        return not self.blocking

    def to_dict(self) -> dict[str, Any]:
        """The ``launcher.check/v1`` document (``launcher check --json``)."""
        return {"schema": SCHEMA, "target": self.target, "backend": self.backend, "backend_why": self.backend_why,
                "ready": self.ready, "blocking": [line.name for line in self.blocking],
                "checks": [{**asdict(line), "status": line.status.value, "needed_for": list(line.needed_for)}
                           for line in self.lines]}


def _here_only(lines: list[Line]) -> list[Line]:
    """This host's GPU lines as advice: on Swarm and Slurm the run's GPUs are the nodes' (their own lines say)."""
    return [replace(line, needed_for=()) for line in lines]


def build_report(p: Probes, *, cpu: bool = False) -> Report:
    """The report for a GPU run (``cpu=True``: a CPU-only run, which ignores every GPU-only line)."""
    gpu = not cpu
    local = p.backend in ("process", "docker")
    engine = docker_lines(p.docker, p.backend, gpu=gpu)
    lines: list[Line] = [*python_lines(p.python, p.backend, gpu=gpu), engine[0],
                         *(engine[1:] if local else _here_only(engine[1:])),
                         *swarm_lines(p.docker, p.backend, gpu=gpu), *image_lines(p.image, p.backend, gpu=gpu)]
    if gpu:
        here = [*nvml_lines(p.nvml), *gpu_container_lines(p.gpu_container)]
        lines += here if local else _here_only(here)
    lines += [*store_lines(p.store), *results_lines(p.results), *slurm_lines(p.slurm, p.backend, gpu=gpu)]
    return Report(CPU if cpu else GPU, p.backend, p.backend_why, tuple(lines))

