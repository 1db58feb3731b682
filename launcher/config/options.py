"""Every ``launcher up`` option declared once (:data:`OPTIONS`), the typed :class:`RunConfig` they fill, and
how one value is read (:func:`coerce`, :func:`parse_hparam`). The package docstring says how the layers fit.

The options every run has are declared here (:data:`COMMON_OPTIONS`); an option only some backends read is
declared by each of them (:func:`launcher.backends.backend_options`, one light module per backend named in the
registry) and added here, with :data:`OWNERS` saying which backends read it. ``--backend``'s choices come from
the same registry."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from launcher.backends import BACKENDS as _REGISTRY
from launcher.backends import backend_options
from launcher.errors import BadInput
from launcher.option import Option
from launcher.units import parse_duration, parse_size
from worker.contract import ACTING, ALGOS, DEFAULT_MAX_UTILIZATION_PCT, DEFAULT_MIN_FREE_MEMORY

BACKENDS = ("auto", *_REGISTRY)  # --backend: auto, then every backend of the one table (launcher.backends)
PROGRESS_MODES = ("auto", "live", "plain", "off")
MAX_WORKERS = 1024
CONFIG_FILE_NAME = "launcher.toml"
CONFIG_ENV = "LAUNCHER_CONFIG"


@dataclass(frozen=True)
class RunConfig:
    """Everything ``launcher up`` needs. Build with :func:`load_config`; check with :func:`validate`."""

    env_id: str = "CartPole-v1"
    algo: str = "ppo"
    model: str | None = None  # the user's model function (MODULE:function or FILE.py:function)
    acting: str = "auto"  # how worker groups run the model: auto (numpy when every layer converts), numpy, tensorflow
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
    master_restarts: int = 3  # a master killed by a signal is replaced in place this many times in a row (recovery)
    hparams: Mapping[str, Any] = field(default_factory=dict)
    env_args: Mapping[str, Any] = field(default_factory=dict)  # keyword arguments for gymnasium.make (--env-arg)
    env_dir: Path | None = None  # a user's env source directory: on PYTHONPATH, mounted read-only into containers
    with_packages: tuple[str, ...] = ()  # docker/swarm: extra packages the run's image must hold (--with)
    image: str | None = None
    swarm_master: str = "auto"  # swarm backend: where the master runs (launcher.backends.swarm.master_placement)
    swarm_groups: str = "spread"  # swarm backend: where worker groups run (launcher.backends.swarm_specs.group_placement)
    build: str = "auto"  # docker backend: how a missing image is built (launcher.image.choose_build_path)
    slurm_partition: str | None = None  # slurm backend: the partition (None: the cluster's default)
    slurm_nodes: int | None = None  # slurm backend: nodes of the job (None: one per group, as many as usable)
    slurm_runtime: str = "auto"  # slurm backend: where steps run on a node: its Docker engine or the shared venv
    slurm_args: tuple[str, ...] = ()  # slurm backend: more sbatch options (--account=lab, --qos=normal)
    min_free_memory: str = DEFAULT_MIN_FREE_MEMORY
    max_utilization: float = DEFAULT_MAX_UTILIZATION_PCT
    lock_dir: Path | None = None
    allow_other_users: bool = False
    samples: int = 3  # NVML readings; the worst counts
    sample_interval_s: float = 0.2  # seconds between readings
    master_memory: str = "4GiB"  # GPU memory the learner needs (placement's memory model)
    worker_memory: str = "256MiB"  # GPU memory each worker adds to its group process
    isolate_master: bool = False  # the master must get a GPU of its own
    share_master_gpu: bool = False  # the master never gets a GPU of its own
    wait_s: float | None = None  # --wait: queue this long for busy GPUs (inf: no limit; None: exit 5 at once)
    elastic: str | None = None  # --elastic MIN_GROUPS | off (None: the site policy's default; launcher.elastic)
    json: bool = False
    progress: str = "auto"  # auto: a live table on a terminal, plain lines otherwise
    progress_interval_s: float = 5.0  # seconds between plain progress lines

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["results"] = str(self.results)
        d["lock_dir"] = None if self.lock_dir is None else str(self.lock_dir)
        d["hparams"] = dict(self.hparams)
        d["env_args"] = dict(self.env_args)
        d["env_dir"] = None if self.env_dir is None else str(self.env_dir)
        d["with_packages"] = list(self.with_packages)
        d["slurm_args"] = list(self.slurm_args)
        if self.wait_s is not None and math.isinf(self.wait_s):
            d["wait_s"] = "forever"  # JSON has no infinity; read back by the same option
        return d


FIELD_TYPES: dict[str, Any] = {f.name: f.type for f in dataclasses.fields(RunConfig)}
DEFAULTS = RunConfig()


COMMON_OPTIONS: tuple[Option, ...] = (  # every run reads these, whatever its backend
    Option("env", "env_id", "str", "gymnasium env id, e.g. CartPole-v1, launcher/Snake-v0, ALE/Pong-v5, or "
           "module:EnvId to import the module that registers it first (flappy_bird_gymnasium:FlappyBird-v0)",
           metavar="ID"),
    Option("algo", "algo", "str", f"algorithm: a built-in ({', '.join(ALGOS)}), or your own as FILE.py:Class or "
           "MODULE:Class (a worker.api.Algorithm subclass; docs/algorithms.md). `--set help` lists its "
           "hyper-parameters", metavar="NAME|REF"),
    Option("model", "model", "str", "your Keras model instead of the algorithm's: FILE.py:function or "
           "MODULE:function, called as function(spaces, hparams)", nullable=True, metavar="REF"),
    Option("acting", "acting", "choice", "how worker groups run the model: auto (numpy when every layer has a "
           "numpy implementation, else TensorFlow), numpy, tensorflow", choices=ACTING),
    Option("workers", "workers", "int", "number of workers (env instances)", metavar="N"),
    Option("backend", "backend", "choice", "where to run; auto: docker if an engine answers, else process; slurm: "
           "one Slurm job whose steps are the master and the groups (docs/scaling-out.md)",
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
    Option("port", "port", "int", "master TCP port on 127.0.0.1 (process backend; any local user can dial it); "
                                  "0, the default: a Unix socket only this user can reach", metavar="N"),
    Option("checkpoint-every", "checkpoint_every", "int", "updates between checkpoints (default: the algorithm's; 25 ppo, 500 a3c)",
           nullable=True, metavar="N"),
    Option("restart-budget", "restart_budget", "int", "restarts per worker group", metavar="N"),
    Option("master-restarts", "master_restarts", "int", "a master killed by a signal is replaced in place, from "
           "its newest checkpoint, up to N times in a row (each within 60 s of the last start); 0: never",
           metavar="N"),
    Option("min-free-memory", "min_free_memory", "size", "least free memory per GPU, e.g. 8GiB", metavar="SIZE"),
    Option("max-utilization", "max_utilization", "float", "highest GPU utilization, percent", metavar="PCT"),
    Option("env-dir", "env_dir", "path", "a directory of your own env modules: put on PYTHONPATH of every process "
           "and mounted read-only into containers", nullable=True, metavar="DIR"),
    Option("lock-dir", "lock_dir", "path", "GPU reservation lock directory", nullable=True, metavar="DIR"),
    Option("allow-other-users", "allow_other_users", "bool",
           "use GPUs where other users' processes run (default: skip them)"),
    Option("samples", "samples", "int", "NVML readings to take; the worst counts", metavar="N"),
    Option("sample-interval", "sample_interval_s", "float", "seconds between NVML readings", metavar="SECONDS"),
    Option("master-memory", "master_memory", "size", "GPU memory the master (learner) needs", metavar="SIZE"),
    Option("worker-memory", "worker_memory", "size", "GPU memory each worker adds to its group process",
           metavar="SIZE"),
    Option("isolate-master", "isolate_master", "bool",
           "require a GPU of its own for the master (default: when the workers fit elsewhere)"),
    Option("share-master-gpu", "share_master_gpu", "bool",
           "never give the master a GPU of its own; spread workers over every GPU"),
    Option("wait", "wait_s", "duration", "wait in the fair queue (across users) for busy GPUs, at most DURATION "
           "(bare --wait: no limit); without it, busy GPUs exit 5", nullable=True, metavar="DURATION",
           const="forever"),
    Option("elastic", "elastic", "str", "let the run's worker groups shrink to MIN_GROUPS when a run queued with "
           "--wait needs their GPUs, and grow back when the GPUs free (process and docker backends; docs/gpus.md); off: never "
           "(default: the site policy's)", nullable=True, metavar="MIN_GROUPS|off"),
    Option("detach", "detach", "bool", "return at once (docker)"),
    Option("json", "json", "bool", "print the result as JSON (schema launcher.result/v1) on stdout"),
    Option("progress", "progress", "choice", "progress display: auto (live on a terminal, else plain lines)",
           choices=PROGRESS_MODES),
    Option("progress-interval", "progress_interval_s", "duration", "seconds between plain progress lines",
           metavar="DURATION"),
)
# Each backend's own options (its options module, named in the registry), by backend name.
BACKEND_OPTIONS: dict[str, tuple[Option, ...]] = backend_options()
# The backends that read each backend option, by option name (an option in no entry is common to every run).
OWNERS: dict[str, tuple[str, ...]] = {}
for _backend, _options in BACKEND_OPTIONS.items():
    for _opt in _options:
        OWNERS.setdefault(_opt.name, ())
        OWNERS[_opt.name] += (_backend,)
# Every option: the common ones, then each backend's (one entry for an option several backends read).
OPTIONS: tuple[Option, ...] = (*COMMON_OPTIONS,
                               *{o.name: o for opts in BACKEND_OPTIONS.values() for o in opts}.values())
BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
# The options that decide GPUs and placement: `launcher plan` takes exactly these (and --config), so it
# shows the plan `up` would make from the same file, environment and flags.
PLACEMENT_OPTIONS: tuple[str, ...] = (
    "workers", "gpus", "groups", "max-workers-per-group", "min-free-memory", "max-utilization", "lock-dir",
    "allow-other-users", "samples", "sample-interval", "master-memory", "worker-memory", "isolate-master",
    "share-master-gpu", "json",
)
WAIT_FOREVER = ("forever", "inf", "infinite")
BY_FIELD: dict[str, Option] = {o.field: o for o in OPTIONS}


# ---------------------------------------------------------------------------------------------- values
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


ENV_ARG_RESERVED = ("render_mode",)  # make_env sets it itself


def parse_env_arg(text: str) -> tuple[str, Any]:
    """Parse ``key=value`` for ``--env-arg``: the value as a TOML scalar (``true``/``false``, an integer, a
    float, a quoted string) or else as a bare string (``use_lidar=false`` -> ``("use_lidar", False)``,
    ``mode=hard`` -> ``("mode", "hard")``).

    Raises:
        ValueError: no ``=``, a key that is not a Python identifier, an empty value, or an array/table.
    """
    import tomllib

    key, sep, raw = text.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key:
        raise ValueError(f"--env-arg takes key=value, got {text!r}")
    if not key.isidentifier():
        raise ValueError(f"--env-arg {text!r}: the key {key!r} is not a keyword argument name")
    if not raw:
        raise ValueError(f"--env-arg {text!r}: no value after '='")
    if raw[0] in "[{":
        raise ValueError(f"--env-arg {text!r}: only scalars (true/false, numbers, strings) are taken, not "
                         f"arrays or tables; put those in launcher.toml's [up.env_args]")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        if raw[0] in "\"'":
            raise ValueError(f"--env-arg {text!r}: the quoted string is not closed") from None
        value = raw  # a bare word: a string
    if not isinstance(value, (bool, int, float, str)):  # a TOML date or time: the user meant the text
        value = raw
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    return key, value


def check_env_args(args: Mapping[str, Any], where: str = "--env-arg") -> list[str]:
    """Problems with keyword arguments for ``gymnasium.make``: keys must be identifiers, not ones make_env
    sets itself, and values scalars (bool, int, float, string) or arrays of scalars (config file only)."""
    problems = []
    for key, value in args.items():
        if not isinstance(key, str) or not key.isidentifier():
            problems.append(f"{where} {key!r}: not a keyword argument name")
        elif key in ENV_ARG_RESERVED:
            problems.append(f"{where} {key}: set by the launcher itself; leave it out")
        items = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            problems.append(f"{where} {key}={value}: not a finite number")
        elif not all(isinstance(v, (bool, int, float, str)) for v in items):
            problems.append(f"{where} {key}={_toml(value)}: only scalars (true/false, numbers, strings) or an "
                            f"array of them, got {_type_name(value)}")
    return problems


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
              "size": isinstance(value, (int, str)) and not isinstance(value, bool),
              "list": isinstance(value, list)}.get(kind, isinstance(value, str))
        if not ok:
            want = {"int": "an integer", "float": "a number", "bool": "true or false",
                    "duration": "a duration such as 90, \"90s\" or \"15m\"",
                    "size": "a size such as \"8GiB\"", "list": "an array of strings"}.get(kind, "a string")
            if opt.nullable:
                want += ' or "none"'
            raise ValueError(f"expected {want}, got {_type_name(value)}")
    if kind == "int":
        return _int(value)
    if kind == "float":
        return _float(value)
    if kind == "duration":
        if opt.const is not None and isinstance(value, str) and value.strip().lower() in WAIT_FOREVER:
            return math.inf  # a bare --wait: no limit
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
    if kind == "list":
        if isinstance(value, str):
            return tuple(value.split())
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) and v.strip() for v in value):
            return tuple(v.strip() for v in value)
        raise ValueError(f"expected a list of strings, got {_toml(value)}")
    if kind == "size":
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


