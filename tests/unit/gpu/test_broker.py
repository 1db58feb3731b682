"""The GPU lease broker (issue 25, item 3): the site cap enforced in one step, leases users cannot flock.

Real processes, sockets and flocks; only the GPUs are the stand-in NVML's. The test process (root, as CI
runs) makes a lease store with a broker (``admin_init(..., broker=...)``) in a temporary directory found through
``$LAUNCHER_SITE``, starts ``launcher admin broker --site`` as a child, makes two Unix users and runs their
launchers with ``setpriv``. The truth is read from the kernel (``/proc/locks``) and from the broker itself.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from launcher.errors import MissingDependency
from launcher.gpu import broker_client, reservations, store
from tests.host_guard import unix_user_name
from tests.nvml_fixtures import build_stub, machine, stub_uuid

ROOT = Path(__file__).resolve().parents[3]
PY = ROOT / ".venv" / "bin" / "python"
UUIDS = [stub_uuid(i) for i in range(4)]
FIGURES: dict[str, Any] = {}


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (CI runs as root): it creates Unix users, a root-owned lease store and runs the broker"
    for tool in ("useradd", "userdel", "setpriv", "flock"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if os.path.realpath(PY).startswith("/root/"):
        return f"{PY} is not executable by other users; make the venv with scripts/setup.sh"
    if os.path.lexists(store.SITE_FILE):
        return f"this machine has a real lease store ({store.SITE_FILE}); $LAUNCHER_SITE would be ignored"
    if not hasattr(os, "pidfd_open"):
        return "os.pidfd_open is missing (Linux 5.3+ and Python 3.9+ needed)"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


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

    def held(self, site: store.Site | None = None) -> dict[str, reservations.Holder]:
        s = site or self.site
        return {h.uuid: h for h in reservations.list_holders(reservations.LeaseDir(s.leases, s))}

    def set_cap(self, cap: int | None) -> None:
        text = "" if cap is None else f"max_gpus_per_user = {cap}\n"
        for s in (self.site, self.plain):
            s.policy.write_text(text)


def _wait_until(pred: Any, timeout_s: float = 10.0, poll_s: float = 0.01) -> float:
    started = time.monotonic()
    while not pred():
        assert time.monotonic() - started < timeout_s, "timed out"
        time.sleep(poll_s)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def box() -> Iterator[Box]:
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
            name = unix_user_name(letter)
            subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
                           check=True, capture_output=True)
            pw = pwd.getpwnam(name)
            users.append(User(name, pw.pw_uid, pw.pw_gid))
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
        for u in users:
            subprocess.run(["userdel", u.name], capture_output=True)
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


def _script(box: Box, user: User, code: str, *args: str, site: store.Site | None = None,
            timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(box.as_user(user, [str(PY), "-c", code, *args]), cwd=ROOT, env=box.env(site),
                          capture_output=True, text=True, timeout=timeout_s)


# Leases GPUs through reserve() (the broker's client), prints "held", ties to argv[3] if given, then sleeps.
_HOLD = ("import sys, time\nfrom launcher.gpu.reservations import reserve\n"
         "r = reserve(sys.argv[1].split(','), sys.argv[2])\n"
         "if len(sys.argv) > 3: r.tie(int(sys.argv[3]))\n"
         "print('held', flush=True)\ntime.sleep(600)\n")


def _holder(box: Box, user: User, uuids: list[str], run_id: str, tie: int | None = None) -> subprocess.Popen[str]:
    argv = [str(PY), "-c", _HOLD, ",".join(uuids), run_id, *([str(tie)] if tie else [])]
    proc = subprocess.Popen(box.as_user(user, argv), cwd=ROOT, env=box.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "held":
        proc.kill()
        raise AssertionError(f"holder did not lease {uuids}: {line} {proc.stderr.read() if proc.stderr else ''}")
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


# ------------------------------------------------------------------------------------------------------ (a)
def test_two_launchers_of_one_uid_under_a_cap_of_one_get_one_gpu(box: Box) -> None:
    """200 trials of two processes of one uid racing the real reserve() under max_gpus_per_user = 1, then 200
    of two launchers' full GPU step (``plan_and_reserve``): every trial the uid holds exactly one GPU. Without
    the broker the raw race gives it two every time (the cap was only counted by the planner)."""
    trials = int(os.environ.get("LAUNCHER_BROKER_TRIALS", "200"))
    alice = box.users[0]
    box.set_cap(1)
    racers = [Proc(box, alice, ["tests/reserve_racer.py", str(box.site.leases), f"racer{k}", "1", ",".join(UUIDS)],
                   name=f"racer{k}") for k in range(2)]
    started = time.monotonic()
    granted_per_trial: list[int] = []
    refusals: dict[str, int] = {}
    try:
        for r in racers:
            assert r.line() == "ready"
        for _ in range(trials):
            for r in racers:
                r.send("go")
            answers = [r.read() for r in racers]
            got = [a for a in answers if a["uuids"]]
            granted_per_trial.append(sum(len(a["uuids"]) for a in answers))
            for a in answers:
                if a.get("error"):
                    key = "cap" if "allows 1 at once" in a["error"] else a["error"][:60]
                    refusals[key] = refusals.get(key, 0) + 1
            held = box.held()
            assert len(held) == 1 and len(got) == 1, (answers, held)
            (uuid, h), = held.items()
            winner = racers[answers.index(got[0])]
            assert (uuid, h.uid, h.user, h.pid) == (got[0]["uuids"][0], alice.uid, alice.name, winner.pid)
            assert h.run_id is not None and h.run_id.startswith(got[0]["run_id"])
            for r in racers:
                r.send("release")
            for r in racers:
                assert r.line() == "released"
            assert box.held() == {}
    finally:
        for r in racers:
            r.close()
    race_s = time.monotonic() - started
    FIGURES["reserve_race"] = {"trials": trials, "trials_with_one_gpu": granted_per_trial.count(1),
                               "refusals": refusals, "seconds": round(race_s, 1)}
    assert granted_per_trial == [1] * trials
    assert refusals.get("cap", 0) == trials  # the loser was refused for the cap, not because a GPU was busy

    # The same through each launcher's whole GPU step (tests/lease_client.py: plan_and_reserve as `launcher up`).
    clients = [Proc(box, alice, ["-m", "tests.lease_client", f"up{k}"], name=f"client{k}") for k in range(2)]
    started = time.monotonic()
    outcomes = {"gpu": 0, "cpu": 0, "exit_5": 0}
    try:
        for c in clients:
            assert c.read()["ready"]
        for _ in range(trials):
            for c in clients:
                c.send("plan workers=1 gpus=auto")
            answers = [c.read() for c in clients]
            for a in answers:
                outcomes["exit_5" if a.get("error") else a["kind"]] += 1
                assert not a.get("error") or a["code"] == 5, a
            assert sum(len(a["uuids"]) for a in answers) == 1, answers
            held = box.held()
            assert len(held) == 1 and next(iter(held.values())).uid == alice.uid, (answers, held)
            for c in clients:
                c.send("release")
                assert c.read() == {"released": True}
    finally:
        for c in clients:
            c.close()
        box.set_cap(None)
    FIGURES["plan_race"] = {"trials": trials, **outcomes, "seconds": round(time.monotonic() - started, 1)}
    print("figures:", FIGURES)
    assert outcomes["gpu"] == trials


def test_lease_request_time(box: Box) -> None:
    """What one lease + release costs through the broker (root, this process; no interpreter start)."""
    n = 200
    started = time.perf_counter()
    for i in range(n):
        got = broker_client.lease(box.site.broker, f"timing-{i}", UUIDS[:1])  # type: ignore[arg-type]
        assert got == UUIDS[:1]
        assert broker_client.release(box.site.broker, got) == got  # type: ignore[arg-type]
    per = (time.perf_counter() - started) / n
    FIGURES["lease_release_ms"] = round(per * 1000, 2)
    print("figures: lease+release", FIGURES["lease_release_ms"], "ms")
    assert per < 0.1


# ------------------------------------------------------------------------------------------------------ (b)
def test_a_user_cannot_flock_a_lease_file(box: Box) -> None:
    alice, bob = box.users
    for u in UUIDS:
        st = os.stat(box.site.lease_path(u))
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600)
    holder = _holder(box, alice, [UUIDS[0]], "alice-run")
    try:
        # bob's flock on alice's lease file and on a free one: neither can even be opened
        for u in (UUIDS[0], UUIDS[1]):
            out = subprocess.run(box.as_user(bob, ["flock", "-x", "-n", str(box.site.lease_path(u)), "true"]),
                                 capture_output=True, text=True, timeout=30)
            assert out.returncode != 0 and "Permission denied" in out.stderr, out
        held = box.held()
        assert set(held) == {UUIDS[0]}
        h = held[UUIDS[0]]
        assert (h.run_id, h.uid, h.user, h.pid) == ("alice-run", alice.uid, alice.name, holder.pid)
        # and bob can still lease the free one through the broker
        out = _script(box, bob, "from launcher.gpu.reservations import reserve\n"
                      f"print(reserve([{UUIDS[1]!r}], 'bob-run').uuids)")
        assert out.returncode == 0 and UUIDS[1] in out.stdout, out.stderr
        # what any user sees: `launcher gpus --json`, as bob, names alice's run on her GPU (the broker's note)
        out = subprocess.run(box.as_user(bob, [str(PY), "-m", "launcher", "gpus", "--json", "--no-docker"]),
                             env=box.env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        leases = {g["uuid"]: g["lease"] for g in json.loads(out.stdout)["gpus"]}
        lease = leases[UUIDS[0]]
        assert (lease["user"], lease["uid"], lease["pid"], lease["run_id"]) == (alice.name, alice.uid, holder.pid,
                                                                                "alice-run")
        assert leases[UUIDS[1]] is None
    finally:
        _kill(holder)


# ------------------------------------------------------------------------------------------------------ (c)
def test_a_lease_ends_with_its_last_tied_process(box: Box) -> None:
    alice = box.users[0]
    holder = _holder(box, alice, [UUIDS[2]], "killed-run")
    os.kill(holder.pid, signal.SIGKILL)
    freed_s = _wait_until(lambda: UUIDS[2] not in box.held(), timeout_s=5)
    _kill(holder)
    assert not list(box.site.holders.glob(f"{UUIDS[2]}@*.json"))  # the broker's note went with the lease

    keeper = subprocess.Popen(box.as_user(alice, ["sleep", "600"]))
    holder = _holder(box, alice, [UUIDS[3]], "tied-run", tie=keeper.pid)
    try:
        os.kill(holder.pid, signal.SIGKILL)
        _kill(holder)
        time.sleep(1.5)
        held = box.held()
        assert UUIDS[3] in held and (held[UUIDS[3]].pid, held[UUIDS[3]].uid) == (keeper.pid, alice.uid), held
        os.kill(keeper.pid, signal.SIGKILL)
        tied_freed_s = _wait_until(lambda: UUIDS[3] not in box.held(), timeout_s=5)
    finally:
        _kill(holder)
        keeper.kill()
        keeper.wait()
    FIGURES["freed_after_sigkill_s"] = [round(freed_s, 3), round(tied_freed_s, 3)]
    print("figures: freed after SIGKILL", FIGURES["freed_after_sigkill_s"])
    assert freed_s < 1.0 and tied_freed_s < 1.0


# ------------------------------------------------------------------------------------------------------ (d)
_CROSS = """
import json, os, sys
from pathlib import Path
from launcher.errors import LauncherError
from launcher.gpu import broker_client
sock, theirs, mine, their_pid = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except LauncherError as exc:
        out[name] = f"{type(exc).__name__}: {exc.message}"
