"""``launcher down RUN`` / ``launcher down --all``: stop a run and remove its containers and network.

Results stay. The master is stopped first (it checkpoints), then the groups; each container's output is
kept in ``<results>/<run>/logs/`` before the container goes. Docker runs are found by their
``launcher.run`` label, so this works after the launcher itself was killed (like
``docker rm -f $(docker ps -aq --filter label=launcher.run=RUN)`` plus the network, in order). Process
runs: the pids in ``run.json``, if still alive and ours.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from launcher.cli.status import results_root
from launcher.errors import BadInput
from launcher.lifecycle import DownReport, down_all, down_run


def register(sub: Any) -> None:
    p = sub.add_parser("down", help="stop a run and remove its containers (results are kept)", description=__doc__)
    p.add_argument("run", nargs="?", default=None, metavar="RUN", help="a run id or directory")
    p.add_argument("--all", action="store_true",
                   help="every live run: your Docker runs on the engine (everyone's as root) and process runs under --results")
    p.add_argument("--grace", type=float, default=8.0, metavar="S", help="seconds the master gets to checkpoint [8]")
    p.add_argument("--results", default=None, help="results root [$LAUNCHER_RESULTS or results]")
    p.add_argument("--json", action="store_true", help="print what was removed as JSON on stdout")
    p.set_defaults(func=run)


def _line(r: DownReport) -> str:
    what = []
    if r.launcher_signalled:
        what.append("stopped its launcher")
    if r.services:
        what.append(f"removed {len(r.services)} service(s)")
    if r.containers:
        what.append(f"removed {len(r.containers)} container(s)")
    if r.networks:
        what.append(f"{r.networks} network(s)")
    if r.secrets:
        what.append(f"{r.secrets} secret(s)")
    if r.pids:
        what.append(f"stopped pid(s) {', '.join(map(str, r.pids))}")
    if r.jobs:
        what.append(f"cancelled Slurm job/step(s) {', '.join(r.jobs)}")
    return f"{r.run_id}: {', '.join(what) or 'nothing was running'}" + (f"; results kept in {r.results}" if r.results else "")


def run(args: argparse.Namespace) -> int:
    if bool(args.run) == bool(args.all):
        raise BadInput("give a RUN or --all (not both)", hint="`launcher status` lists runs")
    root = results_root(args)
    reports = down_all(root, grace_s=args.grace) if args.all else [down_run(root, args.run, grace_s=args.grace)]
    if args.json:
        sys.stdout.write(json.dumps({"schema": "launcher.down/v1", "runs": [r.to_dict() for r in reports]}, indent=2) + "\n")
    elif not reports:
        sys.stdout.write("nothing to stop\n")
    else:
        sys.stdout.write("\n".join(_line(r) for r in reports) + "\n")
    return 0
