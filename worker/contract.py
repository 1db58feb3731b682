"""The launcher↔worker contract: everything both halves must agree on, in one place.

The host side (``launcher/``) writes a :class:`RunSpec` as JSON and sets the ``LAUNCHER_*`` variables named
here; the run side (``worker/``) reads them once at start and passes typed values down. The launcher imports
this module, :mod:`worker.ending` (run states, outcomes, the error document) and :mod:`worker.results` from
``worker/`` and nothing else, so this module must stay light:
standard library only (no numpy, gymnasium or TensorFlow), or every ``launcher`` command would pay for them.

The run secret is never part of the spec: it travels in ``LAUNCHER_SECRET`` or a file named by
``LAUNCHER_SECRET_FILE`` (a Docker secret) and is removed from the environment as soon as it is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --- environment variables the launcher sets for a run's processes -------------------------------------
SPEC_ENV = "LAUNCHER_SPEC"  # the run spec as JSON (or ``--spec FILE``)
SECRET_ENV = "LAUNCHER_SECRET"  # the run secret itself (process backend)
SECRET_FILE_ENV = "LAUNCHER_SECRET_FILE"  # a file holding the run secret (Docker/Swarm secret)
MASTER_ADDR_ENV = "LAUNCHER_MASTER_ADDR"  # host:port or unix:PATH a group dials; overrides connect_host:master_port
TF_THREADS_ENV = "LAUNCHER_TF_THREADS"  # TensorFlow intra/inter-op threads (0: TF's default)
LOG_LEVEL_ENV = "LAUNCHER_LOG_LEVEL"  # logging level of a run's process (default INFO)
LISTEN_FD_ENV = "LAUNCHER_LISTEN_FD"  # an inherited, already-bound listening socket (process backend)
LEASES_ENV = "LAUNCHER_LEASES"  # comma-separated GPU lease file paths the master takes first thing (worker/lease.py)
LEASE_DIR = "/run/launcher/leases"  # where a container backend mounts those lease files

# --- exit codes of a run's processes (``python -m worker master|group``) --------------------------------
# The supervisor reads a group's exit code to decide whether a restart can help: only a crash (any code not
# named here, or a signal) spends the restart budget.
EXIT_OK = 0  # master: the run ended (summary.json says how); group: the master told it the run is over
EXIT_FAILED = 1  # master: the run failed; summary.json's error names the exception, its message and where
EXIT_BAD_SPEC = 2  # either: no or a malformed run spec, or no run secret; nothing ran
GROUP_MASTER_GONE_EXIT = 3  # a group that could not reach the master within its reconnect deadline
GROUP_AUTH_REFUSED_EXIT = 4  # the master refused the group's handshake (wrong secret): never restarted
GROUP_USER_CODE_EXIT = 5  # a group whose algorithm code raised: never restarted (the master ends the run failed)
NEVER_RESTARTED_EXITS = (GROUP_AUTH_REFUSED_EXIT, GROUP_USER_CODE_EXIT)  # a restart would end the same way
LEASE_LOST_EXIT = 75  # EX_TEMPFAIL: the master found a lease taken by another run; the launcher replans or reports it

# --- values both halves validate ------------------------------------------------------------------------
ALGOS = ("ppo", "a3c")  # the built-ins (worker/algorithms BUILTINS); any other is MODULE:Class or FILE.py:Class
ACTING = ("auto", "numpy", "tensorflow")  # how groups run the model: auto picks numpy when every layer converts
SWARM_MASTER = ("auto", "local", "storage", "any")  # where a Swarm run's master may be placed
DEFAULT_MIN_FREE_MEMORY = "1GiB"  # a GPU with less free memory is not chosen
DEFAULT_MAX_UTILIZATION_PCT = 50.0  # a GPU busier than this (percent) is not chosen
SPEC_VERSION = 1


UNIX_PREFIX = "unix:"  # a master address that is a Unix socket's path (the process backend's default)


def parse_addr(addr: str) -> str | tuple[str, int]:
    """``"unix:/path"`` -> ``"/path"`` (a Unix socket); ``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``.
    Raises ValueError naming the address when it is neither."""
    if addr.startswith(UNIX_PREFIX):
        path = addr[len(UNIX_PREFIX):]
        if not path.startswith("/"):
            raise ValueError(f"master address {addr!r}: a unix: address needs an absolute path")
        return path
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"master address {addr!r} is not host:port or unix:/path")
    return host.strip("[]"), int(port)


def format_addr(addr: str | tuple[str, int]) -> str:
    """The inverse of :func:`parse_addr`."""
    return f"{UNIX_PREFIX}{addr}" if isinstance(addr, str) else f"{addr[0]}:{addr[1]}"


def plain_env_id(env_id: str) -> str:
    """The registered id without its module: ``"flappy_bird_gymnasium:FlappyBird-v0"`` -> ``"FlappyBird-v0"``
    (an id without a module is itself). Per-env defaults, run ids and plot titles follow the env, not the module
    that registers it. Here, in the standard-library-only contract, so the host uses it without gymnasium."""
    return env_id.rpartition(":")[2]


def is_code_ref(ref: str) -> bool:
    """Whether ``ref`` reads as user code: ``module:Name`` or ``path/to/file.py:Name``."""
    target, sep, name = ref.rpartition(":")
    return bool(sep and target and name.isidentifier())


# --- the results directory: names of the files in ``<results root>/<run id>/`` ---------------------------
CONFIG_FILE = "config.json"  # resolved launcher configuration (no secret); launcher
PLAN_FILE = "plan.json"  # placement plan; launcher
SPEC_FILE = "spec.json"  # the run spec every process started from; launcher
STATUS_FILE = "status.json"  # live status, rewritten atomically every second; master
METRICS_FILE = "metrics.jsonl"  # one JSON object per line: "episodes" and "progress" records; master
SUMMARY_FILE = "summary.json"  # the outcome, written once at the end; master
RESULT_FILE = "result.json"  # the launcher's own result document (``up --json``); launcher
MASTER_ADDR_FILE = "master.addr"  # host:port the master bound (when the spec's port is 0); master
CURVE_FILE = "learning_curve.png"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS_DIR = "checkpoints"
LOGS_DIR = "logs"  # master.log, group-<N>.log
MODEL_DIR = "model"
POLICY_FILE = "policy.npz"  # in MODEL_DIR: the final model's weights by name and the learner's extras (x/...)
EXTRA_PREFIX = "x/"  # the learner's extras beside the weights, in WEIGHTS frames and every policy*.npz
BEST_POLICY_FILE = "best_policy.npz"  # in MODEL_DIR: the weights at the best rolling mean return
BEST_FILE = "best.json"  # in MODEL_DIR: when and how good the best policy was
POLICY_DOC_FILE = "policy.json"  # in MODEL_DIR: how to act with policy.npz (numpy program, policy output, actions)
KERAS_MODEL_FILE = "final_model.keras"  # in MODEL_DIR
MASTER_LOG = "master.log"  # in LOGS_DIR


def group_log_name(index: int | str) -> str:
    """The log file of worker group ``index`` in ``logs/``."""
    return f"group-{index}.log"


@dataclass(frozen=True)
class RunFiles:
    """Paths of one run's results directory (see the names above)."""

    root: Path

    @property
    def status(self) -> Path:
        return self.root / STATUS_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY_FILE

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD_DIR

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def model_dir(self) -> Path:
        return self.root / MODEL_DIR

    @property
    def curve(self) -> Path:
        return self.root / CURVE_FILE

    @property
    def logs(self) -> Path:
        return self.root / LOGS_DIR

    @property
    def spec(self) -> Path:
        return self.root / SPEC_FILE

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def plan(self) -> Path:
        return self.root / PLAN_FILE

    @property
    def master_addr(self) -> Path:
        return self.root / MASTER_ADDR_FILE