attempt("tie_theirs", lambda: broker_client.tie(sock, [theirs], os.getpid()))
attempt("release_theirs", lambda: broker_client.release(sock, [theirs]))
attempt("lease_mine", lambda: broker_client.lease(sock, "bob-run", [mine]))
attempt("tie_mine_to_their_process", lambda: broker_client.tie(sock, [mine], their_pid))
import subprocess
child = subprocess.Popen(["sleep", "30"])
attempt("tie_mine_to_my_process", lambda: broker_client.tie(sock, [mine], child.pid))
child.kill()
print(json.dumps(out))
"""


def test_a_user_cannot_tie_or_release_another_users_lease(box: Box) -> None:
    alice, bob = box.users
    holder = _holder(box, alice, [UUIDS[0]], "alice-run")
    try:
        out = _script(box, bob, _CROSS, str(box.site.broker), UUIDS[0], UUIDS[1], str(holder.pid))
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got["tie_theirs"].startswith("BadInput: GPU") and f"leased by user {alice.name}" in got["tie_theirs"]
        assert got["release_theirs"].startswith("BadInput") and "only its user may release" in got["release_theirs"]
        assert got["lease_mine"] == "ok"
        assert got["tie_mine_to_their_process"].startswith("BadInput") and f"runs as uid {alice.uid}" in \
            got["tie_mine_to_their_process"]
        assert got["tie_mine_to_my_process"] == "ok", got
        held = box.held()
        assert (held[UUIDS[0]].uid, held[UUIDS[0]].pid) == (alice.uid, holder.pid)
        _wait_until(lambda: UUIDS[1] not in box.held(), timeout_s=2)  # bob's processes ended: so did his lease
    finally:
        _kill(holder)


# ------------------------------------------------------------------------------------------------------ (e)
def _raw(box: Box, payload: bytes, *, wait_s: float = 5.0) -> dict[str, Any]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(wait_s)
    s.connect(str(box.site.broker))
    s.sendall(payload)
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    return json.loads(data)  # type: ignore[no-any-return]


def test_bad_and_slow_requests_are_refused_and_stall_nobody(box: Box) -> None:
    assert _raw(box, b"hello\n")["error"].startswith("not JSON")
    assert "unknown op" in _raw(box, b'{"op": "steal"}\n')["error"]
    assert "uuids must be a list" in _raw(box, b'{"op": "lease", "run_id": "x", "uuids": "all"}\n')["error"]
    assert "not a GPU UUID" in _raw(box, b'{"op": "lease", "run_id": "x", "uuids": ["../../etc/passwd"]}\n')["error"]
    big = _raw(box, b"x" * 5000)
    assert big["refusal"] == "bad" and "longer than 4096 bytes" in big["error"]
    # a silent client: others are answered meanwhile; it is refused at its deadline
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(str(box.site.broker))
    silent.sendall(b'{"op": "li')
    started = time.monotonic()
    answers = []
    for _ in range(5):
        t0 = time.monotonic()
        broker_client.leases(box.site.broker)  # type: ignore[arg-type]
        answers.append(time.monotonic() - t0)
    silent.settimeout(5)
    reply = json.loads(silent.recv(4096))
    waited = time.monotonic() - started
    silent.close()
    assert reply["refusal"] == "bad" and "no complete request line within 2 s" in reply["error"]
    assert 1.5 < waited < 3.5 and max(answers) < 0.5, (waited, answers)
    # a flood of open connections from one uid: the 17th is refused at once, and the broker still serves
    flood = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(16)]
    for s in flood:
        s.connect(str(box.site.broker))
    time.sleep(0.2)
    over = _raw(box, b'{"op": "list"}\n')
    for s in flood:
        s.close()
    assert "already has 16 connections open" in over["error"]
    _wait_until(lambda: "leases" in _raw(box, b'{"op": "list"}\n'), timeout_s=5)
    FIGURES["served_while_a_client_stalls_s"] = round(max(answers), 3)


def test_a_broker_that_is_not_running_is_named(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    gone = store.admin_init(UUIDS, site_file=box.base / "etc-gone" / "site.toml", store=box.base / "store-gone",
                            policy=box.base / "etc-gone" / "policy.toml", broker=box.base / "run-gone" / "b.sock").site
    monkeypatch.setenv(store.SITE_ENV, str(gone.site_file))
    with pytest.raises(MissingDependency) as err:
        reservations.reserve(UUIDS[:1], "nobody-serves")
    assert str(gone.broker) in err.value.message and "launcher admin broker" in (err.value.hint or "")


# ------------------------------------------------------------------------------------------------------ (f)
def test_without_a_broker_todays_behaviour_and_the_plan_says_the_cap_is_not_enforced(box: Box) -> None:
    """A store without a broker: lease files users can flock (0644), and each plan says the cap is only counted.
    The same race as above then gives the uid more than its cap in some trials (the figure is printed)."""
    alice = box.users[0]
    for u in UUIDS:
        assert os.stat(box.plain.lease_path(u)).st_mode & 0o777 == 0o644
    box.set_cap(1)
    trials = int(os.environ.get("LAUNCHER_BROKER_PLAIN_TRIALS", "50"))
    clients = [Proc(box, alice, ["-m", "tests.lease_client", f"plain{k}"], site=box.plain, name=f"plain{k}")
               for k in range(2)]
    over = racing_over = 0
    try:
        for c in clients:
            assert c.read()["ready"]
        for _ in range(trials):
            for c in clients:
                c.send("plan workers=1 gpus=auto")
            answers = [c.read() for c in clients]
            for a in answers:
                assert any(r.startswith("no lease broker: the site's max_gpus_per_user = 1 is counted by each "
                                        "launcher, not enforced") for r in a["reasons"]), a
            over += sum(len(a["uuids"]) for a in answers) > 1
            for c in clients:
                c.send("release")
                assert c.read() == {"released": True}
        # the first part of the cap test, on this store: both racing reserve() calls get a GPU (the cap is
        # only the planner's count, so reserve() itself never refuses): the test above fails here
        racers = [Proc(box, alice, ["tests/reserve_racer.py", str(box.plain.leases), f"old{k}", "1", ",".join(UUIDS)],
                       site=box.plain, name=f"old{k}") for k in range(2)]
        try:
            for r in racers:
                assert r.line() == "ready"
            for _ in range(20):
                for r in racers:
                    r.send("go")
                racing_over += sum(len(r.read()["uuids"]) for r in racers) > 1
                for r in racers:
                    r.send("release")
                for r in racers:
                    assert r.line() == "released"
        finally:
            for r in racers:
                r.close()
        assert racing_over == 20
        # a user's flock works here: it holds a GPU past the launcher (what the broker prevents)
        out = subprocess.run(box.as_user(box.users[1], ["flock", "-x", "-n", str(box.plain.lease_path(UUIDS[0])),
                                                        "true"]), capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
    finally:
        for c in clients:
            c.close()
        box.set_cap(None)
    FIGURES["no_broker_over_cap"] = {"plan_trials": trials, "plan_trials_over_cap": over,
                                     "reserve_trials": 20, "reserve_trials_over_cap": racing_over}
    print("figures: without a broker", FIGURES["no_broker_over_cap"])


def test_figures(box: Box) -> None:
    print("figures:", json.dumps(FIGURES), file=sys.stderr)


# ------------------------------------------------------------------------------------------- the backends' ties
def test_the_backends_tie_the_lease_to_their_master(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process backend ties the lease to its master child; the Docker backend to the master container's pid
    (from the engine's inspect) and mounts no lease files. Each master here is a `sleep` standing in; the
    lease outlives the launcher's own release only through that tie."""
    from types import SimpleNamespace

    from launcher.backends.docker import DockerBackend
    from launcher.backends.process import ProcessBackend

    monkeypatch.setenv(store.SITE_ENV, str(box.site.site_file))
    for backend_kind, uuid in (("process", UUIDS[0]), ("docker", UUIDS[1])):
        reservation = reservations.reserve([uuid], f"{backend_kind}-run")
        assert reservation.brokered and reservation.fds == ()
        master = subprocess.Popen(["sleep", "60"])
        try:
            if backend_kind == "process":
                backend: Any = ProcessBackend()
                backend.run = SimpleNamespace(reservation=reservation)
                backend.master = SimpleNamespace(proc=master)
                backend._tie_leases()
            else:
                engine = SimpleNamespace(inspect=lambda cid: SimpleNamespace(pid=master.pid, exit_code=None))
                backend = DockerBackend(engine=engine)  # type: ignore[arg-type]
                backend._tie_to_master(reservation, "c" * 64)
            (lease,) = [x for x in broker_client.leases(box.site.broker) if x["uuid"] == uuid]  # type: ignore[arg-type]
            assert lease["pids"] == [os.getpid(), master.pid]
            assert box.held()[uuid].pid == master.pid  # `launcher gpus` names the master
        finally:
            master.kill()
            master.wait()

        def pids() -> list[list[int]]:
            return [x["pids"] for x in broker_client.leases(box.site.broker)  # type: ignore[arg-type]
                    if x["uuid"] == uuid]

        _wait_until(lambda: pids() == [[os.getpid()]], timeout_s=2)  # the master's tie went with it
        reservation.release()
        if backend_kind == "docker":  # handed to the master: a detached launcher's exit must not release it
            assert pids() == [[os.getpid()]]
            broker_client.release(box.site.broker, [uuid])  # type: ignore[arg-type]
        assert uuid not in box.held()


def test_the_broker_refuses_to_start_over_lease_files_users_can_open(box: Box) -> None:
    loose = store.admin_init(UUIDS, site_file=box.base / "etc-loose" / "site.toml", store=box.base / "store-loose",
                             policy=box.base / "etc-loose" / "policy.toml",
                             broker=box.base / "run-loose" / "b.sock").site
    os.chmod(loose.lease_path(UUIDS[2]), 0o644)  # as an older `admin init` without --broker made them
    out = subprocess.run([str(PY), "-m", "launcher", "admin", "broker", "--site", str(loose.site_file)], cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "can be opened by users" in out.stderr and "--broker" in out.stderr, out
    assert not loose.broker.exists()  # type: ignore[union-attr]
