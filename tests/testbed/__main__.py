"""Bring a test bed up or down by hand: ``python -m tests.testbed up|down|list`` (scripts/testbed.sh wraps it).

``up`` prints the bed's id and, per node, the DOCKER_HOST that reaches it; the bed stays up until
``down ID`` (or ``down --all``, which removes every bed recorded under /var/lib/launcher-testbed and
nothing else). Exit codes: 0 done, 1 a step failed (the message names it), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tests.testbed.bed import BedSpec, beds, bring_up, node_states, tear_down


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/testbed.sh", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="bring a bed up and leave it running")
    up.add_argument("--nodes", type=int, default=3, help="daemons, the first is the swarm manager (default 3)")
    up.add_argument("--gpus", default="", help="made-up GPUs per node, comma-separated (e.g. 0,2,2)")
    up.add_argument("--no-swarm", action="store_true", help="plain daemons, no swarm")
    up.add_argument("--no-registry", action="store_true", help="no registry on localhost:5000")
    down = sub.add_parser("down", help="remove a bed (or every bed with --all)")
    down.add_argument("id", nargs="?")
    down.add_argument("--all", action="store_true")
    sub.add_parser("list", help="beds recorded on this host")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="testbed: %(message)s")

    if args.cmd == "up":
        try:
            gpus = tuple(int(g) for g in args.gpus.split(",")) if args.gpus else ()
            spec = BedSpec(nodes=args.nodes, swarm=not args.no_swarm, registry=not args.no_registry, gpus=gpus)
        except ValueError as exc:
            print(f"testbed: error: {exc}", file=sys.stderr)
            return 2
        try:
            bed = bring_up(spec)
        except Exception as exc:  # noqa: BLE001 - one line for the user, the bed is already removed
            print(f"testbed: error: bring-up failed (everything made was removed): {exc}", file=sys.stderr)
            return 1
        print(f"bed {bed.id}: subnet {bed.subnet}.0/24, registry {bed.registry or 'none'}")
        for n in bed.nodes:
            role = ("manager" if n.index == 0 else "worker") if bed.swarm else "engine"
            print(f"  {n.name} {n.address} {role} DOCKER_HOST={n.docker_host}" + (f" gpus={','.join(n.gpus)}"
                                                                                 if n.gpus else ""))
        print(f"remove it with: scripts/testbed.sh down {bed.id}")
        return 0
    if args.cmd == "list":
        for bed in beds():
            states = node_states(bed) if bed.swarm else {}
            print(f"bed {bed.id}: {len(bed.nodes)} node(s), subnet {bed.subnet}.0/24, "
                  f"manager DOCKER_HOST={bed.manager.docker_host} {states}")
        return 0
    return remove_beds(beds(), tear_down, args.id, every=args.all, prog="testbed")


def remove_beds(recorded: Sequence[Any], tear_down: Callable[[Any], list[str]], bed_id: str | None, *, every: bool,
         prog: str) -> int:
    """``down ID`` or ``down --all`` over the ``recorded`` beds (the Slurm bed's command uses it too)."""
    chosen = [b for b in recorded if every or b.id == bed_id]
    if not chosen:
        print(f"{prog}: error: no bed {bed_id!r} (see `scripts/{prog}.sh list`)" if bed_id else
              f"{prog}: nothing to remove", file=sys.stderr)
        return 2 if bed_id else 0
    failed = 0
    for bed in chosen:
        problems = tear_down(bed)
        print(f"bed {bed.id}: removed" + (f" with problems: {problems}" if problems else ""))
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
