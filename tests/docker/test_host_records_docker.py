"""Issue 25 item 1 and finding 5 on the Docker backend: a run's containers get only its results directory,
never the launcher's records of it, and ``launcher down`` finds the run's containers by the engine's labels
whatever any record says.

Before, the master's ``/results`` held ``run.json``: a master that rewrote ``"backend": "process"`` was
neither removed by ``down`` nor ``down --all`` and kept its GPU leases.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from launcher.backends.docker import container_specs, teardown
from launcher.engine import labels as dc
from launcher.engine.client import Engine
from launcher.runs import RunDir
from tests.docker.test_docker_backend import prepared
from tests.helpers import read_json, run_dirs, run_launcher


def test_no_container_gets_the_launchers_records(tmp_path: Path) -> None:
    """Pure: the master's only writable bind is the results directory; nothing of ``<root>/.launcher``."""
    run = prepared(tmp_path, workers=4)
    master, groups = container_specs(run, image="img", gpu_runtime=False, uid_gid=(1234, 1234))
    host = str(run.run_dir.host.resolve())
    assert list(master.binds) == [str(run.results_dir.resolve())]
    for cs in (master, *groups):
        for source in (*cs.binds, *cs.read_only_binds):
            assert not source.startswith(host), f"{cs.name} gets {source}"


@pytest.mark.docker
def test_down_removes_a_docker_run_whose_records_say_process(tmp_path: Path, launcher_image: str,
                                                             engine: Engine) -> None:
    """The master container rewrites ``/results/run.json`` to ``"backend": "process"`` with no start times (as
    it could before, when that file was the launcher's record), and the launcher's own record is made to say
    ``process`` too: `down` still stops and removes every container and the network, found by label."""
    root = tmp_path / "results"
    root.mkdir()
    out = run_launcher("up", "--detach", "--backend", "docker", "--image", launcher_image, "--gpus", "none",
                       "--workers", "2", "--groups", "1", "--max-steps", "2000000", "--results", str(root), "--json",
                       timeout=300)
    run_id = ""
    try:
        assert out.returncode == 0, out.stderr[-3000:]
        run = run_dirs(root)[0]
        run_id = run.name
        rd = RunDir(run_id, run)
        assert not rd.legacy and read_json(rd.host / "run.json")["backend"] == "docker"
        master = next(c for c in engine.containers({dc.RUN_LABEL: run_id}) if c.labels.get(dc.ROLE_LABEL) == "master")
        mounts = json.loads(subprocess.run(["docker", "inspect", "--format", "{{json .Mounts}}", master.id],
                                           capture_output=True, text=True, check=True).stdout)
        assert not [m for m in mounts if m["Source"].startswith(str(rd.host.resolve()))], mounts
        # The copy is the launcher's file, but the directory is the container's: it replaces the file.
        code = ("import json, os; p = '/results/run.json'; d = json.load(open(p)); d.pop('starts', None); "
                "d.update(backend='process', pids={'master': 1}); json.dump(d, open(p + '.new', 'w')); "
                "os.replace(p + '.new', p)")
        done = subprocess.run(["docker", "exec", master.id, "python", "-c", code], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert read_json(run / "run.json")["backend"] == "process"  # the container could write that copy
        rd.update_record(backend="process", starts={})  # and whatever our own record says
        down = run_launcher("down", run_id, "--results", str(root), "--json", timeout=180)
        assert down.returncode == 0, down.stderr[-2000:]
        assert engine.containers({dc.RUN_LABEL: run_id}) == [], "down left the run's containers"
        assert engine.networks({dc.RUN_LABEL: run_id}) == [], "down left the run's network"
        (report,) = json.loads(down.stdout)["runs"]
        assert len(report["containers"]) == 2 and report["pids"] == [], report
    finally:
        if run_id:
            teardown(engine, run_id, grace_s=1)
