"""pytest fixtures of the test bed (loaded by tests/conftest.py through ``pytest_plugins``).

* ``swarm_bed``: a 3-node swarm (a dedicated manager and two workers, each its own dockerd in its own
  network namespace; node 0 advertises one made-up GPU, nodes 1 and 2 two each) and a registry on localhost:5000
  seen from every node; one per test module, removed at the module's end even when a test fails.
* ``fresh_engine``: one extra dockerd with an empty data root, its own socket and no registry or
  route out of its namespace (a fresh machine's engine); one per test.
* ``nvidia_engine``: one extra dockerd with the stand-in NVIDIA toolkit (an ``nvidia`` runtime and a no-op
  ``nvidia-container-runtime-hook``, so DeviceRequests of driver ``nvidia`` work) and the launcher image
  copied onto it; one per session (the copy takes tens of seconds).
* ``bed_factory``: ``bed_factory(BedSpec(...)) -> Bed`` for other shapes, each removed at teardown.

Every fixture skips, with the reason, where a bed cannot exist (not root, no dockerd/nsenter/unshare/ip);
a teardown that leaves anything behind fails the test that used it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest

from tests.testbed import registry
from tests.testbed.bed import Bed, BedSpec, bring_up, tear_down

MARKERS = [
    "testbed: brings up extra Docker daemons in network namespaces (root); tests/testbed/",
    "multinode: a swarm across several daemons of the test bed, with a local registry",
    "fresh: an engine with no images at all, as on a fresh machine (builds the image cold; minutes)",
]


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)


def unavailable(need_registry: bool = False) -> str | None:
    """Why a bed cannot be brought up here (for a skip), or None."""
    if os.geteuid() != 0:
        return "the test bed needs root (network namespaces, extra dockerd)"
    for tool in ("dockerd", "docker", "nsenter", "unshare", "ip", "umount"):
        if shutil.which(tool) is None:
            return f"the test bed needs `{tool}`"
    if need_registry:
        return registry.available()
    return None


def _bed(spec: BedSpec) -> Iterator[Bed]:
    reason = unavailable(need_registry=spec.registry)
    if reason:
        pytest.skip(reason)
    bed = bring_up(spec)
    try:
        yield bed
    finally:
        problems = tear_down(bed)
    assert not problems, f"test bed {bed.id} teardown: {problems}"


@pytest.fixture(scope="module")
def swarm_bed() -> Iterator[Bed]:
    yield from _bed(BedSpec(nodes=3, swarm=True, registry=True, gpus=(1, 2, 2)))


@pytest.fixture
def fresh_engine() -> Iterator[Bed]:
    yield from _bed(BedSpec(nodes=1, swarm=False, registry=False))


def copy_image(image: str, bed: Bed) -> float:
    """``docker save IMAGE | docker -H <node> load`` onto every node of ``bed``; returns the seconds it took.

    Why not the bed's registry: a push and a pull move the same bytes twice and need port 5000, which another
    bed may hold; a pipe from the default engine moves them once.

    Raises:
        RuntimeError: the image is not on the default engine, or a load failed (with docker's stderr).
    """
    t0 = time.monotonic()
    for node in bed.nodes:
        save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        load = subprocess.run(["docker", "-H", node.docker_host, "load", "-q"], stdin=save.stdout,
                              capture_output=True, text=True, timeout=600)
        assert save.stdout is not None and save.stderr is not None
        save.stdout.close()
        save_err = save.stderr.read().decode(errors="replace")
        if save.wait(timeout=60) != 0 or load.returncode != 0:
            raise RuntimeError(f"copying {image} onto {node.name} failed: {save_err.strip()} {load.stderr.strip()}")
    return time.monotonic() - t0


@pytest.fixture(scope="session")
def nvidia_engine() -> Iterator[Bed]:
    image = os.environ.get("LAUNCHER_TEST_IMAGE", "launcher:0.1.0-cpu")
    if subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=60).returncode != 0:
        pytest.skip(f"no image {image} on the default engine to copy (`launcher build`)")
    beds = _bed(BedSpec(nodes=1, swarm=False, registry=False, nvidia=True))
    bed = next(beds)
    try:
        print(f"test bed {bed.id}: {image} copied onto its engine in {copy_image(image, bed):.1f} s")
        yield bed
    finally:
        for _ in beds:  # the rest of _bed: tear the bed down and check nothing was left
            pass


@pytest.fixture
def bed_factory() -> Iterator[Callable[[BedSpec], Bed]]:
    made: list[Bed] = []

    def make(spec: BedSpec) -> Bed:
        reason = unavailable(need_registry=spec.registry)
        if reason:
            pytest.skip(reason)
        bed = bring_up(spec)
        made.append(bed)
        return bed

    yield make
    problems = [p for bed in made for p in tear_down(bed)]
    assert not problems, f"test bed teardown: {problems}"
