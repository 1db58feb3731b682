"""Progress output: the plain lines of a real run parsed line by line, and the live view's sections."""

from __future__ import annotations

import io
import json
import re
from datetime import datetime
from typing import Any

import pytest

from launcher.backends.base import BackendStatus, Part, PartState
from launcher.gpu.placement import PlanRequest, make_plan
from launcher.progress import NullReporter, PlainReporter, Tracker, estimate, make_reporter, parse_plain_line
from launcher.progress_live import LiveReporter, render_snapshot
from tests.nvml_fixtures import GiB, NvmlStub, gpu, stub_uuid
from tests.run_fixtures import TARGET_RETURN, CliRun

# The documented format (docs/operator.md), written out independently of launcher.progress.
LINE = re.compile(r'^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) (run|event|build|progress|group|gpu|end)((?: \w+=(?:"(?:[^"\\]|\\.)*"|[^\s"=\\]+))*)$')
PAIR = re.compile(r' (\w+)=("(?:[^"\\]|\\.)*"|[^\s"=\\]+)')
PROGRESS_KEYS = ["run_id", "state", "elapsed_s", "steps", "max_steps", "updates", "updates_per_s", "episodes",
                 "mean_return", "best_return", "target_return", "env_steps_per_s", "queue", "checkpoint_updates",
                 "checkpoint_age_s", "groups", "workers", "rejected", "progress_pct", "eta_s", "eta_basis",
                 "lag_mean", "lag_max", "lag_dropped"]
GROUP_KEYS = ["group", "state", "gpu", "workers", "env_steps", "env_steps_per_s", "recent_return", "restarts"]


def parse(line: str) -> tuple[datetime, str, dict[str, Any]]:
    m = LINE.match(line)
    assert m, f"not a plain progress line: {line!r}"
    fields = {k: None if v == "-" else json.loads(v) if v.startswith('"') else v for k, v in PAIR.findall(m.group(3))}
    return datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%SZ"), m.group(2), fields


def test_plain_output_of_a_real_run_parses_line_by_line(trained_cartpole: CliRun) -> None:
    assert trained_cartpole.returncode == 0, trained_cartpole.stderr[-3000:]
    lines = trained_cartpole.stderr.splitlines()
    assert "\x1b" not in trained_cartpole.stderr and "\r" not in trained_cartpole.stderr  # no control codes
    records = [parse(line) for line in lines]  # every line, none skipped
    for line, (_, kind, fields) in zip(lines, records):
        assert parse_plain_line(line)[1:] == (kind, fields)  # the library's reader agrees
    kinds = [k for _, k, _ in records]
    assert kinds[-1] == "end" and "run" in kinds and kinds.count("end") == 1
    run = next(f for _, k, f in records if k == "run")
    assert run["run_id"] == trained_cartpole.run_dir.name and run["format"] == "1" and run["plan"] == "cpu"

    progress = [(t, f) for t, k, f in records if k == "progress"]
    assert len(progress) >= 3  # one a second: a quiet machine solves CartPole in ~6 s of training
    for _, f in progress:
        assert list(f) == PROGRESS_KEYS
        assert f["target_return"] == "475.00" and f["max_steps"] == "400000"
    # A steady interval: --progress-interval 1 gives one block a second (timestamps have 1 s resolution).
    gaps = [(b - a).total_seconds() for (a, _), (b, _) in zip(progress, progress[1:])]
    assert all(0 <= g <= 3 for g in gaps) and sum(gaps) / len(gaps) <= 1.6, gaps
    steps = [int(f["steps"]) for _, f in progress]
    assert steps == sorted(steps) and steps[-1] > steps[0]
    assert any(f["eta_s"] is not None for _, f in progress)
    assert {f["eta_basis"] for _, f in progress} <= {"steps", "return"}
    assert float(progress[-1][1]["progress_pct"]) == 100.0 and float(progress[-1][1]["mean_return"]) >= TARGET_RETURN

    # Each progress line is followed by one line per worker group.
    for i, (_, kind, _) in enumerate(records):
        if kind == "progress":
            group_lines = [f for _, k, f in records[i + 1:i + 3]]
            assert [k for _, k, _ in records[i + 1:i + 3]] == ["group", "group"]
            assert [g["group"] for g in group_lines] == ["0", "1"]
            assert all(list(g) == GROUP_KEYS and g["gpu"] == "cpu" for g in group_lines)
    assert any(f["state"] == "running" and f["recent_return"] is not None for _, k, f in records if k == "group")
    assert not [f for _, k, f in records if k == "gpu"]  # a CPU run has no GPU lines

    _, _, end = records[-1]
    assert end["state"] == "finished" and end["exit_code"] == "0" and end["run_id"] == run["run_id"]
    assert float(end["mean_return"]) >= TARGET_RETURN and end["message"] == "run target reached"


