"""No user can stall another through the lease store (issue 25, finding 2).

``holders/`` (1733) and ``queue/`` (1777) take files from every user. Another Unix user (``setpriv``) plants
what stalls a reader there: a FIFO (an ``open`` or ``read`` that never returns) and a 64 GiB sparse file (a
read that exhausts memory), under the names a victim's launcher opens, a holder note of a lease held with no
note (as a Docker master holds one) and live, locked queue tickets. A second user's ``launcher gpus``,
``plan``, ``up`` and ``up --wait 10s`` must answer within their deadlines, against the stand-in NVML (two GPUs)
and a real admin store found through ``$LAUNCHER_SITE``. Before the fix each of them hung until killed.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from launcher.gpu import store
from tests import unix_users
from tests.host_guard import unix_user_name
from tests.nvml_fixtures import build_stub, machine, stub_uuid

ROOT = Path(__file__).resolve().parents[3]
PY = ROOT / ".venv" / "bin" / "python"
UUIDS = [stub_uuid(i) for i in range(2)]
SPARSE = 64 << 30  # bytes; sparse, so it costs no disk
FIGURES: dict[str, float] = {}


def _skip_reason() -> str | None:
    return unix_users.skip_reason(PY, "mkfifo", "truncate")


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))

# Holds one lease file's exclusive flock and writes no holder note (as a Docker master does), until killed.
_HOLD = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('held', flush=True)\ntime.sleep(600)\n")
# The attacker's live ticket: open without blocking (a FIFO too), lock it, keep it.
_TICKET = ("import fcntl, os, sys, time\nfds = []\nfor p in sys.argv[1:]:\n"
           "    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)\n    fcntl.flock(fd, fcntl.LOCK_EX)\n    fds.append(fd)\n"
           "print('held', flush=True)\ntime.sleep(600)\n")


@dataclass(frozen=True)
class Box:
    base: Path
    site: store.Site
    stub_dir: Path
    stub_config: Path
    mallory: int  # the attacker's uid
    victim: int
    results: Path

    def env(self) -> dict[str, str]:
        return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(self.base), "PYTHONPATH": str(ROOT),
                "PYTHONDONTWRITEBYTECODE": "1", "LD_LIBRARY_PATH": str(self.stub_dir),
                "NVML_STUB_CONFIG": str(self.stub_config), store.SITE_ENV: str(self.site.site_file),
                "DOCKER_HOST": "unix:///nonexistent/docker.sock", "LAUNCHER_NVML_TIMEOUT": "5"}

    def as_uid(self, uid: int, argv: list[str]) -> list[str]:
        gid = pwd.getpwuid(uid).pw_gid
        return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", *argv]


def _user(letter: str) -> int:
    return unix_users.add_user(letter).uid


@pytest.fixture(scope="module")
def box() -> Iterator[Box]:
    base = Path(tempfile.mkdtemp(prefix="launcher-stall-", dir="/tmp"))
    os.chmod(base, 0o755)
    made: list[str] = []
    procs: list[subprocess.Popen[str]] = []
    try:
        stub_dir = build_stub("current")
        stub_config = base / "nvml.json"
        stub_config.write_text(json.dumps(machine(2)))
        os.chmod(stub_config, 0o644)
        report = store.admin_init(UUIDS, site_file=base / "etc" / "site.toml", store=base / "store",
                                  policy=base / "etc" / "policy.toml")
        mallory, victim = _user("m"), _user("v")
        made += [unix_user_name("m"), unix_user_name("v")]
        results = base / "results"
        results.mkdir()
        os.chown(results, victim, pwd.getpwuid(victim).pw_gid)
        b = Box(base, report.site, stub_dir, stub_config, mallory, victim, results)
        # Every GPU is leased, with no holder note (root's processes, standing in for Docker masters).
        holders = []
        for uuid in UUIDS:
            p = subprocess.Popen([sys.executable, "-c", _HOLD, str(report.site.lease_path(uuid))],
                                 stdout=subprocess.PIPE, text=True)
            procs.append(p)
            assert p.stdout is not None and p.stdout.readline().strip() == "held"
            holders.append(p.pid)
        # The attacker plants, as their own uid: a FIFO and a sparse file as those holders' notes, and a FIFO
        # and a sparse file as live (locked) tickets in the queue.
        h, q = report.site.holders, report.site.queue
        plant = (f"mkfifo {h}/{UUIDS[0]}@{holders[0]}.json && truncate -s {SPARSE} {h}/{UUIDS[1]}@{holders[1]}.json"
                 f" && mkfifo {q}/a-fifo.ticket && truncate -s {SPARSE} {q}/b-sparse.ticket")
        done = subprocess.run(b.as_uid(mallory, ["/bin/sh", "-c", plant]), capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        t = subprocess.Popen(b.as_uid(mallory, [str(PY), "-c", _TICKET, f"{q}/a-fifo.ticket", f"{q}/b-sparse.ticket"]),
                             stdout=subprocess.PIPE, text=True)
        procs.append(t)
        assert t.stdout is not None and t.stdout.readline().strip() == "held"
        assert os.stat(f"{h}/{UUIDS[0]}@{holders[0]}.json").st_uid == mallory
        yield b
    finally:
        for p in procs:
            p.kill()
            p.wait()
        unix_users.remove_users(made)
        shutil.rmtree(base, ignore_errors=True)


def _victim(box: Box, *args: str, limit_s: float) -> tuple[subprocess.CompletedProcess[str], float]:
    """``launcher ARGS`` as the victim; (result, seconds). A hang is a failure, reported as such."""
    start = time.monotonic()
    try:
        out = subprocess.run(box.as_uid(box.victim, [str(PY), "-m", "launcher", *args]), cwd=box.base, env=box.env(),
                             capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`launcher {' '.join(args)}` did not answer within {limit_s} s: another user's FIFO or sparse "
                    "file in the lease store stalls it")
    return out, time.monotonic() - start


def test_gpus_lists_the_holders_and_the_queue_despite_planted_files(box: Box) -> None:
    out, took = _victim(box, "gpus", "--json", "--no-docker", limit_s=60)
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    leases = [g["lease"] for g in doc["gpus"]]
    assert all(lease and lease["uid"] == 0 and lease["run_id"] is None for lease in leases), leases
    # the attacker's tickets are not tickets: a FIFO is skipped; the oversized one is a waiter with no words
    assert [(q["user"], q["run_id"]) for q in doc["queue"]] == [(unix_user_name("m"), None)], doc["queue"]
    FIGURES["gpus_s"] = round(took, 2)


def test_plan_and_up_answer_at_once_and_up_wait_within_its_deadline(box: Box) -> None:
    plan, plan_s = _victim(box, "plan", "--workers", "1", "--gpus", "0", "--samples", "1", limit_s=60)
    assert plan.returncode in (0, 5), plan.stderr
    up_args = ("up", "--backend", "process", "--workers", "1", "--gpus", "0", "--samples", "1", "--results",
               str(box.results), "--progress", "off")
    up, up_s = _victim(box, *up_args, limit_s=60)
    assert up.returncode == 5 and "held by" in up.stderr, (up.returncode, up.stderr[-2000:])
    waited, wait_s = _victim(box, *up_args, "--wait", "10s", limit_s=60)
    assert waited.returncode == 5 and "waited 10 s" in waited.stderr, (waited.returncode, waited.stderr[-2000:])
    assert 10 <= wait_s < 20, wait_s  # the deadline, plus the launcher's start
    FIGURES.update(plan_s=round(plan_s, 2), up_s=round(up_s, 2), up_wait_10s_s=round(wait_s, 2))
    print("figures:", FIGURES)
