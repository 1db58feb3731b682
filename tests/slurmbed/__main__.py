"""Bring a Slurm test bed up or down by hand: ``python -m tests.slurmbed up|down|list`` (scripts/slurmbed.sh wraps
it). ``up`` prints the bed's id and the ``SLURM_CONF`` that reaches it; the bed stays up until ``down ID`` (or
``down --all``: every bed recorded under /var/lib/launcher-slurmbed, nothing else). Exit codes: 0 done, 1 a step
failed (the message names it), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys

from tests.slurmbed.bed import SlurmBedSpec, beds, bring_up, node_states, tear_down
from tests.testbed.__main__ import remove_beds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/slurmbed.sh", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="bring a bed up and leave it running")
    up.add_argument("--nodes", type=int, default=3, help="slurmd nodes (default 3)")
    up.add_argument("--gpus", type=int, default=2, help="fake GPUs per node (default 2)")
    up.add_argument("--cpus", type=int, default=4, help="CPUs each node declares (default 4)")
    down = sub.add_parser("down", help="remove a bed (or every bed with --all)")
    down.add_argument("id", nargs="?")
    down.add_argument("--all", action="store_true")
    sub.add_parser("list", help="beds recorded on this host")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="slurmbed: %(message)s")
    if args.cmd == "up":
        try:
            spec = SlurmBedSpec(nodes=args.nodes, gpus=args.gpus, cpus=args.cpus)
        except ValueError as exc:
            print(f"slurmbed: error: {exc}", file=sys.stderr)
            return 2
        try:
            bed = bring_up(spec)
        except Exception as exc:  # noqa: BLE001 - one line for the user, the bed is already removed
            print(f"slurmbed: error: bring-up failed (everything made was removed): {exc}", file=sys.stderr)
            return 1
        print(f"bed {bed.id}: subnet {bed.subnet}.0/24, slurmctld ctl {bed.ctl_address}, nodes "
              + ", ".join(f"{n} {bed.address(n)}" for n in bed.nodes))
        print(f"export SLURM_CONF={bed.conf}")
        print(f"remove it with: scripts/slurmbed.sh down {bed.id}")
        return 0
    if args.cmd == "list":
        for bed in beds():
            print(f"bed {bed.id}: SLURM_CONF={bed.conf} {node_states(bed)}")
        return 0
    return remove_beds(beds(), tear_down, args.id, every=args.all, prog="slurmbed")

if __name__ == "__main__":
    sys.exit(main())
