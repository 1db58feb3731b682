"""Elastic runs, the GPU side: what the head of the queue waits for, which worker groups an elastic run gives
it, which it takes back, and the notes that say who yielded to whom.

The decisions are pure functions over typed data (as placement's are); :mod:`launcher.elastic` acts on them.
The lease store stays the only authority: a group's GPUs are released only after its process has exited, and
taken back only through the normal lease (a GPU another run took meanwhile is simply not free).

A yield note is a small JSON file ``<run id>.yield`` in the queue's directory (1777, sticky), written by the
yielding run's launcher and removed when its groups are back or the run ends. Its owner is the kernel's; the
text is that user's word, shown as such (``launcher gpus``, the receiving run's status).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher import safefs
from launcher.gpu.holders import user_name
from launcher.gpu.queue import Ticket

NOTE_SUFFIX = ".yield"
NOTE_MAX_BYTES = 4096
_ITEM = re.compile(r"[0-9]{1,4}|(GPU|MIG)-[0-9A-Za-z-]{1,80}")


@dataclass(frozen=True)
class Demand:
    """What the waiter at the head of the queue waits for: the GPUs it named (indices or UUIDs, as written on
    its ticket), or any one GPU (``gpus`` empty: ``--gpus auto``)."""

    ticket: str
    uid: int
    user: str
    run_id: str | None
    gpus: tuple[str, ...]


def demand_of(ticket: Ticket) -> Demand | None:
    """The demand on a ticket (its ``gpus`` field: a list of indices/UUIDs, or ``"auto"``); None when the ticket
    does not say (a launcher from before elastic runs) or says something unreadable: such a waiter is not
    yielded to."""
    raw_gpus = ticket.gpus
    if raw_gpus == "auto":
        return Demand(ticket.name, ticket.uid, ticket.user, ticket.run_id, ())
    if not isinstance(raw_gpus, list) or not raw_gpus or len(raw_gpus) > 64:
        return None
    items = tuple(str(x) for x in raw_gpus if isinstance(x, (str, int)) and not isinstance(x, bool))
    if len(items) != len(raw_gpus) or not all(_ITEM.fullmatch(x) for x in items):
        return None
    return Demand(ticket.name, ticket.uid, ticket.user, ticket.run_id, items)


def gpus_in_use(groups: Mapping[int, tuple[str, ...]], master: Iterable[str]) -> set[str]:
    return set(master).union(*groups.values()) if groups else set(master)


def choose_yield(*, active: Mapping[int, tuple[str, ...]], master: tuple[str, ...], min_groups: int,
                 wanted: tuple[str, ...] | None, held_elsewhere: frozenset[str] = frozenset()) -> tuple[int, ...]:
    """The active groups to stop so that the waiter gets what it waits for; ``()`` when this run cannot give it.

    Args:
        active: the run's active groups, index -> the UUIDs of its GPUs.
        master: the master's GPU UUIDs: they never move (the learner is not elastic).
        min_groups: the run never goes below this many active groups.
        wanted: the UUIDs the waiter named (all of them must then be free), or None for any one GPU.
        held_elsewhere: UUIDs other runs hold now.

    A named set is given only whole: every named GPU this run holds must be freeable (none is the master's, the
    groups on them can go without passing ``min_groups``), every other named GPU must be free of other runs, and
    the run must hold at least one of them. For any one GPU, the GPU whose groups are fewest goes (ties: the
    last one planned)."""
    ours = gpus_in_use(active, ())
    if wanted is not None:
        mine = set(wanted) & (ours | set(master))
        if not mine or mine & set(master) or (set(wanted) - mine) & held_elsewhere:
            return ()
        victims = tuple(sorted(i for i, g in active.items() if set(g) & mine))
        return victims if len(active) - len(victims) >= min_groups else ()
    best: tuple[int, ...] = ()
    for uuid in sorted(ours - set(master), key=lambda u: max(i for i, g in active.items() if u in g)):
        victims = tuple(sorted(i for i, g in active.items() if uuid in g))
        if len(active) - len(victims) >= min_groups and (not best or len(victims) <= len(best)):
            best = victims
    return best


def freed_by(victims: Iterable[int], *, groups: Mapping[int, tuple[str, ...]], staying: Iterable[int],
             master: tuple[str, ...]) -> tuple[str, ...]:
    """The GPUs no longer used once ``victims`` stop: theirs, less the master's and those of the groups staying."""
    keep = gpus_in_use({i: groups[i] for i in staying}, master)
    return tuple(sorted({u for i in victims for u in groups[i]} - keep))


def choose_regrow(yielded: Mapping[int, tuple[str, ...]], *, held: frozenset[str],
                  ours: frozenset[str]) -> tuple[int, ...]:
    """The yielded groups that can come back now: every GPU of the group is either still this run's or held by
    nobody. (``yielded`` holds only groups no waiter in the queue could take the GPUs of: a waiter is served
    first.)"""
    return tuple(sorted(i for i, gpus in yielded.items() if all(u in ours or u not in held for u in gpus)))


