"""The lease store's parts on one user: /proc/locks parsing, the site file's trust rules, the wait queue."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.errors import BadInput, NoResources
from launcher.gpu import queue, store
from launcher.gpu.holders import exclusive_holders, parse_proc_locks, proc_info
from launcher.gpu.policy import SitePolicy, narrow
from launcher.gpu.leaseholders import list_holders
from launcher.gpu.reservations import LeaseDir, lease_dir, reserve

REPO = Path(__file__).resolve().parents[3]
PROC_LOCKS = """\
1: OFDLCK ADVISORY  READ -1 00:0f:18408 0 EOF
2: FLOCK  ADVISORY  WRITE 1418 fe:00:753934 0 EOF
3: FLOCK  ADVISORY  READ 1500 fe:00:753935 0 EOF
4: POSIX  ADVISORY  WRITE 12638 fe:00:382078 0 EOF
5: -> FLOCK  ADVISORY  WRITE 1777 fe:00:753934 0 EOF
6: FLOCK  ADVISORY  WRITE 0 103:02:99 0 EOF
"""


def test_parse_proc_locks_keeps_granted_locks_only() -> None:
    locks = parse_proc_locks(PROC_LOCKS)
    assert [(lk.kind, lk.exclusive, lk.pid, lk.dev, lk.inode) for lk in locks] == [
        ("OFDLCK", False, -1, (0, 15), 18408), ("FLOCK", True, 1418, (254, 0), 753934),
        ("FLOCK", False, 1500, (254, 0), 753935), ("POSIX", True, 12638, (254, 0), 382078),
        ("FLOCK", True, 0, (259, 2), 99)]  # the waiter (->) is not a holder
    files = {((254, 0), 753934): "GPU-a", ((254, 0), 753935): "GPU-b", ((259, 2), 99): "GPU-c"}
    assert exclusive_holders(files, locks) == {"GPU-a": [1418], "GPU-c": [0]}  # shared and POSIX locks are not leases


def test_holders_come_from_the_kernel_not_the_file_text(tmp_path: Path) -> None:
    with reserve(["GPU-aaaa"], "honest", tmp_path):
        (tmp_path / "GPU-aaaa.lock").write_text('{"run_id": "forged", "pid": 1, "user": "mallory"}')
        (h,) = list_holders(tmp_path)
        assert (h.pid, h.uid, h.user) == (os.getpid(), os.getuid(), proc_info(os.getpid()).user)
        assert h.run_id is None  # text not written by the holder's pid is not believed
    (tmp_path / "GPU-bbbb.lock").write_text('{"run_id": "ghost", "pid": 1}')
    assert list_holders(tmp_path) == []  # a file nobody holds is free, whatever it says


def test_narrowing_never_widens() -> None:
    site = SitePolicy(source="/etc/p", max_gpus_per_user=2, min_free_memory_bytes=8, reserved_gpus=("0",),
                      max_workers_per_gpu=None)
    mine = SitePolicy(source="~/p", max_gpus_per_user=4, min_free_memory_bytes=4, reserved_gpus=("3",),
                      max_workers_per_gpu=16)
    both = narrow(site, mine)
    assert (both.max_gpus_per_user, both.min_free_memory_bytes, both.reserved_gpus, both.max_workers_per_gpu) == (
        2, 8, ("0", "3"), 16)
    assert both.source == "/etc/p narrowed by ~/p"
    assert narrow(SitePolicy(), mine) == SitePolicy(source="~/p", max_gpus_per_user=4, min_free_memory_bytes=4,
                                                    reserved_gpus=("3",), max_workers_per_gpu=16)


def test_site_override_needs_a_root_owned_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.path.lexists(store.SITE_FILE):
        pytest.skip("this machine has a real site file, which always wins")
    site_file = tmp_path / "site.toml"
    site_file.write_text('store = "/nonexistent"\n')
    if os.geteuid() != 0:  # a user's own file: not a site
        assert store.find_site({store.SITE_ENV: str(site_file)}) is None
        return
    # pytest's tmp dirs are root's and 0700: trusted; made group-writable they are not
    os.chmod(site_file, 0o664)
    assert store.find_site({store.SITE_ENV: str(site_file)}) is None
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(BadInput, match="must run as root"):
        store.admin_init([], site_file=site_file, store=tmp_path / "store", policy=tmp_path / "policy.toml")


def test_lock_dir_beside_a_store_is_refused(tmp_path: Path) -> None:
    site = store.Site(site_file=tmp_path / "site.toml", store=tmp_path / "store", policy=tmp_path / "p.toml")
    assert lease_dir(None, site=site) == LeaseDir(site.leases, site)
    assert lease_dir(site.leases, site=site).site == site
    with pytest.raises(BadInput, match="--lock-dir /elsewhere: this machine has an admin lease store"):
        lease_dir("/elsewhere", site=site)


def _waiter(qdir: Path, run_id: str) -> subprocess.Popen[str]:
    code = ("import sys, time; from pathlib import Path; from launcher.gpu.queue import Waiter; "
            f"w = Waiter(Path({str(qdir)!r}), {run_id!r}, '1 GPU'); print('queued', flush=True); time.sleep(60)")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def test_queue_order_and_stale_tickets(tmp_path: Path) -> None:
    procs: list[subprocess.Popen[str]] = []
    try:
        for i in range(3):  # one after the other: ctime order is arrival order
            p = _waiter(tmp_path, f"run-{i}")
            procs.append(p)
            assert p.stdout is not None and p.stdout.readline().strip() == "queued"
        assert [t.run_id for t in queue.read_queue(tmp_path)] == ["run-0", "run-1", "run-2"]
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        assert len(list(tmp_path.glob("*.ticket"))) == 3  # its ticket stays on disk ...
        assert [t.run_id for t in queue.read_queue(tmp_path, clean=False)] == ["run-0", "run-2"]  # ... but is dead
        queue.read_queue(tmp_path)  # and the owner (or root) cleans it
        assert len(list(tmp_path.glob("*.ticket"))) == 2
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_wait_in_queue_takes_its_turn_and_gives_up_in_time(tmp_path: Path) -> None:
    calls: list[int] = []

    def attempt() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise NoResources("GPU 0 held by launcher run other")
        return "leased"

    lines: list[str] = []
    assert queue.wait_in_queue(tmp_path, run_id="me", want="GPUs 0", wait_s=10, attempt=attempt,
                               report=lines.append, sleep=lambda s: None) == "leased"
    assert lines == ["waiting for GPUs: place 1 of 1 in the queue; GPU 0 held by launcher run other"]
    assert list(tmp_path.iterdir()) == []  # left the queue

    def never() -> str:
        raise NoResources("busy")

    with pytest.raises(NoResources, match="waited 0.2 s for GPUs and none came free for run me"):
        queue.wait_in_queue(tmp_path, run_id="me", want="x", wait_s=0.2, attempt=never)
    assert list(tmp_path.iterdir()) == []


def test_wait_deadline_bounds_an_attempt_that_blocks(tmp_path: Path) -> None:
    """``--wait`` bounds the whole wait: an attempt (placement) blocked in a system call is ended at the deadline,
    the queue is left and the previous SIGALRM handler is back (issue 25, finding 2)."""
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    q = tmp_path / "queue"
    q.mkdir()

    def blocks() -> str:
        with open(fifo, "rb") as fh:  # no writer: open(2) itself never returns
            return fh.read().decode()

    before = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    with pytest.raises(NoResources, match="waited 1 s for GPUs for run me, and placing the run had not finished"):
        queue.wait_in_queue(q, run_id="me", want="x", wait_s=1, attempt=blocks)
    took = time.monotonic() - start
    assert 1 <= took < 3, took
    assert list(q.iterdir()) == [] and signal.getsignal(signal.SIGALRM) == before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
