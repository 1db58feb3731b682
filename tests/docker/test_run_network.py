"""A run's network reaches only the run (issue 25, finding 4).

Docker's isolation of an ``--internal`` bridge filters only forwarded traffic; the host owned the bridge's
gateway address, so a container of a run reached every host service listening on 0.0.0.0, through the
gateway and through the host's other addresses. The launcher now makes the run's bridge with no host address
(``com.docker.network.bridge.inhibit_ipv4``). Here the network comes from the launcher's own code path
(``DockerBackend.create``), a probe container hardened like the run's (its spec, entrypoint swapped) tries
a host listener on every host address, and a second one on the run's network proves the members still reach
each other by name. A control on a plain ``--internal`` bridge (the network as it was) shows the probe does
see the hole where there is one. Training across the network: ``test_docker_backend.py``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from launcher.backends.containers import MASTER_PORT, network_name
from launcher.backends.docker import DockerBackend, container_specs
from launcher.engine import labels as dc
from launcher.engine.client import INTERNAL_BRIDGE_OPTIONS, Engine
from tests.docker.test_docker_backend import prepared

pytestmark = pytest.mark.docker

CONNECT_TIMEOUT_S = 3.0

# Tries every target at once; prints {"addr port": "connected" | the error's name}.
PROBE = r"""
import json, os, socket, threading
out = {}
def dial(host, port):
    key = f"{host} {port}"
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(info[0], socket.SOCK_STREAM) as s:
            s.settimeout(float(os.environ["PROBE_TIMEOUT"]))
            s.connect(info[4])
        out[key] = "connected"
    except Exception as exc:
        out[key] = type(exc).__name__ + (f" errno {exc.errno}" if getattr(exc, "errno", None) else "")
ts = [threading.Thread(target=dial, args=t) for t in json.loads(os.environ["PROBE_TARGETS"])]
[t.start() for t in ts]
[t.join() for t in ts]
print(json.dumps(out))
"""

# A stand-in for the master: accepts on MASTER_PORT until killed.
PEER = f"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {MASTER_PORT})); s.listen(8)
while True:
    s.accept()[0].close()
"""


