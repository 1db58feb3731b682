"""A run's GPU leases held by its master container: they survive the launcher and go with the container.

Real Docker engine, the launcher image, the real ``worker/lease.py`` (mounted in, as the master would run it
first thing) and real lease files; the kernel's ``/proc/locks`` is the judge. The launcher side is
:mod:`launcher.gpu.handover`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.errors import NoResources
from launcher.gpu import handover
from launcher.gpu.leaseholders import list_holders
from launcher.gpu.reservations import LeaseDir, reserve
from tests.host_guard import skip_beside_an_admin_store
from tests.nvml_fixtures import stub_uuid

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("LAUNCHER_TEST_IMAGE", "launcher:0.1.0-cpu")
UUIDS = (stub_uuid(0), stub_uuid(1))


@pytest.fixture(autouse=True)
def _own_lock_dir() -> None:
    """Every test here leases in a lock directory of its own under /tmp, which the Docker engine mounts from
    the host's view too (tests/host_guard.py); beside a store the suite could not hide, that is refused."""
    skip_beside_an_admin_store()


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    docker = pytest.importorskip("docker")
    try:
        c = docker.from_env(timeout=30)
        c.ping()
        c.images.get(IMAGE)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no Docker engine or no image {IMAGE}: {exc}")
    yield c
    for ctr in c.containers.list(all=True, filters={"label": f"launcher.run=lease-test-{os.getpid()}"}):
        ctr.remove(force=True)


def _master(client: Any, reservation: Any, name: str) -> Any:
    """A stand-in master: the image, the run's leases mounted read-only, worker/lease.py holding them."""
    from docker.types import Mount

    mounts = [Mount(target=dst, source=src, type="bind", read_only=True)
              for src, dst in handover.master_mounts(reservation).items()]
    mounts.append(Mount(target="/lease/lease.py", source=str(ROOT / "worker" / "lease.py"), type="bind",
                        read_only=True))
    env = handover.master_env(reservation)
    handover.hand_over(reservation)  # the launcher lets go right before the master starts
    return client.containers.run(IMAGE, entrypoint=["python3", "/lease/lease.py"], environment=env, detach=True,
                                 mounts=mounts, user="10001:10001", name=f"lease-test-{os.getpid()}-{name}",
                                 labels={"launcher.run": f"lease-test-{os.getpid()}", "launcher.role": "master"},
                                 network_mode="none", cap_drop=["ALL"], security_opt=["no-new-privileges"])


def _exit_code(ctr: Any) -> Any:
    def code() -> int | None:
        ctr.reload()
        return None if ctr.status in ("created", "running") else int(ctr.attrs["State"]["ExitCode"])
    return code


def _released_after(where: LeaseDir, action: Any) -> float:
    start = time.monotonic()
    action()
    while {h.uuid for h in list_holders(where)} & set(UUIDS):
        assert time.monotonic() - start < 10, "lease not released"
        time.sleep(0.005)
    return time.monotonic() - start


def test_lease_outlives_the_launcher_and_goes_with_the_container(client: Any, tmp_path: Path) -> None:
    where = LeaseDir(tmp_path)
    figures: dict[str, float] = {}
    for how in ("kill", "down"):
        ctr = _master(client, reserve(UUIDS, f"run-{how}", tmp_path), how)
        took = handover.confirm_held_by_container(UUIDS, ctr.id, exit_code=_exit_code(ctr), where=where)
        holders = {h.uuid: h for h in list_holders(where)}
        assert set(holders) == set(UUIDS) and {h.container_id for h in holders.values()} == {ctr.id}
        assert {h.uid for h in holders.values()} == {10001}  # the container's user, from the kernel
        with pytest.raises(NoResources):  # a second launcher cannot have them while the master lives
            reserve(UUIDS[:1], "intruder", tmp_path)
        if how == "kill":
            figures[how] = _released_after(where, ctr.kill)  # docker kill: SIGKILL to the master
        else:
            figures[how] = _released_after(where, lambda: ctr.stop(timeout=5))  # what `launcher down` does
        figures[f"{how}_confirm"] = took
        ctr.remove(force=True)
    print("figures:", {k: round(v, 3) for k, v in figures.items()})
    assert figures["kill"] < 1.0 and figures["down"] < 1.0


def test_a_master_that_loses_the_race_exits_and_the_launcher_says_who_won(client: Any, tmp_path: Path) -> None:
    where = LeaseDir(tmp_path)
    ours = reserve(UUIDS, "slow-run", tmp_path)
    mounts_for = ours

    class Sneaky:  # another launcher takes GPU 1 in the hand-over gap
        def __call__(self) -> None:
            self.held = reserve(UUIDS[1:], "fast-run", tmp_path)

    sneaky = Sneaky()
    ctr_holder: dict[str, Any] = {}
    orig = handover.hand_over

    def hand_over_then_race(reservation: Any) -> tuple[str, ...]:
        uuids = orig(reservation)
        sneaky()
        return uuids

    handover.hand_over = hand_over_then_race
    try:
        ctr_holder["c"] = _master(client, mounts_for, "race")
    finally:
        handover.hand_over = orig
    ctr = ctr_holder["c"]
    try:
        with pytest.raises(NoResources, match="another run leased a GPU first: .*held by launcher run fast-run"):
            handover.confirm_held_by_container(UUIDS, ctr.id, exit_code=_exit_code(ctr), where=where)
        assert ctr.attrs["State"]["ExitCode"] == 75
        assert {h.uuid for h in list_holders(where)} == {UUIDS[1]}  # the loser kept nothing
    finally:
        sneaky.held.release()
        ctr.remove(force=True)


