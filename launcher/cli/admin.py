"""``launcher admin init``: the administrator's one-time setup of the GPU lease store (root only).

Thin: reads the GPUs, calls :func:`launcher.gpu.store.admin_init`, prints what it made. docs/gpus.md has the
setup in five lines.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from launcher import gpu
from launcher.errors import MissingDependency
from launcher.gpu import store


def run_init(args: argparse.Namespace) -> int:
    inventory = gpu.inventory()
    if not inventory.available and not args.uuid:
        raise MissingDependency(f"cannot list the GPUs to make lease files for: {inventory.unavailable_reason}",
                                hint=inventory.hint)
    uuids = [*args.uuid]
    for g in inventory.gpus:
        uuids.append(g.uuid)
        uuids.extend(m.uuid for m in g.mig_devices)
    report = store.admin_init(uuids, site_file=Path(args.site_file), store=Path(args.store),
                              policy=Path(args.policy))
    print(f"lease store {report.site.store}: {len(report.gpus)} GPU lease file(s) in {report.site.leases}, "
          f"queue {report.site.queue}")
    print(f"site file {report.site.site_file}; site policy {report.site.policy}")
    for line in report.created:
        print(f"  made {line}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("admin", help="administrator's setup (root)",
                                   description="Administrator commands. `launcher admin init` makes the GPU "
                                   "lease store every user's runs share (docs/gpus.md).")
    sub = parser.add_subparsers(dest="admin_command", metavar="COMMAND")
    init = sub.add_parser("init", help="create or repair the lease store and the site file (root; idempotent)",
                          description="Create the root-owned GPU lease store (one lock file per GPU and MIG "
                          "instance), the wait queue and the site file; run again after adding GPUs.")
    init.add_argument("--store", default=str(store.DEFAULT_STORE), help="lease store directory [%(default)s]")
    init.add_argument("--site-file", default=str(store.SITE_FILE), help="site file to write [%(default)s]")
    init.add_argument("--policy", default=str(store.DEFAULT_POLICY), help="site policy file [%(default)s]")
    init.add_argument("--uuid", action="append", default=[], metavar="UUID",
                      help="also make a lease file for this UUID (repeatable)")
    init.set_defaults(func=run_init)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
