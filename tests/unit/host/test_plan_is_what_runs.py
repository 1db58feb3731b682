"""Issue 23, item 2: ``launcher plan --backend process --json`` is what ``launcher up`` starts.

The plan's ``launch`` section (the backend's one pure step, ``Backend.specs``) is compared with what the running
processes of a real run got, read back from ``/proc/<pid>/cmdline`` and ``/proc/<pid>/environ``: the command,
every variable the launcher sets (GPU and thread variables included), and ``plan.json`` records the same.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

from launcher.backends.specs import GPU_VARS, THREAD_VARS
from launcher.cli.plan import PREVIEW_RUN_ID
from tests.helpers import ROOT, child_env, free_port, launcher_cmd, read_json, run_launcher, wait_for

# What a GPU image or a user's shell may have set in the launcher's own environment: the plan says what the
# processes get instead (a CPU run must not inherit "all" GPUs).
LAUNCHER_ENV = {"NVIDIA_VISIBLE_DEVICES": "all", "OMP_NUM_THREADS": "7"}


def proc_argv(pid: int) -> list[str]:
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]


def proc_env(pid: int) -> dict[str, str]:
    pairs = (item.decode().partition("=") for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def for_run(parts: list[dict[str, Any]], run_id: str) -> dict[str, dict[str, Any]]:
    """The plan's parts with the run's id where the plan had its stand-in, by name."""
    return {p["name"]: p for p in json.loads(json.dumps(parts).replace(PREVIEW_RUN_ID, run_id))}


def test_process_plan_json_is_what_start_launches(tmp_path: Path) -> None:
    args = ("--backend", "process", "--results", str(tmp_path), "--workers", "3", "--groups", "2", "--gpus", "none",
            "--port", str(free_port()))
    shown = run_launcher("plan", "--json", *args, **LAUNCHER_ENV)
    assert shown.returncode == 0, shown.stderr[-2000:]
    launch = json.loads(shown.stdout)["launch"]
    assert launch["backend"] == "process" and [p["name"] for p in launch["parts"]] == ["master", "group-0", "group-1"]

    proc = subprocess.Popen(launcher_cmd("up", *args, "--max-steps", "100000000"), cwd=ROOT,
                            env=child_env(**LAUNCHER_ENV), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run = wait_for(lambda: next((p for p in tmp_path.iterdir() if (p / "run.json").exists()), None), 120,
                       "the run's directory")

        def started() -> dict[str, int] | None:
            pids = read_json(run / "run.json").get("pids") or {}
            return pids if set(pids) == {"master", "group-0", "group-1"} else None

        pids = wait_for(started, 120, "the run's processes")
        planned = for_run(launch["parts"], run.name)
        inherited = {k: v for k, v in child_env(**LAUNCHER_ENV).items() if not k.startswith("LAUNCHER_")}
        for name, pid in pids.items():
            part, argv, env = planned[name], proc_argv(pid), proc_env(pid)
            assert argv == part["command"], name
            for key, value in part["env"].items():  # every variable the launcher sets, as the plan says
                assert env.get(key) == value, (name, key)
            expected = {**inherited, **part["env"]} if part["inherits"] == "host" else dict(part["env"])
            for key in (*GPU_VARS, *THREAD_VARS):
                assert env.get(key) == expected.get(key), (name, key)
            assert env["NVIDIA_VISIBLE_DEVICES"] == "void" and env["CUDA_VISIBLE_DEVICES"] == "", name
            assert set(part["at_start"]) <= set(env), name
        # The run's plan.json records exactly what was started.
        recorded = read_json(run / "plan.json")["launch"]
        assert for_run(recorded["parts"], run.name) == planned
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
