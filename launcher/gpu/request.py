"""What a run asks of the GPU subsystem, parsed once: :class:`GpuRequest`.

``launcher.config`` builds it from the ``--gpus``/threshold/placement options (:func:`launcher.config.gpu_request`);
``launcher up`` and ``launcher plan`` hand the same value to :mod:`launcher.gpu` and nothing below reads a flag
or an environment variable again (PyTorch elastic's ``WorkerSpec`` is the model: a typed blueprint that
checks its own invariants).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.errors import BadInput
from launcher.gpu.placement import PlanRequest
from launcher.units import parse_size
from worker.algorithms.hparams import resolve as resolve_hparams
from worker.contract import DEFAULT_MAX_UTILIZATION_PCT, DEFAULT_MIN_FREE_MEMORY

DEFAULT_SAMPLES = 3
DEFAULT_INTERVAL_S = 0.2


@dataclass(frozen=True)
class GpuChoice:
    """A parsed ``--gpus`` value: ``auto``, ``none``, or explicit indices and/or UUIDs (in the given order)."""

    mode: str  # "auto" | "none" | "explicit"
    items: tuple[str, ...] = ()
    text: str = field(default="", compare=False)  # as the user wrote it, for messages

    def __str__(self) -> str:
        return self.text or (",".join(self.items) if self.mode == "explicit" else self.mode)


def parse_gpu_choice(text: str) -> GpuChoice:
    """Parse ``--gpus auto|none|<indices>|<UUIDs>`` (comma-separated; indices and UUIDs may be mixed).

    Raises:
        BadInput: empty, an item that is neither an index nor a ``GPU-``/``MIG-`` UUID, or a repeated item.
    """
    value = text.strip()
    if value.lower() in ("auto", "none"):
        return GpuChoice(value.lower(), text=value.lower())
    items = tuple(item.strip() for item in value.split(","))
    problems = [
        repr(item)
        for item in items
        if not (item.isdigit() or re.fullmatch(r"(GPU|MIG)-[0-9A-Za-z-]+", item, flags=re.IGNORECASE))
    ]
    if not value or problems:
        raise BadInput(
            f"--gpus: cannot read {text!r}" + (f" (bad item(s): {', '.join(problems)})" if problems else ""),
            hint="use auto, none, GPU indices like 0,2 or UUIDs like GPU-8f3a... (see `launcher gpus`)",
        )
    duplicates = sorted({item for item in items if items.count(item) > 1})
    if duplicates:
        raise BadInput(f"--gpus names {', '.join(duplicates)} more than once")
    return GpuChoice("explicit", items, text=value)


@dataclass(frozen=True)
class GpuRequest:
    """Everything the GPU subsystem needs to choose, plan and lease GPUs for one run.

    Attributes:
        choice: ``--gpus``.
        placement: ``--workers``, group sizes and the memory model (:class:`PlanRequest`).
        min_free_memory_bytes: a GPU needs this much free memory (worst reading).
        max_utilization_pct: and at most this utilisation, percent (worst reading).
        exclude_other_users: other users' compute processes make a GPU unavailable (no ``--allow-other-users``).
        samples: NVML readings to take for ``auto``; the worst counts.
        interval_s: seconds between readings.
        lock_dir: ``--lock-dir`` (None: the admin lease store, else ``$LAUNCHER_LOCK_DIR`` or the default).
        wait_s: ``--wait``: seconds to queue for busy GPUs (``inf``: no limit; None: do not wait, exit 5).
    """

    choice: GpuChoice
    placement: PlanRequest
    min_free_memory_bytes: int = parse_size(DEFAULT_MIN_FREE_MEMORY)
    max_utilization_pct: float = DEFAULT_MAX_UTILIZATION_PCT
    exclude_other_users: bool = True
    samples: int = DEFAULT_SAMPLES
    interval_s: float = DEFAULT_INTERVAL_S
    lock_dir: Path | None = None
    wait_s: float | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.min_free_memory_bytes < 0:
            problems.append(f"--min-free-memory must be >= 0 bytes, got {self.min_free_memory_bytes}")
        if not 0 <= self.max_utilization_pct <= 100:
            problems.append(f"--max-utilization must be a percentage in 0..100, got {self.max_utilization_pct}")
        if self.samples < 1:
            problems.append(f"--samples must be >= 1, got {self.samples}")
        if self.interval_s < 0:
            problems.append(f"--sample-interval must be >= 0 seconds, got {self.interval_s:g}")
        if self.wait_s is not None and not self.wait_s > 0:
            problems.append(f"--wait must be > 0 seconds, got {self.wait_s:g}")
        if problems:
            raise BadInput("; ".join(problems), hint="see `launcher up --help`")

    @property
    def on_cpu(self) -> bool:
        return self.choice.mode == "none"


def _overlapped(cfg: Any) -> bool:
    """Whether the run's groups collect while the learner learns (its ``sync`` hyper-parameter is false), from
    the same table the run uses; a bad ``--algo`` or ``--set`` is reported by config's own check, so here it
    counts as the default (overlapped)."""
    try:
        return not resolve_hparams(cfg.algo, cfg.env_id, dict(cfg.hparams))["sync"]
    except (ValueError, TypeError):
        return True


def request_from_options(cfg: Any) -> tuple[GpuRequest | None, list[str], list[str]]:
    """Build the request from the ``launcher up`` options (a :class:`launcher.config.RunConfig`, whose
    :func:`launcher.config.gpu_request` is the one caller): (request or None, placement problems, other
    problems), every problem found so config can report them all at once."""
    problems: list[str] = []
    choice = None
    try:
        choice = parse_gpu_choice(cfg.gpus)
    except BadInput as exc:
        problems.append(exc.message)
    sizes: dict[str, int] = {}
    for flag, value in (("--min-free-memory", cfg.min_free_memory), ("--master-memory", cfg.master_memory),
                        ("--worker-memory", cfg.worker_memory)):
        try:
            sizes[flag] = parse_size(value, what=flag)
        except BadInput as exc:
            problems.append(exc.message)
    if cfg.isolate_master and cfg.share_master_gpu:
        problems.append("--isolate-master and --share-master-gpu contradict each other; give at most one")
    placement = None
    try:
        placement = PlanRequest(
            workers=cfg.workers, max_workers_per_group=cfg.max_workers_per_group, groups=cfg.groups,
            master_memory_bytes=sizes.get("--master-memory", 0), worker_memory_bytes=sizes.get("--worker-memory", 0),
            isolate_master=True if cfg.isolate_master else False if cfg.share_master_gpu else None,
            learner_core=_overlapped(cfg))
    except ValueError as exc:
        placement_problems = [str(exc)]
    else:
        placement_problems = []
    request = None
    if choice is not None and placement is not None and not problems:
        try:
            request = GpuRequest(
                choice=choice, placement=placement, min_free_memory_bytes=sizes["--min-free-memory"],
                max_utilization_pct=cfg.max_utilization, exclude_other_users=not cfg.allow_other_users,
                samples=cfg.samples, interval_s=cfg.sample_interval_s, lock_dir=cfg.lock_dir,
                wait_s=getattr(cfg, "wait_s", None))
        except BadInput as exc:
            problems.extend(exc.message.split("; "))
    return request, placement_problems, problems
