"""Slurm's view of a cluster and of one job, as typed data parsed from ``scontrol -o show ...`` output. Pure:
no command is run here (:mod:`launcher.slurm.commands` runs them), so every parser is tested on recorded
output.

``scontrol -o`` prints one record per line as ``Key=value`` pairs separated by spaces; a few values hold
spaces themselves (``Reason=Not responding [slurm@...]``), so a record is split before each ``Key=``
token, not at every space. Node lists come compressed (``node[1-3,7]``) and are expanded by
:func:`expand_hostlist`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from launcher.errors import BadInput

_KEY = re.compile(r"(?:^|\s+)([A-Za-z][A-Za-z0-9_/:]*)=")


def parse_record(line: str) -> dict[str, str]:
    """One ``scontrol -o`` line as a dict. A key that repeats (the per-node detail of ``scontrol -d show job``:
    ``Nodes=… CPU_IDs=… GRES=…``) keeps its first value; :func:`node_details` reads those groups."""
    out: dict[str, str] = {}
    matches = list(_KEY.finditer(line))
    for m, nxt in zip(matches, [*matches[1:], None]):
        key = m.group(1)
        value = line[m.end(): nxt.start() if nxt else len(line)].strip()
        out.setdefault(key, value)
    return out


def parse_records(text: str) -> list[dict[str, str]]:
    """Every non-empty line of ``scontrol -o show …`` output as a record."""
    return [parse_record(line) for line in text.splitlines() if "=" in line]


def _null(value: str | None) -> str:
    return "" if value in (None, "(null)", "N/A", "None") else str(value)


def expand_hostlist(expr: str) -> tuple[str, ...]:
    """Slurm's compressed host list as names: ``node[1-3,7],gpu[01-02]`` -> node1 node2 node3 node7 gpu01 gpu02
    (zero padding kept). Empty or ``(null)``: no names.

    Raises:
        ValueError: an unbalanced bracket or a range that is not numeric.
    """
    expr = _null(expr.strip())
    names: list[str] = []
    depth, start = 0, 0
    parts = []
    for i, ch in enumerate(expr):  # split at commas outside brackets
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {expr!r}")
        elif ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in host list {expr!r}")
    parts.append(expr[start:])
    for part in (p for p in parts if p):
        names.extend(_expand_one(part, expr))
    return tuple(names)


def _expand_one(part: str, whole: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", part)
    if not m:
        return [part]
    prefix, ranges, rest = m.groups()
    out: list[str] = []
    for r in ranges.split(","):
        lo, sep, hi = r.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"range {r!r} in host list {whole!r} is not numeric")
        width = len(lo)
        for n in range(int(lo), int(hi if sep else lo) + 1):
            out.extend(f"{prefix}{n:0{width}d}{tail}" for tail in _expand_one(rest, whole) or [""])
    return out


def index_list(text: str) -> tuple[int, ...]:
    """``0-1,3`` (GRES ``IDX``, ``SLURM_STEP_GPUS``) as numbers; empty or ``(null)``: none."""
    out: list[int] = []
    for item in _null(text.strip()).split(","):
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        out.extend(range(int(lo), int(hi if sep else lo) + 1))
    return tuple(out)


def gres_gpus(gres: str) -> int:
    """GPUs in a GRES string: ``gpu:2``, ``gpu:a100:4(S:0-1)``, ``gpu:2,shard:8``, ``gres:gpu:2`` (a
    ``TresPerNode``), ``gres/gpu=6`` (a ``TRES``); 0 when none or ``(null)``."""
    total = 0
    for item in _null(gres).split(","):
        item = re.sub(r"\(.*?\)", "", item).strip()
        if item.startswith("gres/gpu"):  # TRES form: gres/gpu=6 or gres/gpu:a100=6
            _, _, n = item.partition("=")
            total += int(n) if n.isdigit() else 0
            continue
        if item.startswith("gres:"):
            item = item[len("gres:"):]
        fields = item.split(":")
        if fields[0] != "gpu":
            continue
        total += int(fields[-1]) if len(fields) > 1 and fields[-1].isdigit() else 1
    return total


# ---------------------------------------------------------------------------------------------- cluster
@dataclass(frozen=True)
class NodeInfo:
    """One node as slurmctld sees it (``scontrol -o show node``)."""

    name: str
    addr: str  # NodeAddr: where slurmctld and other nodes reach it
    state: str  # the base state in lower case: idle, mixed, allocated, down, …
    flags: tuple[str, ...] = ()  # DRAIN, NOT_RESPONDING, …
    cpus: int = 0
    gpus: int = 0
    partitions: tuple[str, ...] = ()
    reason: str = ""

    @property
    def lost(self) -> bool:
        """slurmctld has lost it: down, or not answering its pings."""
        return self.state in ("down", "fail", "future", "unknown") or "NOT_RESPONDING" in self.flags

    @property
    def down(self) -> bool:
        """slurmctld declared it down: it ends the steps there and removes it from ``--no-kill`` jobs. (Not
        responding for a while is not down yet: Slurm waits SlurmdTimeout, and so does the launcher.)"""
        return self.state in ("down", "fail")

    @property
    def usable(self) -> bool:
        """It may run new jobs now or once its jobs end (not lost, drained or powered down)."""
        return not self.lost and not {"DRAIN", "DRAINING", "DRAINED", "POWERED_DOWN", "POWER_DOWN",
                                      "FAIL", "MAINTENANCE", "REBOOT_REQUESTED"} & set(self.flags)

    @property
    def word(self) -> str:
        """The state as ``sinfo`` prints it: ``down*``, ``idle``, ``mixed+drain``."""
        extra = "".join("+" + f.lower() for f in self.flags if f != "NOT_RESPONDING")
        return self.state + extra + ("*" if "NOT_RESPONDING" in self.flags else "")

    @classmethod
    def from_record(cls, rec: dict[str, str]) -> "NodeInfo":
        state, *flags = (_null(rec.get("State")) or "UNKNOWN").split("+")
        return cls(name=rec.get("NodeName", "?"), addr=_null(rec.get("NodeAddr")) or rec.get("NodeName", "?"),
                   state=state.rstrip("*").lower(), flags=tuple(flags) + (("NOT_RESPONDING",) if state.endswith("*")
                                                                          else ()),
                   cpus=int(rec.get("CPUTot") or 0), gpus=gres_gpus(rec.get("Gres", "")),
                   partitions=tuple(p for p in _null(rec.get("Partitions")).split(",") if p),
                   reason=_null(rec.get("Reason")))


@dataclass(frozen=True)
class PartitionInfo:
    name: str
    default: bool
    nodes: tuple[str, ...]
    up: bool
    max_time: str = ""

    @classmethod
    def from_record(cls, rec: dict[str, str]) -> "PartitionInfo":
        return cls(name=rec.get("PartitionName", "?"), default=rec.get("Default") == "YES",
                   nodes=expand_hostlist(rec.get("Nodes", "")), up=rec.get("State") == "UP",
                   max_time=_null(rec.get("MaxTime")))


@dataclass(frozen=True)
class ClusterView:
    """What the planner knows of the cluster: partitions and nodes (with their GRES), from slurmctld."""

    partitions: tuple[PartitionInfo, ...]
    nodes: tuple[NodeInfo, ...]

    def partition(self, name: str | None) -> PartitionInfo:
        """Partition ``name``, or the cluster's default when None.

        Raises:
            BadInput: no such partition, or none given and the cluster has no default.
        """
        names = ", ".join(p.name for p in self.partitions) or "none"
        if name is None:
            found = next((p for p in self.partitions if p.default), None)
            if found is None:
                raise BadInput(f"the cluster has no default partition (partitions: {names})",
                               hint="choose one with --slurm-partition NAME (`sinfo` lists them)")
            return found
        found = next((p for p in self.partitions if p.name == name), None)
        if found is None:
            raise BadInput(f"--slurm-partition {name!r}: no such partition (partitions: {names})",
                           hint="`sinfo` lists the partitions you may use")
        return found

    def node(self, name: str) -> NodeInfo | None:
        return next((n for n in self.nodes if n.name == name), None)

    @classmethod
    def parse(cls, partitions: str, nodes: str) -> "ClusterView":
        return cls(tuple(PartitionInfo.from_record(r) for r in parse_records(partitions)),
                   tuple(NodeInfo.from_record(r) for r in parse_records(nodes)))


# ------------------------------------------------------------------------------------------------- jobs
ENDED_JOB_STATES = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                    "DEADLINE", "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT")


@dataclass(frozen=True)
class JobInfo:
    """One job as slurmctld sees it (``scontrol -o show job``)."""

    job_id: str
    name: str
    state: str  # PENDING, RUNNING, COMPLETING, CANCELLED, …
    reason: str  # Slurm's pending reason (Resources, Priority, …); "" for None
    nodes: tuple[str, ...] = ()  # in slurmctld's order; after a node failure without the job ending, the rest
    batch_host: str = ""
    partition: str = ""
    time_limit: str = ""
    start_time: str = ""
    gpus_per_node: int = 0
    cpus: int = 0
    user: str = ""

    @property
    def pending(self) -> bool:
        return self.state in ("PENDING", "REQUEUED", "CONFIGURING", "RESV_DEL_HOLD", "REQUEUE_HOLD", "SUSPENDED")

    @property
    def running(self) -> bool:
        return self.state == "RUNNING"

    @property
    def ended(self) -> bool:
        return self.state.split("+")[0] in ENDED_JOB_STATES

    @property
    def word(self) -> str:
        """Slurm's state with its reason, as ``squeue`` shows them: ``PENDING (Resources)``."""
        return self.state + (f" ({self.reason})" if self.reason else "")

    @classmethod
    def from_record(cls, rec: dict[str, str]) -> "JobInfo":
        tres = rec.get("TresPerNode", "")
        return cls(job_id=rec.get("JobId", "?"), name=_null(rec.get("JobName")), state=rec.get("JobState", "UNKNOWN"),
                   reason=_null(rec.get("Reason")), nodes=expand_hostlist(rec.get("NodeList", "")),
                   batch_host=_null(rec.get("BatchHost")), partition=_null(rec.get("Partition")),
                   time_limit=_null(rec.get("TimeLimit")), start_time=_null(rec.get("StartTime")),
                   gpus_per_node=gres_gpus(tres), cpus=int(rec.get("NumCPUs") or 0),
                   user=_null(rec.get("UserId")).split("(")[0])


