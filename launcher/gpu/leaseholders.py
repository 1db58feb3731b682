"""Who holds each GPU lease now: the read side of :mod:`launcher.gpu.reservations`.

:func:`list_holders` joins the kernel's lock table (``/proc/locks``, read by :mod:`launcher.gpu.holders`) with
the lease files of a lease directory and each holder's note into one :class:`Holder` per held lease. The
kernel says who holds a lease (pid, uid); a note only adds labels (run id, host, since), trusted for the
holder's own uid. A lease the broker holds is shown as the run it holds it for. Nothing here takes a lease.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.gpu.holders import ProcInfo, exclusive_holders, file_key, proc_info, read_label, read_proc_locks
from launcher.gpu.reservations import LeaseDir, lease_dir


@dataclass(frozen=True)
class Holder:
    """Who holds a GPU's lease. ``pid`` and ``uid`` come from the kernel's lock table; ``run_id``, ``host`` and
    ``since`` from the holder's note (a label, trusted only for the holder's own uid)."""

    uuid: str
    run_id: str | None = None
    pid: int | None = None
    user: str | None = None
    host: str | None = None
    since: float | None = None  # Unix time the lease was taken (else the holder process's start)
    uid: int | None = None
    container_id: str | None = None

    def describe(self) -> str:
        details = ", ".join(x for x in (self.pid and f"pid {self.pid}", self.user and f"user {self.user}",
                                        self.container_id and f"container {self.container_id[:12]}") if x)
        return f"launcher run {self.run_id or '?'}" + (f" ({details})" if details else "")


def _labelled(uuid: str, label: dict[str, Any], pid: int | None, uid: int | None, user: str | None,
              info: ProcInfo) -> Holder:
    """A :class:`Holder` from who holds the lease (``pid``, ``uid``, ``user``, ``info`` of that pid) and the labels
    of its note (run id, host, since: each taken only when of the right type)."""
    run_id, host, since = label.get("run_id"), label.get("host"), label.get("since")
    return Holder(uuid=uuid, run_id=run_id if isinstance(run_id, str) else None, pid=pid, user=user,
                  host=host if isinstance(host, str) else None,
                  since=float(since) if isinstance(since, (int, float)) else info.started_at, uid=uid,
                  container_id=info.container_id)


def _broker_holder(uuid: str, label: dict[str, Any]) -> Holder:
    """A lease the broker holds (the kernel names the broker, root): who it is for is the broker's note, which
    root wrote. The pid shown is the newest process tied to it (the run's master once the run started)."""
    pids = [p for p in label.get("pids") or [] if isinstance(p, int) and not isinstance(p, bool) and p > 0]
    pid = pids[-1] if pids else None
    info = proc_info(pid) if pid else ProcInfo(None, None, None, None, None)
    uid, user = label.get("uid"), label.get("user")
    return _labelled(uuid, label, pid, uid if isinstance(uid, int) and not isinstance(uid, bool) else None,
                     user if isinstance(user, str) else None, info)


def list_holders(lock_dir: str | Path | LeaseDir | None = None) -> list[Holder]:
    """Every GPU lease held now, by UUID, from the kernel's lock table (``/proc/locks``).

    A lease file nobody holds is not listed, whatever text it has. ``pid``/``uid``/``user``/``container_id``
    are the kernel's; ``run_id``/``host``/``since`` the holder's own note. A lease the broker holds (the kernel
    names a root process whose root-owned note says ``"broker": true``) is shown as the broker's note says:
    the run's uid and user, its newest tied pid and that process's container.
    """
    ld = lock_dir if isinstance(lock_dir, LeaseDir) else lease_dir(lock_dir)
    try:
        paths = sorted(ld.path.glob("*.lock"))
    except OSError:
        return []
    files: dict[tuple[tuple[int, int], int], str] = {}
    by_uuid: dict[str, Path] = {}
    for path in paths:
        try:
            files[file_key(os.stat(path, follow_symlinks=False))] = path.name[: -len(".lock")]
        except OSError:
            continue
        by_uuid[path.name[: -len(".lock")]] = path
    holders: list[Holder] = []
    for uuid, pids in sorted(exclusive_holders(files, read_proc_locks()).items()):
        pid = pids[0]
        info = proc_info(pid)
        note = ld.site.holders / f"{uuid}@{pid}.json" if ld.site is not None else None
        label = read_label(note, by_uuid[uuid], pid, info.uid)
        if note is not None and info.uid == 0 and label.get("broker") is True:  # root's note: the broker's
            holders.append(_broker_holder(uuid, label))
            continue
        holders.append(_labelled(uuid, label, pid if pid > 0 else None, info.uid, info.user, info))
    return holders
