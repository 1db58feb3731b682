"""Issue 14, items 5 and 8 on the container backends: the secret as a file only the container's user reads,
and the same hardening and limits on every container, Swarm task and helper.

The plan-level tests are pure (no engine); the ``docker``-marked ones create real containers on the engine,
read the secret inside one as its user and as another, and remove everything they made. At commit c1dca51 the
secret was ``LAUNCHER_SECRET`` in every container's environment (``docker inspect`` showed it), containers and
tasks had no memory or pids limit, Swarm tasks had no ``no-new-privileges`` and the volume-copy helper ran with
every default capability and a writable root.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from launcher.backends.containers import (GROUP_PIDS, MASTER_PIDS, SECRET_MOUNT, group_limits, master_limits,
                                          remove_secret_file, secret_path, secrets_dir, write_secret_file)
from launcher.backends.docker import DockerBackend, container_specs, teardown
from launcher.backends.swarm_specs import Placement, service_specs
from launcher.engine import labels as dc
from launcher.engine.client import Engine
from launcher.errors import LauncherError
from tests.docker.test_docker_backend import prepared  # a run as `up` prepares it, on made-up GPUs or 2 CPU cores


def test_no_container_has_the_secret_in_its_environment(tmp_path: Path) -> None:
    run = prepared(tmp_path, workers=8)
    master, groups = container_specs(run, image="img", gpu_runtime=False, uid_gid=(1234, 1234))
    for cs in (master, *groups):
        assert run.secret not in repr(cs.create_kwargs()["environment"]), f"{cs.name} carries the secret"
        assert "LAUNCHER_SECRET" not in cs.environment and cs.environment["LAUNCHER_SECRET_FILE"] == SECRET_MOUNT
        assert cs.read_only_binds[str(secret_path(run.run_id))] == SECRET_MOUNT
        mount = next(m for m in cs.create_kwargs()["mounts"] if m["Target"] == SECRET_MOUNT)
        assert mount["ReadOnly"] is True and mount["Type"] == "bind"


def test_every_container_and_task_has_memory_and_pids_limits_from_the_plan(tmp_path: Path) -> None:
    run = prepared(tmp_path, gpus=2, workers=16)
    master, groups = container_specs(run, image="img", gpu_runtime=True, uid_gid=(1234, 1234))
    assert (master.memory_bytes, master.pids_limit) == (master_limits(run.plan.master).memory_bytes, MASTER_PIDS)
    for g, cs in zip(run.plan.groups, groups):
        lim = group_limits(g.share, g.workers)
        kw = cs.create_kwargs()
        assert (kw["mem_limit"], kw["memswap_limit"], kw["pids_limit"]) == (lim.memory_bytes, lim.memory_bytes,
                                                                             GROUP_PIDS)
    assert group_limits(run.plan.groups[0].share, 32).memory_bytes > \
        group_limits(run.plan.groups[0].share, 1).memory_bytes, "more workers, more memory"
    smaster, sgroups = service_specs(run, image="img", placement=Placement((), "bind", "test"), uid_gid=(1234, 1234))
    for svc in (smaster, *sgroups):
        kw = svc.create_kwargs("sec-id", "sec-name", (1234, 1234))
        limits = kw["resources"]["Limits"]
        assert limits["MemoryBytes"] > 0 and limits["Pids"] in (MASTER_PIDS, GROUP_PIDS), limits
        assert kw["privileges"] == {"NoNewPrivileges": True}
        assert kw["cap_drop"] == ["ALL"] and kw["read_only"] is True and kw["user"] == "1234:1234"
        assert "LAUNCHER_SECRET" not in kw["env"]
        ref = kw["secrets"][0]
        assert (ref["File"]["Mode"], ref["File"]["UID"]) == (0o400, "1234"), ref


def test_the_secret_file_is_private_to_the_containers_user() -> None:
    rid = f"test-secret-{os.urandom(3).hex()}"
    uid = 4242 if os.geteuid() == 0 else os.geteuid()
    path = write_secret_file(rid, "s" * 64, uid, uid)
    try:
        st, dst = os.stat(path), os.stat(secrets_dir())
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o400, uid)
        assert stat.S_IMODE(dst.st_mode) == 0o700 and dst.st_uid == os.geteuid()
        assert write_secret_file(rid, "t" * 64, uid, uid) == path  # a resume replaces it
        assert path.read_text() == "t" * 64
    finally:
        remove_secret_file(rid)
    assert not path.exists()


def test_a_planted_secrets_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import launcher.backends.containers as containers

    planted = tmp_path / "launcher-secrets"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    monkeypatch.setattr(containers, "secrets_dir", lambda: planted)
    with pytest.raises(LauncherError, match="not a private directory"):
        write_secret_file("test-planted", "s" * 64, os.geteuid(), os.getegid())
    assert list(planted.iterdir()) == []


# ------------------------------------------------------------------------------------------ real engine
@pytest.mark.docker
def test_created_containers_hide_the_secret_and_carry_limits(tmp_path: Path, launcher_image: str, engine: Engine,
                                                             run_container: Any) -> None:
    run = prepared(tmp_path, workers=4)
    backend = DockerBackend(image=launcher_image, engine=engine, gpu_runtime=False)
    try:
        backend.create(run)
        found = engine.containers({dc.RUN_LABEL: run.run_id})
        assert len(found) == 1 + len(run.plan.groups)
        source = str(secret_path(run.run_id))
        for snap in found:
            c = engine.inspect_raw(snap.id)
            env = "\n".join(c["Config"]["Env"])
            assert run.secret not in env and "LAUNCHER_SECRET=" not in env, f"{snap.name}: the secret in docker inspect"
            mount = next(m for m in c["Mounts"] if m["Destination"] == SECRET_MOUNT)
            assert (mount["Source"], mount["RW"]) == (source, False)
            hc = c["HostConfig"]
            assert hc["Memory"] > 0 and hc["MemorySwap"] == hc["Memory"]
            assert hc["PidsLimit"] in (MASTER_PIDS, GROUP_PIDS)
        user = engine.inspect_raw(found[0].id)["Config"]["User"]
        uid = int(user.split(":")[0])
        read = ["-c", f"print(open({SECRET_MOUNT!r}).read() == {run.secret!r})"]
        mounts = [{"Type": "bind", "Source": source, "Target": SECRET_MOUNT, "ReadOnly": True}]
        code, out = run_container(launcher_image, read, entrypoint=["python"], user=user, mounts=mounts)
        assert (code, out.strip()) == (0, "True"), out
        code, out = run_container(launcher_image, read, entrypoint=["python"], user=f"{uid + 1}:{uid + 1}",
                                  mounts=mounts)
        assert code != 0 and "Permission denied" in out, out
    finally:
        teardown(engine, run.run_id, grace_s=1, run_dir=run.run_dir)
    assert engine.containers({dc.RUN_LABEL: run.run_id}) == [] and engine.networks({dc.RUN_LABEL: run.run_id}) == []
    assert not secret_path(run.run_id).exists(), "teardown leaves the secret file behind"


HARDENING_CHECK = """
import os, sys
status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)
problems = []
if status['NoNewPrivs'].strip() != '1': problems.append('NoNewPrivs ' + status['NoNewPrivs'].strip())
if int(status['CapEff'].strip(), 16) or int(status['CapBnd'].strip(), 16): problems.append('capabilities')
if os.geteuid() == 0: problems.append('root')
try:
    open('/probe', 'w'); problems.append('writable root')
