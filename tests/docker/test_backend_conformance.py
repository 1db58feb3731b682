"""Issue 23, item 6: one lifecycle, the same for every real backend (process, docker, swarm, slurm).

Each case drives the real CLI (``python -m launcher``) through the same steps and checks the same things:

1. ``launcher plan --backend X --json``: its ``launch`` section names the backend and the parts ``start`` will
   launch; ``plan.json`` of the run then started records the same parts and commands;
2. ``launcher up --backend X --json``: a short CartPole PPO run that ends on its own (``--max-steps``);
3. while it runs: ``launcher status RUN --json`` says ``running`` (live) with every planned part running, and
   ``launcher logs RUN --master`` prints the master's log;
4. at its end: exit 0, state ``finished``, outcome ``max_steps`` in the result, in ``launcher status`` and in
   ``launcher runs``; ``summary.json``, the checkpoints and the exported model are in the results;
5. nothing of the run is left: no process, container, network, service, secret, Slurm job or step (each
   backend's own tests' helper says what is left).

Where a check cannot apply to a backend, the case says so (:attr:`Case.not_applicable`) and checks what stands
in for it: Slurm's ``launcher plan`` has no steps before an allocation (``plan.json``'s stand in). A part's ``state``
in ``status --json`` is one vocabulary on every backend (``running``); its ``status`` is the backend's own word
(``alive`` for a process, Docker's ``running``, Slurm's ``RUNNING``), which each case names. The Docker cases use the suite's image and clean-up fixtures (``runs_under``; test_swarm.py's
one-node swarm on this engine and ``swarm_runs_under``); the Slurm case the suite's Slurm bed. Each case prints
``conformance figures: …`` (run with ``-s``). Pick one case by its id
(``tests/docker/test_backend_conformance.py::test_the_same_lifecycle_on_every_backend[docker]``): ``-k docker``
matches every case, this file being under tests/docker/.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from launcher.cli.plan import PREVIEW_RUN_ID
from tests.docker import test_swarm as swarm_tests
from tests.docker_fixtures import ours
from tests.helpers import ROOT, child_env, kill_all, launcher_cmd, processes_mentioning, read_json, run_dirs, wait_for
from tests.slurm import test_slurm_backend as slurm_tests

# test_swarm.py's one-node swarm on this engine (made and left by the fixture) and its checked results root.
swarm = swarm_tests.swarm
swarm_runs_under = swarm_tests.swarm_runs_under

# Two workers, one group: long enough (~10 s of training here) to be seen running, short enough for CI.
MAX_STEPS = 60000
RUN_ARGS = ("--env", "CartPole-v1", "--algo", "ppo", "--workers", "2", "--groups", "1", "--max-steps",
            str(MAX_STEPS), "--checkpoint-every", "20")
UP_ONLY = ("--progress", "plain", "--progress-interval", "5", "--json")  # options `launcher plan` does not take
MODEL_FILES = ("summary.json", "checkpoints/checkpoint", "model/final_model.keras", "model/policy.npz")


@dataclass
class Case:
    """One backend as the lifecycle needs it: where its runs go, its own ``up`` options, the environment its
    commands need, and what of a run (its results directory) is still there."""

    backend: str
    results: Path
    args: tuple[str, ...]
    env: dict[str, str]
    leftovers: Callable[[Path], list[str]]
    running_word: str = "running"  # a running part's `status` in `status --json`: the backend's own word (Part.word)
    extra_parts: dict[str, str] = field(default_factory=dict)  # part name -> why status shows it beyond the plan
    not_applicable: dict[str, str] = field(default_factory=dict)  # check -> why it cannot apply here

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(launcher_cmd(*args), cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def json(self, *args: str) -> Any:
        done = self.cli(*args, "--results", str(self.results), "--json")
        assert done.returncode == 0, f"launcher {' '.join(args)}: exit {done.returncode}\n{done.stderr[-2000:]}"
        return json.loads(done.stdout)


def _process_leftovers(run: Path) -> list[str]:
    pids = (read_json(run / "run.json").get("pids") or {}) if (run / "run.json").exists() else {}
    alive = [f"{name} (pid {pid})" for name, pid in pids.items() if Path(f"/proc/{pid}").exists()
             and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"]
    return alive + [f"process {pid}: {cmd[:120]}" for pid, cmd in processes_mentioning(str(run))]


def _docker_leftovers(engine: Any, root: Path) -> list[str]:
    containers, networks = ours(engine, root)
    return [f"container {c.name}" for c in containers] + [f"network {n}" for n in networks]


def _slurm_leftovers(bed: Any, run: Path) -> list[str]:
    job = str(read_json(run / "run.json").get("slurm_job") or "")
    assert job, f"the run's record names no Slurm job: {read_json(run / 'run.json')}"
    return slurm_tests.leftovers(bed, job, run.name)


@pytest.fixture
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Case]:
    """The backend ``request.param`` with its engine or bed up (their fixtures skip where it cannot be)."""
    backend = request.param
    if backend == "process":
        root = tmp_path / "results"
        root.mkdir()
        yield Case(backend, root, (), child_env(), _process_leftovers, running_word="alive")
        for run in run_dirs(root):  # a failed test must not leave training processes behind
            kill_all(str(run))
    elif backend == "docker":
        image, engine = request.getfixturevalue("launcher_image"), request.getfixturevalue("engine")
        root = request.getfixturevalue("runs_under")  # removes and fails on anything left at teardown
        yield Case(backend, root, ("--image", image), child_env(), lambda run: _docker_leftovers(engine, root))
    elif backend == "swarm":
        image, engine = request.getfixturevalue("launcher_image"), request.getfixturevalue("swarm")
        root = request.getfixturevalue("swarm_runs_under")  # removes and fails on anything left at teardown
        yield Case(backend, root, ("--image", image), child_env(), lambda run: swarm_tests._ours(engine, root))
    elif backend == "slurm":
        bed = request.getfixturevalue("slurm_bed")
        root = tmp_path / "results"
        root.mkdir()
        yield Case(backend, root, ("--slurm-runtime", "process"), bed.env(child_env()),
                   lambda run: _slurm_leftovers(bed, run), running_word="RUNNING",
                   extra_parts={"job": "the Slurm job that holds the run's steps"},
                   not_applicable={"plan parts": "`launcher plan` has no Slurm allocation yet: the steps come from "
                                                 "the plan Slurm's view gives at the start, so plan.json's parts "
                                                 "stand for them"})
        for run in run_dirs(root):  # a failed test: cancel the job (its steps die with it)
            job = str(read_json(run / "run.json").get("slurm_job") or "") if (run / "run.json").exists() else ""
            if job:
                subprocess.run(["scancel", job], env=bed.env(), capture_output=True, timeout=30)
    else:
        raise AssertionError(f"no case for backend {backend!r}")


def for_run(parts: list[dict[str, Any]], run_id: str) -> list[dict[str, Any]]:
    """The plan's parts with the run's id where ``launcher plan`` had its stand-in."""
    return json.loads(json.dumps(parts).replace(PREVIEW_RUN_ID, run_id))


@pytest.mark.parametrize("case", [
    pytest.param("process", id="process"),
    pytest.param("docker", id="docker", marks=pytest.mark.docker),
    pytest.param("swarm", id="swarm", marks=pytest.mark.docker),
    pytest.param("slurm", id="slurm", marks=pytest.mark.slurm),
], indirect=True)
def test_the_same_lifecycle_on_every_backend(case: Case) -> None:
    t0 = time.monotonic()
    common = ("--backend", case.backend, "--results", str(case.results), *case.args, *RUN_ARGS)

    # 1. What start will launch.
    shown = case.cli("plan", "--json", *common)
    assert shown.returncode == 0, shown.stderr[-2000:]
    planned = json.loads(shown.stdout)["launch"]
    assert planned["backend"] == case.backend, planned
    if "plan parts" in case.not_applicable:
        print(f"{case.backend}: plan parts not checked: {case.not_applicable['plan parts']}")
        assert planned["parts"] == [] and planned.get("note"), planned
    else:
        assert [p["name"] for p in planned["parts"]] == ["master", "group-0"], planned["parts"]

    # 2. A short run, attached, ending on its own.
    out, err = case.results.parent / "up.out", case.results.parent / "up.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        up = subprocess.Popen(launcher_cmd("up", *common, *UP_ONLY), cwd=ROOT, env=case.env, stdout=stdout,
                              stderr=stderr, start_new_session=True)
    try:
        run = wait_for(lambda: next((p for p in run_dirs(case.results) if (p / "run.json").exists()), None), 120,
                       "the run's directory")
        recorded = read_json(run / "plan.json")["launch"]
        assert recorded["backend"] == case.backend
        names = [p["name"] for p in recorded["parts"]]
        assert names and names[0] == "master" and len(names) >= 2, recorded
        if "plan parts" not in case.not_applicable:  # what `launcher plan` showed is what this run started
            assert [(p["name"], p["command"]) for p in for_run(planned["parts"], run.name)] == \
                [(p["name"], p["command"]) for p in recorded["parts"]]

        # 3. While it runs: live, every part running; the master's log.
        def running() -> dict[str, Any] | None:
            st = case.json("status", run.name)
            parts = {p["name"]: (p["state"], p["status"]) for p in st["parts"]}
            return st if st["state"] == "running" and set(names) <= set(parts) and \
                all(s == ("running", case.running_word) for s in parts.values()) else None

        try:
            live = wait_for(running, 120, "`launcher status` to show the run and all its parts running", interval=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nlast status: {case.json('status', run.name)}\n"
                                 f"launcher: {err.read_text()[-3000:]}") from None
        t_running = time.monotonic() - t0
        assert live["live"] is True and live["backend"] == case.backend
        extra = {p["name"] for p in live["parts"]} - set(names)
        assert extra == set(case.extra_parts), f"status shows parts the plan does not: {extra - set(case.extra_parts)}"
        def master_log() -> subprocess.CompletedProcess[str] | None:  # the parts may run before the master logs
            done = case.cli("logs", run.name, "--master", "--results", str(case.results))
            assert done.returncode == 0, done.stderr[-2000:]
            return done if f"master of run {run.name} listening on" in done.stdout else None

        wait_for(master_log, 60, "`launcher logs --master` to show the master listening", interval=0.5)
        assert up.poll() is None, "the run ended before its live views were all read: raise MAX_STEPS"

        # 4. Its end, the same through every view.
        assert up.wait(timeout=240) == 0, err.read_text()[-3000:]
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
    t_up = time.monotonic() - t0
    result = json.loads(out.read_text())
    assert (result["state"], result["exit_code"], result["summary"]["outcome"]) == ("finished", 0, "max_steps"), result
    status = case.json("status", run.name)
    assert (status["state"], status["outcome"], status["live"]) == ("finished", "max_steps", False), status
    (listed,) = [r for r in case.json("runs")["runs"] if r["run_id"] == run.name]
    assert (listed["status"], listed["outcome"], listed["backend"]) == ("finished", "max_steps", case.backend), listed
    summary = read_json(run / "summary.json")
    assert summary["outcome"] == "max_steps" and summary["env_steps"] >= MAX_STEPS, summary
    for name in MODEL_FILES:
        assert (run / name).is_file() and (run / name).stat().st_size > 0, f"missing {name}"
    assert list((run / "checkpoints").glob("ckpt-*.index")), "no checkpoint"

    # 5. Nothing of it is left.
    assert case.leftovers(run) == [], f"the {case.backend} run left these behind"
    print(f"conformance figures: backend={case.backend} running_after={t_running:.1f}s up_done={t_up:.1f}s "
          f"total={time.monotonic() - t0:.1f}s")
