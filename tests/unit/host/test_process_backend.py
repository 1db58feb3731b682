"""End to end through the real CLI on the process backend: results files, exit codes, resume, signals."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import (run_dirs, ROOT, child_env, launcher_cmd, only_run, processes_mentioning, read_json, run_launcher,
                           status_of, wait_for)

RESULT_FILES = ("config.json", "plan.json", "spec.json", "run.json", "status.json", "summary.json", "metrics.jsonl",
                "learning_curve.png", "model/final_model.keras", "model/policy.npz", "model/policy.json",
                "logs/master.log", "logs/group-0.log")


def test_short_run_writes_every_results_file(tmp_path: Path) -> None:
    proc = run_launcher("up", "--backend", "process", "--workers", "4", "--env", "CartPole-v1", "--algo", "ppo",
                        "--max-steps", "12000", "--results", str(tmp_path), "--seed", "1", "--checkpoint-every", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run(tmp_path)
    for name in RESULT_FILES:
        assert (run / name).is_file() and (run / name).stat().st_size > 0, f"missing {name}"
    assert list((run / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events"
    ckpt = run / "checkpoints"
    assert (ckpt / "checkpoint").is_file() and list(ckpt.glob("ckpt-*.index"))
    summary = read_json(run / "summary.json")
    assert summary["outcome"] == "max_steps" and summary["env_steps"] >= 12000
    assert summary["updates"] > 0 and summary["episodes"] > 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = {r["type"] for r in records}
    assert {"episodes", "progress", "event"} <= kinds
    progress = [r for r in records if r["type"] == "progress"]
    assert all("env_steps_per_s" in r and "network" in r and "groups" in r for r in progress)
    steps = [r["env_steps"] for r in progress]
    assert steps == sorted(steps), "env steps went backwards"
    # The exported numpy policy is the trained one: same weights as the last checkpoint's model.
    policy = np.load(run / "model" / "policy.npz")
    assert "pi_out/kernel" in policy.files
    # The stdout summary names the run and its results.
    assert run.name in proc.stdout and "max steps" in proc.stdout
    png = (run / "learning_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Traceback" not in (run / "logs" / "master.log").read_text()


def test_target_not_reached_has_its_own_exit_code(tmp_path: Path) -> None:
    proc = run_launcher("up", "--backend", "process", "--workers", "2", "--max-steps", "3000", "--until-return", "499",
                        "--results", str(tmp_path))
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "not reached" in proc.stdout


@pytest.mark.parametrize("args,needle", [
    (["--workers", "-3"], "--workers must be between 1 and 1024, got -3"),
    (["--env", "CartPol-v1"], "CartPol-v1"),
    (["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
    (["--timeout", "soon"], "'soon' is not a duration"),
    (["--set", "lr"], "--set takes key=value"),
    (["--set", "bogus=1"], "unknown ppo hyper-parameter 'bogus'"),
])
def test_bad_input_exits_2_with_one_clear_message_and_starts_nothing(tmp_path: Path, args: list[str], needle: str) -> None:
    root = tmp_path / "results"
    proc = run_launcher("up", "--backend", "process", "--results", str(root), *args, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not root.exists() or not any(root.iterdir()), "a run directory was created for bad input"


def test_unwritable_results_root_is_bad_input(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = run_launcher("up", "--backend", "process", "--results", str(blocker / "sub"), timeout=60)
    assert proc.returncode == 2 and "is not a directory" in proc.stderr
    assert blocker.read_text() == "not a directory"


def _start(tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(launcher_cmd("up", "--backend", "process", "--results", str(tmp_path), *extra), cwd=ROOT,
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_tears_everything_down_within_10s(tmp_path: Path) -> None:
    proc = _start(tmp_path, "--workers", "4", "--groups", "2", "--max-steps", "10000000")
    run = wait_for(lambda: next((p for p in tmp_path.iterdir() if (p / "status.json").exists()), None), 90,
                   "the run to start")
    wait_for(lambda: status_of(run).get("env_steps", 0) > 0, 60, "training to start")
    pids = read_json(run / "run.json")["pids"]
    assert set(pids) == {"master", "group-0", "group-1"}
    sock_dir = Path(wait_for(lambda: _socket_dir(run), 90, "the master's address"))
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert time.monotonic() - t0 < 10, "teardown took longer than 10 s"
    assert proc.returncode == 130, err[-2000:]
    for name, pid in pids.items():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], \
            f"{name} (pid {pid}) survived"
    assert not processes_mentioning(str(run)), "a child of the run is still alive"
    assert not sock_dir.exists(), "the master's socket directory outlived the run"
    summary = read_json(run / "summary.json")  # the master still wrote its summary and checkpoint
    assert summary["outcome"] == "interrupted"
    assert read_json(run / "run.json")["state"] == "interrupted"


def test_kill_9_of_the_launcher_leaves_no_orphans(tmp_path: Path) -> None:
    proc = _start(tmp_path, "--workers", "2", "--groups", "2", "--max-steps", "10000000")
    run = wait_for(lambda: next((p for p in run_dirs(tmp_path) if (p / "run.json").exists()
                                 and "pids" in read_json(p / "run.json")), None), 90, "the run to start")
    sock_dir = Path(wait_for(lambda: _socket_dir(run), 90, "the master's address"))
    proc.kill()
    proc.wait()
    # SIGTERM through PR_SET_PDEATHSIG at once; what ignores it (or is still importing TensorFlow) the reaper
    # SIGKILLs 10 s after the launcher's death. 30 s leaves room for a loaded machine (one CI run: > 15 s).
    wait_for(lambda: not processes_mentioning(str(run)), 30, "the children to die with their parent")
    # The master's private socket directory goes too: the launcher could not remove it, its reaper does.
    wait_for(lambda: not sock_dir.exists(), 30, f"{sock_dir} to be removed")


def _socket_dir(run: Path) -> str | None:
    """The directory of the master's Unix socket, from its master.addr (None until it listens)."""
    try:
        addr = (run / "master.addr").read_text().strip()
    except OSError:
        return None
    assert addr.startswith("unix:/"), addr
    return str(Path(addr[5:]).parent)


