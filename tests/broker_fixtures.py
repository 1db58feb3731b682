"""The lease broker's test bed (tests/unit/gpu/test_broker*.py): a temporary lease store with a broker, found
through ``$LAUNCHER_SITE``; ``launcher admin broker --site`` running as a child (root); two Unix users made with
``useradd`` whose processes run with ``setpriv``; the stand-in NVML showing 4 GPUs. Fixture: ``broker_box``
(one per test module).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from launcher.gpu import leaseholders, reservations, store
from tests import unix_users
from tests.unix_users import User
from tests.nvml_fixtures import build_stub, machine, stub_uuid

ROOT = Path(__file__).resolve().parents[1]
PY = ROOT / ".venv" / "bin" / "python"
UUIDS = [stub_uuid(i) for i in range(4)]


def skip_reason() -> str | None:
    if not hasattr(os, "pidfd_open"):
        return "os.pidfd_open is missing (Linux 5.3+ and Python 3.9+ needed)"
    return unix_users.skip_reason(PY, "flock", needs="a root-owned lease store and runs the broker")


@dataclass(frozen=True)
class Box:
    base: Path
    site: store.Site  # with a broker
    plain: store.Site  # the same GPUs, a store without a broker (today's behaviour)
    stub_dir: Path
    stub_config: Path
    users: tuple[User, ...]
    broker_pid: int

    def env(self, site: store.Site | None = None, **extra: str) -> dict[str, str]:
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(self.base), "PYTHONPATH": str(ROOT),
               "PYTHONDONTWRITEBYTECODE": "1", "LD_LIBRARY_PATH": str(self.stub_dir),
               "NVML_STUB_CONFIG": str(self.stub_config), store.SITE_ENV: str((site or self.site).site_file),
               "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
        env.update(extra)
        return env

    def as_user(self, user: User, argv: list[str]) -> list[str]:
        return ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--", *argv]

    def held(self, site: store.Site | None = None) -> dict[str, leaseholders.Holder]:
        s = site or self.site
        return {h.uuid: h for h in leaseholders.list_holders(reservations.LeaseDir(s.leases, s))}

    def set_cap(self, cap: int | None) -> None:
        text = "" if cap is None else f"max_gpus_per_user = {cap}\n"
        for s in (self.site, self.plain):
            s.policy.write_text(text)


def wait_until(pred: Any, timeout_s: float = 10.0, poll_s: float = 0.01) -> float:
    started = time.monotonic()
    while not pred():
        assert time.monotonic() - started < timeout_s, "timed out"
        time.sleep(poll_s)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def broker_box() -> Iterator[Box]:
    base = Path(tempfile.mkdtemp(prefix="launcher-broker-", dir="/tmp"))
    os.chmod(base, 0o755)
    users: list[User] = []
    broker: subprocess.Popen[str] | None = None
    try:
        stub_dir = build_stub("current")
        stub_config = base / "nvml.json"
        stub_config.write_text(json.dumps(machine(4)))
        os.chmod(stub_config, 0o644)
        site = store.admin_init(UUIDS, site_file=base / "etc" / "site.toml", store=base / "store",
                                policy=base / "etc" / "policy.toml", broker=base / "run" / "broker.sock").site
        plain = store.admin_init(UUIDS, site_file=base / "etc-plain" / "site.toml", store=base / "store-plain",
                                 policy=base / "etc-plain" / "policy.toml").site
        for letter in "de":
            users.append(unix_users.add_user(letter))
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
        broker = subprocess.Popen([str(PY), "-m", "launcher", "admin", "broker", "--site", str(site.site_file)],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=open(base / "broker.err", "w"),
                                  text=True)
        assert broker.stdout is not None
        first = broker.stdout.readline()
        assert first.startswith("launcher broker: pid"), (first, (base / "broker.err").read_text())
        yield Box(base, site, plain, stub_dir, stub_config, tuple(users), broker.pid)
    finally:
        if broker is not None:
            broker.terminate()
            broker.wait(timeout=10)
        unix_users.remove_users([u.name for u in users])
        shutil.rmtree(base, ignore_errors=True)


class Proc:
    """A child answering one JSON line per line it is sent (tests/reserve_racer.py, tests/lease_client.py)."""

    def __init__(self, box: Box, user: User, argv: list[str], *, site: store.Site | None = None,
                 name: str = "proc") -> None:
        self.user = user
        self.err = box.base / f"{name}.err"
        self.proc = subprocess.Popen(box.as_user(user, [str(PY), *argv]), cwd=ROOT, env=box.env(site),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.err, "w"),
                                     text=True, bufsize=1)
        self.pid = self.proc.pid  # setpriv execs: the same process

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def line(self) -> str:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        got = out.readline()
        if not got:
            raise AssertionError(f"{self.proc.args} ended: {self.err.read_text()[-2000:]}")
        return got.strip()

    def read(self) -> dict[str, Any]:
        return json.loads(self.line())  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def script(box: Box, user: User, code: str, *args: str, site: store.Site | None = None,
            timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(box.as_user(user, [str(PY), "-c", code, *args]), cwd=ROOT, env=box.env(site),
                          capture_output=True, text=True, timeout=timeout_s)


# Leases GPUs through reserve() (the broker's client), prints "held", ties to argv[3] if given, then sleeps.
HOLD = ("import sys, time\nfrom launcher.gpu.reservations import reserve\n"
         "r = reserve(sys.argv[1].split(','), sys.argv[2])\n"
         "if len(sys.argv) > 3: r.tie(int(sys.argv[3]))\n"
         "print('held', flush=True)\ntime.sleep(600)\n")


def hold(box: Box, user: User, uuids: list[str], run_id: str, tie: int | None = None) -> subprocess.Popen[str]:
    argv = [str(PY), "-c", HOLD, ",".join(uuids), run_id, *([str(tie)] if tie else [])]
    proc = subprocess.Popen(box.as_user(user, argv), cwd=ROOT, env=box.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "held":
        proc.kill()
        raise AssertionError(f"holder did not lease {uuids}: {line} {proc.stderr.read() if proc.stderr else ''}")
    return proc


def kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
