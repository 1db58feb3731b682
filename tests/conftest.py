"""Shared pytest configuration."""

pytest_plugins = ["tests.nvml_fixtures"]
pytest_plugins += ["tests.docker_fixtures"]  # docker_client, launcher_image, run_container
pytest_plugins += ["tests.run_fixtures"]  # trained_cartpole: one real run trained to 475, per session
pytest_plugins += ["tests.testbed.fixtures"]  # swarm_bed, fresh_engine, bed_factory: extra daemons (root)
