"""GPU reservations: flock lock files, their holders, crashes, a two-process race, and container labels."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest

from launcher.gpu import holders, reservations
from launcher.errors import BadInput, NoResources
from launcher.gpu.leaseholders import list_holders
from launcher.gpu.reservations import reserve

REPO = Path(__file__).resolve().parents[3]
UUIDS = [f"GPU-{i:08x}-1111-2222-3333-{i:012x}" for i in range(4)]


def test_reserve_records_the_holder_and_releases(tmp_path: Path) -> None:
    with reserve(UUIDS[:2], "run-a", tmp_path) as res:
        assert res.uuids == tuple(UUIDS[:2])
        holders = list_holders(tmp_path)
        assert [h.uuid for h in holders] == UUIDS[:2]
        h = holders[0]
        assert (h.run_id, h.pid, h.host) == ("run-a", os.getpid(), os.uname().nodename)
        assert h.user and h.since and abs(h.since - time.time()) < 60
        assert h.describe() == f"launcher run run-a (pid {os.getpid()}, user {h.user})"
        record = json.loads((tmp_path / f"{UUIDS[0]}.lock").read_text())
        assert record["schema"] == "launcher.lock/v1" and record["uuid"] == UUIDS[0]
    assert list_holders(tmp_path) == []
    assert (tmp_path / f"{UUIDS[0]}.lock").read_text() == ""  # kept (never unlinked), cleared
    res.release()  # idempotent


def test_all_or_nothing(tmp_path: Path) -> None:
    with reserve([UUIDS[1]], "run-a", tmp_path):
        with pytest.raises(NoResources) as exc:
            reserve(UUIDS[:2], "run-b", tmp_path)
        assert f"{UUIDS[1]} held by launcher run run-a (pid {os.getpid()}" in exc.value.message
        assert [h.uuid for h in list_holders(tmp_path)] == [UUIDS[1]]  # run-b kept nothing


def test_count_takes_the_first_free_in_order(tmp_path: Path) -> None:
    with reserve([UUIDS[0]], "run-a", tmp_path):
        with reserve(UUIDS, "run-b", tmp_path, count=2) as res:
            assert res.uuids == (UUIDS[1], UUIDS[2])
            with pytest.raises(NoResources, match="could not reserve 2 GPU"):
                reserve(UUIDS, "run-c", tmp_path, count=2)


def test_a_crashed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    code = (
        "import sys; from launcher.gpu.reservations import reserve; "
        f"r = reserve([{UUIDS[0]!r}], 'crashes', {str(tmp_path)!r}); print('held', flush=True); "
        "import time; time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert [h.run_id for h in list_holders(tmp_path)] == ["crashes"]
        with pytest.raises(NoResources):
            reserve([UUIDS[0]], "waits", tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert "crashes" in (tmp_path / f"{UUIDS[0]}.lock").read_text()  # the text stays, the lock does not
    assert list_holders(tmp_path) == []
    with reserve([UUIDS[0]], "next", tmp_path) as res:
        assert res.uuids == (UUIDS[0],)


def test_a_listing_probe_does_not_make_a_gpu_busy(tmp_path: Path) -> None:
    path = tmp_path / f"{UUIDS[0]}.lock"
    path.touch()
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # what list_holders holds for a moment
    threading.Timer(0.01, lambda: os.close(fd)).start()
    with reserve([UUIDS[0]], "run-a", tmp_path) as res:
        assert res.uuids == (UUIDS[0],)


def test_lock_dir_is_shared_and_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock_dir = tmp_path / "new" / "locks"
    monkeypatch.setenv("LAUNCHER_LOCK_DIR", str(lock_dir))
    assert reservations.default_lock_dir() == lock_dir
    with reserve([UUIDS[0]], "run-a"):
        assert stat.S_IMODE(lock_dir.stat().st_mode) == 0o1777
        assert stat.S_IMODE((lock_dir / f"{UUIDS[0]}.lock").stat().st_mode) == 0o666
        assert [h.run_id for h in list_holders()] == ["run-a"]
    monkeypatch.delenv("LAUNCHER_LOCK_DIR")
    assert reservations.default_lock_dir() == Path("/tmp/launcher-locks")


def test_refuses_symlinks_and_odd_names(tmp_path: Path) -> None:
    (tmp_path / f"{UUIDS[0]}.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BadInput, match="symlink"):
        reserve([UUIDS[0]], "run-a", tmp_path)
    with pytest.raises(BadInput, match="not a GPU UUID"):
        reserve(["../../etc/passwd"], "run-a", tmp_path)


def _racer(lock_dir: Path, run_id: str, count: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "reserve_racer.py"), str(lock_dir), run_id, str(count), ",".join(UUIDS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def _out(p: subprocess.Popen[str]) -> IO[str]:
    assert p.stdout is not None
    return p.stdout


def _in(p: subprocess.Popen[str]) -> IO[str]:
    assert p.stdin is not None
    return p.stdin


def test_two_launchers_reserving_at_the_same_moment_never_overlap(tmp_path: Path) -> None:
    """100 rounds of two processes taking 2 of 4 simulated GPUs at once; both hold until both have answered."""
    started = time.monotonic()
    a, b = _racer(tmp_path, "a", 2), _racer(tmp_path, "b", 2)
    try:
        for p in (a, b):
            assert _out(p).readline().strip() == "ready"
        for round_no in range(100):
            for p in (a, b):  # the start signal, back to back
                _in(p).write("go\n")
                _in(p).flush()
            got = [json.loads(_out(p).readline()) for p in (a, b)]
            ua, ub = set(got[0]["uuids"]), set(got[1]["uuids"])
            assert len(ua) == 2 and len(ub) == 2, got
            assert not ua & ub, f"round {round_no}: both runs got {ua & ub}"
            for p in (a, b):
                _in(p).write("release\n")
                _in(p).flush()
            assert [_out(p).readline().strip() for p in (a, b)] == ["released", "released"]
    finally:
        for p in (a, b):
            _in(p).close()
        for p in (a, b):
            p.wait(timeout=30)
    assert list_holders(tmp_path) == []
    assert time.monotonic() - started < 60


def test_container_holders_without_an_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    containers, reason = holders.container_holders()
    assert containers == [] and reason is not None and reason.startswith("Docker engine not reachable")


def _docker_client() -> Any:
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no Docker engine: {exc}")
    return client


@pytest.mark.docker
def test_container_holders_reads_launcher_labels(pause_image: str) -> None:
    client = _docker_client()
    labels = {"launcher.run": "r-docker-test", "launcher.role": "group", "launcher.group": "1",
              "launcher.gpus": f"{UUIDS[2]},{UUIDS[3]}"}
    container = client.containers.run(pause_image, ["/pause"], detach=True, labels=labels, name=f"launcher-test-{os.getpid()}")
    try:
        found, reason = holders.container_holders()  # through the engine layer
        assert reason is None
        mine = [c for c in found if c.container_id == container.id]
        assert len(mine) == 1
        c = mine[0]
        assert (c.run_id, c.role, c.group, c.gpu_uuids) == ("r-docker-test", "group", "1", (UUIDS[2], UUIDS[3]))
        assert c.describe() == f"launcher run r-docker-test (container {container.name}, group 1)"
        container.reload()
        pid = container.attrs["State"]["Pid"]
        if pid and os.path.exists(f"/proc/{pid}"):
            assert holders.container_id_of_pid(pid) == container.id
    finally:
        container.remove(force=True)


def test_a_lease_passed_to_the_master_child_outlives_a_killed_launcher(tmp_path: Path) -> None:
    """What the process backend does (Reservation.fds in pass_fds): the kernel keeps the flock while any
    holder of the descriptor lives, so the master can checkpoint on a lease after the launcher is gone."""
    code = (
        "import subprocess, sys; from launcher.gpu.reservations import reserve; "
        f"r = reserve([{UUIDS[0]!r}], 'run-m', {str(tmp_path)!r}); "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], pass_fds=r.fds); "
        "print(c.pid, flush=True); import time; time.sleep(60)"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert launcher.stdout is not None
    master_pid = int(launcher.stdout.readline())
    try:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        with pytest.raises(NoResources):  # still leased: the master child holds the descriptor
            reserve([UUIDS[0]], "next", tmp_path)
    finally:
        os.kill(master_pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while True:
        try:
            with reserve([UUIDS[0]], "next", tmp_path):
                break
        except NoResources:
            assert time.monotonic() < deadline, "the lease outlived the master"
            time.sleep(0.02)


def test_a_fifo_planted_as_a_single_user_lock_file_is_refused_not_waited_on(tmp_path: Path) -> None:
    """Single-user mode's lock directory is 1777: a FIFO under a GPU's lock name gets one clear message (exit 2),
    not a blocked open or a traceback from writing the record into it (issue 25, finding 2)."""
    os.mkfifo(tmp_path / "GPU-fifo.lock")
    with pytest.raises(BadInput, match="GPU-fifo.lock is not a regular file"):
        reserve(["GPU-fifo"], "r", tmp_path)
