"""GPU sharing between real Unix users: an admin lease store, concurrent launchers, attacks, the fair queue.

The test process (root, as CI runs) makes a lease store with ``launcher.gpu.store.admin_init`` in a temporary
directory, found through ``$LAUNCHER_SITE`` (honoured because root owns it), creates three Unix users with
``useradd`` and runs each launcher as one of them with ``setpriv``, against a simulated 4-GPU machine (the
stand-in NVML). Each launcher is ``tests/lease_client.py``: ``launcher.gpu.plan_and_reserve`` exactly as
``launcher up`` calls it, kept alive between trials. The truth is read from the kernel's lock table.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import jsonschema
import pytest

from launcher import schemas
from launcher.gpu import leaseholders, reservations, store
from launcher.gpu.queue import read_queue
from tests import unix_users
from tests.unix_users import User
from tests.nvml_fixtures import build_stub, machine, stub_uuid

ROOT = Path(__file__).resolve().parents[3]
PY = ROOT / ".venv" / "bin" / "python"
UUIDS = [stub_uuid(i) for i in range(4)]
FIGURES: dict[str, Any] = {}


def _skip_reason() -> str | None:
    return unix_users.skip_reason(PY)


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


@dataclass(frozen=True)
class Machine:
    base: Path
    site: store.Site
    stub_dir: Path
    stub_config: Path
    users: tuple[User, ...]

    @property
    def lease_dir(self) -> reservations.LeaseDir:
        return reservations.LeaseDir(self.site.leases, self.site)

    def env(self, **extra: str) -> dict[str, str]:
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(self.base), "PYTHONPATH": str(ROOT),
               "PYTHONDONTWRITEBYTECODE": "1", "LD_LIBRARY_PATH": str(self.stub_dir),
               "NVML_STUB_CONFIG": str(self.stub_config), store.SITE_ENV: str(self.site.site_file),
               "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
        env.update(extra)
        return env

    def as_user(self, user: User, argv: list[str], **kw: Any) -> list[str]:
        return ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--", *argv]

    def held(self) -> dict[str, tuple[int | None, int | None]]:
        """UUID -> (pid, uid) holding its lease, from /proc/locks."""
        return {h.uuid: (h.pid, h.uid) for h in leaseholders.list_holders(self.lease_dir)}


@pytest.fixture(scope="module")
def box() -> Iterator[Machine]:
    base = Path(tempfile.mkdtemp(prefix="launcher-users-", dir="/tmp"))
    os.chmod(base, 0o755)
    users: list[User] = []
    try:
        stub_dir = build_stub("current")
        stub_config = base / "nvml.json"
        stub_config.write_text(json.dumps(machine(4)))
        os.chmod(stub_config, 0o644)
        report = store.admin_init(UUIDS, site_file=base / "etc" / "site.toml", store=base / "store",
                                  policy=base / "etc" / "policy.toml")
        for letter in "abc":
            users.append(unix_users.add_user(letter))
        yield Machine(base, report.site, stub_dir, stub_config, tuple(users))
    finally:
        unix_users.remove_users([u.name for u in users])
        shutil.rmtree(base, ignore_errors=True)


class Client:
    """One launcher, run as ``user``, answering one JSON line per command."""

    def __init__(self, box: Machine, user: User, prefix: str, **env: str) -> None:
        self.user = user
        self.err = box.base / f"{prefix}.err"
        self.proc = subprocess.Popen(box.as_user(user, [str(PY), "-m", "tests.lease_client", prefix]), cwd=ROOT,
                                     env=box.env(**env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.err, "w"), text=True, bufsize=1)
        hello = self.read()
        assert hello["ready"] and hello["uid"] == user.uid, hello
        self.pid = int(hello["pid"])

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float = 60) -> dict[str, Any]:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        line = out.readline()
        if not line:
            raise AssertionError(f"client of {self.user.name} ended: {self.err.read_text()[-2000:]}")
        return json.loads(line)  # type: ignore[no-any-return]

    def ask(self, line: str) -> dict[str, Any]:
        self.send(line)
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            with_stdin = self.proc.stdin
            try:
                if with_stdin:
                    with_stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def test_store_is_root_owned_and_users_cannot_bend_it(box: Machine) -> None:
    st = os.stat(box.site.leases)
    assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o755)
    assert os.stat(box.site.queue).st_mode & 0o7777 == 0o1777  # sticky, and listable by every waiter
    assert os.stat(box.site.holders).st_mode & 0o7777 == 0o1733
    for u in UUIDS:
        s = os.stat(box.site.lease_path(u))
        assert (s.st_uid, s.st_mode & 0o777) == (0, 0o644)
    # an override file that is not root's is no site at all (single-user mode, with its one-line note)
    fake = box.base / "fake-site.toml"
    fake.write_text(f'store = "{box.site.store}"\n')
    os.chown(fake, box.users[1].uid, box.users[1].gid)
    assert store.find_site({store.SITE_ENV: str(fake)}) is None
    assert store.find_site({store.SITE_ENV: str(box.site.site_file)}) == box.site


def test_two_users_four_launchers_never_share_a_gpu(box: Machine) -> None:
    """2 users x 4 concurrent launchers, 200 trials: the plans are disjoint and the kernel agrees."""
    trials = int(os.environ.get("LAUNCHER_USER_TRIALS", "200"))
    clients = [Client(box, box.users[u], f"{box.users[u].name}-{k}") for u in (0, 1) for k in range(4)]
    rng = random.Random(13)
    granted = conflicts = cpu = 0
    started = time.monotonic()
    try:
        for _ in range(trials):
            for i, c in enumerate(clients):
                choice = "auto" if i % 2 == 0 else ",".join(map(str, rng.sample(range(4), rng.choice((1, 2)))))
                c.send(f"plan workers=1 gpus={choice}")
            answers = [c.read() for c in clients]
            owner: dict[str, Client] = {}
            for c, a in zip(clients, answers):
                if a.get("error"):
                    assert a["code"] == 5, a  # held by another run: exit 5, never a traceback
                    conflicts += 1
                    continue
                if a["kind"] == "cpu":
                    cpu += 1
                    continue
                assert sorted(a["uuids"]) == sorted(a["plan"]), a  # the lease covers the whole plan
                for u in a["uuids"]:
                    assert u not in owner, f"{u} planned by {owner[u].pid} and {c.pid}"
                    owner[u] = c
                granted += 1
            kernel = box.held()
            assert set(kernel) == set(owner), (kernel, {u: c.pid for u, c in owner.items()})
            for u, c in owner.items():
                assert kernel[u] == (c.pid, c.user.uid)
            for c in clients:
                assert c.ask("release") == {"released": True}
            assert box.held() == {}
    finally:
        for c in clients:
            c.close()
    FIGURES["stress"] = {"trials": trials, "launches": trials * len(clients), "granted": granted,
                         "refused_exit_5": conflicts, "cpu_plans": cpu, "seconds": round(time.monotonic() - started, 1)}
    print("figures:", FIGURES["stress"])
    assert granted >= trials and conflicts > 0  # the trials did race


def _run_as(box: Machine, user: User, shell: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(box.as_user(user, ["/bin/sh", "-c", shell]), env=box.env(), capture_output=True, text=True,
                          timeout=30)


def test_attacks_from_the_other_user_fail_and_take_no_gpu(box: Machine) -> None:
    alice, bob = box.users[0], box.users[1]
    policy_text = box.site.policy.read_text()
    box.site.policy.write_text("max_gpus_per_user = 1\n")
    a = Client(box, alice, "alice-run")
    b_own_policy = box.base / "bob-policy.toml"
    b_own_policy.write_text("max_gpus_per_user = 4\n")
    os.chmod(b_own_policy, 0o644)
    b = Client(box, bob, "bob-run", LAUNCHER_POLICY=str(b_own_policy))
    try:
        got = a.ask("plan workers=1 gpus=0")
        assert got["uuids"] == [UUIDS[0]]
        before = box.held()
        lease = box.site.lease_path(UUIDS[0])
        # 1. delete or replace alice's lease file, or write into it
        for shell in (f"rm -f {lease}", f"mv {lease} {lease}.x", f"ln -sf /tmp {lease}", f"echo bob > {lease}",
                      f"touch {box.site.leases}/GPU-new.lock", f"rm -rf {box.site.queue}"):
            out = _run_as(box, bob, shell)
            assert out.returncode != 0 and "Permission denied" in out.stderr, (shell, out)
        assert os.stat(lease).st_uid == 0 and box.held() == before
        assert _run_as(box, bob, f"ls {box.site.queue}").returncode == 0  # every waiter can see the whole queue
        # 2. take alice's GPU anyway: exit 5 naming her (the kernel's uid, not a file's text)
        refused = b.ask("plan workers=1 gpus=0")
        assert refused["code"] == 5 and f"user {alice.name}" in refused["error"] and "alice-run-1" in refused["error"]
        # 3. leave the store with --lock-dir: exit 2 with what to do
        escaped = b.ask(f"plan workers=1 gpus=1 lock_dir={box.base}/bob-locks")
        assert escaped["code"] == 2 and "admin lease store" in escaped["error"], escaped
        assert not (box.base / "bob-locks").exists()
        # 4. widen the site policy with LAUNCHER_POLICY: the site's cap of 1 still holds
        capped = b.ask("plan workers=1 gpus=auto")
        assert len(capped["uuids"]) == 1 and any("allows user" in r for r in capped["reasons"]), capped
        # 5. forge holder notes: one saying alice holds another GPU, one renaming bob's lease to alice
        mine = capped["uuids"][0]
        spare = next(u for u in UUIDS if u not in (UUIDS[0], mine))
        forged = (f"echo '{{\"run_id\": \"forged\", \"user\": \"{alice.name}\"}}' > "
                  f"{box.site.holders}/{spare}@{a.pid}.json; "
                  f"rm -f {box.site.holders}/{UUIDS[0]}@{a.pid}.json")
        _run_as(box, bob, forged)
        holders = {h.uuid: h for h in leaseholders.list_holders(box.lease_dir)}
        assert set(holders) == {UUIDS[0], mine} and holders[UUIDS[0]].run_id == "alice-run-1"
        assert holders[mine].user == bob.name
        again = b.ask("plan workers=1 gpus=auto")  # bob's second run: his first one counts, by uid
        assert again.get("kind") == "cpu" or again.get("code") in (2, 5), again
        assert box.held() == {UUIDS[0]: (a.pid, alice.uid), mine: (b.pid, bob.uid)}
    finally:
        a.close()
        b.close()
        box.site.policy.write_text(policy_text)
    assert box.held() == {}


def _wait_until(pred: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_wait_queue_serves_three_users_in_order_and_a_killed_waiter_leaves(box: Machine) -> None:
    """root holds every GPU; three users queue for all four in turn; one is SIGKILLed while queued."""
    env = {store.SITE_ENV: str(box.site.site_file)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    holder = reservations.reserve(UUIDS, "root-holds-all")
    waiters = [Client(box, u, f"{u.name}-q") for u in box.users]
    extra = Client(box, box.users[1], "killed-q")
    handovers: list[float] = []
    try:
        for c in waiters[:2] + [extra] + waiters[2:]:
            n = len(read_queue(box.site.queue, clean=False))
            c.send("plan workers=1 gpus=0,1,2,3 wait=60")
            _wait_until(lambda: len(read_queue(box.site.queue, clean=False)) == n + 1)
        queue = read_queue(box.site.queue, clean=False)
        assert [t.user for t in queue] == [box.users[0].name, box.users[1].name, box.users[1].name, box.users[2].name]
        os.kill(extra.pid, signal.SIGKILL)
        _wait_until(lambda: len(read_queue(box.site.queue, clean=False)) == 3)
        # what any user sees: `launcher gpus --json` names each lease's holder and the queue in order
        out = subprocess.run(box.as_user(box.users[2], [str(PY), "-m", "launcher", "gpus", "--json", "--no-docker"]),
                             env=box.env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        jsonschema.validate(doc, schemas.load(schemas.GPUS_SCHEMA))
        assert doc["store"]["mode"] == "admin" and doc["store"]["site_file"] == str(box.site.site_file)
        for g in doc["gpus"]:
            lease = g["lease"]
            assert (lease["user"], lease["uid"], lease["pid"], lease["run_id"]) == ("root", 0, os.getpid(),
                                                                                    "root-holds-all")
            assert lease["since"] and abs(lease["since"] - time.time()) < 300
        assert [(q["place"], q["user"]) for q in doc["queue"]] == [(1, box.users[0].name), (2, box.users[1].name),
                                                                    (3, box.users[2].name)]
        previous: Any = holder
        for c in waiters:
            freed = time.monotonic()
            previous.release() if previous is holder else previous.ask("release")
            got = c.read(timeout_s=30)
            handovers.append(time.monotonic() - freed)
            assert got["uuids"] and sorted(got["uuids"]) == sorted(got["plan"]), json.dumps(got)  # --gpus names all four
            assert {pid for pid, _ in box.held().values()} == {c.pid}
            previous = c
        previous.ask("release")
        assert read_queue(box.site.queue, clean=False) == []
    finally:
        holder.release()
        for c in [*waiters, extra]:
            c.close()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    FIGURES["queue"] = {"handover_s_max": round(max(handovers), 2), "handovers": [round(h, 2) for h in handovers]}
    print("figures:", FIGURES["queue"])
    assert max(handovers) < 2.0


def test_admin_init_command_is_idempotent_and_reads_the_gpus(box: Machine) -> None:
    """`launcher admin init` as root: lease files for every GPU NVML lists, then again changes nothing."""
    where = box.base / "init-test"
    args = [str(PY), "-m", "launcher", "admin", "init", "--store", str(where / "store"),
            "--site-file", str(where / "etc" / "site.toml"), "--policy", str(where / "etc" / "policy.toml")]
    first = subprocess.run(args, env=box.env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith(f"lease store {where / 'store'}: 4 GPU lease file(s)")
    assert sorted(p.name for p in (where / "store" / "leases").iterdir()) == sorted(f"{u}.lock" for u in UUIDS)
    again = subprocess.run(args, env=box.env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "  made " not in again.stdout  # nothing to make or fix
    os.chmod(where / "store" / "leases", 0o777)  # someone loosened it: init repairs it
    fixed = subprocess.run(args, env=box.env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "owner/mode fixed to root 0755" in fixed.stdout and os.stat(where / "store" / "leases").st_mode & 0o777 == 0o755
    as_user = subprocess.run(box.as_user(box.users[0], args), env=box.env(), cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
    assert as_user.returncode == 2 and "must run as root" in as_user.stderr
