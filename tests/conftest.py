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

import os
import signal
from typing import Any

import pytest

# A suite started as a background job of a non-interactive shell (`nohup .ci/run &`) inherits SIGINT ignored,
# and so would every launcher it starts (an ignored signal survives exec): a SIGINT sent before the launcher
# installs its handler would then be lost instead of ending it, unlike Ctrl-C in a terminal. Python's own
# handler here means children start with SIGINT at its default (handlers are reset on exec).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Under pytest-xdist (scripts/test.sh runs two workers): every test that shares the Docker engine, the test beds,
# Slurm or host-wide state, or counts what runs on the host, is in one work unit that one worker runs in order (the
# "serial" group); the unit tests, each in temporary directories of its own, go to the other worker meanwhile.
# The scheduler sees node ids only, so the group is by file: everything outside tests/unit/, and the unit modules
# named here. Collection checks that no other unit test uses the engine, a test bed or a serial marker.
# (xdist's own --dist loadgroup renames node ids through an attribute pytest 9 no longer reads, so it would group
# nothing here.)
SERIAL_GROUP = "serial"
# test_broker.py times its broker's answers against wall-clock bounds (others answered within 0.5 s while a silent
# client stalls): beside a second worker's unit tests it failed once, so it runs with the serial group (22 s).
SERIAL_UNIT_MODULES = frozenset({"tests/unit/gpu/test_gpu_watch.py", "tests/unit/gpu/test_reservations.py",
                                 "tests/unit/gpu/test_broker.py"})
_SERIAL_MARKS = ("docker", "fault", "slurm", "testbed", "fresh", "multinode")
_SERIAL_FIXTURES = frozenset({"docker_client", "launcher_image", "run_container", "engine", "pause_image", "swarm_bed",
                              "fresh_engine", "bed_factory", "nvidia_engine", "slurm_bed", "gpu_box"})


def serial_file(nodeid: str) -> bool:
    """Whether the test ``nodeid`` runs in the serial group (by its file, relative to the repository)."""
    path = nodeid.split("::", 1)[0]
    return not path.startswith("tests/unit/") or path in SERIAL_UNIT_MODULES


def _needs_serial(item: Any) -> bool:
    return (any(item.get_closest_marker(m) for m in _SERIAL_MARKS)
            or bool(_SERIAL_FIXTURES & set(getattr(item, "fixturenames", ()))))


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """The fresh-engine test first: it builds the worker image from nothing on its own engine and hands it to
    this engine (tests/docker/test_fresh_engine.py), so the session's image fixture finds it up to date. Then the
    serial group, then the unit tests.

    Raises:
        pytest.UsageError: a unit test outside :data:`SERIAL_UNIT_MODULES` needs the engine or a test bed."""
    stray = sorted({i.nodeid.split("::", 1)[0] for i in items if _needs_serial(i) and not serial_file(i.nodeid)})
    if stray:
        raise pytest.UsageError(f"{', '.join(stray)}: uses the Docker engine, a test bed or a serial marker; add it to "
                                "SERIAL_UNIT_MODULES in tests/conftest.py so that it never runs beside the engine tests")
    items.sort(key=lambda item: 0 if item.get_closest_marker("fresh") else 1 if serial_file(item.nodeid) else 2)


@pytest.hookimpl(optionalhook=True)  # called before xdist's own (trylast)
def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    """The serial group as one work unit (the largest, so the first handed out), every other test its own."""
    from xdist.scheduler import LoadScopeScheduling

    class SerialGroup(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return SERIAL_GROUP if serial_file(nodeid) else nodeid

    return SerialGroup(config, log)


# The worker that runs unit tests beside the serial group yields the CPU to it: the serial group's tests time
# failovers, restarts and rejoins against deadlines, and a unit test on the other core (TensorFlow training, a
# launcher's children, which inherit the niceness) once slowed a swarm group's rejoin past its 90 s. Weight 335
# against 1024 at nice 5: the unit tests still get a quarter of a contended core and all of an idle one.
UNIT_WORKER_NICENESS = 5
_reniced = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: Any) -> None:
    global _reniced
    if not _reniced and hasattr(item.config, "workerinput") and not serial_file(item.nodeid):
        os.nice(UNIT_WORKER_NICENESS)
        _reniced = True
