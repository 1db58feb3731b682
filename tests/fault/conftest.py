"""The fault-injection suite: kills, restarts, hostile peers, bad input, concurrent launchers.

Every test collected under this folder carries the ``fault`` marker, so ``pytest -m fault`` runs the suite
alone and ``-m "not fault"`` leaves it out. Counts and figures: see ``tests/fault/helpers.py`` and
docs/reliability.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.fault)
