"""Issue 14, host side, without a Docker engine: items 5 (process backend), 6, 7 and 10, with real processes,
real pipes, real ``flock``\\ s and the real CLI. Each test names what it would catch at commit c1dca51.

Some need root (a process of another uid; ``setpriv``-free: ``Popen(user=...)``) and skip without it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher import lifecycle
from launcher.backends.process import ProcessBackend, _Child, _Reaper
from launcher.errors import BadInput
from launcher.procs import identity
from launcher.runs import RunDir, claim_live, create_run_dir
from tests.helpers import ROOT, child_env, run_launcher, wait_for
from worker.reporting import aside

OTHER_UID = 4917  # nothing else on the test machines uses it (docs/reliability.md)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a process of another uid")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
        p.wait()


def sleeper(started: list[subprocess.Popen[bytes]], marker: str, *, user: int | None = None,
            ignore_term: bool = False, leader: bool = True) -> int:
    """A sleeping interpreter whose command line holds ``marker``; its own process group unless not ``leader``."""
    code = ("import signal, time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
            + "time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code, marker], process_group=0 if leader else None, user=user)
    started.append(p)
    wait_for(lambda: marker.encode() in Path(f"/proc/{p.pid}/cmdline").read_bytes(), 10, "the sleeper's exec")
    return p.pid


def process_run(root: Path, run_id: str, **record: object) -> RunDir:
    rd = create_run_dir(root, run_id)
    (rd.path / "spec.json").write_text("{}")
    rd.update_record(run_id=run_id, backend="process", state="running", **record)
    return rd


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------------ item 7: down checks ownership, not names
def test_down_signals_a_genuine_child(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """The positive case: the pid, its start time, the directory's owner and the process group all match."""
    rid = "cartpole-ppo-genuine-0001"
    pid = sleeper(procs, f"{tmp_path}/{rid}/spec.json")
    process_run(tmp_path, rid, pids={"master": pid}, starts={"master": identity(pid)["start"]})
    report = lifecycle.down_run(tmp_path, rid, grace_s=1)
    assert report.pids == [pid]
    wait_for(lambda: not alive(pid), 10, "the run's master to end")


@needs_root
def test_root_down_leaves_another_users_process_group_alone(tmp_path: Path,
                                                            procs: list[subprocess.Popen[bytes]]) -> None:
    """c1dca51: the pid only had to name the run in its command line, so a forged run.json in a directory root
    trusts made root killpg() any user's process group."""
    rid = "cartpole-ppo-forged-0002"
    victim = sleeper(procs, f"{tmp_path}/{rid}/spec.json", user=OTHER_UID)
    process_run(tmp_path, rid, pids={"master": victim}, starts={"master": identity(victim)["start"]})
    report = lifecycle.down_run(tmp_path, rid, grace_s=1)
    assert report.pids == [] and alive(victim)
    # Nor does the run count as live for `down --all` (asked of the process backend only: down_all itself
    # would also stop every Docker run on the shared engine).
    assert rid not in ProcessBackend.live_run_ids(tmp_path, user=None) and alive(victim)


