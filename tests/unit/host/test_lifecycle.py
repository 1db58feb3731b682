"""`launcher status`, `logs` and `down` on process-backend runs (no Docker needed; the Docker side is in
tests/docker/test_docker_backend.py). Runs are real directories with real processes standing in for the master
and groups: a process whose command line names the run, as the process backend's children do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher import backends, lifecycle
from launcher.backends.docker import DockerBackend
from launcher.backends.docker_run import DockerRun
from launcher.engine.client import Container
from tests.engine_snapshots import SnapshotEngine, snap
from launcher.procs import identity, pid_is_ours
from launcher.cli.main import main
from launcher.runs import RunDir, create_run_dir
from worker.results import atomic_write_json


def make_run(root: Path, run_id: str, **record: object) -> RunDir:
    rd = create_run_dir(root, run_id)
    (rd.path / "spec.json").write_text("{}")
    rd.update_record(run_id=run_id, **record)
    return rd


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def sleeper(procs: list[subprocess.Popen[bytes]], marker: str, *, ignore_term: bool = False) -> int:
    """A process in its own process group whose command line contains ``marker`` (like the process
    backend's ``python -m worker master --spec <results>/<run>/spec.json``)."""
    code = "import signal, time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "") + \
        "time.sleep(120)"
    p = subprocess.Popen([sys.executable, "-c", code, marker], process_group=0)
    procs.append(p)
    deadline = time.monotonic() + 10
    while marker.encode() not in Path(f"/proc/{p.pid}/cmdline").read_bytes():  # until it has exec'd
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return p.pid


def test_pid_must_be_alive_and_name_the_run(sleepers: list[subprocess.Popen[bytes]]) -> None:
    pid = sleeper(sleepers, "results/run-abc/spec.json")
    assert pid_is_ours(pid, "run-abc")
    assert not pid_is_ours(pid, "run-other"), "a recycled pid running something else is not ours"
    sleepers[0].kill()
    sleepers[0].wait()
    assert not pid_is_ours(pid, "run-abc")
    assert not pid_is_ours(0, "") and not pid_is_ours(-1, "")


def test_status_of_a_live_process_run_then_down(tmp_path: Path, sleepers: list[subprocess.Popen[bytes]],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    rid = "cartpole-ppo-live-0001"
    master = sleeper(sleepers, f"{rid}/spec.json master")
    group = sleeper(sleepers, f"{rid}/spec.json group", ignore_term=True)  # needs SIGKILL
    rd = make_run(tmp_path, rid, backend="process", state="running", pids={"master": master, "group-0": group},
                  starts={"master": identity(master)["start"], "group-0": identity(group)["start"]})
    atomic_write_json(rd.files.status, {"env_steps": 1234, "env_steps_per_s": 456.0, "updates": 7, "mean_return": 21.5,
                                        "groups": {"0": {"workers": 4, "connected": True}}})
    assert main(["status", rid, "--results", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["state"] == "running" and doc["live"] and doc["env_steps_per_s"] == 456.0
    assert doc["mean_return"] == 21.5 and doc["workers_connected"] == 4
    assert {p["name"]: (p["state"], p["status"]) for p in doc["parts"]} == {"master": ("running", "alive"),
                                                                              "group-0": ("running", "alive")}

    assert main(["status", "--results", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert rid in table and "456 env steps/s" in table and "return 21.50" in table

    t0 = time.monotonic()
    assert main(["down", rid, "--results", str(tmp_path), "--grace", "2"]) == 0
    assert f"stopped pid(s) {', '.join(map(str, sorted([master, group])))}" in capsys.readouterr().out
    assert time.monotonic() - t0 < 10
    for p in sleepers:
        p.wait(timeout=5)
    assert rd.read_record()["state"] == "interrupted"
    assert rd.path.is_dir() and rd.files.status.exists(), "down keeps the results"
    assert main(["down", rid, "--results", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["pids"] == []


def test_a_run_whose_processes_vanished_is_stale(tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]) -> None:
    rid = "cartpole-ppo-dead-0002"
    pid = sleeper(sleepers, rid)
    sleepers[0].kill()
    sleepers[0].wait()
    rd = make_run(tmp_path, rid, backend="process", state="running", pids={"master": pid})
    (view,) = lifecycle.view_runs(tmp_path, run=rid)
    assert view.state == "stale" and "nothing of it is running" in view.note
    finished = make_run(tmp_path, "cartpole-ppo-done-0003", backend="process", state="finished", pids={"master": pid})
    assert lifecycle.view_run(backends.find(finished.run_id, finished, finished.read_record())).state == "finished"
    assert rd.run_id in {v.run_id for v in lifecycle.view_runs(tmp_path)}


def test_logs_from_the_kept_files(tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    rid = "cartpole-ppo-logs-0004"
    rd = make_run(tmp_path, rid, backend="process", state="finished", pids={})
    (rd.files.logs / "master.log").write_bytes(b"master line\n")
    (rd.files.logs / "group-0.log").write_bytes(b"group zero\n")
    (rd.files.logs / "group-1.log").write_bytes(b"group one")
    assert main(["logs", rid, "--results", str(tmp_path), "--group", "1"]) == 0
    assert capsysbinary.readouterr().out == b"group one\n"
    assert main(["logs", rid, "--results", str(tmp_path)]) == 0
    out = capsysbinary.readouterr().out
    assert out.index(b"==> master <==") < out.index(b"==> group-0 <==") < out.index(b"==> group-1 <==")
    assert main(["logs", rid, "--results", str(tmp_path), "--group", "7"]) == 2
    assert b"group-7" in capsysbinary.readouterr().err
    # --follow on a run with nothing alive prints what is there and returns.
    assert main(["logs", rid, "--results", str(tmp_path), "--follow"]) == 0
    assert capsysbinary.readouterr().out == b"master line\n"


def test_a_part_that_ended_while_the_run_goes_on_is_read_from_its_kept_log(
        tmp_path: Path, sleepers: list[subprocess.Popen[bytes]], capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    """The backend lists only the master (as Slurm does once a group's step has finished while the master still
    writes its model); the group's kept log is still there to read and follow."""
    rid = "cartpole-ppo-ended-0006"
    pid = sleeper(sleepers, rid)
    rd = make_run(tmp_path, rid, backend="process", state="running", pids={"master": pid})
    (rd.files.logs / "master.log").write_bytes(b"master line\n")
    (rd.files.logs / "group-1.log").write_bytes(b"group one\n")
    (found,) = [p.name for p in backends.find(rid, rd, rd.read_record()).parts()]
    assert found == "master"  # what the backend lists: the master alone
    assert main(["logs", rid, "--results", str(tmp_path), "--group", "1"]) == 0
    assert capsysbinary.readouterr().out == b"group one\n"
    assert next(lifecycle.follow_logs(tmp_path, rid, "group-1", poll_s=0.05)) == b"group one\n"
    assert main(["logs", rid, "--results", str(tmp_path), "--group", "7"]) == 2
    assert b"has no group-7 (it has: master, group-1)" in capsysbinary.readouterr().err


def test_follow_stops_when_the_run_stops(tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]) -> None:
    rid = "cartpole-ppo-follow-0005"
    pid = sleeper(sleepers, rid)
    rd = make_run(tmp_path, rid, backend="process", state="running", pids={"master": pid})
    log = rd.files.logs / "master.log"
    log.write_bytes(b"one\n")
    chunks = lifecycle.follow_logs(tmp_path, rid, None, poll_s=0.05)
    assert next(chunks) == b"one\n"
    with open(log, "ab") as fh:
        fh.write(b"two\n")
    assert next(chunks) == b"two\n"
    sleepers[0].kill()
    sleepers[0].wait()
    assert list(chunks) == []


def test_bad_usage_and_unknown_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["down", "--results", str(tmp_path)]) == 2
    assert "give a RUN or --all" in capsys.readouterr().err
    assert main(["status", "no-such-run", "--results", str(tmp_path)]) == 2
    assert main(["logs", "no-such-run", "--results", str(tmp_path)]) == 2
    assert "no run 'no-such-run'" in capsys.readouterr().err


def test_down_refuses_a_pid_that_is_not_the_runs(tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]) -> None:
    """run.json may name a pid the kernel has since given to something else: that process is left alone."""
    other = sleeper(sleepers, "something-else-entirely")
    make_run(tmp_path, "cartpole-ppo-reuse-0006", backend="process", state="running", pids={"master": other},
             launcher_pid=other)
    report = lifecycle.down_run(tmp_path, "cartpole-ppo-reuse-0006", grace_s=1)
    assert report.pids == [] and not report.launcher_signalled
    assert sleepers[0].poll() is None and os.path.exists(f"/proc/{other}")


def _found(rd: RunDir, engine: SnapshotEngine) -> DockerRun:
    return DockerRun(rd.run_id, rd, rd.read_record(), engine=engine)  # type: ignore[arg-type]


def test_a_detached_run_whose_master_died_is_failed_not_running(tmp_path: Path) -> None:
    rd = make_run(tmp_path, "cartpole-ppo-dock-0007", backend="docker", state="running", detached=True)
    engine = SnapshotEngine([snap("master", "exited", 137), snap("group", "restarting", None, "0")])
    view = lifecycle.view_run(_found(rd, engine))
    assert view.state == "failed" and "launcher up --resume cartpole-ppo-dock-0007" in view.note
    assert [p.name for p in view.parts] == ["master", "group-0"]
    engine.snaps = [snap("master", "exited", 0), snap("group", "exited", 0, "0")]
    atomic_write_json(rd.files.summary, {"outcome": "max_steps"})
    ended = lifecycle.view_run(_found(rd, engine))  # `launcher runs` says the same (test_run_states.py)
    assert ended.state == "finished" and ended.outcome == "max_steps" and "launcher down" in ended.note
    engine.snaps = [snap("master", "running", None), snap("group", "running", None, "0")]
    assert lifecycle.view_run(_found(rd, engine)).state == "running"


def test_down_of_a_docker_run_never_goes_through_the_swarm_teardown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On an engine that is also a swarm manager, the swarm teardown would wait for a Docker run's containers
    (no service's tasks) and remove their network under them: the run's record names its backend, and only
    that backend's down runs."""
    import launcher.backends.docker_run as docker_run
    import launcher.backends.swarm_run as swarm_run

    rd = make_run(tmp_path, "cartpole-ppo-dock-0008", backend="docker", state="running", detached=True)
    engine = SnapshotEngine([snap("master", "running", None)])
    monkeypatch.setattr(DockerBackend, "find", classmethod(lambda cls, rid, run_dir, rec: _found(rd, engine)))
    monkeypatch.setattr(swarm_run, "teardown", lambda *a, **k: pytest.fail("swarm teardown for a docker run"))
    monkeypatch.setattr(swarm_run.SwarmRun, "parts", lambda self: pytest.fail("no need to ask the swarm"))
    removed: list[str] = []

    def teardown(eng: object, rid: str, **kwargs: object) -> list[Container]:
        removed.append(rid)
        return engine.snaps

    monkeypatch.setattr(docker_run, "teardown", teardown)
    report = lifecycle.down_run(tmp_path, rd.run_id, grace_s=1)
    assert removed == [rd.run_id] and report.containers == ["c-master"] and report.services == []
    assert rd.read_record()["state"] == "interrupted"
