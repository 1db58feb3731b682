"""Shared pytest configuration."""

pytest_plugins = ["tests.nvml_fixtures"]
