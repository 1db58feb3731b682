"""``launcher plan``: show the placement ``launcher up`` would use, without starting anything.

The GPU selection and memory flags are defined here once (:func:`add_gpu_arguments`,
:func:`add_placement_arguments`) so ``up`` can take the same ones and turn them into the same values
(:func:`selection_kwargs`, :func:`plan_request_from_args`).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, replace
from typing import Any, Sequence

from launcher import gpu_select, policy
from launcher.errors import BadInput
from launcher.gpu_select import format_size
from launcher.nvml import GpuInfo
from launcher.placement import (
    DEFAULT_MASTER_MEMORY_BYTES,
    DEFAULT_MAX_WORKERS_PER_GROUP,
    DEFAULT_WORKER_MEMORY_BYTES,
    Plan,
    PlanRequest,
    make_plan,
)

SCHEMA = "launcher.plan/v1"


def add_gpu_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--gpus`` choice and the thresholds that decide which GPUs are free."""
    g = parser.add_argument_group("GPU selection")
    g.add_argument("--gpus", default="auto", metavar="auto|none|LIST",
                   help="auto: free GPUs by the thresholds below; none: CPU only; or indices/UUIDs, e.g. 0,2 "
                   "(overrides the thresholds) (default: auto)")
    g.add_argument("--min-free-memory", default=gpu_select.DEFAULT_MIN_FREE_MEMORY, metavar="SIZE",
                   help="least free memory a GPU needs, e.g. 8GiB, 500MB (default: %(default)s)")
    g.add_argument("--max-utilization", type=float, default=gpu_select.DEFAULT_MAX_UTILIZATION_PCT, metavar="PCT",
                   help="highest GPU utilization in percent (default: %(default)g)")
    g.add_argument("--allow-other-users", action="store_true",
                   help="use GPUs where other users' processes run (default: skip them)")
    g.add_argument("--samples", type=int, default=gpu_select.DEFAULT_SAMPLES, metavar="N",
                   help="NVML readings to take; the worst counts (default: %(default)s)")
    g.add_argument("--sample-interval", type=float, default=gpu_select.DEFAULT_INTERVAL_S, metavar="SECONDS",
                   help="seconds between readings (default: %(default)g)")
    g.add_argument("--lock-dir", default=None, metavar="DIR",
                   help="GPU reservation lock directory (default: $LAUNCHER_LOCK_DIR or /tmp/launcher-locks)")


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """Group sizes and the memory figures placement computes capacity from."""
    g = parser.add_argument_group("placement")
    g.add_argument("--max-workers-per-group", type=int, default=DEFAULT_MAX_WORKERS_PER_GROUP, metavar="N",
                   help="most workers in one group process (default: %(default)s)")
    g.add_argument("--groups", type=int, default=None, metavar="N", help="force this many worker groups")
    g.add_argument("--master-memory", default=f"{DEFAULT_MASTER_MEMORY_BYTES // 2**20}MiB", metavar="SIZE",
                   help="GPU memory the master (learner) needs (default: %(default)s)")
    g.add_argument("--worker-memory", default=f"{DEFAULT_WORKER_MEMORY_BYTES // 2**20}MiB", metavar="SIZE",
                   help="GPU memory each worker adds to its group process (default: %(default)s)")
    iso = g.add_mutually_exclusive_group()
    iso.add_argument("--isolate-master", dest="isolate_master", action="store_true", default=None,
                     help="require a GPU of its own for the master (default: when the workers fit elsewhere)")
    iso.add_argument("--share-master-gpu", dest="isolate_master", action="store_false",
                     help="never give the master a GPU of its own; spread workers over every GPU")


def selection_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for :func:`launcher.gpu_select.resolve_gpus` from :func:`add_gpu_arguments`' flags."""
    problems = []
    if args.samples < 1:
        problems.append(f"--samples must be >= 1, got {args.samples}")
    if args.sample_interval < 0:
        problems.append(f"--sample-interval must be >= 0 seconds, got {args.sample_interval}")
    try:
        min_free = gpu_select.parse_size(args.min_free_memory, what="--min-free-memory")
    except BadInput as exc:
        problems.append(exc.message)
    if problems:
        raise BadInput("; ".join(problems), hint="see `launcher plan --help`")
    return {
        "min_free_memory": min_free,
        "max_utilization_pct": args.max_utilization,
        "exclude_other_users": not args.allow_other_users,
        "samples": args.samples,
        "interval_s": args.sample_interval,
        "lock_dir": args.lock_dir,
    }


