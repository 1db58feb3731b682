"""Env packages and users' modules in containers, on a real engine: ``launcher build --with WHEEL`` makes the
derived image (``BASE-with-HASH``, labelled ``launcher.extras``), ``launcher up --with WHEEL`` runs on it, a
user's module comes in with ``--env-dir`` (read-only mount + PYTHONPATH), and the env check refuses a module the
image lacks before any container of the run starts (exit 6), leaving nothing behind.

Every run works under its own results root; ``runs_under`` removes and fails on anything labelled with it, and
the derived image is removed at the end of the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.engine import labels as dc
from launcher.engine.client import Engine, remove_container
from launcher.image import EXTRAS_BASE_LABEL, EXTRAS_LABEL, EXTRAS_PACKAGES_LABEL
from launcher.image_extras import remove_abandoned_builds, this_host
from launcher.procs import proc_info
from tests.docker_fixtures import ours
from tests.helpers import ROOT, child_env, launcher_cmd

DATA = Path(__file__).resolve().parents[1] / "data"
pytestmark = pytest.mark.docker
DANGLING_BEFORE: set[str] = set()  # untagged images before the derived build (other builds leave some)
BUILD_LOG: list[str] = []  # the derived build's stderr
ABANDONED = "launcher-extras-0123456789ab-{host}-{pid}-{start}"  # a build container's name (launcher.image_extras)


def _gone_pid() -> int:
    """A pid no process has now: a child's that was waited for."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _pause_container(docker_client: Any, image: str, name: str) -> str:
    """A container named like a build container and labelled like one (the digest is made up); its id."""
    return str(docker_client.api.create_container(image, ["/pause"], name=name,
                                                labels={EXTRAS_LABEL: "0123456789ab"})["Id"])


@pytest.fixture(scope="module")
def envpkg_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("envpkg")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(DATA / "envpkg")], check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("launcher_test_envpkg-*.whl")
    return wheel


@pytest.fixture(scope="module")
def extras_image(launcher_image: str, envpkg_wheel: Path, docker_client: Any, pause_image: str) -> Iterator[str]:
    """``launcher build --offline --with WHEEL``: the tag it prints; the image is removed afterwards. Before it, a
    build container that a SIGKILLed launcher on this host left (its pid gone), which the build removes."""
    global DANGLING_BEFORE
    DANGLING_BEFORE = set(docker_client.api.images(filters={"dangling": True}, quiet=True))
    left = _pause_container(docker_client, pause_image, ABANDONED.format(host=this_host(), pid=_gone_pid(), start=1))
    try:
        done = subprocess.run(launcher_cmd("build", "--offline", "--with", str(envpkg_wheel)), cwd=ROOT,
                              env=child_env(), capture_output=True, text=True, timeout=900)
    finally:
        remove_container(left, docker_client)
    assert done.returncode == 0, done.stderr[-4000:]
    BUILD_LOG.append(done.stderr)
    tag = done.stdout.strip()
    try:
        yield tag
    finally:
        try:
            docker_client.images.remove(tag, force=True)
        except Exception as exc:  # noqa: BLE001 - say so, do not hide the test's own result
            print(f"could not remove {tag}: {exc}")


