"""``launcher plan``: show the placement ``launcher up`` would use, without starting anything.

Its options are ``up``'s own GPU and placement options (:data:`launcher.config.PLACEMENT_OPTIONS`, declared
once in :data:`launcher.config.OPTIONS`), read through the same layers (``launcher.toml``, ``LAUNCHER_*``,
flags) into the same :class:`~launcher.gpu.request.GpuRequest`, so the plan shown is the plan ``up`` makes.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any, Sequence

from launcher import gpu
from launcher.config import PLACEMENT_OPTIONS, gpu_request, load_config
from launcher.gpu.nvml import GpuInfo
from launcher.gpu.placement import Plan, PlanRequest
from launcher.units import format_size

SCHEMA = "launcher.plan/v1"


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
    from launcher.cli.up import flags_from_args

    cfg, _ = load_config(flags_from_args(args), config_path=args.config)
    request = gpu_request(cfg)  # every option problem at once, before reading any GPU
    outcome = gpu.preview(request)
    if cfg.json:
        doc = plan_document(outcome.plan, request.placement, outcome.gpus)
        doc["policy"] = None if outcome.site.empty else outcome.site.to_dict()
        print(json.dumps(doc, indent=2))
    else:
        print(format_plan(outcome.plan))
    return 0


def register(subparsers: Any) -> None:
    from launcher.cli.up import add_up_options

    parser = subparsers.add_parser(
        "plan",
        help="show where the master and worker groups would run",
        description="Show the placement `launcher up` would use (GPUs, groups, memory limits) without starting "
        "anything, from up's own GPU and placement options (flags, launcher.toml [up], LAUNCHER_*). On a machine "
        "with no usable GPU this is a CPU plan, with the reason.",
    )
    add_up_options(parser, only=PLACEMENT_OPTIONS)
    parser.set_defaults(func=run)