def test_stop_and_resume_continues_the_counters(tmp_path: Path) -> None:
    proc = _start(tmp_path, "--workers", "4", "--groups", "2", "--max-steps", "10000000", "--checkpoint-every", "5")
    run = wait_for(lambda: next((p for p in tmp_path.iterdir() if (p / "status.json").exists()), None), 90,
                   "the run to start")
    wait_for(lambda: status_of(run).get("updates", 0) >= 12, 120, "a dozen updates")
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    first = read_json(run / "summary.json")
    assert first["outcome"] == "interrupted" and first["updates"] >= 12
    target = first["env_steps"] + 6000
    resumed = run_launcher("up", "--resume", run.name, "--results", str(tmp_path), "--max-steps", str(target),
                           "--backend", "process")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    second = read_json(run / "summary.json")
    assert second["env_steps"] >= target > first["env_steps"]
    assert second["updates"] > first["updates"]
    assert second["episodes"] > first["episodes"]
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    starts = [e for e in events if e.get("event") == "master_started"]
    assert len(starts) == 2 and starts[1]["env_steps"] == first["env_steps"] and starts[1]["updates"] == first["updates"]
    assert only_run(tmp_path) == run  # resumed in place, no second directory


def test_a_signal_before_the_start_starts_nothing(tmp_path: Path) -> None:
    """SIGINT during planning (before any process or image build): supervise() starts nothing, stops
    cleanly, records `interrupted` and ends with exit 130."""
    from launcher.backends.base import PreparedRun
    from launcher.backends.process import ProcessBackend
    from launcher.config import RunConfig
    from launcher.errors import ExitCode
    from launcher.gpu.placement import PlanRequest, cpu_plan
    from launcher.runs import create_run_dir, new_secret
    from launcher.supervisor import StopSignal, supervise
    from launcher.up import build_spec

    cfg = RunConfig(workers=2, results=tmp_path, max_steps=1000)
    plan = cpu_plan(PlanRequest(workers=2, max_workers_per_group=8), 2)
    rd = create_run_dir(tmp_path, "cartpole-ppo-early-0001")
    spec = build_spec(cfg, plan, rd.run_id, rd.path)
    stopper = StopSignal()
    stopper.requested = signal.SIGINT

    class Watched(ProcessBackend):
        def start(self, run: PreparedRun) -> None:
            pytest.fail("nothing may start after a signal")

    # What the handlers were before: default_int_handler under a terminal, SIG_IGN when pytest itself was
    # started as a background job of a non-interactive shell (as CI may start it).
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(Exception) as info:
        supervise(PreparedRun(cfg, plan, spec, rd, new_secret()), Watched(), stop_signal=stopper)
    assert getattr(info.value, "exit_code", None) == ExitCode.INTERRUPTED
    rec = rd.read_record()
    assert (rec["state"], rec["exit_code"]) == ("interrupted", 130)
    assert {s: signal.getsignal(s) for s in before} == before, "handlers given back"