except OSError:
    pass
pids = open('/sys/fs/cgroup/pids.max').read().strip() if os.path.exists('/sys/fs/cgroup/pids.max') else \\
    open('/sys/fs/cgroup/pids/pids.max').read().strip()
if pids != '256': problems.append('pids.max ' + pids)
print(problems, file=sys.stderr)
sys.exit(1 if problems else 0)
"""


@pytest.mark.docker
def test_the_helper_container_is_hardened(launcher_image: str, engine: Engine, tmp_path: Path) -> None:
    """The throw-away helper (the Swarm backend copies a results volume with it): checked from inside."""
    rid = f"test-helper-{os.urandom(3).hex()}"
    ok = engine.run_once(launcher_image, ["python", "-c", HARDENING_CHECK], user="10001:10001",
                         labels={dc.RUN_LABEL: rid, dc.ROLE_LABEL: "copy"}, mounts=[])
    assert ok, "the helper container is not hardened (see the engine's warning above)"
    assert engine.containers({dc.RUN_LABEL: rid}) == []


@pytest.mark.docker
def test_a_helper_that_fails_is_reported_as_its_exit_not_as_a_missing_engine(launcher_image: str, engine: Engine,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A helper container that exits non-zero is the engine answering: the warning gives its status and its last
    stderr line. (The SDK's ContainerError is a DockerException; it was read as "no Docker engine answers".)"""
    rid = f"test-helper-{os.urandom(3).hex()}"
    code = "import sys; print('first', file=sys.stderr); print('the-last-words', file=sys.stderr); sys.exit(3)"
    with caplog.at_level("WARNING"):
        ok = engine.run_once(launcher_image, ["python", "-c", code], user="10001:10001",
                             labels={dc.RUN_LABEL: rid, dc.ROLE_LABEL: "copy"}, mounts=[])
    assert not ok
    assert "exited with status 3: the-last-words" in caplog.text, caplog.text
    assert "no Docker engine answers" not in caplog.text
    assert engine.containers({dc.RUN_LABEL: rid}) == []


