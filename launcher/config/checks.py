"""Whole-configuration checks, all problems at once, before anything starts; and the typed GPU request."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.errors import BadInput, ConfigErrors
from launcher.config.options import BACKENDS, MAX_WORKERS, PROGRESS_MODES, RunConfig, check_env_args
from worker.contract import ALGOS, plain_env_id, resolve_hparams

if TYPE_CHECKING:
    from launcher.gpu.request import GpuRequest


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
    if cfg.algo not in ALGOS:
        problems.append(f"--algo must be one of {', '.join(ALGOS)}, got {cfg.algo!r}")
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
    problems.extend(_gpu_request(cfg)[2])  # its placement problems are the --workers/--groups ones above
    if cfg.image is not None:
        from launcher.image import valid_reference

        if not valid_reference(cfg.image):
            problems.append(f"--image {cfg.image!r} is not a valid image reference "
                            f"(a lower-case name and an optional tag, e.g. launcher:0.1.0-cpu)")
    problems.extend(_check_env(cfg))
    problems.extend(_check_results(cfg.results))
    try:
        resolve_hparams(cfg.algo if cfg.algo in ALGOS else "ppo", plain_env_id(cfg.env_id), dict(cfg.hparams))
    except (TypeError, ValueError) as exc:
        problems.append(f"--set: {exc}")
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