# ------------------------------------------------------------------------------------- estimates (pure)
def test_eta_by_steps_and_by_return_trend() -> None:
    assert estimate(25_000, 100_000, 5_000.0, None, None, []) == (25.0, 15.0, "steps")
    assert estimate(0, None, None, None, None, []) == (None, None, None)
    history = [(t, 100.0 + 10.0 * t) for t in range(11)]  # +10 return a second, 200 after 10 s
    pct, eta, basis = estimate(50_000, 10_000_000, 1_000.0, 200.0, 300.0, history)
    assert basis == "return" and eta == pytest.approx(10.0) and pct == pytest.approx(50.0)
    flat = [(float(t), 200.0) for t in range(11)]
    pct, eta, basis = estimate(1_000, None, 1_000.0, 200.0, 300.0, flat)  # not rising: no ETA
    assert (pct, eta, basis) == (0.0, None, "return")
    assert estimate(1_000, None, 1.0, 310.0, 300.0, flat)[:2] == (100.0, 0.0)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def status(steps: int, mean: float | None, **extra: Any) -> dict[str, Any]:
    return {"run_id": "r1", "env_id": "CartPole-v1", "algo": "ppo", "state": "running", "env_steps": steps,
            "updates": steps // 512, "updates_per_s": 2.0, "episodes": steps // 100, "mean_return": mean,
            "best_mean_return": mean, "episodes_in_window": 100, "return_window": 100, "env_steps_per_s": 1000.0,
            "queue_depth": 1, "checkpoint": {"updates": 25, "age_s": 3.5, "path": "ckpt-25"},
            "network": {"rejected.bad_shape": 2, "connections": 2},
            "groups": {"0": {"workers": 4, "connected": True, "env_steps": steps // 2, "env_steps_per_s": 500.0,
                             "mean_return": mean},
                       "1": {"workers": 4, "connected": False, "env_steps": steps // 2, "env_steps_per_s": 0.0,
                             "mean_return": None}},
            "target": {"until_return": 475.0, "max_steps": 100_000}, **extra}


def gpu_plan() -> Any:
    from launcher.gpu.nvml import GpuInfo

    gpus = [GpuInfo(i, stub_uuid(i), "A100", "", 80 * GiB, 0, 80 * GiB, 0, 0) for i in range(2)]
    return make_plan(PlanRequest(workers=8, max_workers_per_group=4), gpus, 4)


def test_a_run_that_ends_between_two_blocks_prints_its_final_figures_before_end() -> None:
    clock, out = Clock(), io.StringIO()
    rep = PlainReporter(out, interval_s=5.0, gpu_reader=None, clock=clock)
    rep("prepared", {"run_id": "r1", "results": "/x", "plan": make_plan(PlanRequest(workers=8, groups=2), [], 2)})
    backend = BackendStatus(Part("master", PartState.RUNNING),
                            {0: Part("group-0", PartState.RUNNING), 1: Part("group-1", PartState.RUNNING)})
    for t, steps in ((0, 1000), (1, 40_000), (2, 100_000)):  # the last two come inside the 5 s period
        clock.t = float(t)
        rep("status", {"status": status(steps, 480.0), "backend": backend, "restarts": {}})
    rep("result", {"run_id": "r1", "state": "finished", "exit_code": 0, "summary": {}, "wall_s": 2.0})
    kinds = [(k, f) for _, k, f in (parse(line) for line in out.getvalue().splitlines())]
    progress = [f for k, f in kinds if k == "progress"]
    assert [f["steps"] for f in progress] == ["1000", "100000"], "the first block and the final one, nothing between"
    assert [k for k, _ in kinds][-4:] == ["progress", "group", "group", "end"]
    # Nothing new since the last block: no repeat before the end line.
    out2 = io.StringIO()
    rep2 = PlainReporter(out2, interval_s=5.0, gpu_reader=None, clock=Clock())
    rep2("status", {"status": status(1000, 20.0), "backend": backend, "restarts": {}})
    rep2("result", {"run_id": "r1", "state": "finished", "exit_code": 0, "summary": {}, "wall_s": 2.0})
    assert [parse(line)[1] for line in out2.getvalue().splitlines()].count("progress") == 1


