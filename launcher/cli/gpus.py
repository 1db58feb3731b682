"""``launcher gpus``: each GPU's memory and utilisation, and who holds it.

Holders come from three places: NVML's compute processes (with user and command from /proc, and the
container they run in), the launcher's GPU lock files (run id, pid, user), and the ``launcher.*`` labels of
running containers (runs started from another machine namespace). Similar to ``nvidia-smi`` plus
``docker ps --filter label=launcher.run``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any, Sequence

from launcher import nvml, reservations
from launcher.errors import MissingDependency
from launcher.gpu_select import format_size
from launcher.nvml import Inventory
from launcher.reservations import ContainerHolder, Holder

SCHEMA = "launcher.gpus/v1"


def build_report(
    inventory: Inventory,
    locks: Sequence[Holder],
    containers: Sequence[ContainerHolder],
    docker_reason: str | None,
    *,
    container_of_pid: Any = reservations.container_id_of_pid,
) -> dict[str, Any]:
    """The ``--json`` document (also what the table is printed from)."""
    by_container = {c.container_id: c for c in containers}
    gpus = []
    for gpu in inventory.gpus:
        processes = []
        for p in gpu.processes:
            cid = container_of_pid(p.pid)
            c = by_container.get(cid) if cid else None
            processes.append({
                **asdict(p),
                "container_id": cid,
                "container_name": c.name if c else None,
                "run_id": c.run_id if c else None,
                "role": c.role if c else None,
                "group": c.group if c else None,
            })
        holders: list[dict[str, Any]] = [{"source": "lock", **asdict(h)} for h in locks if h.uuid == gpu.uuid]
        holders += [
            {"source": "container", "run_id": c.run_id, "role": c.role, "group": c.group,
             "container_id": c.container_id, "container_name": c.name}
            for c in containers if gpu.uuid in c.gpu_uuids
        ]
        entry = gpu.to_dict()
        entry.update(processes=processes, holders=holders)
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
    }


def _holder_text(h: dict[str, Any]) -> str:
    if h["source"] == "lock":
        who = ", ".join(x for x in (h.get("pid") and f"pid {h['pid']}", h.get("user")) if x)
        return f"run {h.get('run_id') or '?'} (lock{', ' + who if who else ''})"
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
            lines.append(f"     MIG {m['index']} {m['uuid']}  {format_size(m['memory_used_bytes'])} / "
                         f"{format_size(m['memory_total_bytes'])}")
        for p in g["processes"]:
            where = ""
            if p["run_id"]:
                where = f" [run {p['run_id']} {p['role'] or ''}{' ' + p['group'] if p['group'] else ''}]"
            elif p["container_id"]:
                where = f" [container {p['container_id'][:12]}]"
            lines.append(f"     pid {p['pid']} {p['user'] or '?'} {format_size(p['used_memory_bytes'])}{where} "
                         f"{(p['command'] or '')[:80]}".rstrip())
    for e in report["errors"]:
        lines.append(f"{e['index']:<4} skipped: {e['error']} ({e['uuid'] or 'uuid unknown'})")
    if not report["docker"]["available"]:
        lines.append(f"(containers not checked: {report['docker']['reason']})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    inventory = nvml.read_inventory()
    locks = reservations.list_holders(args.lock_dir)
    if args.no_docker:
        containers: list[ContainerHolder] = []
        docker_reason: str | None = "--no-docker"
    else:
        containers, docker_reason = reservations.container_holders()
    report = build_report(inventory, locks, containers, docker_reason)
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
