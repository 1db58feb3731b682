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
from typing import Any

# A suite started as a background job of a non-interactive shell (`nohup .ci/run &`) inherits SIGINT ignored,
# and so would every launcher it starts (an ignored signal survives exec): a SIGINT sent before the launcher
# installs its handler would then be lost instead of ending it, unlike Ctrl-C in a terminal. Python's own
# handler here means children start with SIGINT at its default (handlers are reset on exec).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """The fresh-engine test first: it builds the worker image from nothing on its own engine and hands it to
    this engine (tests/docker/test_fresh_engine.py), so the session's image fixture finds it up to date."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("fresh") else 1)
