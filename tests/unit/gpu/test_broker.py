"""The GPU lease broker (issue 25, item 3): the site cap enforced in one step, leases users cannot flock.

Real processes, sockets and flocks; only the GPUs are the stand-in NVML's. The test process (root, as CI
runs) makes a lease store with a broker (``admin_init(..., broker=...)``) in a temporary directory found through
``$LAUNCHER_SITE``, starts ``launcher admin broker --site`` as a child, makes two Unix users and runs their
launchers with ``setpriv`` (tests/broker_fixtures.py). The truth is read from the kernel (``/proc/locks``) and
from the broker itself. The backends' ties and whole runs are tests/unit/gpu/test_broker_runs.py; the rules
without sockets, tests/unit/gpu/test_broker_rules.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from launcher.errors import MissingDependency
from launcher.gpu import broker_client, reservations, store
from tests.broker_fixtures import (PY, ROOT, UUIDS, Box, Proc, hold, kill, script, skip_reason,
                                   wait_until)

FIGURES: dict[str, Any] = {}

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))


@pytest.fixture(scope="module")
def box(broker_box: Box) -> Box:
    return broker_box


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
    holder = hold(box, alice, [UUIDS[0]], "alice-run")
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
        out = script(box, bob, "from launcher.gpu.reservations import reserve\n"
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
        kill(holder)


# ------------------------------------------------------------------------------------------------------ (c)
def test_a_lease_ends_with_its_last_tied_process(box: Box) -> None:
    alice = box.users[0]
    holder = hold(box, alice, [UUIDS[2]], "killed-run")
    os.kill(holder.pid, signal.SIGKILL)
    freed_s = wait_until(lambda: UUIDS[2] not in box.held(), timeout_s=5)
    kill(holder)
    assert not list(box.site.holders.glob(f"{UUIDS[2]}@*.json"))  # the broker's note went with the lease

    keeper = subprocess.Popen(box.as_user(alice, ["sleep", "600"]))
    holder = hold(box, alice, [UUIDS[3]], "tied-run", tie=keeper.pid)
    try:
        os.kill(holder.pid, signal.SIGKILL)
        kill(holder)
        time.sleep(1.5)
        held = box.held()
        assert UUIDS[3] in held and (held[UUIDS[3]].pid, held[UUIDS[3]].uid) == (keeper.pid, alice.uid), held
        os.kill(keeper.pid, signal.SIGKILL)
        tied_freed_s = wait_until(lambda: UUIDS[3] not in box.held(), timeout_s=5)
    finally:
        kill(holder)
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
    holder = hold(box, alice, [UUIDS[0]], "alice-run")
    try:
        out = script(box, bob, _CROSS, str(box.site.broker), UUIDS[0], UUIDS[1], str(holder.pid))
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
        wait_until(lambda: UUIDS[1] not in box.held(), timeout_s=2)  # bob's processes ended: so did his lease
    finally:
        kill(holder)


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
    wait_until(lambda: "leases" in _raw(box, b'{"op": "list"}\n'), timeout_s=5)
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
