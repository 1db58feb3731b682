"""Whole-configuration checks, all problems at once, before anything starts; and the typed GPU request."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING

from launcher.errors import BadInput, ConfigErrors
from launcher.backends.slurm_options import SLURM_RUNTIMES
from launcher.config.options import BACKENDS, MAX_WORKERS, PROGRESS_MODES, RunConfig, check_env_args
from worker.algorithms.hparams import resolve as resolve_hparams
from worker.contract import ACTING, ALGOS, plain_env_id

if TYPE_CHECKING:
    from launcher.gpu.request import GpuRequest

# sbatch options the Slurm backend's plan sets itself (launcher.backends.slurm_specs.sbatch_args); --slurm-arg
# may not repeat them. Here, with the other option checks, so that config asks nothing of the backends.
SLURM_OWN_OPTIONS = ("--nodes", "-N", "--ntasks", "-n", "--ntasks-per-node", "--cpus-per-task", "-c", "--gres",
                     "--gpus", "-G", "--gpus-per-node", "--time", "-t", "--job-name", "-J", "--output", "-o",
                     "--error", "-e", "--partition", "-p", "--wrap", "--parsable", "--no-kill", "-k", "--open-mode",
                     "--export")


# ------------------------------------------------------------------------------------------ GPU request
def _gpu_request(cfg: RunConfig) -> tuple[GpuRequest | None, list[str], list[str]]:
    """(request or None, placement problems, other GPU option problems)."""
    from launcher.gpu.request import request_from_options

    return request_from_options(cfg)


def gpu_request(cfg: RunConfig) -> GpuRequest:
    """The GPU and placement options of ``cfg`` as one typed :class:`~launcher.gpu.request.GpuRequest`: the
    one place ``--gpus``, the thresholds and the memory figures are parsed (``up`` and ``plan`` both call it).

    Raises:
        BadInput: every problem with those options, at once (placement first).
    """
    request, placement_problems, problems = _gpu_request(cfg)
    if request is None:
        raise BadInput("; ".join([*placement_problems, *problems]), hint="see `launcher up --help`")
    return request


# ------------------------------------------------------------------------------------------ validation
def validate(cfg: RunConfig) -> list[str]:
    """Every problem with ``cfg``, as sentences with the value seen. Empty when it is runnable."""
    problems: list[str] = []
    if not 1 <= cfg.workers <= MAX_WORKERS:
        problems.append(f"--workers must be between 1 and {MAX_WORKERS}, got {cfg.workers}")
    problems.extend(_check_code(cfg))
    if cfg.backend not in BACKENDS:
        problems.append(f"--backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}")
    if cfg.progress not in PROGRESS_MODES:
        problems.append(f"--progress must be one of {', '.join(PROGRESS_MODES)}, got {cfg.progress!r}")
    if not cfg.progress_interval_s > 0:
        problems.append(f"--progress-interval must be > 0 seconds, got {cfg.progress_interval_s}")
    if cfg.max_steps is not None and cfg.max_steps < 1:
        problems.append(f"--max-steps must be >= 1, got {cfg.max_steps}")
    if cfg.max_steps is None and cfg.until_return is None and cfg.timeout_s is None:
        problems.append("the run would never end: give --max-steps, --until-return or --timeout")
    if cfg.return_window < 1:
        problems.append(f"--return-window must be >= 1, got {cfg.return_window}")
    if cfg.groups is not None and not 1 <= cfg.groups <= max(cfg.workers, 1):
        problems.append(f"--groups must be between 1 and --workers ({cfg.workers}), got {cfg.groups}")
    if cfg.max_workers_per_group < 1:
        problems.append(f"--max-workers-per-group must be >= 1, got {cfg.max_workers_per_group}")
    if not 0 <= cfg.port <= 65535:
        problems.append(f"--port must be in 0..65535, got {cfg.port}")
    elif cfg.port and not port_free(cfg.port):
        problems.append(f"--port {cfg.port} is already in use on 127.0.0.1; pick another or 0 for any free port")
    if cfg.checkpoint_every is not None and cfg.checkpoint_every < 1:
        problems.append(f"--checkpoint-every must be >= 1, got {cfg.checkpoint_every}")
    if cfg.restart_budget < 0:
        problems.append(f"--restart-budget must be >= 0, got {cfg.restart_budget}")
    if cfg.master_restarts < 0:
        problems.append(f"--master-restarts must be >= 0, got {cfg.master_restarts}")
    problems.extend(_gpu_request(cfg)[2])  # its placement problems are the --workers/--groups ones above
    problems.extend(_check_slurm(cfg))
    if cfg.image is not None:
        from launcher.image import valid_reference

        if not valid_reference(cfg.image):
            problems.append(f"--image {cfg.image!r} is not a valid image reference "
                            f"(a lower-case name and an optional tag, e.g. launcher:0.1.0-cpu)")
    problems.extend(_check_env(cfg))
    problems.extend(_check_results(cfg.results))
    # The launcher must refuse, before anything starts, what the master would refuse: the same table the run
    # resolves from. A user's algorithm is checked where its code runs (the pre-flight probe, worker.envs.probe).
    if cfg.algo in ALGOS:
        try:
            resolve_hparams(cfg.algo, plain_env_id(cfg.env_id), dict(cfg.hparams))
        except (TypeError, ValueError) as exc:
            problems.append(f"--set: {exc}")
    return problems


def _check_code(cfg: RunConfig) -> list[str]:
    """``--algo``, ``--model`` and ``--acting`` as far as they can be judged without importing anything."""
    from launcher.usercode import resolve, user_code

    problems = []
    for algo, model in ((cfg.algo, None), ("ppo", cfg.model)):  # each reference on its own: every problem at once
        try:
            resolve(algo, model, None)
        except BadInput as exc:
            problems.append(str(exc))
    if not problems:
        try:
            user_code(cfg)  # the two together (two files of one name)
        except BadInput as exc:
            problems.append(str(exc))
    if cfg.acting not in ACTING:
        problems.append(f"--acting must be one of {', '.join(ACTING)}, got {cfg.acting!r}")
    return problems


def check_slurm_args(extra: Sequence[str]) -> list[str]:
    """Problems with ``--slurm-arg`` values: each an option (``--account=lab``), none the plan sets itself."""
    problems = []
    for arg in extra:
        name = arg.split("=", 1)[0]
        if not arg.startswith("-"):
            problems.append(f"--slurm-arg {arg!r}: not an sbatch option (e.g. --account=lab, --qos=normal)")
        elif name in SLURM_OWN_OPTIONS:
            problems.append(f"--slurm-arg {arg!r}: the launcher sets {name} itself from the plan "
                            f"(--slurm-nodes, --slurm-partition, --gpus, --timeout)")
    return problems


def _check_slurm(cfg: RunConfig) -> list[str]:
    """The Slurm options: a node count, sbatch options the plan does not set itself, ``--gpus`` auto or none."""
    problems = []
    if cfg.slurm_nodes is not None and cfg.slurm_nodes < 1:
        problems.append(f"--slurm-nodes must be >= 1, got {cfg.slurm_nodes}")
    if cfg.slurm_runtime not in SLURM_RUNTIMES:
        problems.append(f"--slurm-runtime must be one of {', '.join(SLURM_RUNTIMES)}, got {cfg.slurm_runtime!r}")
    problems.extend(check_slurm_args(cfg.slurm_args))
    if cfg.backend == "slurm" and cfg.gpus.strip().lower() not in ("auto", "none"):
        problems.append(f"--gpus {cfg.gpus!r} names GPUs of this host; with --backend slurm the scheduler picks each "
                        f"step's GPUs: use --gpus auto or none")
    return problems


def check(cfg: RunConfig) -> None:
    """Raise :class:`ConfigErrors` listing every problem in ``cfg``."""
    problems = validate(cfg)
    if problems:
        raise ConfigErrors(problems, hint="nothing was started; fix the values above and run again")


def _check_env(cfg: RunConfig) -> list[str]:
    """The env's name, arguments, directory and extra packages, as far as they can be judged here. Whether
    the env can be made is asked where the groups will run, after the backend is chosen
    (:mod:`launcher.backends.envcheck`): the host's Python is the wrong place to ask for a container's env."""
    problems = []
    module, sep, plain = cfg.env_id.rpartition(":")
    if not plain.strip() or (sep and not all(part.isidentifier() for part in module.split("."))):
        problems.append(f"--env {cfg.env_id!r} is not a gymnasium id or module:EnvId (a dotted module name, one "
                        f"colon, a registered id, e.g. flappy_bird_gymnasium:FlappyBird-v0)")
    problems.extend(check_env_args(cfg.env_args))
    if cfg.env_dir is not None:
        if not cfg.env_dir.is_dir():
            problems.append(f"--env-dir {cfg.env_dir} is not a directory")
        elif not os.access(cfg.env_dir, os.R_OK | os.X_OK):
            problems.append(f"--env-dir {cfg.env_dir} is not readable by uid {os.getuid()}")
    for pkg in cfg.with_packages:
        if pkg.endswith(".whl") and not Path(pkg).expanduser().is_file():
            problems.append(f"--with {pkg}: no such wheel file")
    return problems


def _check_results(root: Path) -> list[str]:
    probe = root
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        return [f"--results {root} is not a directory ({probe} is a file)"]
    if not os.access(probe, os.W_OK | os.X_OK):
        return [f"--results {root} is not writable by uid {os.getuid()} ({probe} denies it)"]
    return []


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True