# ------------------------------------------------------------------ the Docker backend hands the leases over
def _prepared_gpu_run(tmp_path: Path, lock_dir: Path) -> Any:
    """A run as `up` prepares it on 2 fake GPUs, with its leases taken in ``lock_dir``."""
    from launcher.backends.base import PreparedRun
    from launcher.config import RunConfig
    from launcher.gpu.nvml import GpuInfo
    from launcher.gpu.placement import PlanRequest, make_plan
    from launcher.runs import create_run_dir, new_secret
    from launcher.up import build_spec

    gib = 1024**3
    gpus = [GpuInfo(i, u, "Test GPU", f"0000:{i:02x}:00.0", 80 * gib, 2 * gib, 78 * gib, 0, 0)
            for i, u in enumerate(UUIDS)]
    cfg = RunConfig(workers=2, results=tmp_path / "results", max_steps=2_000)
    plan = make_plan(PlanRequest(workers=2), gpus, 2)
    run_id = f"lease-test-{os.getpid()}-{os.urandom(2).hex()}"
    run_dir = create_run_dir(cfg.results, run_id)
    spec = build_spec(cfg, plan, run_id, run_dir.path)
    (run_dir.path / "spec.json").write_text(spec.to_json())
    return PreparedRun(config=cfg, plan=plan, spec=spec, run_dir=run_dir, secret=new_secret(),
                       reservation=reserve(plan.gpu_uuids, run_id, lock_dir))


def test_master_container_gets_the_lease_files_read_only(tmp_path: Path) -> None:
    from launcher.backends.containers import SECRET_MOUNT
    from launcher.backends.docker import container_specs

    run = _prepared_gpu_run(tmp_path, tmp_path / "locks")
    try:
        master, groups = container_specs(run, image="img", gpu_runtime=False, uid_gid=(1234, 5678))
        wanted = {str(tmp_path / "locks" / f"{u}.lock"): f"/run/launcher/leases/{u}.lock" for u in run.plan.gpu_uuids}
        # Beside the leases every container gets one more read-only bind: its run's secret file (issue 14).
        leases = {h: c for h, c in master.read_only_binds.items() if c != SECRET_MOUNT}
        assert leases == wanted
        assert master.environment["LAUNCHER_LEASES"] == ",".join(wanted.values())
        mounts = {m["Target"]: m for m in master.create_kwargs()["mounts"]}
        assert all(mounts[t]["ReadOnly"] for t in wanted.values())
        assert all("LAUNCHER_LEASES" not in g.environment for g in groups)
        assert all(set(g.read_only_binds.values()) == {SECRET_MOUNT} for g in groups), [g.read_only_binds for g in groups]
    finally:
        run.reservation.release()


@pytest.mark.parametrize("how", ["kill", "down"])
def test_docker_backend_start_confirms_the_master_holds_the_leases(client: Any, tmp_path: Path, how: str) -> None:
    """End to end with the real master (needs an image built with worker/lease.py): after start the
    launcher holds nothing and the master container holds every lease; ``docker kill`` of the master, or the
    teardown ``launcher down`` runs, frees them within a second."""
    from launcher.backends.docker import DockerBackend

    try:
        client.containers.run(IMAGE, entrypoint=["python3", "-c", "import worker.lease"], remove=True,
                              network_mode="none")
    except Exception:  # noqa: BLE001 - ContainerError: the image predates worker/lease.py
        pytest.skip(f"{IMAGE} was built before worker/lease.py; rebuild it (`launcher build`) to run this test")
    lock_dir = tmp_path / "locks"
    run = _prepared_gpu_run(tmp_path, lock_dir)
    backend = DockerBackend(image=IMAGE, gpu_runtime=False)
    where = LeaseDir(lock_dir)
    try:
        backend.start(run)  # confirms from /proc/locks before the groups start, or raises NoResources
        holders = {h.uuid: h for h in list_holders(where)}
        assert set(holders) == set(run.plan.gpu_uuids)
        assert {h.container_id for h in holders.values()} == {backend.master_id}
        assert not run.reservation.uuids  # the launcher let go: the master holds them now
        if how == "kill":
            gone = _released_after(where, lambda: client.containers.get(backend.master_id).kill())
        else:
            backend.stop(grace_s=5.0)  # the master checkpoints, then its container is removed
            gone = _released_after(where, lambda: None)  # measured from the end of `down`
        print("figures:", how, round(gone, 3))
        assert gone < 1.0
    finally:
        backend.stop(grace_s=2.0)
        run.reservation.release()
