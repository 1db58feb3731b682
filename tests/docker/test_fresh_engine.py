"""A fresh machine, reproduced (issue 11): README's first command on a Docker engine that has no images at all.

The engine is an extra ``dockerd`` started for this test (tests/testbed/, ``fresh_engine``): an empty data
root, its own socket, and a network namespace with no route out, so no registry answers it, as on an
air-gapped or freshly installed host. ``scripts/quickstart.sh`` runs in a copy of the repository (its own
``.venv``, made by ``scripts/setup.sh``; pip may use the host's cache and ``docker/wheels`` is linked in, as
a user who fetched wheels before would have) with DOCKER_HOST pointing at that engine. It must build the
image the only way that can work there (offline: debootstrap base + host-side wheels) and solve CartPole.

The wall time is split into setup, image build and training, printed and recorded as test properties
(``--junitxml`` carries them). Marked ``fresh`` and ``slow`` (several minutes cold): CI runs it as a step of
its own with ``-m fresh``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.helpers import ROOT, child_env, run_dirs
from tests.testbed import daemon
from tests.testbed.bed import Bed

pytestmark = [pytest.mark.fresh, pytest.mark.slow, pytest.mark.docker, pytest.mark.testbed]

QUICKSTART_TIMEOUT_S = 1500


def _copy_repo(dest: Path) -> None:
    """The tracked files as they are in the work tree (what a fresh clone of this commit would hold), and
    docker/wheels/ hard-linked (the host's earlier wheel download; the build would fetch it otherwise)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    if (ROOT / "docker" / "wheels").is_dir():
        subprocess.run(["cp", "-al", str(ROOT / "docker" / "wheels"), str(dest / "docker" / "wheels")], check=True)


def _images(node: Any) -> list[str]:
    return daemon.docker(node, "images", "--format", "{{.Repository}}:{{.Tag}}", timeout=30).stdout.split()


def _watch(poll: Callable[[], bool], stop: threading.Event) -> dict[str, float]:
    """Start a thread that records (monotonic) when ``poll`` first holds; returns the dict it fills."""
    seen: dict[str, float] = {}

    def loop() -> None:
        while not stop.is_set() and "at" not in seen:
            try:
                if poll():
                    seen["at"] = time.monotonic()
            except Exception:  # noqa: BLE001 - the engine may be busy building; look again
                pass
            stop.wait(1.0)

    threading.Thread(target=loop, daemon=True).start()
    return seen


def _hand_over(node: Any) -> float:
    """The images the quickstart built (the worker image and its base) into the suite's own engine: they carry
    the digest of this source (``launcher.source``), so the session's image fixture and every `launcher build`
    after this find them up to date instead of building the same thing again (one cold build per CI run, not
    two). Not when ``LAUNCHER_TEST_IMAGE_TAG`` names another tag (a second checkout sharing the engine)."""
    if os.environ.get("LAUNCHER_TEST_IMAGE_TAG"):
        return 0.0
    from launcher.image import Flavour, OFFLINE_BASE_IMAGE, default_tag

    tags = [t for t in (default_tag(Flavour.CPU), OFFLINE_BASE_IMAGE) if t in _images(node)]
    t0 = time.monotonic()
    save = subprocess.Popen(["docker", "-H", node.docker_host, "save", *tags], stdout=subprocess.PIPE)
    try:
        load = subprocess.run(["docker", "load"], stdin=save.stdout, capture_output=True, text=True, timeout=900)
    finally:
        assert save.stdout is not None
        save.stdout.close()
        save.wait(timeout=120)
    assert save.returncode == 0 and load.returncode == 0, load.stderr[-2000:]
    return time.monotonic() - t0


def test_quickstart_on_an_engine_with_no_images_builds_offline_and_solves_cartpole(
        fresh_engine: Bed, tmp_path: Path, record_property: Any) -> None:
    node = fresh_engine.manager
    assert _images(node) == [], "the engine starts with no images at all"
    repo = tmp_path / "repo"
    _copy_repo(repo)
    results = tmp_path / "results"

    env = child_env(DOCKER_HOST=node.docker_host)
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT)))
    stop = threading.Event()
    built = _watch(lambda: any(i.startswith("launcher:") for i in _images(node)), stop)
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", "scripts/quickstart.sh", "--results", str(results), "--json"], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            if time.monotonic() - t0 > QUICKSTART_TIMEOUT_S:
                break
        proc.wait(timeout=60)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    end = time.monotonic()
    output = "\n".join(text for _, text in lines)
    assert proc.returncode == 0, f"quickstart exited {proc.returncode}:\n{output[-6000:]}"

    setup_done = next((t for t, text in lines if text.startswith("setup: .venv")), None)
    assert setup_done is not None, output[-3000:]
    assert built.get("at", setup_done) >= setup_done
    build_done = built.get("at")
    assert build_done is not None, "the image appeared on the fresh engine"
    (run_dir,) = [p for p in run_dirs(results) if p.is_dir()]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["state"] == "finished" and result["summary"]["target_reached"], result
    assert json.loads((run_dir / "run.json").read_text())["backend"] == "docker", "an engine answered: Docker"
    assert (run_dir / "model" / "final_model.keras").is_file()
    assert any(i.startswith("launcher-base:") for i in _images(node)), "the base was made offline (debootstrap)"
    leftovers = daemon.docker(node, "ps", "-aq", "--filter", "label=launcher.run", timeout=30).stdout.split()
    assert leftovers == [], "the run removed its containers"

    handed_s = _hand_over(node)
    times = {"setup_s": setup_done - t0, "image_build_s": build_done - setup_done, "training_s": end - build_done,
             "total_s": end - t0, "hand_over_s": handed_s}
    for key, value in times.items():
        record_property(key, round(value, 1))
    print("fresh machine: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