def test_plain_reporter_keeps_a_steady_interval_and_reports_gpus() -> None:
    from launcher.gpu.nvml import GpuInfo

    clock, out = Clock(), io.StringIO()
    readings = [GpuInfo(i, stub_uuid(i), "A100", "", 80 * GiB, 5 * GiB, 75 * GiB, 40 + i, 10) for i in range(3)]
    rep = PlainReporter(out, interval_s=5.0, gpu_reader=lambda: readings, clock=clock)
    plan = gpu_plan()
    rep("prepared", {"run_id": "r1", "results": "/tmp/r 1", "plan": plan})
    backend = BackendStatus(Part("master", PartState.RUNNING),
                            {0: Part("group-0", PartState.RUNNING), 1: Part("group-1", PartState.FAILED,
                                                                                        exit_code=1, restarts=1)})
    for t in range(0, 12):  # a status event every second for 12 s: progress at 0, 5 and 10
        clock.t = float(t)
        rep("status", {"status": status(1000 * t, 20.0 + t), "backend": backend, "restarts": {1: 1}})
    rep("event", {"message": 'group 1 died (exit 1); "restarting"'})
    lines = out.getvalue().splitlines()
    parsed = [parse(line) for line in lines]
    assert [k for _, k, _ in parsed].count("progress") == 3
    run = parsed[0][2]
    assert run["results"] == "/tmp/r 1" and run["plan"] == "gpu" and run["workers"] == "8"
    first_block = [k for _, k, _ in parsed[1:6]]
    assert first_block == ["progress", "group", "group", "gpu", "gpu"]  # only the plan's GPUs, not GPU 2
    g0, g1 = parsed[2][2], parsed[3][2]
    assert (g0["state"], g0["gpu"], g0["workers"]) == (
        "running", ",".join(map(str, plan.groups[0].share.gpu_indices)), "4")
    assert (g1["state"], g1["restarts"]) == ("failed", "1")
    gpu0 = parsed[4][2]
    assert gpu0 == {"gpu": "0", "uuid": stub_uuid(0), "memory_used_bytes": str(5 * GiB),
                    "memory_total_bytes": str(80 * GiB), "utilization_pct": "40"}
    p = parsed[1][2]
    assert (p["queue"], p["checkpoint_age_s"], p["rejected"], p["groups"]) == ("1", "3.50", "2", "1/2")
    assert parsed[-1][2]["message"] == 'group 1 died (exit 1); "restarting"'


