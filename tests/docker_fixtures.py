"""Fixtures for tests that need a real Docker engine (``@pytest.mark.docker``).

* ``docker_client``: a client that answered a ping; the test is skipped when no engine answers.
* ``launcher_image``: the worker image tag, built ONCE per session through the project's own offline
  path (:func:`launcher.image_build.build_image`): debootstrap base and host-side wheels are made if missing,
  then ``docker build`` with no network. Unchanged layers come from the engine's cache, so a session
  after the first pays seconds, not minutes. ``LAUNCHER_TEST_NO_CACHE=1`` rebuilds every layer.
* ``run_container``: starts a container labelled ``launcher.run=test-<id>``, waits for it and returns
  (exit status, output); every container it creates is removed at teardown, even when the test fails.

tests/conftest.py loads this module with ``pytest_plugins``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from launcher.errors import MissingDependency
from launcher.backends.docker import teardown
from launcher.engine import Engine, connect_client as connect
from launcher.engine import labels as dc
from launcher.engine.client import Container
from launcher.image import BuildOptions, Flavour, default_tag
from launcher.image_build import build_image

log = logging.getLogger("tests.docker")

TEST_LABEL = "launcher.run"
RunContainer = Callable[..., "tuple[int, str]"]


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    try:
        client = connect()
    except MissingDependency as exc:
        pytest.skip(f"no Docker engine: {exc}")
    yield client
    client.close()


@pytest.fixture(scope="session")
def launcher_image(docker_client: Any) -> str:
    """The CPU worker image, built through the offline path once per session; returns its tag
    (``LAUNCHER_TEST_IMAGE_TAG`` names another, so a second checkout's session on the same engine does not
    retag the image a first one is using)."""
    options = BuildOptions(
        tag=os.environ.get("LAUNCHER_TEST_IMAGE_TAG") or default_tag(Flavour.CPU),
        flavour=Flavour.CPU,
        offline=True,
        no_cache=os.environ.get("LAUNCHER_TEST_NO_CACHE") == "1",
    )
    result = build_image(options, progress=log.info, client=docker_client)
    log.warning("test image %s built in %.0f s (%.2f GB)", result.tag, result.seconds, result.size_bytes / 1e9)
    return result.tag


# Per session: a second test session on the same engine (another checkout) removes its own at its end, not ours.
PAUSE_IMAGE = f"launcher-test-pause:{os.getpid()}"


@pytest.fixture(scope="session")
def pause_image(docker_client: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A one-file image (a static C program that sleeps), imported without a registry; removed at the end."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc to build the pause binary")
    work = tmp_path_factory.mktemp("pause")
    (work / "pause.c").write_text("#include <unistd.h>\nint main(void){for(;;)pause();}\n")
    built = subprocess.run([gcc, "-static", "-O1", "-o", str(work / "pause"), str(work / "pause.c")], capture_output=True)
    if built.returncode:
        pytest.skip(f"cannot link statically: {built.stderr.decode()[:200]}")
    subprocess.run(["tar", "-C", str(work), "-cf", str(work / "rootfs.tar"), "pause"], check=True)
    repository, tag = PAUSE_IMAGE.split(":")
    docker_client.api.import_image_from_file(str(work / "rootfs.tar"), repository=repository, tag=tag)
    yield PAUSE_IMAGE
    try:
        docker_client.images.remove(PAUSE_IMAGE, force=True)
    except Exception as exc:  # noqa: BLE001 - a container another test left may still use it; say so
        log.warning("could not remove %s: %s", PAUSE_IMAGE, exc)


@pytest.fixture
def run_container(docker_client: Any) -> Iterator[RunContainer]:
    """``run_container(image, command, **kwargs) -> (exit_status, output)``; no network by default.

    kwargs go to ``containers.create`` (``user=``, ``entrypoint=``, ``environment=``, ...).
    """
    created: list[Any] = []

    def run(image: str, command: Any = None, *, timeout_s: float = 120, **kwargs: Any) -> tuple[int, str]:
        kwargs.setdefault("network_disabled", True)
        container = docker_client.containers.create(
            image, command, labels={TEST_LABEL: f"test-{uuid.uuid4().hex[:12]}"}, **kwargs
        )
        created.append(container)
        container.start()
        status = container.wait(timeout=timeout_s)
        output = container.logs(stdout=True, stderr=True).decode(errors="replace")
        return int(status["StatusCode"]), output

    yield run
    for container in created:
        try:
            container.remove(force=True)
        except Exception as exc:  # noqa: BLE001 - teardown must try every container
            log.warning("could not remove test container %s: %s", container.short_id, exc)


@pytest.fixture
def engine(docker_client: Any) -> Iterator[Engine]:
    """The launcher's own wrapper (:class:`launcher.engine.Engine`) on the suite's engine, closed after the test."""
    e = Engine()
    yield e
    e.close()


def ours(engine: Engine, root: Path) -> tuple[list[Container], list[str]]:
    """(containers, network names) whose ``launcher.results`` label points below ``root``."""
    prefix = str(root.resolve())
    snaps = [s for s in engine.containers({dc.RUN_LABEL: None})
             if s.labels.get(dc.RESULTS_LABEL, "").startswith(prefix)]
    nets = [name for _, name, labels in engine.networks({dc.RUN_LABEL: None})
            if labels.get(dc.RESULTS_LABEL, "").startswith(prefix)]
    return snaps, nets


def cleanup_docker(engine: Engine, root: Path) -> tuple[list[str], list[str]]:
    """Remove whatever a test left on the engine under ``root``; return what it had left (container and
    network names, for the assert)."""
    snaps, nets = ours(engine, root)
    for rid in {s.labels.get(dc.RUN_LABEL) for s in snaps}:
        teardown(engine, rid, grace_s=1)
    for name in ours(engine, root)[1]:
        engine.remove_network(name)
    return [s.name for s in snaps], nets


@pytest.fixture
def runs_under(tmp_path: Path, engine: Engine) -> Iterator[Path]:
    """A results root; at teardown nothing labelled with it may remain (removed, and the test fails)."""
    root = tmp_path / "results"
    root.mkdir()
    yield root
    containers, nets = cleanup_docker(engine, root)
    assert ours(engine, root) == ([], [])
    assert not containers and not nets, f"the test left {containers} and {len(nets)} network(s) behind"


def as_invoker() -> tuple[dict[str, str], int]:
    """Environment for a child `launcher up`, and the uid whose files the results must be: as root, act as
    `sudo` would for user 4242, so ownership (results, a swarm secret file) is proven for a uid other than
    the launcher's."""
    if os.geteuid() == 0:
        return {"SUDO_UID": "4242", "SUDO_GID": "4242"}, 4242
    return {}, os.getuid()