def test_a_record_without_start_times_signals_nothing(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """Issue 25 finding 5: with ``starts`` gone from the record, `down` signalled any process group of the
    directory's owner whose command line held the run id (a ``tensorboard --logdir results/RUN`` was killed).
    Now a pid without its start time is not signalled, nor shown alive, nor counted live by `down --all`."""
    rid = "cartpole-ppo-nostarts-0008"
    pid = sleeper(procs, f"tensorboard --logdir {tmp_path}/{rid}")
    process_run(tmp_path, rid, pids={"master": pid}, launcher_pid=pid)
    report = lifecycle.down_run(tmp_path, rid, grace_s=1)
    assert report.pids == [] and not report.launcher_signalled and alive(pid)
    assert rid not in ProcessBackend.live_run_ids(tmp_path, user=None)


def test_down_leaves_a_recycled_pid_alone(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """Same uid, same marker, but not the process the record saw start (a recycled pid)."""
    rid = "cartpole-ppo-recycled-0003"
    pid = sleeper(procs, f"{tmp_path}/{rid}/spec.json")
    process_run(tmp_path, rid, pids={"master": pid}, starts={"master": identity(pid)["start"] - 7})
    assert lifecycle.down_run(tmp_path, rid, grace_s=1).pids == [] and alive(pid)


def test_down_distrusts_a_world_writable_run_directory(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """c1dca51: any user who can write the run directory can write run.json's pids."""
    rid = "cartpole-ppo-shared-0004"
    pid = sleeper(procs, f"{tmp_path}/{rid}/spec.json")
    rd = process_run(tmp_path, rid, pids={"master": pid}, starts={"master": identity(pid)["start"]})
    rd.path.chmod(0o777)
    assert lifecycle.down_run(tmp_path, rid, grace_s=1).pids == [] and alive(pid)


def test_down_leaves_a_process_that_does_not_lead_its_group(tmp_path: Path,
                                                            procs: list[subprocess.Popen[bytes]]) -> None:
    rid = "cartpole-ppo-member-0005"
    pid = sleeper(procs, f"{tmp_path}/{rid}/spec.json", leader=False)
    process_run(tmp_path, rid, pids={"master": pid}, starts={"master": identity(pid)["start"]})
    assert lifecycle.down_run(tmp_path, rid, grace_s=1).pids == [] and alive(pid)


@needs_root
def test_root_down_does_not_signal_a_forged_launcher_pid(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """c1dca51: any process with "launcher" in its command line passed as the run's launcher."""
    rid = "cartpole-ppo-launcher-0006"
    victim = sleeper(procs, "not-a-launcher-but-says-launcher", user=OTHER_UID)
    process_run(tmp_path, rid, pids={}, launcher_pid=victim, launcher_start=identity(victim)["start"] + 1)
    report = lifecycle.down_run(tmp_path, rid, grace_s=1)
    assert not report.launcher_signalled and alive(victim)


def test_down_signals_the_launcher_that_holds_the_runs_lease(tmp_path: Path) -> None:
    """The run's launcher is the process holding the lease on the run directory; it gets the SIGTERM."""
    rid = "cartpole-ppo-launcher-0007"
    rd = process_run(tmp_path, rid, pids={})
    code = (f"import sys, time; from pathlib import Path; from launcher.runs import RunDir, claim_live; "
            f"claim_live(RunDir({rid!r}, Path({str(rd.path)!r}))); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, "launcher"], cwd=ROOT, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        rd.update_record(launcher_pid=holder.pid, launcher_start=identity(holder.pid)["start"])
        report = lifecycle.down_run(tmp_path, rid, grace_s=1)
        assert report.launcher_signalled
        assert holder.wait(timeout=10) == -signal.SIGTERM
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_down_does_not_signal_a_launcher_pid_without_the_lease(tmp_path: Path,
                                                               procs: list[subprocess.Popen[bytes]]) -> None:
    """Same uid, right start time, "launcher" in its command line, but it does not hold the run's lease."""
    rid = "cartpole-ppo-launcher-0008"
    pid = sleeper(procs, "launcher up --something")
    process_run(tmp_path, rid, pids={}, launcher_pid=pid, launcher_start=identity(pid)["start"])
    assert not lifecycle.down_run(tmp_path, rid, grace_s=1).launcher_signalled and alive(pid)


# ------------------------------------------------------------------ item 6: the liveness lease
def _hold_live(run: Path) -> subprocess.Popen[bytes]:
    """A real holder of the lease, as the master takes it (worker.contract.hold_live), in another process."""
    code = (f"import sys, time; from worker.contract import hold_live; assert hold_live({str(run)!r}) is not None; "
            "print('held', flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"held\n"
    return p


def test_resume_of_a_live_run_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    """c1dca51: `up --resume` of a live run started a second master beside the first and overwrote run.json's
    pids. Now: exit 2 naming the lease, run.json byte for byte as it was, no process started."""
    rid = "cartpole-ppo-20261122-000000-live"
    rd = process_run(tmp_path, rid, pids={"master": 424242, "group-0": 424243}, starts={"master": 1, "group-0": 2})
    cfg = {"schema": "launcher.config/v1", "env_id": "CartPole-v1", "algo": "ppo", "workers": 2, "gpus": "none",
           "backend": "process", "max_steps": 1000}
    rd.config.write_text(json.dumps(cfg))  # the launcher's record of the run
    before = rd.record.read_bytes()
    listing = sorted(p.name for p in rd.path.iterdir())
    holder = _hold_live(rd.path)
    try:
        out = run_launcher("up", "--resume", rid, "--results", str(tmp_path), "--backend", "process", "--gpus", "none",
                           timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 2, out.stderr[-2000:]
    assert "still live" in out.stderr and "liveness lease" in out.stderr, out.stderr[-2000:]
    assert rd.record.read_bytes() == before, "a refused resume rewrote run.json"
    assert sorted(p.name for p in rd.path.iterdir()) == listing, "a refused resume wrote into the run directory"
    assert not (rd.path / "logs" / "master.log").exists(), "a refused resume started a master"


def test_the_lease_frees_when_its_holders_die(tmp_path: Path) -> None:
    rd = process_run(tmp_path, "cartpole-ppo-lease-0007")
    holder = _hold_live(rd.path)
    with pytest.raises(BadInput, match="still live"):
        claim_live(rd)
    holder.kill()
    holder.wait()
    fd = claim_live(rd)  # nobody holds it: the resume may go on (and now holds it itself)
    try:  # a second launcher, while this one lives, is refused
        other = subprocess.run([sys.executable, "-c", "from pathlib import Path; from launcher.runs import RunDir, "
                                f"claim_live; claim_live(RunDir('x', Path({str(rd.path)!r})))"],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert other.returncode != 0 and "still live" in other.stderr, other.stderr[-2000:]
    finally:
        os.close(fd)


def test_temp_names_beside_the_model_are_unique_per_writer(tmp_path: Path) -> None:
    """c1dca51 wrote .policy.tmp.npz and .final_model.tmp.keras: two masters wrote into one file."""
    a, b = aside(tmp_path / "policy.npz"), aside(tmp_path / "policy.npz")
    assert a != b and a.suffix == ".npz" and str(os.getpid()) in a.name
    assert aside(tmp_path / "final_model.keras").suffix == ".keras"


# ------------------------------------------------------------------ item 5: the process backend's secret
def test_a_child_reads_the_secret_from_a_pipe_not_its_environment(tmp_path: Path) -> None:
    """c1dca51 put LAUNCHER_SECRET in every child's environment (/proc/<pid>/environ)."""
    (tmp_path / "logs").mkdir()
    secret = os.urandom(32).hex()
    code = ("import os, sys, time; from worker.contract import take_secret; s = take_secret(); "
            "print('got', len(s), 'LAUNCHER_SECRET' in os.environ, flush=True); time.sleep(30)")
    child = _Child("master", [sys.executable, "-c", code], child_env(), tmp_path / "logs" / "master.log",
                   secret=secret)
    child.start()
    try:
        assert child.proc is not None
        pid = child.proc.pid
        log = tmp_path / "logs" / "master.log"
        wait_for(lambda: b"got" in log.read_bytes(), 60, "the child to read its secret")
        assert log.read_bytes().strip().endswith(b"got 64 False")
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert secret.encode() not in environ and b"LAUNCHER_SECRET=" not in environ
        assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    finally:
        child.signal(signal.SIGKILL)
        if child.proc is not None:
            child.proc.wait()
        child.close_log()


# ------------------------------------------------------------------ item 10: the launcher's death, log caps
FAKE_LAUNCHER = """
import sys, time
from pathlib import Path
from launcher.backends.process import ProcessBackend, _Child, _Reaper
logs = Path(sys.argv[1])
child = _Child("master", [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "print('stuck', flush=True); time.sleep(300)"], {}, logs / "master.log")
reaper = _Reaper(sys.executable, float(sys.argv[2]), child.open_log())
child.start()
reaper.watch(child.proc.pid)
print(child.proc.pid, flush=True)
time.sleep(300)
"""


def test_a_child_stuck_after_the_launchers_death_is_killed_after_the_grace(tmp_path: Path) -> None:
    """c1dca51: a kill -9 of the launcher gave each child SIGTERM (PR_SET_PDEATHSIG) and nothing later; one that
    ignores it (stuck) ran on. Now the reaper SIGKILLs it ``grace`` seconds after the launcher died."""
    (tmp_path / "logs").mkdir()
    grace_s = 2.0
    launcher = subprocess.Popen([sys.executable, "-c", FAKE_LAUNCHER, str(tmp_path / "logs"), str(grace_s)], cwd=ROOT,
                                env=child_env(), stdout=subprocess.PIPE, process_group=0)
    assert launcher.stdout is not None
    child_pid = int(launcher.stdout.readline())
    try:
        wait_for(lambda: b"stuck" in (tmp_path / "logs" / "master.log").read_bytes(), 30, "the child to start")
        t0 = time.monotonic()
        launcher.kill()
        launcher.wait()
        time.sleep(0.5)
        assert alive(child_pid), "the child should ignore its SIGTERM (it is the stuck case)"
        wait_for(lambda: not alive(child_pid), grace_s + 15, "the reaper's SIGKILL")
        took = time.monotonic() - t0
        assert took >= grace_s - 0.2, f"killed after {took:.1f} s, before the {grace_s} s grace"
        print(f"stuck child killed {took:.1f} s after the launcher's kill -9 (grace {grace_s} s)")
        assert b"SIGKILLed process group" in (tmp_path / "logs" / "master.log").read_bytes()
    finally:
        try:
            os.killpg(child_pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_the_reaper_leaves_everything_alone_after_a_clean_stop(tmp_path: Path,
                                                               procs: list[subprocess.Popen[bytes]]) -> None:
    pid = sleeper(procs, "clean-stop-marker", ignore_term=True)
    (tmp_path / "r.log").touch()
    fd = os.open(tmp_path / "r.log", os.O_WRONLY)
    reaper = _Reaper(sys.executable, 0.5, fd)
    os.close(fd)
    reaper.watch(pid)
    reaper.done()
    assert reaper.proc.returncode == 0
    time.sleep(1.0)
    assert alive(pid)


def test_a_childs_log_is_rotated_past_its_cap(tmp_path: Path) -> None:
    """c1dca51: logs/master.log (process backend) grew ~130 bytes per refused connection, without a cap."""
    (tmp_path / "logs").mkdir()
    code = "import sys\nfor i in range(3000): sys.stdout.write('x' * 999 + '\\n')\nsys.stdout.flush()"
    child = _Child("master", [sys.executable, "-c", code], child_env(), tmp_path / "logs" / "master.log")
    child.start()
    assert child.proc is not None and child.proc.wait(timeout=60) == 0
    cap = 1_000_000
    assert child.cap_log(cap)
    log, old = tmp_path / "logs" / "master.log", tmp_path / "logs" / "master.log.1"
    assert old.stat().st_size == 3_000_000 and log.stat().st_size < 200
    assert b"passed 1000000 bytes" in log.read_bytes()
    assert not child.cap_log(cap)
    child.close_log()


def test_a_childs_log_is_never_opened_through_a_planted_link(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep\n")
    (tmp_path / "logs" / "master.log").symlink_to(victim)
    child = _Child("master", [sys.executable, "-c", "print('x')"], child_env(), tmp_path / "logs" / "master.log")
    with pytest.raises(OSError, match="symbolic link"):
        child.start()
    assert victim.read_bytes() == b"keep\n"
