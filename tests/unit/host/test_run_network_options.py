"""Which networks get no host address (issue 25, finding 4); the engine faked at the SDK's client only.

The real engine's answer (a container on such a bridge reaches no host address): tests/docker/test_run_network.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher.engine import client as client_mod
from launcher.engine.client import INTERNAL_BRIDGE_OPTIONS, Engine


class _Networks:
    def __init__(self) -> None:
        self.created: list[dict[str, Any]] = []

    def create(self, name: str, **kwargs: Any) -> Any:
        self.created.append({"name": name, **kwargs})
        return type("Net", (), {"id": f"id-{name}"})()


class _Client:
    def __init__(self) -> None:
        self.networks = _Networks()

    def close(self) -> None:
        pass


@pytest.mark.parametrize("internal,driver,options", [
    (True, "bridge", dict(INTERNAL_BRIDGE_OPTIONS)),  # a run's private bridge: no host address on it
    (False, "bridge", None),  # a published port needs the host's address on the bridge
    (True, "overlay", None),  # not a bridge: the node owns no address on an overlay anyway
])
def test_only_an_internal_bridge_is_made_without_a_host_address(monkeypatch: pytest.MonkeyPatch, internal: bool,
                                                                driver: str, options: dict[str, str] | None) -> None:
    fake = _Client()
    monkeypatch.setattr(client_mod, "connect_client", lambda *a, **k: fake)
    engine = Engine()
    assert engine.create_network("launcher-x", {"launcher.run": "x"}, internal=internal, driver=driver) == "id-launcher-x"
    (made,) = fake.networks.created
    assert made["options"] == options and made["internal"] is internal and made["driver"] == driver
    assert INTERNAL_BRIDGE_OPTIONS == {"com.docker.network.bridge.inhibit_ipv4": "true"}
