"""Whole-configuration checks, all problems at once, before anything starts; and the typed GPU request."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from launcher.backends import AUTO_PICKS
from launcher.errors import BadInput, ConfigErrors
from launcher.backends.slurm_options import SLURM_RUNTIMES
from launcher.config.options import (BACKENDS, MAX_WORKERS, OPTIONS, OWNERS, PROGRESS_MODES, RunConfig, _toml,
                                     check_env_args)
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
def validate(cfg: RunConfig, origin: Mapping[str, str] | None = None) -> list[str]:
    """Every problem with ``cfg``, as sentences with the value seen. Empty when it is runnable. With ``origin``
    (where each value came from, :func:`launcher.config.load_config`), also every backend option set for a
    backend this run does not use (:func:`backend_mismatch`)."""
    problems: list[str] = []
    if origin is not None:
        problems.extend(backend_mismatch(cfg, origin))
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
    problems.extend(_check_elastic(cfg))
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


def _check_elastic(cfg: RunConfig) -> list[str]:
    """``--elastic`` as far as it can be judged before the plan (the plan's groups: launcher.gpu.policy)."""
    if cfg.elastic is None or cfg.elastic == "off":
        return []
    if not cfg.elastic.isdigit() or int(cfg.elastic) < 1:
        return [f"--elastic takes the fewest worker groups the run may shrink to (a whole number >= 1) or 'off', "
                f"got {cfg.elastic!r}"]
    problems = []
    most = cfg.groups or cfg.workers
    if int(cfg.elastic) > most:
        problems.append(f"--elastic {cfg.elastic}: the run has at most {most} worker group(s) "
                        f"({'--groups' if cfg.groups else '--workers'} {most})")
    if cfg.detach:
        problems.append("--elastic needs its launcher attached (it watches the GPU queue for the run): leave out "
                        "--detach")
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


def backend_mismatch(cfg: RunConfig, origin: Mapping[str, str]) -> list[str]:
    """One problem per backend option (:data:`launcher.config.options.OWNERS`) the user set, by flag, config file
    or ``LAUNCHER_*`` variable, for a backend this run does not use: it would be silently ignored. Each names the
    option, the value, its source, the backend(s) it belongs to, the backend chosen and what to do.

    ``--backend auto`` is decided here, before the engine is asked: auto picks only
    :data:`launcher.backends.AUTO_PICKS` (Docker when an engine answers, else processes), so an option none of
    those reads (``--slurm-*``, ``--swarm-*``) is a problem whatever auto picks; one the Docker backend reads
    (``--image``, ``--with``, ``--build``) is not: it applies when auto picks Docker, and a file meant for both
    kinds of host stays valid. A value ``launcher up`` only inherits from the file's ``[build]`` table
    (``with``; origin ``file PATH [build]``) is ``launcher build``'s, never a problem here; nor is a resumed
    run's own recorded value (origin ``record RUN``): only what is given with ``--resume`` is judged."""
    chosen = cfg.backend
    picks = AUTO_PICKS if chosen == "auto" else (chosen,)
    backend_from = origin.get("backend", "default")
    uses = (f"--backend auto ({_source(backend_from)}), which picks {' or '.join(AUTO_PICKS)}" if chosen == "auto"
            else f"--backend {chosen} ({_source(backend_from)})")
    problems = []
    for opt in OPTIONS:
        owners = OWNERS.get(opt.name, ())
        source = origin.get(opt.field, "default")
        if (not owners or source == "default" or source.endswith("[build]") or source.startswith("record ")
                or set(owners) & set(picks)):
            continue
        value: Any = getattr(cfg, opt.field)
        shown = "none" if value is None else " ".join(value) if isinstance(value, tuple) else str(value)
        kind, _, where = source.partition(" ")
        if kind == "env":
            seen, fix = f"{opt.env_var}={shown} (environment)", f"unset {opt.env_var}"
        elif kind == "file":
            seen = f"{opt.name} = {_toml(list(value) if isinstance(value, tuple) else value)} ({where} [up])"
            fix = f"remove {opt.name} from {where}"
        else:
            seen, fix = f"{opt.flag} {shown} (flag)", f"drop {opt.flag}"
        belongs = "--backend " + (owners[0] if len(owners) == 1 else f"{', '.join(owners[:-1])} or {owners[-1]}")
        problems.append(f"{seen} is an option of {belongs}; this run uses {uses}: {fix} or run with "
                        f"{belongs}")
    return problems


def _source(origin: str) -> str:
    """``flag --backend`` -> ``flag``, ``env LAUNCHER_BACKEND`` -> ``LAUNCHER_BACKEND``, ``file P`` -> ``P``."""
    kind, _, where = origin.partition(" ")
    if kind == "record":
        return f"run {where}'s record"
    return {"flag": "flag", "default": "default"}.get(kind, where or kind)


def check(cfg: RunConfig, origin: Mapping[str, str] | None = None) -> None:
    """Raise :class:`ConfigErrors` listing every problem in ``cfg`` (with ``origin``: backend options set for
    another backend too, :func:`backend_mismatch`)."""
    problems = validate(cfg, origin)
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