def lease_owners(master: tuple[str, ...], groups: Mapping[int, tuple[str, ...]]) -> dict[int, tuple[str, ...]]:
    """Which group holds which GPU's lease itself, where the parts hold their own leases (a container backend
    without a broker: the master holds its GPUs', and an elastic run's groups those the master does not use, so a
    yielded group's exit drops its GPU's lease and nothing else has to): each GPU to the lowest-index group on
    it. The groups on one GPU always yield and grow back together (:func:`choose_yield`)."""
    owners: dict[int, list[str]] = {}
    for uuid in sorted(gpus_in_use(groups, ()) - set(master)):
        owners.setdefault(min(i for i, g in groups.items() if uuid in g), []).append(uuid)
    return {i: tuple(u) for i, u in owners.items()}


# ------------------------------------------------------------------------------------------ yield notes
@dataclass(frozen=True)
class YieldNote:
    """One run's yield, as its launcher wrote it (``uid``/``user``: the kernel's owner of the note)."""

    from_run: str
    uid: int
    user: str
    to_run: str | None
    to_user: str | None
    groups: tuple[int, ...]
    gpus: tuple[str, ...]
    since: float

    def to_dict(self) -> dict[str, Any]:
        return {"from_run": self.from_run, "user": self.user, "uid": self.uid, "to_run": self.to_run,
                "to_user": self.to_user, "groups": list(self.groups), "gpus": list(self.gpus), "since": self.since}

    def describe(self) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(self.since))
        return (f"run {self.from_run} ({self.user}) yielded GPU(s) {', '.join(self.gpus)} (group(s) "
                f"{', '.join(map(str, self.groups))}) to run {self.to_run or '?'} ({self.to_user or '?'}) at {when}")


def write_note(queue_dir: Path, run_id: str, *, to: Demand, groups: Iterable[int], gpus: Iterable[str],
               since: float) -> Path:
    """Write (replace) this run's yield note, atomically."""
    path = queue_dir / f"{run_id}{NOTE_SUFFIX}"
    tmp = queue_dir / f".{run_id}{NOTE_SUFFIX}.{os.getpid()}.new"
    doc = {"from_run": run_id, "to_run": to.run_id, "to_user": to.user, "to_ticket": to.ticket,
           "groups": sorted(groups), "gpus": sorted(gpus), "since": since}
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, json.dumps(doc).encode())
    finally:
        os.close(fd)
    os.rename(tmp, path)
    return path


def remove_note(queue_dir: Path, run_id: str) -> None:
    with contextlib.suppress(OSError):
        (queue_dir / f"{run_id}{NOTE_SUFFIX}").unlink()


def read_notes(queue_dir: Path) -> list[YieldNote]:
    """Every readable yield note, oldest first. Each is opened once without following links (anyone can put
    anything in the queue's directory); a note that is not a regular file of at most :data:`NOTE_MAX_BYTES`
    of JSON is skipped, and its run id must be its own file name."""
    try:
        names = sorted(n for n in os.listdir(queue_dir) if n.endswith(NOTE_SUFFIX) and not n.startswith("."))
    except OSError:
        return []
    notes = []
    for name in names:
        try:
            fd = safefs.open_beneath(queue_dir, name, os.O_RDONLY)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            raw = os.pread(fd, NOTE_MAX_BYTES, 0) if st.st_size <= NOTE_MAX_BYTES else b""
        except OSError:
            continue
        finally:
            os.close(fd)
        try:
            doc = json.loads(raw.decode("utf-8") or "{}")
        except (UnicodeDecodeError, ValueError, RecursionError):
            continue
        if not isinstance(doc, dict) or doc.get("from_run") != name[: -len(NOTE_SUFFIX)]:
            continue
        groups: list[Any] = doc["groups"] if isinstance(doc.get("groups"), list) else []
        gpus: list[Any] = doc["gpus"] if isinstance(doc.get("gpus"), list) else []
        since = doc.get("since")
        notes.append(YieldNote(
            from_run=str(doc["from_run"]), uid=st.st_uid, user=user_name(st.st_uid),
            to_run=doc["to_run"] if isinstance(doc.get("to_run"), str) else None,
            to_user=doc["to_user"] if isinstance(doc.get("to_user"), str) else None,
            groups=tuple(g for g in groups if isinstance(g, int) and not isinstance(g, bool)),
            gpus=tuple(str(g) for g in gpus if isinstance(g, str)),
            since=float(since) if isinstance(since, (int, float)) and not isinstance(since, bool) else st.st_mtime))
    return sorted(notes, key=lambda n: n.since)
