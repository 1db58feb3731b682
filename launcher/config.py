"""Run configuration: every ``launcher up`` option as one typed, validated :class:`RunConfig`.

Each option is declared once in :data:`OPTIONS` (its flag, config-file key, environment variable, type and
help), so the parser, the TOML file, the environment and ``launcher config show`` cannot drift apart.
Values are layered defaults < config file < ``LAUNCHER_*`` environment < flags by :func:`load_config` /
:func:`resolve_config`, which also say where each value came from; :func:`validate` then checks the whole
configuration and reports every problem at once (sample-factory's ``verify_cfg`` idea) before anything is
started.

The config file is TOML: ``launcher.toml`` in the working directory, or ``--config PATH`` /
``$LAUNCHER_CONFIG``. Table ``[up]`` takes any option by its flag name (``max-steps = 50000``; ``max_steps``
works too) and ``[up.hparams]`` the algorithm hyper-parameters (as ``--set`` does). docs/operator.md has an
example.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from launcher.errors import BadInput, ConfigErrors

BACKENDS = ("auto", "process", "docker", "swarm")
ALGOS = ("ppo", "a3c")
PROGRESS_MODES = ("auto", "live", "plain", "off")
SWARM_MASTER = ("auto", "local", "storage", "any")
MAX_WORKERS = 1024
CONFIG_FILE_NAME = "launcher.toml"
CONFIG_ENV = "LAUNCHER_CONFIG"


@dataclass(frozen=True)
class RunConfig:
    """Everything ``launcher up`` needs. Build with :func:`load_config`; check with :func:`validate`."""

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
    swarm_master: str = "auto"  # swarm backend: where the master runs (launcher.backends.swarm.master_placement)
    min_free_memory: str = "1GiB"
    max_utilization: float = 50.0
    lock_dir: Path | None = None
    json: bool = False
    progress: str = "auto"  # auto: a live table on a terminal, plain lines otherwise
    progress_interval_s: float = 5.0  # seconds between plain progress lines

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
DEFAULTS = RunConfig()


@dataclass(frozen=True)
class Option:
    """One ``launcher up`` option: flag ``--<name>``, file key ``<name>``, variable ``LAUNCHER_<NAME>``.

    kind: how text and TOML values are read: ``int``, ``float``, ``str``, ``bool``, ``path``,
    ``duration`` (seconds, or text like ``15m``), ``size`` (``8GiB``) or ``choice``.
    nullable: ``"none"`` means "no value" (no limit, no target).
    """

    name: str
    field: str
    kind: str
    help: str
    choices: tuple[str, ...] = ()
    nullable: bool = False
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    @property
    def env_var(self) -> str:
        return "LAUNCHER_" + self.name.upper().replace("-", "_")


OPTIONS: tuple[Option, ...] = (
    Option("env", "env_id", "str", "gymnasium env id, e.g. CartPole-v1, launcher/Snake-v0", metavar="ID"),
    Option("algo", "algo", "choice", "algorithm", choices=ALGOS),
    Option("workers", "workers", "int", "number of workers (env instances)", metavar="N"),
    Option("backend", "backend", "choice", "where to run; auto: docker if an engine answers, else process",
           choices=BACKENDS),
    Option("results", "results", "path", "results root; each run gets a directory in it", metavar="DIR"),
    Option("max-steps", "max_steps", "int", "total env steps ('none': no limit)", nullable=True, metavar="N"),
    Option("until-return", "until_return", "float",
           "stop when the mean return of the last --return-window episodes reaches this", nullable=True,
           metavar="R"),
    Option("return-window", "return_window", "int", "episodes averaged for --until-return", metavar="N"),
    Option("seed", "seed", "int", "base seed", metavar="N"),
    Option("gpus", "gpus", "str", "auto | none | indices (0,2) | UUIDs", metavar="auto|none|LIST"),
    Option("groups", "groups", "int", "number of worker groups ('none': computed)", nullable=True, metavar="N"),
    Option("max-workers-per-group", "max_workers_per_group", "int", "most workers in one group process",
           metavar="N"),
    Option("timeout", "timeout_s", "duration", "hard wall-clock limit, e.g. 90s, 15m, 1h30m (exit 4)",
           nullable=True, metavar="DURATION"),
    Option("port", "port", "int", "master port on 127.0.0.1 (process backend); 0: any free port", metavar="N"),
    Option("checkpoint-every", "checkpoint_every", "int", "updates between checkpoints (default: 25 ppo, 500 a3c)",
           nullable=True, metavar="N"),
    Option("restart-budget", "restart_budget", "int", "restarts per worker group", metavar="N"),
    Option("min-free-memory", "min_free_memory", "size", "least free memory per GPU, e.g. 8GiB", metavar="SIZE"),
    Option("max-utilization", "max_utilization", "float", "highest GPU utilization, percent", metavar="PCT"),
    Option("image", "image", "str", "container image (docker/swarm backends)", nullable=True, metavar="IMAGE"),
    Option("swarm-master", "swarm_master", "choice", "swarm backend: the master's node; auto: a node labelled "
           "launcher.storage=true if any, else this one (docs/scaling-out.md)", choices=SWARM_MASTER),
    Option("lock-dir", "lock_dir", "path", "GPU reservation lock directory", nullable=True, metavar="DIR"),
    Option("detach", "detach", "bool", "return at once (docker)"),
    Option("json", "json", "bool", "print the result as JSON (schema launcher.result/v1) on stdout"),
    Option("progress", "progress", "choice", "progress display: auto (live on a terminal, else plain lines)",
           choices=PROGRESS_MODES),
    Option("progress-interval", "progress_interval_s", "duration", "seconds between plain progress lines",
           metavar="DURATION"),
)
BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
BY_FIELD: dict[str, Option] = {o.field: o for o in OPTIONS}


# ---------------------------------------------------------------------------------------------- values
_DURATION = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*$")


def parse_duration(text: str | float | int) -> float:
    """Parse ``90``, ``90s``, ``15m``, ``1h30m`` into seconds. Raises ValueError."""
    if isinstance(text, bool):
        raise ValueError(f"expected a duration, got {text!r}")
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


def _toml(value: Any) -> str:
    """A value as it would be written in TOML (near enough for messages)."""
    import json

    return json.dumps(value, default=str)


def _type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "float", str: "string", list: "array",
            dict: "table"}.get(type(value), type(value).__name__)


def coerce(opt: Option, value: Any, *, strict: bool = False) -> Any:
    """Turn ``value`` into the field's type. ``strict`` (TOML values): the TOML type must fit the option.

    Raises:
        ValueError: with a sentence saying what was expected.
    """
    if opt.nullable and (value is None or (isinstance(value, str) and value.strip().lower() in ("none", ""))):
        return None
    kind = opt.kind
    if strict:
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "float": isinstance(value, (int, float)) and not isinstance(value, bool),
              "bool": isinstance(value, bool),
              "duration": isinstance(value, (int, float, str)) and not isinstance(value, bool),
              "size": isinstance(value, (int, str)) and not isinstance(value, bool)}.get(kind, isinstance(value, str))
        if not ok:
            want = {"int": "an integer", "float": "a number", "bool": "true or false",
                    "duration": "a duration such as 90, \"90s\" or \"15m\"",
                    "size": "a size such as \"8GiB\""}.get(kind, "a string")
            if opt.nullable:
                want += ' or "none"'
            raise ValueError(f"expected {want}, got {_type_name(value)}")
    if kind == "int":
        return _int(value)
    if kind == "float":
        return _float(value)
    if kind == "duration":
        return parse_duration(value)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected true or false")
    if kind == "path":
        return Path(str(value)).expanduser()
    if kind == "size":
        from launcher.gpu_select import parse_size

        try:
            parse_size(value)
        except BadInput:
            raise ValueError("expected a memory size such as 8GiB, 500MB or a byte count") from None
        return str(value)
    if kind == "choice":
        text = str(value).strip().lower()
        if text not in opt.choices:
            raise ValueError(f"expected one of {', '.join(opt.choices)}")
        return text
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {_type_name(value)}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError("expected a whole number")
    if isinstance(value, (int, float)):
        return int(value)
    try:
        return int(str(value).strip().replace("_", ""))
    except ValueError:
        raise ValueError("expected a whole number") from None


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError("expected a number") from None
    if not math.isfinite(f):
        raise ValueError("expected a finite number")
    return f


# ------------------------------------------------------------------------------------------ the layers
@dataclass(frozen=True)
class FileValues:
    """What a config file set, by RunConfig field, with the problems found reading it."""

    path: Path | None
    values: dict[str, Any] = field(default_factory=dict)
    problems: tuple[str, ...] = ()


def find_config_file(explicit: str | Path | None, *, environ: Mapping[str, str] | None = None,
                     cwd: Path | None = None) -> tuple[Path | None, bool]:
    """The config file to read: ``explicit`` (``--config``), else ``$LAUNCHER_CONFIG``, else
    ``./launcher.toml`` if it exists. Returns (path or None, whether the user named it)."""
    env = os.environ if environ is None else environ
    if explicit:
        return Path(explicit).expanduser(), True
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]).expanduser(), True
    local = (cwd or Path.cwd()) / CONFIG_FILE_NAME
    return (local, False) if local.is_file() else (None, False)


def read_config_file(path: Path) -> FileValues:
    """Read a TOML config file's ``[up]`` and ``[up.hparams]`` tables. Never raises: problems are returned,
    each naming the file, the key and the value (unknown keys, wrong types, TOML syntax)."""
    where = str(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return FileValues(path, problems=(f"{where}: config file not found",))
    except (OSError, UnicodeDecodeError) as exc:
        return FileValues(path, problems=(f"{where}: cannot read the config file: {exc}",))
    except tomllib.TOMLDecodeError as exc:
        return FileValues(path, problems=(f"{where}: not valid TOML: {exc}",))
    problems: list[str] = []
    for key in data:
        if key != "up":
            problems.append(f"{where}: unknown table or key {key!r} (the file has one table, [up])")
    up = data.get("up", {})
    if not isinstance(up, dict):
        return FileValues(path, problems=(*problems, f"{where}: 'up' must be a table ([up]), got {_type_name(up)}"))
    values: dict[str, Any] = {}
    for key, value in up.items():
        if key == "hparams":
            if not isinstance(value, dict):
                problems.append(f"{where}: [up] hparams = {_toml(value)}: expected a table ([up.hparams]), "
                                f"got {_type_name(value)}")
            else:
                values["hparams"] = dict(value)
            continue
        opt = BY_NAME.get(key.replace("_", "-"))
        if opt is None:
            names = [o.name for o in OPTIONS] + ["hparams"]
            close = difflib.get_close_matches(key.replace("_", "-"), names, n=1)
            problems.append(f"{where}: unknown key {key!r} in [up]" + (f" (did you mean {close[0]!r}?)" if close
                                                                       else f"; known keys: {', '.join(names)}"))
            continue
        try:
            values[opt.field] = coerce(opt, value, strict=True)
        except ValueError as exc:
            problems.append(f"{where}: [up] {key} = {_toml(value)}: {exc}")
    return FileValues(path, values, tuple(problems))


def load_config(flags: Mapping[str, Any], *, config_path: str | Path | None = None,
                environ: Mapping[str, str] | None = None, cwd: Path | None = None
                ) -> tuple[RunConfig, dict[str, str]]:
    """The configuration ``launcher up`` runs with: defaults < config file < environment < flags.

    Args:
        flags: RunConfig fields the user gave as flags (None values mean "not given"); ``hparams`` merges
            key by key over the file's ``[up.hparams]``.
        config_path: ``--config``; else ``$LAUNCHER_CONFIG``, else ``./launcher.toml`` if present.
        environ: the environment (default ``os.environ``).

    Returns:
        (config, origin): origin maps each field to ``default``, ``file PATH``, ``env LAUNCHER_X`` or
        ``flag --x``.

    Raises:
        ConfigErrors: every unknown key and wrong value, each naming the key, the value and its source.
    """
    path, named = find_config_file(config_path, environ=environ, cwd=cwd)
    file = read_config_file(path) if path is not None else FileValues(None)
    return resolve_config(flags, file_values=file.values, environ=environ,
                          file_label=str(path) if path else "file", extra_problems=file.problems)


def resolve_config(flags: Mapping[str, Any], *, file_values: Mapping[str, Any] | None = None,
                   environ: Mapping[str, str] | None = None, file_label: str = "file",
                   extra_problems: tuple[str, ...] = ()) -> tuple[RunConfig, dict[str, str]]:
    """Layer defaults < file < environment < flags. Returns the config and where each value came from.

    ``flags`` and ``file_values`` are keyed by RunConfig field; ``flags`` holds only options the user gave.
    Raises ConfigErrors listing every problem, each with its source.
    """
    values: dict[str, Any] = {}
    origin: dict[str, str] = {name: "default" for name in FIELD_TYPES}
    problems: list[str] = list(extra_problems)
    hparams: dict[str, Any] = {}
    for name, value in (file_values or {}).items():
        if name == "hparams":
            hparams.update(value or {})
            origin["hparams"] = f"file {file_label}"
        elif name in BY_FIELD:
            try:
                values[name] = coerce(BY_FIELD[name], value)
                origin[name] = f"file {file_label}"
            except ValueError as exc:
                problems.append(f"{file_label}: {BY_FIELD[name].name} = {value!r}: {exc}")
        elif name in FIELD_TYPES:
            values[name] = value
            origin[name] = f"file {file_label}"
        else:
            problems.append(f"{file_label}: unknown key {name!r}")
    env = os.environ if environ is None else environ
    for opt in OPTIONS:
        if opt.env_var in env:
            try:
                values[opt.field] = coerce(opt, env[opt.env_var])
                origin[opt.field] = f"env {opt.env_var}"
            except ValueError as exc:
                problems.append(f"environment: {opt.env_var}={env[opt.env_var]!r}: {exc}")
    for name, value in flags.items():
        if value is None:
            continue
        if name == "hparams":
            hparams.update(value)
            origin["hparams"] = "flag --set" if origin["hparams"] == "default" else f"{origin['hparams']} + flag --set"
            continue
        flag_opt = BY_FIELD.get(name)
        if flag_opt is None:
            if name in FIELD_TYPES:  # resume: flag-only, already typed
                values[name] = value
                origin[name] = f"flag --{name}"
            else:
                problems.append(f"unknown option {name!r}")
            continue
        try:
            values[name] = coerce(flag_opt, value)
            origin[name] = f"flag {flag_opt.flag}"
        except ValueError as exc:
            problems.append(f"flag {flag_opt.flag} {value!r}: {exc}")
    if hparams:
        values["hparams"] = hparams
    if problems:
        raise ConfigErrors(problems, hint="fix the values above; `launcher up --help` lists every option and "
                                          "docs/operator.md the config file")
    return RunConfig(**values), origin


def show_rows(cfg: RunConfig, origin: Mapping[str, str]) -> list[dict[str, Any]]:
    """One row per option (and hparams) for ``launcher config show``: name, value, source, env var."""
    rows: list[dict[str, Any]] = []
    for opt in OPTIONS:
        value = getattr(cfg, opt.field)
        rows.append({"key": opt.name, "value": str(value) if isinstance(value, Path) else value,
                     "source": origin.get(opt.field, "default"), "env": opt.env_var, "flag": opt.flag})
    rows.append({"key": "hparams", "value": dict(cfg.hparams), "source": origin.get("hparams", "default"),
                 "env": None, "flag": "--set"})
    return rows


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
    if not 0 <= cfg.max_utilization <= 100:
        problems.append(f"--max-utilization must be a percentage in 0..100, got {cfg.max_utilization}")
    if cfg.image is not None:
        from launcher.image import valid_reference

        if not valid_reference(cfg.image):
            problems.append(f"--image {cfg.image!r} is not a valid image reference "
                            f"(a lower-case name and an optional tag, e.g. launcher:0.1.0-cpu)")
    problems.extend(_check_env(cfg.env_id))
    problems.extend(_check_results(cfg.results))
    try:
        from worker.algorithms.hparams import resolve

        resolve(cfg.algo if cfg.algo in ALGOS else "ppo", cfg.env_id, cfg.hparams)
    except (TypeError, ValueError) as exc:
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

