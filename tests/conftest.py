"""Shared pytest configuration."""

# First: it hides the host's admin lease store and site policy (a private mount namespace) before anything else
# runs, and checks at the end that the suite left them and the user list as they were.
pytest_plugins = ["tests.host_guard"]
pytest_plugins += ["tests.nvml_fixtures"]
pytest_plugins += ["tests.broker_fixtures"]  # broker_box: a lease store with a running broker and two users (root)
pytest_plugins += ["tests.docker_fixtures"]  # docker_client, launcher_image, run_container
pytest_plugins += ["tests.run_fixtures"]  # trained_cartpole: one real run trained to 475, per session
pytest_plugins += ["tests.testbed.fixtures"]  # swarm_bed, fresh_engine, bed_factory: extra daemons (root)
pytest_plugins += ["tests.slurmbed.fixtures"]  # slurm_bed: slurmctld + slurmd's in namespaces (root)

import signal
from pathlib import Path
from typing import Any

import pytest

# A suite started as a background job of a non-interactive shell (`nohup .ci/run &`) inherits SIGINT ignored,
# and so would every launcher it starts (an ignored signal survives exec): a SIGINT sent before the launcher
# installs its handler would then be lost instead of ending it, unlike Ctrl-C in a terminal. Python's own
# handler here means children start with SIGINT at its default (handlers are reset on exec).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Under pytest-xdist (scripts/test.sh runs two workers): what shares one engine, one set of test beds, host-wide
# Docker or Slurm state, or counts what runs on the host, runs in one group, in order, on one worker (xdist
# --dist loadgroup); the unit tests, each in its own temporary directories, go to the other worker meanwhile.
SERIAL_GROUP = "serial"
_SERIAL_MARKS = ("docker", "fault", "slurm", "testbed", "fresh", "multinode")
_SERIAL_FIXTURES = frozenset({"docker_client", "launcher_image", "run_container", "engine", "pause_image", "swarm_bed",
                              "fresh_engine", "bed_factory", "nvidia_engine", "slurm_bed", "gpu_box"})
_UNIT = Path(__file__).parent / "unit"


def serial(item: Any) -> bool:
    """Whether ``item`` must run in the serial group: anything outside tests/unit, or a unit test that uses the
    engine, a test bed or the fault markers."""
    return (_UNIT not in Path(str(item.fspath)).parents or any(item.get_closest_marker(m) for m in _SERIAL_MARKS)
            or bool(_SERIAL_FIXTURES & set(getattr(item, "fixturenames", ()))))


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """The fresh-engine test first: it builds the worker image from nothing on its own engine and hands it to
    this engine (tests/docker/test_fresh_engine.py), so the session's image fixture finds it up to date. Then the
    serial group, then the unit tests. The tests that share the session's trained CartPole run go to one worker
    (one training, not one per worker)."""
    for item in items:
        if serial(item):
            item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP))
        elif "trained_cartpole" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("trained_cartpole"))
    items.sort(key=lambda item: 0 if item.get_closest_marker("fresh") else 1 if serial(item) else 2)
