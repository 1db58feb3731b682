"""The lease broker with the backends and whole runs: each backend ties the lease to its master; a real
``launcher up`` as another user holds its GPU through the broker, tied to its master child, under the site cap;
a broker refuses to start over lease files users can open. The test bed is tests/broker_fixtures.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from launcher.gpu import broker_client, reservations, store
from tests.broker_fixtures import PY, ROOT, UUIDS, Box, skip_reason, wait_until

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))


@pytest.fixture(scope="module")
def box(broker_box: Box) -> Box:
    return broker_box


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

        wait_until(lambda: pids() == [[os.getpid()]], timeout_s=2)  # the master's tie went with it
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


# ------------------------------------------------------------------------------------------- a real run
def _ppid(pid: int) -> int | None:
    try:
        for line in open(f"/proc/{pid}/status", encoding="utf-8"):
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def test_a_real_launcher_up_holds_its_gpu_through_the_broker_tied_to_its_master(box: Box) -> None:
    """`launcher up --backend process --gpus auto` as another user, through the real CLI, under a cap of 1: the
    broker's lease is that user's, tied to the launcher and to its master child; a second `up --gpus auto` by the
    same user meanwhile does not get a GPU; when the run ends, so does the lease."""
    alice = box.users[0]
    home, results = box.base / "home-alice", box.base / "results-alice"
    for d in (home, results):
        d.mkdir()
        os.chown(d, alice.uid, alice.gid)
    env = box.env(HOME=str(home), TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0", PYTHONUNBUFFERED="1")
    up = [str(PY), "-m", "launcher", "up", "--backend", "process", "--gpus", "auto", "--env", "CartPole-v1",
          "--workers", "2", "--results", str(results), "--progress", "off", "--seed", "1"]
    box.set_cap(1)
    err = open(box.base / "up-first.err", "w")
    first = subprocess.Popen(box.as_user(alice, [*up, "--max-steps", "20000"]), cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=err, text=True)

    def alices() -> list[dict[str, Any]]:
        return [x for x in broker_client.leases(box.site.broker) if x["uid"] == alice.uid]  # type: ignore[arg-type]

    try:
        wait_until(lambda: first.poll() is not None or (alices() and len(alices()[0]["pids"]) >= 2), timeout_s=120,
                   poll_s=0.2)
        assert first.poll() is None, (first.returncode, (box.base / "up-first.err").read_text()[-3000:])
        (lease,) = alices()
        launcher_pid, master_pid = lease["pids"]
        assert launcher_pid == first.pid and _ppid(master_pid) == first.pid, lease
        assert lease["user"] == alice.name and lease["uuid"] in UUIDS
        # what alice sees: `launcher gpus --json` names her run and its master on that GPU
        shown = subprocess.run(box.as_user(alice, [str(PY), "-m", "launcher", "gpus", "--json", "--no-docker"]),
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        held = {g["uuid"]: g["lease"] for g in json.loads(shown.stdout)["gpus"]}[lease["uuid"]]
        assert (held["user"], held["uid"], held["pid"], held["run_id"]) == (alice.name, alice.uid, master_pid,
                                                                            lease["run_id"]), held
        # the same user's second run at the same time: the cap leaves it no GPU, so `auto` plans it on CPU (exit 0)
        # and its plan says why; it is not leased anything
        second = subprocess.run(box.as_user(alice, [*up, "--max-steps", "1000"]), cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=120)
        assert first.poll() is None, "the first run ended before the second was planned: make it longer"
        assert second.returncode == 0, (second.returncode, second.stderr[-3000:])
        (plan_file,) = [p for p in results.glob("*/plan.json") if lease["run_id"] not in str(p)]
        plan = json.loads(plan_file.read_text())
        assert plan["kind"] == "cpu", plan
        assert any(f"allows user {alice.name} 1 GPU(s) at once (1 held by your other runs)" in r
                   for r in plan["reasons"]), plan["reasons"]
        assert [x["pids"] for x in alices()] == [[launcher_pid, master_pid]]
        assert first.wait(timeout=300) == 0, (box.base / "up-first.err").read_text()[-3000:]
        freed_s = wait_until(lambda: not alices(), timeout_s=2)
    finally:
        if first.poll() is None:
            first.terminate()
            first.wait(timeout=60)
        err.close()
        box.set_cap(None)
    assert lease["uuid"] not in box.held()
    print("figures: lease gone", round(freed_s, 3), "s after the run's end")
