"""The admin lease store's rule, and the suite beside such a store (issue 24).

Where an administrator ran ``launcher admin init``, no user-settable path may lead a run's leases out of the
store: ``--lock-dir`` and ``$LAUNCHER_LOCK_DIR`` naming another directory are refused (exit 2). These tests
check that on a simulated admin machine at the real paths (tests/admin_ns.py: ``/etc/launcher`` and
``/var/lib/launcher`` are the test's own directories in a private mount namespace), on the host's own store
when it has one (read-only), and that the suite itself passes on such a machine (tests/host_guard.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import host_guard
from tests.admin_ns import ETC, STORE, AdminMachine, unavailable
from tests.helpers import run_launcher
from tests.nvml_fixtures import build_stub, machine, stub_uuid

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

REFUSED = ("this machine has an admin lease store ({leases}, set up in {site}); every run leases its GPUs there, "
           "so another lock directory is not allowed")


@pytest.fixture
def admin_machine(tmp_path: Path) -> Iterator[AdminMachine]:
    """A machine where the administrator ran ``launcher admin init`` (one GPU) with a site policy that caps users."""
    box = AdminMachine(tmp_path / "admin")
    try:
        box.admin_init(stub_uuid(0), policy="max_gpus_per_user = 1\nmax_workers_per_gpu = 8\n")
        yield box
    finally:
        box.remove()


def _stub_env(tmp_path: Path, gpus: int = 1) -> dict[str, str]:
    config = tmp_path / "nvml.json"
    config.write_text(json.dumps(machine(gpus)))
    return {"LD_LIBRARY_PATH": str(build_stub("current")), "NVML_STUB_CONFIG": str(config)}


def _assert_refused(done: subprocess.CompletedProcess[str], given: Path, leases: str, site: str) -> None:
    """Exit 2 with the one message (``up`` and ``plan`` name the option as ``--lock-dir`` whether it came from
    the flag or from ``$LAUNCHER_LOCK_DIR``, which their configuration layers read into the same option)."""
    rc, err = done.returncode, done.stderr
    assert rc == 2, f"a lock directory beside the admin store: exit {rc}\n{err}"
    assert err.startswith(("launcher: error: --lock-dir ", "launcher: error: $LAUNCHER_LOCK_DIR ")), err
    assert f" {given}: " + REFUSED.format(leases=leases, site=site) in err.splitlines()[0], err
    assert "HINT: leave out --lock-dir and unset LAUNCHER_LOCK_DIR" in err
    assert not given.exists(), f"{given} was created"


def test_a_user_set_lock_dir_beside_the_admin_store_is_refused(admin_machine: AdminMachine, tmp_path: Path) -> None:
    own = tmp_path / "my-locks"
    leases, site = "/var/lib/launcher/leases", "/etc/launcher/site.toml"
    # The simulated machine is an admin machine: without a lock directory, leases are the store's.
    shown = admin_machine.launcher("gpus", "--json", "--no-docker", env=_stub_env(tmp_path))
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["store"] == {"mode": "admin", "leases": leases, "site_file": site, "note": None}
    env: dict[str, str]
    for args, env in ((["gpus", "--no-docker", "--lock-dir", str(own)], {}),
                      (["gpus", "--no-docker"], {"LAUNCHER_LOCK_DIR": str(own)}),
                      (["plan", "--workers", "4", "--gpus", "auto", "--lock-dir", str(own)], {}),
                      (["plan", "--workers", "4", "--gpus", "auto"], {"LAUNCHER_LOCK_DIR": str(own)})):
        _assert_refused(admin_machine.launcher(*args, env={**_stub_env(tmp_path), **env}), own, leases, site)
    # `up` refuses before it starts or leases anything.
    results = tmp_path / "results"
    for flag, env in ((["--lock-dir", str(own)], {}), ([], {"LAUNCHER_LOCK_DIR": str(own)})):
        up = admin_machine.launcher("up", "--backend", "process", "--workers", "2", "--gpus", "auto", "--max-steps",
                                    "1000", "--results", str(results), "--progress", "off", *flag,
                                    env={**_stub_env(tmp_path), **env})
        _assert_refused(up, own, leases, site)
        assert not list(results.glob("*/run.json")), "a run was started"
    # Naming the store's own lease directory is no bypass, and is allowed.
    same = admin_machine.launcher("gpus", "--json", "--no-docker", "--lock-dir", leases, env=_stub_env(tmp_path))
    assert same.returncode == 0 and json.loads(same.stdout)["store"]["mode"] == "admin", same.stderr


def test_the_hosts_own_admin_store_refuses_a_lock_dir_too(tmp_path: Path) -> None:
    """About the host's real store, which it uses read-only: the read-only views tests/host_guard.py keeps of
    the originals it hid, bound back at their places, or the store itself where the suite could not hide it."""
    views = host_guard.host_views()
    if not (views.get(ETC, ETC) / "site.toml").is_file():
        pytest.skip(f"no admin lease store on this machine ({host_guard.SITE_FILE} does not exist)")
    host = AdminMachine(tmp_path / "host", views, read_only=True) if views else None
    own = tmp_path / "my-locks"
    env: dict[str, str]
    try:
        for args, env in ((["gpus", "--no-docker", "--lock-dir", str(own)], {}),
                          (["gpus", "--no-docker"], {"LAUNCHER_LOCK_DIR": str(own)})):
            done = host.launcher(*args, env=env) if host else run_launcher(*args, **env)
            assert done.returncode == 2 and "so another lock directory is not allowed" in done.stderr, done.stderr
            assert "this machine has an admin lease store" in done.stderr and not own.exists()
    finally:
        if host is not None:
            host.remove()


def test_the_suite_passes_on_a_machine_with_an_admin_store(admin_machine: AdminMachine, tmp_path: Path) -> None:
    """Tests that failed there before (each needs a lock directory or a policy of its own) pass, and the
    machine's store and policy are as before: the suite runs in its own namespace (tests/host_guard.py)."""
    before = {**host_guard.snapshot(admin_machine.binds[ETC]), **host_guard.snapshot(admin_machine.binds[STORE])}
    tests = ["tests/unit/gpu/test_reservations.py::test_all_or_nothing",
             "tests/unit/gpu/test_policy.py::test_policy_file_is_read",
             "tests/unit/gpu/test_cli_gpus_plan.py::test_plan_32_workers_on_4x80gb_json"]
    done = admin_machine.run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                             str(tmp_path / "inner"), *tests, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "3 passed" in done.stdout
    assert ("host check: /etc/launcher, /var/lib/launcher and the user files are as before (hidden from the tests "
            "in a private mount namespace: /etc/launcher, /var/lib/launcher)") in done.stdout
    after = {**host_guard.snapshot(admin_machine.binds[ETC]), **host_guard.snapshot(admin_machine.binds[STORE])}
    assert after == before
