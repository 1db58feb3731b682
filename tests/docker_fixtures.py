"""Fixtures for tests that need a real Docker engine (``@pytest.mark.docker``).

* ``docker_client``: a client that answered a ping; the test is skipped when no engine answers.
* ``launcher_image``: the worker image tag, built ONCE per session through the project's own offline
  path (:func:`launcher.image.build_image`): debootstrap base and host-side wheels are made if missing,
  then ``docker build`` with no network. Unchanged layers come from the engine's cache, so a session
  after the first pays seconds, not minutes. ``LAUNCHER_TEST_NO_CACHE=1`` rebuilds every layer.
* ``run_container``: starts a container labelled ``launcher.run=test-<id>``, waits for it and returns
  (exit status, output); every container it creates is removed at teardown, even when the test fails.

tests/conftest.py loads this module with ``pytest_plugins``.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Callable, Iterator

import pytest

from launcher.errors import MissingDependency
from launcher.image import BuildOptions, Flavour, build_image, connect, default_tag

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
    """The CPU worker image, built through the offline path once per session; returns its tag."""
    options = BuildOptions(
        tag=default_tag(Flavour.CPU),
        flavour=Flavour.CPU,
        offline=True,
        no_cache=os.environ.get("LAUNCHER_TEST_NO_CACHE") == "1",
    )
    result = build_image(options, progress=log.info, client=docker_client)
    log.warning("test image %s built in %.0f s (%.2f GB)", result.tag, result.seconds, result.size_bytes / 1e9)
    return result.tag


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