@dataclass(frozen=True)
class StepInfo:
    """One job step (``scontrol -o show step``)."""

    step_id: str  # "12.3", "12.batch"
    name: str
    state: str
    nodes: tuple[str, ...] = field(default=())

    @property
    def job_id(self) -> str:
        return self.step_id.split(".")[0]

    @classmethod
    def from_record(cls, rec: dict[str, str]) -> "StepInfo":
        return cls(step_id=rec.get("StepId", "?"), name=_null(rec.get("Name")), state=rec.get("State", "UNKNOWN"),
                   nodes=expand_hostlist(rec.get("NodeList", "")))


def node_details(line: str) -> dict[str, tuple[int, ...]]:
    """The GPUs each node of a running job holds, from ``scontrol -o -d show job`` (``Nodes=node[1-3] CPU_IDs=…
    GRES=gpu:2(IDX:0-1)``, one group per set of alike nodes): node -> GPU indices."""
    out: dict[str, tuple[int, ...]] = {}
    for m in re.finditer(r"\bNodes=(\S+)\s+CPU_IDs=\S+\s+Mem=\S+(?:\s+GRES=(\S*))?", line):
        idx = re.search(r"gpu[^(]*\(IDX:([0-9,\-]*)\)", m.group(2) or "")
        for name in expand_hostlist(m.group(1)):
            out[name] = index_list(idx.group(1)) if idx else ()
    return out
