"""``launcher logs RUN [--master | --group N] [--follow]``: what a run's master or groups printed.

Docker runs: the containers' output while they exist (like ``docker logs``; across a group's restarts),
else the copies kept in ``<results>/<run>/logs/`` when they were removed. Process runs: those files.
Output on stdout, as written; on a terminal, control characters other than newline, tab, carriage return and
backspace are shown escaped (``\\x1b``), so what a run printed cannot drive the terminal.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from launcher.cli.status import results_root
from launcher.lifecycle import follow_logs, log_target_name, read_logs
from launcher.rundata import terminal_safe


def register(sub: Any) -> None:
    p = sub.add_parser("logs", help="print a run's master or worker-group output", description=__doc__)
    p.add_argument("run", metavar="RUN", help="a run id or directory")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--master", action="store_true", help="the master only")
    which.add_argument("--group", type=int, default=None, metavar="N", help="worker group N only")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the run stops (default part: master)")
    p.add_argument("--results", default=None, help="results root [$LAUNCHER_RESULTS or results]")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    part = log_target_name(args.master, args.group)
    out = sys.stdout.buffer
    shown: Callable[[bytes], bytes] = terminal_safe if sys.stdout.isatty() else bytes  # piped: byte for byte
    if args.follow:
        for chunk in follow_logs(results_root(args), args.run, part):
            out.write(shown(chunk))
            out.flush()
        return 0
    parts = list(read_logs(results_root(args), args.run, part))
    for name, data in parts:
        if part is None and len(parts) > 1:
            out.write(f"==> {name} <==\n".encode())
        out.write(shown(data))
        if data and not data.endswith(b"\n"):
            out.write(b"\n")
    out.flush()
    return 0
