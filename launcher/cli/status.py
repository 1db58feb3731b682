"""``launcher status [RUN]``: what each run is doing: its containers or processes, throughput and return.

Reads the results directory (``run.json``, the master's ``status.json``) and, for Docker runs, the engine
(containers found by their ``launcher.run`` label). Similar to ``docker ps --filter label=launcher.run``
plus the master's own view. Results on stdout (``--json``: one document); nothing is changed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from launcher.lifecycle import RunView, view_runs
from launcher.rundata import printable
from launcher.schemas import STATUS_LIST_SCHEMA


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="show runs, their containers/processes and progress", description=__doc__)
    p.add_argument("run", nargs="?", default=None, metavar="RUN", help="a run id or directory (default: every run)")
    p.add_argument("--results", default=None, help="results root [$LAUNCHER_RESULTS or results]")
    p.add_argument("--json", action="store_true", help="print a JSON document on stdout")
    p.set_defaults(func=run)


def results_root(args: argparse.Namespace) -> Path:
    return Path(args.results or os.environ.get("LAUNCHER_RESULTS") or "results").expanduser()


def _num(x: Any, nd: int = 1) -> str:
    if x is None:
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def format_view(v: RunView) -> str:
    d = v.to_dict()
    lines = [f"{v.run_id}  {v.backend}  {v.state}" + (f"  ({v.note})" if v.note else ""),
             f"  results     {d['results'] or '-'}",
             f"  progress    {_num(d['env_steps'])} env steps, {_num(d['env_steps_per_s'], 0)} env steps/s, "
             f"{_num(d['updates'])} updates, return {_num(d['mean_return'], 2)}"
             + (f", outcome {d['outcome']}" if d["outcome"] else ""),
             f"  workers     {d['workers_connected']} connected in {d['groups_connected']}/{d['groups']} groups"]
    if d["error"]:
        lines.append(f"  error       {d['error']}")
    recs = [r for r in d["recoveries"] if isinstance(r, dict)]
    if recs:
        last = recs[-1]
        lines.append(f"  recovered   the master {len(recs)} time(s); last from {last.get('checkpoint') or 'no checkpoint'} "
                     f"({_num(last.get('restored_env_steps'))} env steps, {_num(last.get('steps_lost'))} lost), "
                     f"{sum(r.get('steps_lost') or 0 for r in recs)} env steps lost in all")
    lines.extend(elastic_lines(d))
    for p in v.parts:
        extra = "".join([f" exit {p.exit_code}" if p.exit_code is not None else "",
                         f" health {p.health}" if p.health else "",
                         f" restarts {p.restarts}" if p.restarts else "",
                         f" on {p.node}" if p.node else "", f" gpus {p.gpus}" if p.gpus else "",
                         f" ({p.lost})" if p.lost else "",
                         f" raised {v.part_errors[p.name]}" if p.name in v.part_errors else ""])
        lines.append(f"    {p.name:<10} {p.word:<11} {p.ident}{extra}")
    foreign = d["foreign_processes"] if v.live and isinstance(d["foreign_processes"], list) else []
    for f in (f for f in foreign if isinstance(f, dict)):  # from the supervisor's GPU watch (run.json)
        lines.append(f"  FOREIGN     pid {f.get('pid')} ({f.get('user') or '?'}) on GPU {f.get('gpu_index')} "
                     f"({f.get('gpu_uuid')}), not part of this run")
    # The run's containers write much of this (status.json, summary.json, run.json): whatever reached a line,
    # no control character reaches the terminal (an OSC-52 escape prints as \x1b]52;...).
    return "\n".join(printable(line, limit=4096) for line in lines)


def _clock(t: Any) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"


def elastic_lines(d: dict[str, Any]) -> list[str]:
    """An elastic run's groups and its last yield or regrowth; the elastic runs that gave this run its GPUs."""
    lines = []
    el = d.get("elastic")
    if isinstance(el, dict):
        states: dict[str, Any] = el["groups"] if isinstance(el.get("groups"), dict) else {}
        away = [g for g, s in states.items() if s != "active"]
        line = (f"  elastic     {el.get('active')} of {len(states)} groups playing (minimum {el.get('min_groups')})"
                + (f"; away: group(s) {', '.join(map(str, away))}" if away else ""))
        events = [e for e in el.get("events") or [] if isinstance(e, dict)]
        if events:
            e = events[-1]
            to = f" to run {e.get('to_run')} of {e.get('to_user')}" if e.get("to_run") or e.get("to_user") else ""
            line += (f"; last: {e.get('event')} group(s) {', '.join(map(str, e.get('groups') or []))} "
                     f"(GPU(s) {', '.join(map(str, e.get('gpus') or [])) or '-'}){to} at {_clock(e.get('t'))}")
        lines.append(line)
    for n in d.get("gpus_from") or []:
        lines.append(f"  gpus from   run {n.get('from_run')} ({n.get('user')}) yielded GPU(s) "
                     f"{', '.join(map(str, n.get('gpus') or []))} to this run at {_clock(n.get('since'))}")
    return lines


def run(args: argparse.Namespace) -> int:
    views = view_runs(results_root(args), run=args.run)
    if args.json:
        doc: Any = views[0].to_dict() if args.run else {"schema": STATUS_LIST_SCHEMA,
                                                         "runs": [v.to_dict() for v in views]}
        sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
        return 0
    if not views:
        sys.stderr.write(f"no runs under {results_root(args)} and no launcher containers on the engine\n")
        return 0
    sys.stdout.write("\n".join(format_view(v) for v in views) + "\n")
    return 0
