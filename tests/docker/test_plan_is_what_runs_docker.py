"""Issue 23, item 2: ``launcher plan --backend docker --json`` is what ``launcher up`` starts.

The plan's ``launch`` section (``Backend.specs``, the step ``start`` uses) is compared with the run's containers
as the engine has them, read back through the Docker SDK (``Config.Cmd``, ``Config.Env``, ``Config.Image``,
``HostConfig.Mounts``): the command, every variable the launcher sets (GPU and thread variables included), the
image and the mounts; and ``plan.json`` records the same. Uses the suite's image and the ``runs_under`` clean-up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from launcher.backends.specs import GPU_VARS, THREAD_VARS
from launcher.cli.plan import PREVIEW_RUN_ID
from launcher.engine.client import Engine
from launcher.engine.labels import RUN_LABEL, part_name
from tests.docker_fixtures import ours
from tests.helpers import only_run, read_json, run_launcher


def for_run(parts: list[dict[str, Any]], run_id: str) -> dict[str, dict[str, Any]]:
    """The plan's parts with the run's id where the plan had its stand-in, by name."""
    return {p["name"]: p for p in json.loads(json.dumps(parts).replace(PREVIEW_RUN_ID, run_id))}


@pytest.mark.docker
def test_docker_plan_json_is_what_start_launches(launcher_image: str, runs_under: Path, engine: Engine,
                                                docker_client: Any) -> None:
    args = ("--backend", "docker", "--image", launcher_image, "--results", str(runs_under), "--workers", "3",
            "--groups", "2", "--gpus", "none", "--max-steps", "5000000")
    shown = run_launcher("plan", "--json", *args, timeout=60)
    assert shown.returncode == 0, shown.stderr[-2000:]
    launch = json.loads(shown.stdout)["launch"]
    assert launch["backend"] == "docker" and [p["name"] for p in launch["parts"]] == ["master", "group-0", "group-1"]

    up = run_launcher("up", *args, "--detach", timeout=180)
    assert up.returncode == 0, up.stderr[-3000:]
    run = only_run(runs_under)
    try:
        planned = for_run(launch["parts"], run.name)
        containers = docker_client.containers.list(all=True, filters={"label": f"{RUN_LABEL}={run.name}"})
        assert sorted(part_name(c.labels) for c in containers) == sorted(planned)
        for c in containers:
            name = part_name(c.labels)
            part, config = planned[name], c.attrs["Config"]
            env = {k: v for k, _, v in (item.partition("=") for item in config["Env"] or [])}
            assert list(config["Cmd"]) == part["command"], name
            assert config["Image"] == part["image"], name
            for key, value in part["env"].items():  # every variable the launcher sets, as the plan says
                assert env.get(key) == value, (name, key)
            for key in (*GPU_VARS, *THREAD_VARS):  # and no other GPU or thread setting (the image's own included)
                assert env.get(key) == part["env"].get(key), (name, key)
            assert env["NVIDIA_VISIBLE_DEVICES"] == "void" and env["CUDA_VISIBLE_DEVICES"] == "", name
            mounts = {(m["Source"], m["Target"], bool(m.get("ReadOnly"))) for m in c.attrs["HostConfig"]["Mounts"] or []}
            assert {(m["source"], m["target"], m["read_only"]) for m in part["mounts"]} == mounts, name
        # The run's plan.json records exactly what was started.
        assert for_run(read_json(run / "plan.json")["launch"]["parts"], run.name) == planned
    finally:
        down = run_launcher("down", run.name, "--results", str(runs_under), timeout=90)
        assert down.returncode == 0, down.stderr[-2000:]
    assert ours(engine, runs_under) == ([], [])
