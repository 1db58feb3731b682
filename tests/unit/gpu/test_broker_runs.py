"""The lease broker with the backends and whole runs: each backend ties the lease to its master; a real
``launcher up`` as another user holds its GPU through the broker, tied to its master child, under the site cap;
a broker refuses to start over lease files users can open. The test bed is tests/broker_fixtures.py.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest

from launcher.gpu import broker_client, reservations, store
from tests.broker_fixtures import PY, ROOT, UUIDS, Box, skip_reason, wait_until

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))


@pytest.fixture(scope="module")
def box(broker_box: Box) -> Box:
    return broker_box


# ------------------------------------------------------------------------------------------- the backends' ties
def test_the_backends_tie_the_lease_to_their_master(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process backend ties the lease to its master child; the Docker backend to the master container's pid
    (from the engine's inspect) and mounts no lease files. Each master here is a `sleep` standing in; the
    lease outlives the launcher's own release only through that tie."""
    from types import SimpleNamespace

    from launcher.backends.docker import DockerBackend
    from launcher.backends.process import ProcessBackend

    monkeypatch.setenv(store.SITE_ENV, str(box.site.site_file))
    for backend_kind, uuid in (("process", UUIDS[0]), ("docker", UUIDS[1])):
        reservation = reservations.reserve([uuid], f"{backend_kind}-run")
        assert reservation.brokered and reservation.fds == ()
        master = subprocess.Popen(["sleep", "60"])
        try:
            if backend_kind == "process":
                backend: Any = ProcessBackend()
                backend.run = SimpleNamespace(reservation=reservation)
                backend.master = SimpleNamespace(proc=master)
                backend._tie_leases()
            else:
                engine = SimpleNamespace(inspect=lambda cid: SimpleNamespace(pid=master.pid, exit_code=None))
                backend = DockerBackend(engine=engine)  # type: ignore[arg-type]
                backend._tie_to_master(reservation, "c" * 64)
            (lease,) = [x for x in broker_client.leases(box.site.broker) if x["uuid"] == uuid]  # type: ignore[arg-type]
            assert lease["pids"] == [os.getpid(), master.pid]
            assert box.held()[uuid].pid == master.pid  # `launcher gpus` names the master
        finally:
            master.kill()
            master.wait()

        def pids() -> list[list[int]]:
            return [x["pids"] for x in broker_client.leases(box.site.broker)  # type: ignore[arg-type]
                    if x["uuid"] == uuid]

        wait_until(lambda: pids() == [[os.getpid()]], timeout_s=2)  # the master's tie went with it
        reservation.release()
        if backend_kind == "docker":  # handed to the master: a detached launcher's exit must not release it
            assert pids() == [[os.getpid()]]
            broker_client.release(box.site.broker, [uuid])  # type: ignore[arg-type]
        assert uuid not in box.held()


def test_the_broker_refuses_to_start_over_lease_files_users_can_open(box: Box) -> None:
    loose = store.admin_init(UUIDS, site_file=box.base / "etc-loose" / "site.toml", store=box.base / "store-loose",
                             policy=box.base / "etc-loose" / "policy.toml",
                             broker=box.base / "run-loose" / "b.sock").site
    os.chmod(loose.lease_path(UUIDS[2]), 0o644)  # as an older `admin init` without --broker made them
    out = subprocess.run([str(PY), "-m", "launcher", "admin", "broker", "--site", str(loose.site_file)], cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "can be opened by users" in out.stderr and "--broker" in out.stderr, out
    assert not loose.broker.exists()  # type: ignore[union-attr]