def test_live_view_shows_groups_master_gpus_and_progress(nvml_stub: NvmlStub) -> None:
    """The live table with GPU readings from launcher.nvml (stand-in NVML), rendered to text."""
    from rich.console import Console

    nvml_stub.configure({"driver_version": "550.54.15",
                         "gpus": [gpu(0, used_bytes=12 * GiB, util_pct=87), gpu(1, used_bytes=3 * GiB, util_pct=12)]})
    screen = io.StringIO()
    console = Console(file=screen, width=150, record=True, force_terminal=True)
    clock = Clock()
    live = LiveReporter(console=console, clock=clock)
    try:
        live("prepared", {"run_id": "r1", "results": "/tmp/r1", "plan": gpu_plan()})
        for t in range(0, 31, 5):
            clock.t = float(t)
            live("status", {"status": status(10_000 + 1000 * t, 200.0 + 5 * t), "backend": None, "restarts": {}})
        text = Console(width=150, record=True, file=io.StringIO())
        text.print(live.render())
        view = text.export_text()
    finally:
        live.close()
    assert "run r1 · ppo on CartPole-v1 · running" in view
    for header in ("group", "state", "GPU", "env steps/s", "recent return", "restarts"):
        assert header in view
    assert re.search(r"│\s+0\s+│ running\s+│ [01]\s+│\s+4 │\s+500 │", view), view
    assert "connecting" in view  # group 1 is not connected
    assert "master on GPU " in view and "2.00/s" in view and "queue 1" in view and "at update 25, 4s ago" in view
    assert "12.0 GiB / 80.0 GiB" in view and "87%" in view and "3.0 GiB / 80.0 GiB" in view
    assert "40,000/100,000 steps" in view and "target 475" in view and "(by return)" in view
    assert screen.getvalue().count("\x1b") > 0  # the live view redraws with control codes


def test_reporter_choice() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(make_reporter(io.StringIO()), PlainReporter)  # not a terminal: plain lines
    assert isinstance(make_reporter(io.StringIO(), mode="off"), NullReporter)
    live = make_reporter(Tty())
    try:
        assert isinstance(live, LiveReporter)
    finally:
        live.close()
    plain = make_reporter(Tty(), mode="plain", interval_s=2.0)
    assert isinstance(plain, PlainReporter) and plain.interval_s == 2.0


def test_tracker_without_status_yet() -> None:
    t = Tracker(Clock())
    t.update("prepared", {"run_id": "r9", "results": "/x", "plan": make_plan(PlanRequest(workers=3, groups=2), [], 2)})
    snap = t.snapshot()
    assert snap.run_id == "r9" and [g.state for g in snap.groups] == ["starting", "starting"]
    assert "progress" in render_snapshot(snap).renderables[-1].plain


def _build(phase: str, elapsed: float, step: int | None = None, line: str = "x") -> dict[str, Any]:
    return {"tag": "launcher:t", "phase": phase, "elapsed_s": elapsed, "line": line, "step": step, "steps": 32}


def test_an_image_build_shows_its_phases_in_plain_lines_and_in_the_live_view() -> None:
    """Before the start, a cold image build takes minutes: each phase and Dockerfile step gets a `build`
    line (other output at most once per interval), and the live view shows phase, step and time."""
    from rich.console import Console

    clock, out = Clock(), io.StringIO()
    rep = PlainReporter(out, interval_s=5.0, gpu_reader=None, clock=clock)
    for t, rec in [(0, _build("base rootfs", 0)), (1, _build("base rootfs", 1, line="I: Retrieving")),
                   (7, _build("base rootfs", 7, line="I: Extracting")), (8, _build("wheels", 8)),
                   (9, _build("docker build", 9, 1)), (9, _build("docker build", 9, 1, line="---> abc")),
                   (10, _build("docker build", 10, 2, line="Step 2/32 : RUN pip install"))]:
        clock.t = float(t)
        rep("build", rec)
    parsed = [parse(line) for line in out.getvalue().splitlines()]
    assert [k for _, k, _ in parsed] == ["build"] * 5
    assert [(f["phase"], f["step"]) for _, _, f in parsed] == [("base rootfs", None), ("base rootfs", None),
                                                              ("wheels", None), ("docker build", "1"),
                                                              ("docker build", "2")]
    assert parsed[1][2]["line"] == "I: Extracting" and parsed[-1][2]["steps"] == "32"

    screen = io.StringIO()
    live = LiveReporter(console=Console(file=screen, width=120, force_terminal=True), clock=clock)
    try:
        live("build", _build("docker build", 83.0, 5, line="Step 5/32 : COPY launcher /src/launcher"))
        live.live.refresh()
    finally:
        live.close()
    assert "building image launcher:t · docker build · step 5/32 · 1m23s" in screen.getvalue()
