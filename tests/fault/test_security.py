"""Fault suite, security review (the threat model is in docs/reliability.md).

* Nothing from the network is unpickled or evaluated: no pickle, marshal, shelve, eval or exec in
  ``worker/`` (the code that reads the wire) and no ``allow_pickle=True`` anywhere.
* The run secret never appears in any process's argv (``/proc/*/cmdline``, containers' included), in
  the results directory or in the logs the launcher keeps, on either backend.
* Containers run as a non-root user, drop every capability, set no-new-privileges, are not privileged
  and publish no port; the master's port is reachable from the host only as the documentation says.
"""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.docker_fixtures import cleanup_docker, ours
from tests.fault.helpers import (Drain, cmdlines, environ_of, files_containing, first_run, launcher_proc, master_pid,
                                 record, status, stop_proc)
from tests.helpers import ROOT, wait_for
from worker import protocol as p
from worker.protocol import Connection, MsgType


UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib", "yaml"}
UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}


def _python_files(*dirs: str) -> list[Path]:
    return sorted(f for d in dirs for f in (ROOT / d).rglob("*.py"))


def test_no_pickle_or_eval_on_the_run_side() -> None:
    found = []
    for path in _python_files("worker"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [f"{path}:{node.lineno} import {a.name}" for a in node.names
                          if a.name.split(".")[0] in UNSAFE_MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
                found.append(f"{path}:{node.lineno} from {node.module} import ...")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in UNSAFE_CALLS:
                found.append(f"{path}:{node.lineno} {node.func.id}(...)")
    # np.load may unpickle object arrays unless allow_pickle stays False (its default): nowhere may say True.
    for path in _python_files("worker", "launcher"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "allow_pickle" and \
                    not (isinstance(node.value, ast.Constant) and node.value.value is False):
                found.append(f"{path}:{node.value.lineno} allow_pickle={ast.unparse(node.value)}")
    assert not found, "unsafe deserialisation or evaluation:\n" + "\n".join(found)
    # The wire format is JSON and raw numpy buffers of whitelisted dtypes, nothing else.
    assert all(np.dtype(str(dt)).kind in "fiub" for dt in p.DTYPES.values())
    record("security_static", files_checked=len(_python_files("worker")), unsafe_calls=0, allow_pickle_true=0)


def _argv_with(secret: bytes) -> list[str]:
    return [f"pid {pid}: {raw[:120]!r}" for pid, raw in cmdlines() if secret in raw]


def test_secret_stays_out_of_argv_results_and_logs_process_backend(tmp_path: Path) -> None:
    root = tmp_path / "results"
    proc = launcher_proc("up", "--backend", "process", "--gpus", "none", "--workers", "4", "--groups", "2", "--max-steps", "6000",
                         "--results", str(root), "--json", "--progress", "plain")
    drain = Drain(proc)
    try:
        run = first_run(root, 120)
        pid = wait_for(lambda: master_pid(run), 120, "the master process")
        env = wait_for(lambda: environ_of(pid), 30, "the master's environment")
        # The secret comes in an inherited pipe (issue 14): not in the environment, and read to its end.
        assert "LAUNCHER_SECRET" not in env, "the run secret is in the master's environment"
        fd_path = env["LAUNCHER_SECRET_FILE"]
        assert fd_path.startswith("/dev/fd/"), fd_path
        assert os.readlink(f"/proc/{pid}/fd/{fd_path.rsplit('/', 1)[1]}").startswith("pipe:")
        wait_for(lambda: status(run).get("env_steps") or proc.poll() is not None, 180, "training")
        leaked = [f"pid {p}: {raw[:120]!r}" for p, raw in cmdlines() if b"LAUNCHER_SECRET=" in raw]
        addr = (run / "master.addr").read_text().strip()
        code = drain.wait(timeout=300)
    finally:
        stop_proc(proc)
    assert code == 0, drain.stderr[-3000:]
    assert not leaked, leaked
    # No port by default: a Unix socket in a directory of mode 0700 (tests/fault/test_flood_other_uid.py shows
    # another uid refused by the kernel); --port N listens on 127.0.0.1 only (tests/unit/host/test_plan_is_what_runs).
    assert addr.startswith("unix:/"), f"the master listens on {addr}, not on a private Unix socket"
    record("security_process", secret_in_argv=0, master_listens="unix socket (0700 directory)",
           secret_in_proc_environ="no (an inherited pipe, read once)")


def _probe(host: str, port: int, timeout: float = 3.0) -> str:
    """What a TCP client on the host meets at host:port: ``refused``, ``timeout``, ``unreachable``,
    or ``challenge`` (the master's first frame), then whether a forged HELLO is rejected."""
    try:
        s = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        return "refused"
    except socket.timeout:
        return "timeout"
    except OSError as exc:
        return f"unreachable ({exc.strerror})"
    conn = Connection(s, max_frame_bytes=1 << 20, timeout_s=timeout)
    try:
        first = conn.recv(deadline=time.monotonic() + timeout)
        if first.type != MsgType.CHALLENGE:
            return f"connected, got {first.type.name}"
        conn.send(MsgType.HELLO, {"role": "group", "group": 0, "workers": 1, "run_id": first.fields.get("run_id"),
                                  "nonce": os.urandom(32).hex(), "mac": os.urandom(32).hex()})
        reply = conn.recv(deadline=time.monotonic() + timeout)
        return f"challenge; forged HELLO -> {reply.type.name}"
    except (OSError, p.ProtocolError, TimeoutError) as exc:
        return f"connected, then {type(exc).__name__}"
    finally:
        conn.close()


@pytest.mark.docker
def test_containers_and_network_docker_backend(tmp_path: Path, launcher_image: str, engine: Any) -> None:
    from launcher.backends.containers import SECRET_MOUNT
    from launcher.backends.docker import MASTER_PORT, master_name, network_name

    root = tmp_path / "results"
    root.mkdir()
    proc = launcher_proc("up", "--backend", "docker", "--image", launcher_image, "--gpus", "none", "--workers", "4", "--groups", "2",
                         # Long enough that every container still runs while it is inspected and probed below
                         # (6000 steps ended within a second of the first status once teardown got faster).
                         "--max-steps", "200000", "--results", str(root), "--json", "--progress", "plain")
    drain = Drain(proc)
    figures: dict[str, Any] = {}
    try:
        run = first_run(root, 120)
        wait_for(lambda: status(run).get("env_steps") or proc.poll() is not None, 300, "training")
        assert proc.poll() is None, drain.stderr[-3000:]
        snaps, nets = ours(engine, root)
        assert len(snaps) == 3 and nets == [network_name(run.name)]
        secret = b""
        for s in snaps:
            c = engine.inspect_raw(s.id)
            hc, cfg = c["HostConfig"], c["Config"]
            uid = int(str(cfg["User"]).split(":")[0] or 0)
            assert uid != 0, f"{s.name} runs as root (User {cfg['User']!r})"
            assert hc["CapDrop"] == ["ALL"] and not hc.get("CapAdd"), (hc["CapDrop"], hc.get("CapAdd"))
            assert "no-new-privileges" in (hc.get("SecurityOpt") or []), hc.get("SecurityOpt")
            assert hc["Privileged"] is False and hc["ReadonlyRootfs"] is True
            assert not hc.get("PortBindings") and not (c["NetworkSettings"].get("Ports") or {}).get(f"{MASTER_PORT}/tcp")
            assert hc.get("PidMode", "") in ("", "private") and hc.get("NetworkMode") == network_name(run.name)
            env = dict(e.split("=", 1) for e in cfg["Env"])
            assert "LAUNCHER_SECRET" not in env and env["LAUNCHER_SECRET_FILE"] == SECRET_MOUNT, sorted(env)
            mount = next(m for m in c["Mounts"] if m["Destination"] == SECRET_MOUNT)
            assert mount["RW"] is False
            st_secret = os.stat(mount["Source"])  # 0400, the container's user's, in a 0700 directory
            assert (st_secret.st_mode & 0o777, st_secret.st_uid) == (0o400, uid), (oct(st_secret.st_mode), uid)
            assert os.stat(os.path.dirname(mount["Source"])).st_mode & 0o077 == 0
            secret = Path(mount["Source"]).read_bytes()
            # The process itself, as the kernel sees it: not root, no effective capabilities.
            st = Path(f"/proc/{s.pid}/status").read_text()
            fields = dict(line.split(":", 1) for line in st.splitlines() if ":" in line)
            assert int(fields["Uid"].split()[1]) != 0, f"{s.name}: effective uid 0"
            assert int(fields["CapEff"].strip(), 16) == 0, f"{s.name}: CapEff {fields['CapEff'].strip()}"
            assert fields["NoNewPrivs"].strip() == "1"
        assert engine.client.networks.get(network_name(run.name)).attrs["Internal"] is True
        assert not _argv_with(secret), _argv_with(secret)
        # Reaching the master from the host: published ports (none), then its address on the run's network.
        master = engine.inspect_raw(master_name(run.name))
        ip = next(iter(master["NetworkSettings"]["Networks"].values()))["IPAddress"]
        figures["host_to_published_127.0.0.1"] = _probe("127.0.0.1", MASTER_PORT)
        figures["host_to_container_ip"] = _probe(ip, MASTER_PORT)
        # The run's bridge has no host address (issue 25, finding 4): the host has no route onto it either,
        # so that dial leaves by the default route, if any (on a machine whose gateway accepts any TCP
        # connection it "connects", to the gateway, and no CHALLENGE comes).
        bridge = f"br-{engine.client.networks.get(network_name(run.name)).id[:12]}"
        route = subprocess.run(["ip", "-o", "route", "get", ip], capture_output=True, text=True).stdout.split()
        figures["host_route_to_container_ip"] = route[route.index("dev") + 1] if "dev" in route else "none"
        assert figures["host_route_to_container_ip"] != bridge, (bridge, route)
        code = drain.wait(timeout=300)
    finally:
        stop_proc(proc)
        left = cleanup_docker(engine, root)
    assert code == 0, drain.stderr[-3000:]
    assert left == ([], [])
    assert not files_containing(root, secret), files_containing(root, secret)
    assert secret.decode() not in drain.stdout + drain.stderr
    # Whatever the host can reach, it is the authenticated protocol: a forged HELLO is refused. Anything but a
    # CHALLENGE did not reach the master ("connected, then ...": something else took the connection).
    for where in ("host_to_published_127.0.0.1", "host_to_container_ip"):
        assert not figures[where].startswith("challenge") or figures[where].endswith("REJECT"), figures
    record("security_docker", user="non-root", cap_drop="ALL", cap_add="none", no_new_privileges=True,
           privileged=False, read_only_rootfs=True, published_ports=0, network_internal=True, secret_in_argv=0,
           secret_in_results_or_logs=0, secret_in_docker_inspect_env="no (a 0400 file, read-only bind)",
           **figures)
