"""Run configuration: every ``launcher up`` option as one typed, validated :class:`RunConfig`.

Values are layered (defaults < config file < ``LAUNCHER_*`` environment < flags) by
:func:`resolve_config`; :func:`validate` then checks the whole configuration and reports every problem at
once (sample-factory's ``verify_cfg`` idea) before anything is started.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from launcher.errors import BadInput, ConfigErrors

BACKENDS = ("auto", "process", "docker", "swarm")
ALGOS = ("ppo", "a3c")
MAX_WORKERS = 1024


@dataclass(frozen=True)
class RunConfig:
    """Everything ``launcher up`` needs. Build with :func:`resolve_config`; check with :func:`validate`."""

    env_id: str = "CartPole-v1"
    algo: str = "ppo"
    workers: int = 8
    backend: str = "auto"
    results: Path = Path("results")
    max_steps: int | None = 1_000_000
    until_return: float | None = None
    return_window: int = 100
    seed: int = 0
    gpus: str = "auto"
    groups: int | None = None
    max_workers_per_group: int = 16
    timeout_s: float | None = None
    detach: bool = False
    resume: str | None = None
    port: int = 0
    checkpoint_every: int | None = None
    restart_budget: int = 3
    hparams: Mapping[str, Any] = field(default_factory=dict)
    image: str | None = None
    min_free_memory: str = "1GiB"
    max_utilization: float = 50.0
    lock_dir: Path | None = None
    json: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["results"] = str(self.results)
        d["lock_dir"] = None if self.lock_dir is None else str(self.lock_dir)
        d["hparams"] = dict(self.hparams)
        return d

    @property
    def effective_checkpoint_every(self) -> int:
        """Updates between checkpoints: PPO updates are big and rare, A3C's small and frequent."""
        if self.checkpoint_every is not None:
            return self.checkpoint_every
        return 25 if self.algo == "ppo" else 500


FIELD_TYPES: dict[str, Any] = {f.name: f.type for f in dataclasses.fields(RunConfig)}

_DURATION = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*$")


def parse_duration(text: str | float | int) -> float:
    """Parse ``90``, ``90s``, ``15m``, ``1h30m`` into seconds. Raises ValueError."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _DURATION.match(text)
        if not m or not any(m.groups()):
            raise ValueError(f"{text!r} is not a duration (examples: 90, 90s, 15m, 1h30m)")
        h, mi, s = (float(x) if x else 0.0 for x in m.groups())
        value = h * 3600 + mi * 60 + s
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"duration must be > 0, got {text!r}")
    return value


def parse_hparam(text: str) -> tuple[str, Any]:
    """Parse ``key=value`` (value as int, float, bool or comma list) for ``--set``."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set takes key=value, got {text!r}")
    raw = raw.strip()
    value: Any
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    else:
        try:
            value = int(raw)
        except ValueError:
            try:
                value = float(raw)
            except ValueError:
                value = [int(x) for x in raw.split(",")] if re.fullmatch(r"\d+(,\d+)+", raw) else raw
    return key.strip(), value


def resolve_config(flags: Mapping[str, Any], *, file_values: Mapping[str, Any] | None = None,
                   environ: Mapping[str, str] | None = None) -> tuple[RunConfig, dict[str, str]]:
    """Layer defaults < file < environment < flags. Returns the config and where each value came from.

    ``flags`` holds only options the user actually gave (None means "not given").
    """
    values: dict[str, Any] = {}
    origin: dict[str, str] = {name: "default" for name in FIELD_TYPES}
    for name, value in (file_values or {}).items():
        values[name] = value
        origin[name] = "file"
    env = os.environ if environ is None else environ
    for name in FIELD_TYPES:
        key = f"LAUNCHER_{name.upper()}"
        if key in env and name not in ("hparams", "json"):
            values[name] = env[key]
            origin[name] = f"env {key}"
    for name, value in flags.items():
        if value is not None:
            values[name] = value
            origin[name] = "flag"
    problems: list[str] = []
    coerced: dict[str, Any] = {}
    for name, value in values.items():
        if name not in FIELD_TYPES:
            problems.append(f"unknown option {name!r} (from {origin.get(name, '?')})")
            continue
        try:
            coerced[name] = _coerce(name, value)
        except (TypeError, ValueError) as exc:
            problems.append(f"{name}: {exc} (from {origin[name]})")
    if problems:
        raise ConfigErrors(problems, hint="fix the values above; `launcher up --help` lists every option")
    return RunConfig(**coerced), origin


def _coerce(name: str, value: Any) -> Any:
    if name in ("workers", "seed", "groups", "max_workers_per_group", "port", "checkpoint_every",
                "restart_budget", "return_window"):
        return _int(value)
    if name == "max_steps":
        return None if value in (None, "none", "") else _int(value)
    if name == "until_return":
        return None if value in (None, "none", "") else _float(value)
    if name == "timeout_s":
        return None if value in (None, "none", "") else parse_duration(value)
    if name == "max_utilization":
        return _float(value)
    if name in ("results", "lock_dir"):
        return None if value is None else Path(str(value)).expanduser()
    if name in ("detach", "json"):
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes"):
            return True
        if str(value).lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"expected true or false, got {value!r}")
    if name == "hparams":
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a table of key = value, got {type(value).__name__}")
        return dict(value)
    if not isinstance(value, (str, type(None))):
        raise TypeError(f"expected a string, got {type(value).__name__} {value!r}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"expected a whole number, got {value!r}")
    try:
        return int(str(value).replace("_", "")) if not isinstance(value, (int, float)) else int(value)
    except ValueError:
        raise ValueError(f"expected a whole number, got {value!r}") from None


def _float(value: Any) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {value!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"expected a finite number, got {value!r}")
    return f


def validate(cfg: RunConfig) -> list[str]:
    """Every problem with ``cfg``, as sentences with the value seen. Empty when it is runnable."""
    problems: list[str] = []
    if not 1 <= cfg.workers <= MAX_WORKERS:
        problems.append(f"--workers must be between 1 and {MAX_WORKERS}, got {cfg.workers}")
    if cfg.algo not in ALGOS:
        problems.append(f"--algo must be one of {', '.join(ALGOS)}, got {cfg.algo!r}")
    if cfg.backend not in BACKENDS:
        problems.append(f"--backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}")
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
    if not 0 <= cfg.max_utilization <= 100:
        problems.append(f"--max-utilization must be a percentage in 0..100, got {cfg.max_utilization}")
    problems.extend(_check_env(cfg.env_id))
    problems.extend(_check_results(cfg.results))
    try:
        from worker.algorithms.hparams import resolve

        resolve(cfg.algo if cfg.algo in ALGOS else "ppo", cfg.env_id, cfg.hparams)
    except ValueError as exc:
        problems.append(f"--set: {exc}")
    return problems


def check(cfg: RunConfig) -> None:
    """Raise :class:`ConfigErrors` listing every problem in ``cfg``."""
    problems = validate(cfg)
    if problems:
        raise ConfigErrors(problems, hint="nothing was started; fix the values above and run again")


def _check_env(env_id: str) -> list[str]:
    try:
        from worker.envs import describe_env

        describe_env(env_id)
    except ValueError as exc:
        return [f"--env: {exc}"]
    except Exception as exc:  # an env that fails to build is a bad choice too, say why
        return [f"--env {env_id!r} cannot be created: {type(exc).__name__}: {exc}"]
    return []


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


def require(condition: bool, message: str, hint: str | None = None) -> None:
    if not condition:
        raise BadInput(message, hint=hint)