@dataclass
class Listener:
    """A host service on every address of one family (0.0.0.0 or ::), on a free port; records who connected."""

    family: int
    sock: socket.socket = field(init=False)
    accepted: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = socket.socket(self.family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.family == socket.AF_INET6:
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        self.sock.bind(("0.0.0.0" if self.family == socket.AF_INET else "::", 0))
        self.sock.listen(64)
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _serve(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            self.accepted.append(peer)
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listeners() -> Iterator[tuple[Listener, Listener]]:
    four, six = Listener(socket.AF_INET), Listener(socket.AF_INET6)
    yield four, six
    four.close()
    six.close()


def host_addresses(family: str) -> list[tuple[str, str]]:
    """(interface, address) of every address the host owns (``ip -4 -o addr`` / ``ip -6 -o addr``)."""
    out = subprocess.run(["ip", family, "-o", "addr"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        found.append((parts[1], parts[3].split("/")[0]))
    return found


def run_probe(docker_client: Any, kwargs: dict[str, Any], targets: list[tuple[str, int]]) -> dict[str, str]:
    """Run PROBE in a container made from ``kwargs`` (a run container's create kwargs); its answer."""
    c = docker_client.containers.create(**{**kwargs, "entrypoint": ["python", "-c", PROBE], "command": [],
                                           "environment": {"PROBE_TARGETS": json.dumps(targets),
                                                           "PROBE_TIMEOUT": str(CONNECT_TIMEOUT_S)},
                                           "restart_policy": {"Name": "no"}})
    try:
        c.start()
        status = c.wait(timeout=120)
        logs = c.logs(stdout=True, stderr=True).decode(errors="replace")
        assert status["StatusCode"] == 0, logs
        return dict(json.loads(logs.strip().splitlines()[-1]))
    finally:
        c.remove(force=True)


def test_a_run_container_reaches_no_host_address_but_its_peers(launcher_image: str, runs_under: Path,
                                                                engine: Engine, docker_client: Any,
                                                                listeners: tuple[Listener, Listener]) -> None:
    four, six = listeners
    run = prepared(runs_under)
    backend = DockerBackend(launcher_image, engine=engine)
    backend.create(run)  # the run's network and its containers (not started), as `up` makes them
    control = f"{network_name(run.run_id)}-control"
    try:
        net = docker_client.networks.get(network_name(run.run_id)).attrs
        assert net["Internal"] is True and net["Driver"] == "bridge"
        assert net["Options"] == dict(INTERNAL_BRIDGE_OPTIONS), net["Options"]
        subnet = ipaddress.ip_network(net["IPAM"]["Config"][0]["Subnet"])
        gateway = net["IPAM"]["Config"][0]["Gateway"]
        bridge = f"br-{net['Id'][:12]}"
        # The host owns nothing on the run's subnet: no address on its bridge, the gateway included.
        assert not [a for _, a in host_addresses("-4") if ipaddress.ip_address(a) in subnet], host_addresses("-4")

        master, groups = container_specs(run, image=launcher_image, gpu_runtime=False, uid_gid=(4242, 4242))
        group_kwargs = groups[0].create_kwargs()
        group_kwargs["name"] += "-probe"
        peer_kwargs = {**master.create_kwargs(), "name": f"{master.name}-peer", "mounts": [],
                       "entrypoint": ["python", "-c", PEER], "command": [], "environment": {}}
        peer = docker_client.containers.create(**peer_kwargs)
        peer.start()

        v4 = [a for _, a in host_addresses("-4")]
        # IPv6 too: the bridge keeps a link-local address, and a service on :: would answer there.
        v6 = [f"{a}%eth0" if a.startswith("fe80") else a for i, a in host_addresses("-6") if i != "lo"]
        targets = [(a, four.port) for a in sorted({*v4, gateway})] + [(a, six.port) for a in v6] + \
            [(f"{master.name}-peer", MASTER_PORT)]
        answers = run_probe(docker_client, group_kwargs, targets)
        reached = sorted(k for k, v in answers.items() if v == "connected")
        assert reached == [f"{master.name}-peer {MASTER_PORT}"], answers
        assert four.accepted == [] and six.accepted == [], (four.accepted, six.accepted)

        # The control: the same probe on a plain --internal bridge (the run network as it was) got through.
        docker_client.networks.create(control, driver="bridge", internal=True,
                                      labels={dc.RUN_LABEL: run.run_id, dc.RESULTS_LABEL: str(runs_under.resolve())})
        plain_gw = docker_client.networks.get(control).attrs["IPAM"]["Config"][0]["Gateway"]
        eth = sorted(a for i, a in host_addresses("-4") if not i.startswith(("lo", "br-", "docker")))
        before = run_probe(docker_client, {**group_kwargs, "network": control},
                           [(plain_gw, four.port), *[(a, four.port) for a in eth]])
        assert before[f"{plain_gw} {four.port}"] == "connected", before
        assert four.accepted, "the control's connections never reached the listener"
    finally:
        backend.stop(grace_s=1)
        for c in docker_client.containers.list(all=True, filters={"label": f"{dc.RUN_LABEL}={run.run_id}"}):
            c.remove(force=True)
        if engine.network_exists(control):
            engine.remove_network(control)
    print("figures:", {"bridge": bridge, "subnet": str(subnet), "gateway": gateway, "run_network": answers,
                       "plain_internal_network": before})


# A host service inside a test-bed node's namespace, on 0.0.0.0: prints its port, then every peer it accepts.
NODE_LISTENER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 0)); s.listen(64)
print(s.getsockname()[1], flush=True)
while True:
    c, peer = s.accept(); print("accepted", peer[0], flush=True); c.close()
"""


@pytest.mark.testbed
def test_a_swarm_task_on_the_run_overlay_reaches_no_node_address(bed_factory: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The Swarm backend's network (an internal, attachable overlay): the node owns no address on it (the
    overlay's gateway lives in the network's own namespace) and an internal overlay gives its tasks no
    ``docker_gwbridge`` leg, so a task reaches no address of its node; the control, the same probe on a
    non-internal overlay, reaches the node through ``docker_gwbridge``. On a one-node swarm of the test bed,
    never the shared default engine."""
    from launcher.engine.swarm import ServiceSpec, SwarmEngine
    from tests.helpers import wait_for
    from tests.testbed import daemon
    from tests.testbed.bed import BedSpec
    from tests.testbed.fixtures import copy_image

    base = "launcher-base:bookworm"
    if subprocess.run(["docker", "image", "inspect", base], capture_output=True).returncode != 0:
        pytest.skip(f"{base} is not on the default engine (`launcher build` makes it)")
    bed = bed_factory(BedSpec(nodes=1, swarm=True, registry=False))
    node = bed.nodes[0]
    copy_image(base, bed)
    listener = subprocess.Popen(["ip", "netns", "exec", node.name, "python3", "-c", NODE_LISTENER],
                                stdout=subprocess.PIPE, text=True)
    monkeypatch.setenv("DOCKER_HOST", node.docker_host)
    swarm = SwarmEngine(Engine())
    rid = f"test-overlay-{os.urandom(3).hex()}"
    lab = {dc.RUN_LABEL: rid}
    answers: dict[str, dict[str, str]] = {}
    try:
        assert listener.stdout is not None
        port = int(listener.stdout.readline())
        ns_out = subprocess.run(["ip", "netns", "exec", node.name, "ip", "-4", "-o", "addr"], capture_output=True,
                                text=True, check=True).stdout
        node_addrs = sorted({line.split()[3].split("/")[0] for line in ns_out.splitlines()})
        secret = swarm.create_secret(f"{rid}-secret", "s" * 64, lab)
        for kind, internal in (("run", True), ("control", False)):
            net = f"launcher-{rid}-{kind}"
            if internal:
                swarm.create_network(net, lab)  # the backend's own call
            else:
                swarm.engine.create_network(net, lab, internal=False, driver="overlay", attachable=True)
            gw = json.loads(daemon.docker(node, "network", "inspect", net).stdout)[0]["IPAM"]["Config"][0]["Gateway"]
            targets = [(a, port) for a in sorted({*node_addrs, gw})]
            spec = ServiceSpec(name=f"launcher-{rid}-{kind}", image=base, args=("python3", "-c", PROBE),
                               env={"PROBE_TARGETS": json.dumps(targets), "PROBE_TIMEOUT": str(CONNECT_TIMEOUT_S)},
                               labels={**lab, "probe": kind}, network=net, user="10001:10001")
            swarm.create_service(spec, secret, f"{rid}-secret", (10001, 10001))
            cid = wait_for(lambda: daemon.docker(node, "ps", "-aq", "--filter", f"label=probe={kind}", "--filter",
                                                 f"label={dc.RUN_LABEL}={rid}", "--filter", "status=exited"
                                                 ).stdout.strip(), 120, f"the {kind} probe to end")
            logs = daemon.docker(node, "logs", cid).stdout
            answers[kind] = dict(json.loads(logs.strip().splitlines()[-1]))
        reached = sorted(k for k, v in answers["run"].items() if v == "connected")
        assert reached == [], answers
        assert any(v == "connected" for v in answers["control"].values()), answers
    finally:
        for s in swarm.services(lab):
            swarm.remove_service(s["ID"])
        for net_id, _ in swarm.overlay_networks(lab):
            swarm.remove_network(net_id)
        for sec_id, _ in swarm.secrets(lab):
            swarm.remove_secret(sec_id)
        swarm.engine.close()
        listener.kill()
        listener.wait()
    print("figures:", {"node_addresses": node_addrs, "internal_overlay": answers["run"],
                       "non_internal_overlay": answers["control"]})
