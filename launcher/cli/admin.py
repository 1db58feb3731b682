"""``launcher admin init``: the administrator's one-time setup of the GPU lease store (root only), and
``launcher admin broker``: the lease broker that enforces the per-user cap (root, foreground).

Thin: reads the GPUs, calls :func:`launcher.gpu.store.admin_init` or :func:`launcher.gpu.broker.run_broker`,
prints what it did. docs/gpus.md has the setup in a few lines.
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
                              policy=Path(args.policy), broker=Path(args.broker) if args.broker else None)
    print(f"lease store {report.site.store}: {len(report.gpus)} GPU lease file(s) in {report.site.leases}, "
          f"queue {report.site.queue}")
    print(f"site file {report.site.site_file}; site policy {report.site.policy}")
    for line in report.created:
        print(f"  made {line}")
    if report.site.broker is not None:
        print(f"lease broker socket {report.site.broker}: lease files are root 0600; start `launcher admin broker` "
              "(as root, e.g. a systemd service) before users' runs lease GPUs")
    else:
        print("no lease broker: users flock the lease files themselves and max_gpus_per_user is counted, not "
              "enforced; `--broker /run/launcher/broker.sock` sets one up")
    return 0


def run_broker(args: argparse.Namespace) -> int:
    from launcher.gpu.broker import run_broker as serve

    site = store.site_from_file(Path(args.site)) if args.site else store.find_site()
    if site is None:
        raise MissingDependency("no admin lease store on this machine (/etc/launcher/site.toml) for the broker to serve",
                                hint="run `launcher admin init --broker /run/launcher/broker.sock` first")
    serve(site)
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
    init.add_argument("--broker", metavar="SOCKET", default=None,
                      help="enforce the site policy with a lease broker listening on SOCKET (e.g. "
                      "/run/launcher/broker.sock): lease files become root 0600; then run `launcher admin broker`")
    init.set_defaults(func=run_init)
    broker = sub.add_parser("broker", help="run the GPU lease broker (root; foreground, for systemd)",
                            description="Serve GPU leases on the socket the site file names: the per-user cap "
                            "and the locks in one step, the locks held by the broker (docs/gpus.md).")
    broker.add_argument("--site", default=None, metavar="FILE",
                        help="the site file (default: /etc/launcher/site.toml, or a root-owned $LAUNCHER_SITE)")
    broker.set_defaults(func=run_broker)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
