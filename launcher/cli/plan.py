"""``launcher plan``: show the placement ``launcher up`` would use, and what its backend would start, without
starting anything.

Its options are ``up``'s own (all but :data:`NOT_SHOWN`, declared once in :data:`launcher.config.OPTIONS`), read
through the same layers (``launcher.toml``, ``LAUNCHER_*``, flags): the GPU and placement ones
(:data:`launcher.config.PLACEMENT_OPTIONS`) into the same :class:`~launcher.gpu.request.GpuRequest`, so the
plan shown is the plan ``up`` makes; from the rest, which decide each part's command and environment, the
backend's one pure step (:meth:`launcher.backends.base.Backend.specs`, the one ``start`` uses) gives the
``launch`` section. The run has no id yet: :data:`PREVIEW_RUN_ID` stands for it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any, Sequence

from launcher import gpu
from launcher.backends.base import PreparedRun
from launcher.backends.specs import LaunchSpecs, format_specs
from launcher.config import RunConfig, gpu_request, load_config
from launcher.config.checks import backend_mismatch
from launcher.errors import ConfigErrors
from launcher.gpu.nvml import GpuInfo
from launcher.gpu.placement import Plan, PlanRequest
from launcher.runs import RunDir
from launcher.schemas import PLAN_SCHEMA
from launcher.units import format_size

SCHEMA = PLAN_SCHEMA
# `up`'s options that change nothing `launcher plan` shows; every other one is plan's too (placement, and what
# each part is started with: command, environment, mounts, the run's spec in a container's environment).
NOT_SHOWN: tuple[str, ...] = ("detach", "progress", "progress-interval", "wait")
PREVIEW_RUN_ID = "RUN-ID"  # stands for the id `launcher up` gives the run


def preview_run(cfg: RunConfig, plan: Plan) -> PreparedRun:
    """The run ``launcher up`` would prepare from ``cfg`` and ``plan``, with :data:`PREVIEW_RUN_ID` for its id and
    no secret (no spec has it). Writes nothing."""
    from launcher.up import build_spec

    run_dir = RunDir(PREVIEW_RUN_ID, cfg.results / PREVIEW_RUN_ID)
    return PreparedRun(config=cfg, plan=plan, spec=build_spec(cfg, plan, PREVIEW_RUN_ID, run_dir.path),
                       run_dir=run_dir, secret="")


def launch_specs(cfg: RunConfig, plan: Plan) -> tuple[LaunchSpecs, str]:
    """What the backend ``cfg`` chooses would start for ``plan`` (:meth:`Backend.specs`), and why that backend."""
    from launcher.up import choose_backend, make_backend

    name, why = choose_backend(cfg.backend)
    return make_backend(name, cfg).specs(preview_run(cfg, plan)), why


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

    cfg, origin = load_config(flags_from_args(args), config_path=args.config)
    mismatch = backend_mismatch(cfg, origin)  # what `up` would refuse: an option of a backend not chosen
    if mismatch:
        raise ConfigErrors(mismatch, hint="nothing was planned; fix the options above and run again")
    request = gpu_request(cfg)  # every option problem at once, before reading any GPU
    outcome = gpu.preview(request)
    specs, why = launch_specs(cfg, outcome.plan)
    if cfg.json:
        doc = plan_document(outcome.plan, request.placement, outcome.gpus)
        doc["policy"] = None if outcome.site.empty else outcome.site.to_dict()
        doc["launch"] = {**specs.to_dict(), "backend_reason": why, "run_id": PREVIEW_RUN_ID}
        print(json.dumps(doc, indent=2))
    else:
        print(format_plan(outcome.plan))
        print("\n".join(format_specs(specs)))
    return 0


def register(subparsers: Any) -> None:
    from launcher.cli.up import add_up_options

    parser = subparsers.add_parser(
        "plan",
        help="show where the master and worker groups would run, and what would be started",
        description="Show the placement `launcher up` would use (GPUs, groups, memory limits) and what its backend "
        "would start for each part (command, GPU and thread variables; --json: the whole environment the "
        "launcher sets and the mounts, as plan.json records them) without starting anything, from up's own "
        "options (flags, launcher.toml [up], LAUNCHER_*). On a machine with no usable GPU this is a CPU plan, "
        f"with the reason. The run's id is not known yet: {PREVIEW_RUN_ID} stands for it.",
    )
    add_up_options(parser, exclude=NOT_SHOWN)
    parser.set_defaults(func=run)
