"""A user's algorithm is checked where the groups run: in a throw-away container of the run's image, with the
file's directory mounted as the run's containers get it. A module that does not import there is exit 2 before
anything of the run exists (issue 22 item 8)."""

from __future__ import annotations

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
