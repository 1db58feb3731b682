"""``launcher gpus``: each GPU's memory and utilisation, and who holds it.

Holders come from three places: NVML's compute processes (with user and command from /proc, and the
container they run in), the GPU leases (who holds each, from the kernel's lock table: uid, pid, container;
the run id from the holder's note), and the ``launcher.*`` labels of running containers. Processes on a
leased GPU that are not part of its lease (:mod:`launcher.gpu.foreign`) are flagged as foreign; the
``--wait`` queue is listed in order. Similar to ``nvidia-smi`` plus ``docker ps --filter label=launcher.run``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from typing import Any, Sequence

from launcher import gpu
from launcher.errors import MissingDependency
from launcher.gpu import foreign, leaseholders, reservations
from launcher.gpu.nvml import Inventory
from launcher.gpu.holders import ContainerHolder, container_holders, container_id_of_pid
from launcher.gpu.elastic import YieldNote, read_notes
from launcher.gpu.queue import Ticket, read_queue
from launcher.gpu.leaseholders import Holder
from launcher.gpu.store import NO_STORE_NOTE
from launcher.units import format_size

SCHEMA = "launcher.gpus/v1"


def build_report(
    inventory: Inventory,
    locks: Sequence[Holder],
    containers: Sequence[ContainerHolder],
    docker_reason: str | None,
    *,
    container_of_pid: Any = container_id_of_pid,
    store: dict[str, Any] | None = None,
    queue: Sequence[Ticket] = (),
    yields: Sequence[YieldNote] = (),
) -> dict[str, Any]:
    """The ``--json`` document (also what the table is printed from).

    Per GPU: ``lease`` (who holds it, from the kernel: user, uid, pid, container, run, since; None when
    free), ``processes`` (each with ``foreign``: on a leased GPU or MIG instance and not part of that lease)
    and ``foreign_processes`` (their pids). Top level: ``store`` (admin lease store or single-user lock directory), ``queue`` (``--wait``
    tickets in order) and ``yields`` (elastic runs that gave GPUs to a queued run and are not back to full size).
    """
    by_container = {c.container_id: c for c in containers}
    lease_of = {h.uuid: h for h in locks}
    parts_of = foreign.leases_from(locks, containers)
    gpus = []
    for dev in inventory.gpus:
        lease = lease_of.get(dev.uuid)
        processes = []
        for p in dev.processes:
            cid = container_of_pid(p.pid)
            c = by_container.get(cid) if cid else None
            entry_p = {
                **asdict(p),
                "container_id": cid,
                "container_name": c.name if c else None,
                "run_id": c.run_id if c else None,
                "role": c.role if c else None,
                "group": c.group if c else None,
            }
            parts = parts_of.get(foreign.lease_unit(dev, p))  # the GPU's lease, or its MIG instance's
            entry_p["foreign"] = parts is not None and not foreign.part_of_lease(
                p.pid, parts, parent_of=foreign.parent_pid, container_of=container_of_pid)
            processes.append(entry_p)
        holders: list[dict[str, Any]] = [{"source": "lock", **asdict(h)} for h in locks if h.uuid == dev.uuid]
        holders += [
            {"source": "container", "run_id": c.run_id, "role": c.role, "group": c.group,
             "container_id": c.container_id, "container_name": c.name}
            for c in containers if dev.uuid in c.gpu_uuids
        ]
        entry = dev.to_dict()
        for m in entry["mig_devices"]:  # each MIG instance is leased on its own UUID
            m["lease"] = asdict(lease_of[m["uuid"]]) if m["uuid"] in lease_of else None
        entry.update(processes=processes, holders=holders, lease=None if lease is None else asdict(lease),
                     foreign_processes=[q["pid"] for q in processes if q["foreign"]])
        gpus.append(entry)
    return {
        "schema": SCHEMA,
        "nvml": {
            "available": inventory.available,
            "driver_version": inventory.driver_version,
            "reason": inventory.unavailable_reason,
            "hint": inventory.hint,
        },
        "gpus": gpus,
        "errors": [asdict(e) for e in inventory.errors],
        "locks": [asdict(h) for h in locks],
        "docker": {"available": docker_reason is None, "reason": docker_reason},
        "store": store or {"mode": "single-user", "leases": None, "site_file": None, "note": None},
        "queue": [{"place": i + 1, **t.to_dict()} for i, t in enumerate(queue)],
        "yields": [n.to_dict() for n in yields],
    }


def _since(t: float | None) -> str:
    return "?" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _holder_text(h: dict[str, Any]) -> str:
    if h["source"] == "lock":
        who = ", ".join(x for x in (h.get("user"), h.get("container_id") and f"container {h['container_id'][:12]}",
                                    h.get("pid") and f"pid {h['pid']}") if x)
        return f"run {h.get('run_id') or '?'} (lease{', ' + who if who else ''}, since {_since(h.get('since'))})"
    role = " ".join(str(x) for x in (h.get("role"), h.get("group")) if x is not None)
    return f"run {h['run_id']} (container {h['container_name']}{', ' + role if role else ''})"


def format_report(report: dict[str, Any]) -> str:
    """The report as a table: one line per GPU, then its holders and processes indented below it."""
    lines = [f"{'GPU':<4} {'NAME':<26} {'MEMORY USED / TOTAL':<22} {'UTIL':>5}  HELD BY"]
    for g in report["gpus"]:
        memory = f"{format_size(g['memory_used_bytes'])} / {format_size(g['memory_total_bytes'])}"
        util = "-" if g["gpu_utilization_pct"] is None else f"{g['gpu_utilization_pct']}%"
        held = "; ".join(_holder_text(h) for h in g["holders"]) or "-"
        lines.append(f"{g['index']:<4} {g['name'][:26]:<26} {memory:<22} {util:>5}  {held}")
        lines.append(f"     {g['uuid']}  {g['pci_bus_id']}" + ("  MIG on" if g["mig_mode"] else ""))
        for m in g["mig_devices"]:
            held_mig = f"  {_holder_text({'source': 'lock', **m['lease']})}" if m.get("lease") else ""
            lines.append(f"     MIG {m['index']} {m['uuid']}  {format_size(m['memory_used_bytes'])} / "
                         f"{format_size(m['memory_total_bytes'])}{held_mig}")
        for p in g["processes"]:
            where = ""
            if p["run_id"]:
                where = f" [run {p['run_id']} {p['role'] or ''}{' ' + p['group'] if p['group'] else ''}]"
            elif p["container_id"]:
                where = f" [container {p['container_id'][:12]}]"
            flag = "  FOREIGN (not part of the lease on this GPU)" if p.get("foreign") else ""
            lines.append(f"     pid {p['pid']} {p['user'] or '?'} {format_size(p['used_memory_bytes'])}{where} "
                         f"{(p['command'] or '')[:80]}{flag}".rstrip())
    for e in report["errors"]:
        lines.append(f"{e['index']:<4} skipped: {e['error']} ({e['uuid'] or 'uuid unknown'})")
    for q in report["queue"]:
        lines.append(f"queue {q['place']}: {q['user']} run {q['run_id'] or '?'} waiting for {q['want'] or 'GPUs'} "
                     f"since {_since(q['since'])}")
    for n in report.get("yields") or []:
        lines.append(f"yield: run {n['from_run']} ({n['user']}) gave GPU(s) {', '.join(n['gpus']) or '-'} (group(s) "
                     f"{', '.join(map(str, n['groups']))}) to run {n['to_run'] or '?'} ({n['to_user'] or '?'}) "
                     f"at {_since(n['since'])}")
    if report["store"]["note"]:
        lines.append(f"({report['store']['note']})")
    if not report["docker"]["available"]:
        lines.append(f"(containers not checked: {report['docker']['reason']})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    inventory = gpu.inventory()
    ld = reservations.lease_dir(args.lock_dir)
    locks = leaseholders.list_holders(ld)
    store = {"mode": "admin" if ld.site else "single-user", "leases": str(ld.path),
             "site_file": str(ld.site.site_file) if ld.site else None, "note": None if ld.site else NO_STORE_NOTE}
    if args.no_docker:
        containers: list[ContainerHolder] = []
        docker_reason: str | None = "--no-docker"
    else:
        containers, docker_reason = container_holders()
    live_runs = {h.run_id for h in locks if h.run_id}  # a note of a run that holds nothing any more is stale
    report = build_report(inventory, locks, containers, docker_reason, store=store,
                          queue=read_queue(ld.queue, clean=False),
                          yields=[n for n in read_notes(ld.queue) if n.from_run in live_runs])
    if args.json:
        print(json.dumps(report, indent=2))
    elif inventory.available:
        print(format_report(report))
    if not inventory.available:
        raise MissingDependency(str(inventory.unavailable_reason), hint=inventory.hint)
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "gpus",
        help="list GPUs, their memory and utilization, and who holds them",
        description="List each GPU's memory and utilization and who holds it: launcher runs (lock files and "
        "container labels) and other processes (PID, user, command). Exits 6 when NVML is unavailable.",
    )
    parser.add_argument("--json", action="store_true", help=f"print JSON ({SCHEMA}) instead of a table")
    parser.add_argument("--lock-dir", default=None, metavar="DIR",
                        help="GPU reservation lock directory (default: $LAUNCHER_LOCK_DIR or /tmp/launcher-locks)")
    parser.add_argument("--no-docker", action="store_true", help="do not ask the Docker engine for containers")
    parser.set_defaults(func=run)