# --- the run spec ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GroupAssignment:
    """What one worker-group process runs: how many workers (env instances) and on which device."""

    index: int
    workers: int
    gpu: bool = False  # whether this group's process sees a GPU (it then limits TF memory)
    memory_limit_bytes: int | None = None  # TF per-process GPU memory cap; None: memory growth only

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"group index must be >= 0, got {self.index}")
        if self.workers < 1:
            raise ValueError(f"group {self.index}: workers must be >= 1, got {self.workers}")


@dataclass(frozen=True)
class RunSpec:
    """Everything the master and the worker groups need to know about a run.

    Attributes:
        run_id: the run's id; names its containers, network, results directory and log lines.
        env_id: a gymnasium env id (``CartPole-v1``, ``launcher/Snake-v0``, ...), or gymnasium's
            ``module:EnvId`` form naming a module to import first (``flappy_bird_gymnasium:FlappyBird-v0``).
        env_args: keyword arguments for ``gymnasium.make`` (``--env-arg k=v``, ``[up.env_args]``).
        algo: a built-in (``ppo``, ``a3c``) or the user's algorithm as ``module:Class`` (importable where the run's
            processes run: the launcher puts a ``--algo file.py:Class`` file's directory on their path).
        model: the user's model function as ``module:function`` (None: the algorithm's own model).
        acting: how groups run the model: ``auto`` (numpy when every layer converts), ``numpy``, ``tensorflow``.
        seed: base seed; worker w of group g uses ``seed + 1000 * g + w``.
        max_steps: total env steps over all workers after which the run ends (None: no limit).
        until_return: end the run when the mean return over the last ``return_window`` episodes reaches
            this value (None: no target).
        master_host: address the master binds (process backend: 127.0.0.1; container: 0.0.0.0 on the
            run's private network only).
        master_port: port the master binds; 0 lets the OS choose (it is then written to ``master.addr``).
        connect_host: address the worker groups dial to reach the master.
        results_dir: the run's results directory as the master sees it.
        checkpoint_every: updates between checkpoints (None: the algorithm's ``checkpoint_every``).
        hparams: algorithm hyper-parameter overrides (see ``worker.algorithms``).
        groups: one entry per worker group.
    """

    run_id: str
    env_id: str
    algo: str
    model: str | None = None
    acting: str = "auto"
    seed: int = 0
    max_steps: int | None = None
    until_return: float | None = None
    return_window: int = 100
    master_host: str = "127.0.0.1"
    master_port: int = 0
    connect_host: str = "127.0.0.1"
    results_dir: str = "results"
    checkpoint_every: int | None = None
    hparams: dict[str, Any] = field(default_factory=dict)
    env_args: dict[str, Any] = field(default_factory=dict)
    groups: tuple[GroupAssignment, ...] = ()
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 20.0
    handshake_timeout_s: float = 5.0
    max_frame_bytes: int = 256 * 1024 * 1024
    max_connections: int = 256
    version: int = SPEC_VERSION

    def __post_init__(self) -> None:
        problems = []
        if self.algo not in ALGOS and not is_code_ref(self.algo):
            problems.append(f"algo must be one of {', '.join(ALGOS)} or MODULE:Class, got {self.algo!r}")
        if self.model is not None and not is_code_ref(self.model):
            problems.append(f"model must be MODULE:function, got {self.model!r}")
        if self.acting not in ACTING:
            problems.append(f"acting must be one of {', '.join(ACTING)}, got {self.acting!r}")
        if self.max_steps is not None and self.max_steps < 1:
            problems.append(f"max_steps must be >= 1, got {self.max_steps}")
        if self.return_window < 1:
            problems.append(f"return_window must be >= 1, got {self.return_window}")
        if not 0 <= self.master_port <= 65535:
            problems.append(f"master_port must be in 0..65535, got {self.master_port}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            problems.append(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def total_workers(self) -> int:
        return sum(g.workers for g in self.groups)

    def group(self, index: int) -> GroupAssignment:
        for g in self.groups:
            if g.index == index:
                return g
        raise KeyError(f"run {self.run_id} has no group {index}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunSpec":
        data = dict(data)
        if data.get("version", SPEC_VERSION) != SPEC_VERSION:
            raise ValueError(f"run spec version {data.get('version')} is not {SPEC_VERSION}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown run spec fields: {', '.join(unknown)}")
        data["groups"] = tuple(GroupAssignment(**g) for g in data.get("groups", ()))
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        return cls.from_dict(json.loads(text))


def take_secret(environ: dict[str, str] | None = None) -> bytes:
    """Read the run secret once and remove it from the environment so children and logs never see it.

    Reads ``LAUNCHER_SECRET_FILE`` (a Docker/Swarm secret file, or the process backend's inherited pipe
    ``/dev/fd/N``) when set, else
    ``LAUNCHER_SECRET``. Raises ``RuntimeError`` (without the value) when neither is set or it is empty.
    """
    env = os.environ if environ is None else environ
    path = env.pop(SECRET_FILE_ENV, None)
    value = env.pop(SECRET_ENV, None)
    if path:
        with open(path, "rb") as fh:  # a file, or the launcher's pipe /dev/fd/N (process backend)
            secret = fh.read(4096).strip()
    elif value:
        secret = value.encode()
    else:
        raise RuntimeError(f"no run secret: set {SECRET_ENV} or {SECRET_FILE_ENV}")
    if len(secret) < 16:
        raise RuntimeError("the run secret is shorter than 16 bytes; the launcher generates 32")
    return secret


def hold_live(results_dir: str | Path) -> int | None:
    """Hold a shared ``flock`` on the results directory for the life of this process (the descriptor stays
    open, close-on-exec): the run's liveness lease, which the launcher holds too; ``launcher up --resume``
    refuses a run while anyone holds it. None when the directory cannot be opened (the run still runs)."""
    import fcntl

    try:
        fd = os.open(results_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # shared: never blocks while only launchers and masters hold it
    except OSError:
        os.close(fd)
        return None
    return fd