@pytest.mark.docker
@pytest.mark.testbed
def test_a_swarm_task_runs_with_the_limits_and_hardening(bed_factory: Any, pause_image: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On a real swarm (a one-node swarm of the test bed, not the shared default engine): the service the
    backend would create carries the pids and memory limits into its task's container, read-only and without
    capabilities, as a non-root user, with the secret as a 0400 file of that user. c1dca51 set no limit at
    all. (This engine speaks API 1.41: it drops NoNewPrivileges, so ``SecurityOpt`` is printed, not checked.)"""
    from launcher.engine.swarm import ServiceSpec, SwarmEngine
    from tests.testbed import daemon
    from tests.testbed.bed import BedSpec
    from tests.testbed.fixtures import copy_image
    from tests.helpers import wait_for

    image = pause_image  # one static binary that sleeps (tests/docker_fixtures.py)
    bed = bed_factory(BedSpec(nodes=1, swarm=True, registry=False))
    node = bed.nodes[0]
    copy_image(image, bed)
    monkeypatch.setenv("DOCKER_HOST", node.docker_host)
    swarm = SwarmEngine(Engine())
    rid = f"test-swarm-{os.urandom(3).hex()}"
    lab = {dc.RUN_LABEL: rid}
    try:
        net = f"launcher-{rid}"
        swarm.create_network(net, lab)
        secret = swarm.create_secret(f"{rid}-secret", "s" * 64, lab)
        spec = ServiceSpec(name=f"launcher-{rid}-group-0", image=image, args=("/pause",), env={}, labels=lab,
                           network=net, user="10001:10001", memory_bytes=256 * 2**20, pids_limit=64)
        swarm.create_service(spec, secret, f"{rid}-secret", (10001, 10001))
        cid = wait_for(lambda: daemon.docker(node, "ps", "-q", "--filter", f"label={dc.RUN_LABEL}={rid}"
                                             ).stdout.strip(), 120, "the task's container to run")
        c = json.loads(daemon.docker(node, "inspect", cid).stdout)[0]
        hc = c["HostConfig"]
        assert (hc["PidsLimit"], hc["Memory"]) == (64, 256 * 2**20), (hc["PidsLimit"], hc["Memory"])
        assert hc["ReadonlyRootfs"] is True and hc["CapDrop"] == ["ALL"] and c["Config"]["User"] == "10001:10001"
        # The secret as the engine wrote it for the task (a tmpfs under the data root, not a bind mount).
        files = list(node.root.glob(f"data/containers/{c['Id']}/mounts/secrets/*"))
        assert files, f"no secret file under {node.root}/data/containers/{c['Id']}/mounts/secrets"
        st = os.stat(files[0])
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o400, 10001), (oct(st.st_mode), st.st_uid)
        print(f"swarm task: PidsLimit {hc['PidsLimit']}, Memory {hc['Memory']}, SecurityOpt {hc.get('SecurityOpt')}")
    finally:
        for s in swarm.services(lab):
            swarm.remove_service(s["ID"])
        swarm.engine.close()


@pytest.mark.docker
def test_resume_of_a_detached_docker_run_is_refused_while_its_master_lives(tmp_path: Path, launcher_image: str,
                                                                        engine: Engine) -> None:
    """The launcher of a ``--detach`` run has exited; the master container holds the run's lease (a ``flock``
    on the bind-mounted results directory, the same inode as the host's). c1dca51 started a second master."""
    from tests.helpers import run_dirs, run_launcher, status_of, wait_for

    root = tmp_path / "results"
    root.mkdir()
    out = run_launcher("up", "--detach", "--backend", "docker", "--image", launcher_image, "--gpus", "none",
                       "--workers", "2", "--groups", "2", "--max-steps", "2000000", "--results", str(root), "--json", timeout=300)
    run_id = ""
    try:
        assert out.returncode == 0, out.stderr[-3000:]
        run = next(p for p in run_dirs(root) if p.is_dir())
        run_id = run.name
        wait_for(lambda: (status_of(run).get("env_steps") or 0) > 0, 180, "the detached run to train")
        record = (run / "run.json").read_bytes()
        again = run_launcher("up", "--resume", run_id, "--results", str(root), "--backend", "docker", "--image",
                             launcher_image, timeout=120)
        assert again.returncode == 2 and "still live" in again.stderr, (again.returncode, again.stderr[-2000:])
        assert (run / "run.json").read_bytes() == record
        assert len(engine.containers({dc.RUN_LABEL: run_id})) == 3, "a second master or group was started"
        down = run_launcher("down", run_id, "--results", str(root), "--json", timeout=120)
        assert down.returncode == 0, down.stderr[-2000:]
    finally:
        if run_id:
            teardown(engine, run_id, grace_s=1)
    assert engine.containers({dc.RUN_LABEL: run_id}) == [] and engine.networks({dc.RUN_LABEL: run_id}) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: another uid's secrets directory")
def test_a_root_teardown_removes_the_secret_of_a_run_its_user_started(tmp_path: Path) -> None:
    """``down`` by root of a run a user started: the secret is in that user's directory, found by the run's
    ``launcher.user`` label; a directory of theirs that is a link is not followed."""
    rid = f"test-owner-{os.urandom(3).hex()}"
    theirs = secrets_dir(4242)
    made = not theirs.exists()
    if made:
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 4242, 4242)
    try:
        (theirs / rid).write_text("s" * 64)
        remove_secret_file(rid, (4242,))
        assert not (theirs / rid).exists()
        decoy = tmp_path / "decoy"
        decoy.mkdir()
        (decoy / rid).write_text("keep")
        linked = secrets_dir(4243)
        linked.symlink_to(decoy, target_is_directory=True)
        try:
            remove_secret_file(rid, (4243,))
            assert (decoy / rid).read_text() == "keep"
        finally:
            linked.unlink()
    finally:
        (theirs / rid).unlink(missing_ok=True)
        if made:
            theirs.rmdir()