def test_build_with_a_wheel_makes_a_small_derived_image(extras_image: str, launcher_image: str,
                                                        envpkg_wheel: Path, docker_client: Any) -> None:
    assert extras_image.startswith(launcher_image + "-with-") and extras_image != launcher_image
    attrs = docker_client.api.inspect_image(extras_image)
    labels = attrs["Config"]["Labels"]
    assert extras_image.endswith(labels[EXTRAS_LABEL])
    assert json.loads(labels[EXTRAS_PACKAGES_LABEL])[0].startswith(envpkg_wheel.name + "@sha256:")
    base = docker_client.api.inspect_image(launcher_image)
    for key in ("User", "Entrypoint", "Cmd", "Env", "WorkingDir"):  # the base's own configuration, not the build's
        assert attrs["Config"].get(key) == base["Config"].get(key), key
    # One small layer on top of the base: the wheels stay out of it.
    assert attrs["RootFS"]["Layers"][:len(base["RootFS"]["Layers"])] == base["RootFS"]["Layers"]
    assert len(attrs["RootFS"]["Layers"]) == len(base["RootFS"]["Layers"]) + 1
    assert attrs["Size"] - base["Size"] < 5 * 2**20
    # Nothing of the build is left but the tagged image: no untagged image, no build container.
    assert set(docker_client.api.images(filters={"dangling": True}, quiet=True)) - DANGLING_BEFORE == set()
    assert docker_client.api.containers(all=True, filters={"label": f"{EXTRAS_LABEL}={labels[EXTRAS_LABEL]}"}) == []
    # The build container a killed launcher left before this build: removed by it, and said so.
    assert "removed build container launcher-extras-0123456789ab-" in BUILD_LOG[0], BUILD_LOG[0][-2000:]
    assert docker_client.api.containers(all=True, filters={"label": f"{EXTRAS_LABEL}=0123456789ab"}) == []
    assert {k: v for k, v in labels.items() if k not in base["Config"]["Labels"]} == {
        EXTRAS_LABEL: labels[EXTRAS_LABEL], EXTRAS_PACKAGES_LABEL: labels[EXTRAS_PACKAGES_LABEL],
        EXTRAS_BASE_LABEL: launcher_image}  # the build's own labels and nothing else
    # The package is in the venv, and the staged wheels are not in the image.
    probe = docker_client.containers.run(
        extras_image, entrypoint=["sh", "-c", "test ! -e /tmp/launcher-extras && python -c 'import launcher_test_envpkg'"],
        network_disabled=True, remove=True, labels={dc.RUN_LABEL: "test-extras-probe"}, stderr=True)
    assert probe == b""
    # Asked again (same base, same wheel): the same tag, found on the engine, no build.
    done = subprocess.run(launcher_cmd("build", "--offline", "--with", str(envpkg_wheel)), cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == extras_image, done.stderr[-2000:]
    assert "is on the engine already" in done.stderr


def test_only_build_containers_whose_launcher_is_gone_are_removed(docker_client: Any, pause_image: str) -> None:
    """A build container's name says which launcher on which host made it: one on this host whose pid is gone, or
    whose pid now names another process (another start time), is removed; a live launcher's, another host's and a
    container not named like a build's stay."""
    me = proc_info(os.getpid())
    assert me is not None
    names = {
        "dead": ABANDONED.format(host=this_host(), pid=_gone_pid(), start=me.start_ticks),
        "reused": ABANDONED.format(host=this_host(), pid=os.getpid(), start=me.start_ticks + 1),
        "live": ABANDONED.format(host=this_host(), pid=os.getpid(), start=me.start_ticks),
        "elsewhere": ABANDONED.format(host="another-host", pid=_gone_pid(), start=1),
        "unnamed": f"launcher-test-extras-{os.getpid()}",
    }
    ids = {key: _pause_container(docker_client, pause_image, name) for key, name in names.items()}
    try:
        said: list[str] = []
        gone = remove_abandoned_builds(docker_client, said.append)
        assert sorted(gone) == sorted([names["dead"], names["reused"]])
        assert said == [f"removed build container {n}: the launcher that made it is gone" for n in gone]
        left = {c["Id"] for c in docker_client.api.containers(all=True, filters={"label": EXTRAS_LABEL})}
        assert {k for k, i in ids.items() if i in left} == {"live", "elsewhere", "unnamed"}
        assert remove_abandoned_builds(docker_client, said.append) == []  # nothing more the second time
    finally:
        for container_id in ids.values():
            remove_container(container_id, docker_client)


def _up(root: Path, image: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(launcher_cmd("up", "--backend", "docker", "--image", image, "--gpus", "none", "--workers",
                                       "2", "--results", str(root), "--progress", "off", "--json", *args),
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)


def _finished(done: subprocess.CompletedProcess[str], root: Path) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["state"] == "finished" and result["summary"]["env_steps"] >= 2000
    run = root / result["run_id"]
    for name in ("summary.json", "metrics.jsonl", "model/policy.npz", "logs/master.log", "logs/group-0.log"):
        assert (run / name).is_file(), name
    return result


def test_a_package_env_runs_in_containers_of_the_derived_image(extras_image: str, launcher_image: str,
                                                               envpkg_wheel: Path, runs_under: Path) -> None:
    # `up --with` picks the image `build --with` made (same base, same wheel: same hash).
    done = _up(runs_under, launcher_image, "--with", str(envpkg_wheel), "--env", "launcher_test_envpkg:TinyPkg-v0",
               "--env-arg", "length=10", "--max-steps", "2000")
    result = _finished(done, runs_under)
    run = runs_under / result["run_id"]
    assert json.loads((run / "run.json").read_text())["image"] == extras_image
    assert json.loads((run / "spec.json").read_text())["env_args"] == {"length": 10}
    assert json.loads((run / "config.json").read_text())["with_packages"] == [str(envpkg_wheel)]


def test_a_user_module_runs_in_containers_through_env_dir(launcher_image: str, runs_under: Path,
                                                          engine: Engine) -> None:  # noqa: F811
    done = _up(runs_under, launcher_image, "--env", "lab_env:LabTiny-v0", "--env-dir", str(DATA / "userenv"),
               "--env-arg", "length=12", "--max-steps", "2000")
    result = _finished(done, runs_under)
    config = json.loads((runs_under / result["run_id"] / "config.json").read_text())
    assert config["env_dir"] == str(DATA / "userenv") and config["env_args"] == {"length": 12}


def test_the_env_check_refuses_a_module_the_image_lacks_before_any_container_starts(
        launcher_image: str, runs_under: Path, engine: Engine) -> None:  # noqa: F811
    before = {c.id for c in engine.containers({dc.RUN_LABEL: None})}
    done = _up(runs_under, launcher_image, "--env", "lab_env:LabTiny-v0", "--max-steps", "2000")  # no --env-dir
    assert done.returncode == 6, done.stderr[-3000:]
    err = done.stderr
    assert f"--env 'lab_env:LabTiny-v0' cannot be made where the worker groups will run (image {launcher_image} " \
           f"as uid:gid" in err and "no network" in err
    assert "module 'lab_env' cannot be imported" in err and "nothing was started" in err
    assert "HINT: add it to the run's image: `launcher up --with" in err and "--env-dir DIR" in err
    assert done.stdout == ""
    assert not any(runs_under.iterdir()), "no run directory"
    assert ours(engine, runs_under) == ([], []), "no container or network of the run"
    assert {c.id for c in engine.containers({dc.RUN_LABEL: None})} <= before, "the probe container is gone"
    # A wrong id in a package the image has: exit 2, the ids it does register suggested.
    done = _up(runs_under, launcher_image, "--env", "lab_env:LabTiny-v9", "--env-dir", str(DATA / "userenv"),
               "--max-steps", "2000")
    assert done.returncode == 2 and "did you mean 'LabTiny-v0'" in done.stderr, done.stderr[-2000:]
    assert not any(runs_under.iterdir())
