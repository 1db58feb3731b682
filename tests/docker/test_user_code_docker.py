"""A user's algorithm is checked where the groups run: in a throw-away container of the run's image, with the
file's directory mounted as the run's containers get it. A module that does not import there is exit 2 before
anything of the run exists (issue 22 item 8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.engine import Engine
from tests.docker_fixtures import ours
from tests.helpers import ROOT, run_launcher

CODE = ROOT / "tests" / "data" / "usercode"


@pytest.mark.docker
@pytest.mark.parametrize("algo,args,says", [
    (f"{CODE / 'broken_import.py'}:Anything", (), "No module named 'no_such_package_for_launcher_tests'"),
    (f"{CODE / 'reinforce.py'}:Reinforce", ("--set", "learning_rate=1"), "unknown"),
])
def test_user_code_is_checked_in_the_image_before_anything_starts(launcher_image: str, tmp_path: Path,
                                                                  engine: Engine, algo: str, args: tuple[str, ...],
                                                                  says: str) -> None:
    proc = run_launcher("up", "--backend", "docker", "--image", launcher_image, "--gpus", "none", "--workers", "2",
                        "--algo", algo, *args, "--max-steps", "1000", "--results", str(tmp_path), timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert says in proc.stderr and f"image {launcher_image}" in proc.stderr, proc.stderr  # asked in the image
    assert "/opt/launcher/code/0 mounted" in proc.stderr  # as the run's containers would see the file
    assert "nothing was started" in proc.stderr
    assert not list(tmp_path.iterdir())  # no run directory
    assert ours(engine, tmp_path) == ([], [])  # the probe's container is gone, and no run container was made


@pytest.mark.docker
def test_a_group_whose_code_raises_is_not_restarted_by_the_engine(launcher_image: str, runs_under: Path,
                                                                  engine: Engine) -> None:
    """A group that exits 5 (the algorithm's code raised) would raise again: an attached Docker run's groups
    have no engine restart policy (Docker's on-failure cannot tell exit codes apart), and the supervisor does not
    restart it. The run fails with the actor's error; the group's saved log says it was never restarted."""
    proc = run_launcher("up", "--backend", "docker", "--image", launcher_image, "--gpus", "none", "--workers", "2",
                        "--groups", "2", "--algo", f"{CODE / 'reinforce.py'}:Reinforce", "--set", "fault=collect",
                        "--max-steps", "100000", "--results", str(runs_under), "--json", timeout=300)
    assert proc.returncode == 7, proc.stderr[-3000:]
    assert "RuntimeError: the actor broke while collecting (fault=collect)" in proc.stdout
    result = json.loads(proc.stdout)
    assert set(result["restarts"].values()) == {0}, result["restarts"]
    assert "restarting it" not in proc.stderr, proc.stderr[-3000:]
    (run,) = [p for p in runs_under.iterdir() if not p.name.startswith(".")]
    headers = [line for f in sorted((run / "logs").glob("group-*.log")) for line in f.read_text().splitlines()
               if "output of container" in line]
    assert headers and all(" 0 restart(s)" in h for h in headers), headers
