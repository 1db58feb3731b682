"""``launcher check``: what a run here needs and has, one line each, with the next step for every problem.

Exit 0 when a GPU run can start here (``--cpu``: a CPU-only run), 6 when one cannot (every line that stops it
is marked ``(needed)`` and says what to do), 2 for a bad flag or config file. ``--json`` prints the
``launcher.check/v1`` document for CI runners. The backend, image and results directory come from the same
layers as ``launcher up`` (launcher.toml, ``LAUNCHER_*``, flags).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from launcher.check import GPU, Report, Status
from launcher.errors import ExitCode


def register(sub: Any) -> None:
    from launcher.backends import BACKENDS

    p = sub.add_parser("check", help="what a run on this machine needs and has, and what to do about each gap",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="check for a CPU-only run (no NVML, GPU runtime or GPU image)")
    p.add_argument("--backend", choices=("auto", *BACKENDS), default=None,
                   help="the backend to check (default: as `up`)")
    p.add_argument("--image", default=None, help="the image to check (default: as `up`, launcher:VERSION-gpu or -cpu)")
    p.add_argument("--results", type=Path, default=None, metavar="DIR", help="the results directory to check")
    p.add_argument("--config", default=None, metavar="FILE", help="launcher.toml to read (default: as `up`)")
    p.add_argument("--json", dest="as_json", action="store_true", help="print JSON (launcher.check/v1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from launcher.check import build_report
    from launcher.check_probes import CheckRequest, probe_all
    from launcher.config import load_config

    flags = {"backend": args.backend, "image": args.image, "results": args.results}
    cfg, origin = load_config({k: v for k, v in flags.items() if v is not None}, config_path=args.config)
    request = CheckRequest(backend=cfg.backend, image=cfg.image, results=cfg.results, build=cfg.build, cpu=args.cpu,
                           backend_origin=origin.get("backend", "default"))
    report = build_report(probe_all(request), cpu=args.cpu)
    if args.as_json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        sys.stdout.write(format_report(report) + "\n")
    return int(ExitCode.OK if report.ready else ExitCode.MISSING_DEPENDENCY)


def format_report(report: Report) -> str:
    """The report as text: one line per check, its next step indented below, then the verdict."""
    out = []
    for line in report.lines:
        mark = "  (needed)" if line.blocks(report.target) else ""
        out.append(f"{line.status.value:<8} {line.name:<20} {line.detail}{mark}")
        if line.next_step and line.status is not Status.OK:
            out.append(f"{'':<8} {'':<20} next: {line.next_step}")
        elif line.next_step:
            out.append(f"{'':<8} {'':<20} note: {line.next_step}")
    kind = "a GPU run" if report.target == GPU else "a CPU-only run"
    if report.ready:
        out.append(f"ready: {kind} can start here (backend {report.backend}: {report.backend_why})")
    else:
        names = ", ".join(line.name for line in report.blocking)
        out.append(f"not ready: {kind} cannot start here (backend {report.backend}: {report.backend_why}); "
                   f"fix: {names}")
    return "\n".join(out)