def plan_request_from_args(args: argparse.Namespace) -> PlanRequest:
    """A :class:`PlanRequest` from ``--workers`` and :func:`add_placement_arguments`' flags.

    Raises:
        BadInput: every problem found, at once.
    """
    problems: list[str] = []
    sizes: dict[str, int] = {}
    for flag, attr in (("--master-memory", "master_memory"), ("--worker-memory", "worker_memory")):
        try:
            sizes[attr] = gpu_select.parse_size(getattr(args, attr), what=flag)
        except BadInput as exc:
            problems.append(exc.message)
    try:
        request = PlanRequest(
            workers=args.workers,
            max_workers_per_group=args.max_workers_per_group,
            groups=args.groups,
            master_memory_bytes=sizes.get("master_memory", 0),
            worker_memory_bytes=sizes.get("worker_memory", 0),
            isolate_master=args.isolate_master,
        )
    except ValueError as exc:
        problems.insert(0, str(exc))
    if problems:
        raise BadInput("; ".join(problems), hint="see `launcher plan --help`")
    return request


def cpu_count() -> int:
    """Cores this process may run on (respects a container's or taskset's CPU set)."""
    return len(os.sched_getaffinity(0))


def plan_document(plan: Plan, request: PlanRequest, gpus: Sequence[GpuInfo]) -> dict[str, Any]:
    """The ``--json`` output: the plan, the request it answers and the GPUs it was made from."""
    return {
        "schema": SCHEMA,
        **plan.to_dict(),
        "request": asdict(request),
        "selected_gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "memory_total_bytes": g.memory_total_bytes,
                "memory_free_bytes": g.memory_free_bytes,
                "gpu_utilization_pct": g.gpu_utilization_pct,
            }
            for g in gpus
        ],
    }


def format_plan(plan: Plan) -> str:
    """The plan as a table people read."""
    where = f"on {len(plan.gpu_uuids)} GPU(s)" if plan.kind == "gpu" else "on CPU"
    lines = [f"Plan: {plan.total_workers} worker(s) in {len(plan.groups)} group(s) {where}"]

    def row(label: str, share: Any, workers: str) -> str:
        if not share.on_gpu:
            return f"  {label:<9} CPU  cpus {share.cpus:<6g} {workers}".rstrip()
        device = f"GPU {','.join(map(str, share.gpu_indices))}  {','.join(share.gpu_uuids)}"
        limit = f"TF memory limit {format_size(share.memory_limit_bytes)}"
        return f"  {label:<9} {device:<50} {limit:<27} cpus {share.cpus:<6g} {workers}".rstrip()

    lines.append(row("master", plan.master, ""))
    for g in plan.groups:
        lines.append(row(f"group {g.index}", g.share, f"{g.workers} worker(s)"))
    lines.append("Why:")
    lines.extend(f"  - {r}" for r in plan.reasons)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    problems: list[str] = []
    for check in (plan_request_from_args, selection_kwargs):
        try:
            check(args)
        except BadInput as exc:
            problems.append(exc.message)
    if problems:  # every flag problem at once, before reading any GPU
        raise BadInput("; ".join(problems), hint="see `launcher plan --help`")
    request = plan_request_from_args(args)
    # The site policy (launcher.policy) applies here exactly as in `up`: memory floor, GPUs, workers per GPU.
    site = policy.load_policy()
    kwargs = selection_kwargs(args)
    kwargs["min_free_memory"], notes = policy.floor_min_free_memory(kwargs["min_free_memory"], site)
    gpus, reasons = gpu_select.resolve_gpus(args.gpus, **kwargs)
    gpu_filter = policy.gpu_filter_for(site, gpus_choice=args.gpus, lock_dir=args.lock_dir)
    if gpu_filter is not None:
        gpus, limited = gpu_filter(gpus)
        reasons = [*reasons, *limited]
    first = [*(notes if args.gpus != "none" else []), *reasons]
    plan, _, limits = policy.plan_obeying(lambda req: (make_plan(req, gpus, cpu_count(), reasons=first), None),
                                          request, site)
    plan = replace(plan, reasons=(*plan.reasons, *limits))
    if args.json:
        doc = plan_document(plan, request, gpus)
        doc["policy"] = None if site.empty else site.to_dict()
        print(json.dumps(doc, indent=2))
    else:
        print(format_plan(plan))
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="show where the master and worker groups would run",
        description="Show the placement `launcher up` would use (GPUs, groups, memory limits) without starting "
        "anything. On a machine with no usable GPU this is a CPU plan, with the reason.",
    )
    parser.add_argument("--workers", type=int, required=True, metavar="N", help="number of workers (env instances)")
    add_gpu_arguments(parser)
    add_placement_arguments(parser)
    parser.add_argument("--json", action="store_true", help=f"print JSON ({SCHEMA}) instead of a table")
    parser.set_defaults(func=run)
