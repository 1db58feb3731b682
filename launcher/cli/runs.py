"""``launcher runs``: past and current runs under a results root: id, env, algo, workers, status, returns,
steps, duration and path. A run whose record says it is running but whose processes are gone is ``stale``
(resume it with ``launcher up --resume RUN``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from launcher.rundata import printable
from launcher.schemas import RUNS_SCHEMA


def register(sub: Any) -> None:
    p = sub.add_parser("runs", help="list past and current runs", description=__doc__)
    p.add_argument("--results", default=None, metavar="DIR",
                   help="results root [as `launcher up`: launcher.toml, $LAUNCHER_RESULTS, or results]")
    p.add_argument("--json", action="store_true", help=f"print JSON ({RUNS_SCHEMA}) instead of a table")
    p.set_defaults(func=run)


def results_root(given: str | None) -> Path:
    """The results root ``launcher up`` would use (flag, else launcher.toml / $LAUNCHER_RESULTS / default)."""
    from launcher.config import load_config

    cfg, _ = load_config({"results": given} if given else {})
    return cfg.results


def _num(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'RUN':<36} {'ENV':<18} {'ALGO':<10} {'WORKERS':>7}  {'STATUS':<11} {'BEST':>8} {'LAST':>8} "
            f"{'STEPS':>10} {'DURATION':>8}  PATH")
    lines = [head]
    for r in rows:
        algo = (r["algo"] or "-").rpartition(":")[2][:10]  # a user's algorithm by its class name
        lines.append(f"{r['run_id']:<36} {(r['env_id'] or '-')[:18]:<18} {algo:<10} "
                     f"{_num(r['workers'], '{}'):>7}  {r['status']:<11} {_num(r['best_return']):>8} "
                     f"{_num(r['last_return']):>8} {_num(r['steps'], '{:,}'):>10} {_duration(r['duration_s']):>8}  "
                     f"{r['path']}")
    # Names and states come from files a run's containers can write: nothing acts on the terminal.
    return "\n".join(printable(line, limit=4096) for line in lines)


def run(args: argparse.Namespace) -> int:
    from launcher.history import history

    root = results_root(args.results)
    rows = [r.to_dict() for r in history(root)]
    if args.json:
        sys.stdout.write(json.dumps({"schema": RUNS_SCHEMA, "results_root": str(root.resolve()), "runs": rows},
                                    indent=2) + "\n")
    elif rows:
        sys.stdout.write(format_table(rows) + "\n")
    else:
        sys.stderr.write(f"no runs under {root}\n")
    return 0
