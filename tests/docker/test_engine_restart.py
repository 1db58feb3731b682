"""Issue 14, item 9: the Docker engine is killed (``kill -9``) and started again while a run trains.

The engine is a private ``dockerd`` of the test bed (tests/testbed/, one node, no swarm), never the default
daemon other tests share; the launcher reaches it through ``DOCKER_HOST``. The launcher image is copied onto
it first (tens of seconds). While the engine is down the supervisor waits for it (up to
``ENGINE_RESTART_WINDOW_S``); when it answers again the run goes on or ends, and either way the launcher
exits on its own, prints no traceback, and the engine keeps no container or network of the run.

At commit c1dca51 the first failed ``inspect`` ended the supervisor, the teardown's engine calls failed in turn
(a connection error the SDK left unwrapped: a traceback) and the run's containers and network stayed behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, child_env, launcher_cmd, wait_for, run_dirs
from tests.testbed import daemon
from tests.testbed.bed import Bed, BedSpec
from tests.testbed.fixtures import copy_image

pytestmark = [pytest.mark.docker, pytest.mark.testbed, pytest.mark.slow]

DOWN_S = float(os.environ.get("ENGINE_DOWN_S", "5"))  # how long the engine stays dead


def _status(run: Path) -> dict[str, Any]:
    try:
        doc = json.loads((run / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _leftovers(bed: Bed, run_id: str) -> tuple[str, str]:
    node = bed.nodes[0]
    flt = f"label=launcher.run={run_id}"
    containers = daemon.docker(node, "ps", "-aq", "--filter", flt, timeout=60).stdout.strip()
    networks = daemon.docker(node, "network", "ls", "-q", "--filter", flt, timeout=60).stdout.strip()
    return containers, networks


def test_a_run_survives_an_engine_restart_and_leaves_nothing(bed_factory: Callable[[BedSpec], Bed],
                                                             tmp_path: Path) -> None:
    image = os.environ.get("LAUNCHER_TEST_IMAGE", "launcher:0.1.0-cpu")
    if subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=60).returncode != 0:
        pytest.skip(f"no image {image} on the default engine to copy")
    bed = bed_factory(BedSpec(nodes=1, swarm=False, registry=False))
    node = bed.nodes[0]
    print(f"{image} copied onto the bed's engine in {copy_image(image, bed):.0f} s")
    root = tmp_path / "results"
    root.mkdir()
    proc = subprocess.Popen(
        launcher_cmd("up", "--backend", "docker", "--image", image, "--gpus", "none", "--workers", "2", "--groups", "2",
                     "--max-steps", "60000", "--results", str(root), "--json", "--progress", "plain"),
        cwd=ROOT, env=child_env(DOCKER_HOST=node.docker_host), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    run_id = ""
    try:
        run = wait_for(lambda: next((p for p in run_dirs(root) if p.is_dir()), None), 120, "the run directory")
        run_id = run.name
        wait_for(lambda: (_status(run).get("env_steps") or 0) > 0 or proc.poll() is not None, 300, "training")
        assert proc.poll() is None, proc.communicate()[1][-3000:]

        pid = daemon.pid_of(node)
        assert pid is not None
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)  # the engine dies: no goodbye to its clients
        wait_for(lambda: daemon.gone(pid), 20, "the engine to die")
        time.sleep(DOWN_S)
        assert proc.poll() is None, "the launcher gave up while the engine was down:\n" + proc.communicate()[1][-3000:]
        daemon.start(node)  # the same data root: it finds the run's containers and network again
        print(f"engine back after {time.monotonic() - t0:.1f} s")
        out, err = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(err[-2500:])
    assert "Traceback" not in err, err[-4000:]
    assert proc.returncode in (0, 7), (proc.returncode, err[-3000:])
    result = json.loads(out)
    assert result["state"] in ("finished", "failed"), result
    assert "engine" in err and "waiting up to" in err, "the outage was not reported"
    containers, networks = _leftovers(bed, run_id)
    assert (containers, networks) == ("", ""), f"left on the engine: containers {containers!r}, networks {networks!r}"
    assert not any((run / "logs").glob("*.log")) or all(
        b"Traceback" not in f.read_bytes() for f in (run / "logs").glob("*.log") if f.name != "master.log"), \
        "a group died with a traceback"
