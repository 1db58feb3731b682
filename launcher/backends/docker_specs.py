"""What a Docker run's containers are, from its plan (:func:`container_specs`): pure, no engine asked. The Docker
backend (:mod:`launcher.backends.docker`) creates them; ``launcher plan --backend docker`` prints them
(:func:`launch_specs`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from launcher.backends import envcheck
from launcher.backends.base import PreparedRun
from launcher.backends.containers import (MASTER_PORT, SECRET_MOUNT, Kind, container_user, group_limits, group_name,
                                          labels, master_limits, master_name, nano_cpus, network_name, secret_path,
                                          worker_env)
from launcher.backends.docker_elastic import group_leases
from launcher.backends.specs import LaunchSpecs, PartSpec, binds
from launcher.engine.client import ContainerSpec
from launcher.gpu import handover
from launcher.usercode import user_code
from worker.contract import SECRET_FILE_ENV, SPEC_ENV, RunSpec

RESULTS_MOUNT = "/results"


def container_run_spec(spec: RunSpec) -> RunSpec:
    """The spec as the containers see it: results at /results, the master on 0.0.0.0:7100 of the run's
    network, groups dialling the master container by name."""
    return dataclasses.replace(spec, results_dir=RESULTS_MOUNT, master_host="0.0.0.0", master_port=MASTER_PORT,
                               connect_host=master_name(spec.run_id))


def container_specs(run: PreparedRun, *, image: str, gpu_runtime: bool, uid_gid: tuple[int, int] | None = None,
                    publish_port: int | None = None,
                    engine_cpus: int | None = None) -> tuple[ContainerSpec, list[ContainerSpec]]:
    """The master's and each worker group's container, from the plan. Pure: no engine is asked.

    Args:
        image: the worker image.
        gpu_runtime: whether the engine has the NVIDIA runtime; only then do containers get DeviceRequests.
        uid_gid: who the containers run as (default: :func:`container_user`, the invoking user, never root).
        publish_port: publish the master's port on the host's 127.0.0.1 at this port (None: not published).
        engine_cpus: CPUs of the engine's host; a CPU limit above it is lowered to it (the engine refuses
            more, and a plan made on this host may meet a remote engine).
    """
    uid, gid = uid_gid or container_user()
    user, net, rid, results = f"{uid}:{gid}", network_name(run.run_id), run.run_id, run.results_dir
    cspec = container_run_spec(run.spec)
    # The secret is a file (write_secret_file) bind-mounted read-only: not in the environment or `docker inspect`.
    # --env-dir and the --algo/--model files' directories: the same read-only mounts and PYTHONPATH for the master
    # and every group (envcheck probed them so).
    code = user_code(run.config)
    secret_env = {SPEC_ENV: cspec.to_json(), SECRET_FILE_ENV: SECRET_MOUNT, **envcheck.container_env(code)}
    secret_bind = {str(secret_path(rid)): SECRET_MOUNT, **envcheck.container_mounts(code)}
    m = run.plan.master
    mlim = master_limits(m)
    # Without a lease broker the master takes the leases over from mounted lease files; with one, the broker ties
    # them to the master's pid (DockerBackend._start_master) and the files (root 0600) are not mounted.
    lease = (run.reservation if run.reservation is not None and run.reservation.uuids
             and not run.reservation.brokered else None)
    master_leases, owned = group_leases(run) if lease else (None, {})
    master = ContainerSpec(
        name=master_name(rid), image=image, command=("master",),
        environment={**secret_env, **worker_env(Kind.DOCKER, m, master_addr=None),
                     **(handover.master_env(lease, master_leases) if lease else {})},  # it takes the GPU leases over
        labels=labels(rid, results, "master", gpus=m.gpu_uuids, uid=uid), network=net, user=user,
        nano_cpus=nano_cpus(m.cpus, engine_cpus), gpu_uuids=m.gpu_uuids if gpu_runtime else (), restart_max=master_restart_max(run),
        binds={str(results.resolve()): RESULTS_MOUNT},
        read_only_binds={**(handover.master_mounts(lease, master_leases) if lease else {}), **secret_bind},
        ports={MASTER_PORT: publish_port} if publish_port is not None else {},
        memory_bytes=mlim.memory_bytes, pids_limit=mlim.pids,
    )
    groups = []
    for g in run.plan.groups:
        env = worker_env(Kind.DOCKER, g.share, master_addr=f"{cspec.connect_host}:{MASTER_PORT}")
        glim = group_limits(g.share, g.workers)
        groups.append(ContainerSpec(
            name=group_name(rid, g.index), image=image, command=("group", "--index", str(g.index)),
            environment={**secret_env, **env, **(handover.master_env(lease, owned[g.index]) if g.index in owned
                                                 and lease else {})},
            labels=labels(rid, results, "group", group=g.index, gpus=g.share.gpu_uuids, uid=uid),
            network=net, user=user, nano_cpus=nano_cpus(g.share.cpus, engine_cpus),
            gpu_uuids=g.share.gpu_uuids if gpu_runtime else (), restart_max=group_restart_max(run),
            read_only_binds={**(handover.master_mounts(lease, owned[g.index]) if g.index in owned and lease else {}),
                             **secret_bind}, memory_bytes=glim.memory_bytes, pids_limit=glim.pids,
        ))
    return master, groups


def launch_specs(run: PreparedRun, master: ContainerSpec, groups: list[ContainerSpec]) -> LaunchSpecs:
    """The containers :func:`container_specs` gives, as :class:`~launcher.backends.specs.LaunchSpecs`. Pure."""
    def part(name: str, cs: ContainerSpec, share: Any) -> PartSpec:
        return PartSpec(name, tuple(cs.command), dict(cs.environment), mounts=binds(cs.binds, cs.read_only_binds),
                        gpu_uuids=tuple(share.gpu_uuids), cpus=share.cpus, image=cs.image)

    return LaunchSpecs("docker", (part("master", master, run.plan.master),
                                  *(part(f"group-{g.index}", cs, g.share) for g, cs in zip(run.plan.groups, groups))))


def on_failure_max(retries: int) -> int | None:
    """``restart_max`` for an ``on-failure`` policy of at most ``retries`` restarts. Docker reads a
    ``MaximumRetryCount`` of 0 as *no limit*, so 0 retries is no policy at all (None)."""
    return retries if retries > 0 else None


def group_restart_max(run: PreparedRun) -> int | None:
    """The engine's restart policy for the run's groups: none for an attached run, whose supervisor restarts a
    dead group itself (the budget counted in one place, and a group that exited 4 (secret refused) or 5 (the
    user's code raised) is never restarted: Docker's ``on-failure`` cannot tell exit codes apart); ``on-failure``
    with the budget for a detached run, which has no supervisor (``--restart-budget 0``: none)."""
    return on_failure_max(run.config.restart_budget) if run.config.detach else None


def master_restart_max(run: PreparedRun) -> int | None:
    """The engine's restart policy for the master (issue 27): none for an attached run, whose supervisor replaces
    a master killed by a signal (:class:`launcher.recovery.MasterRecovery`); ``on-failure`` with
    ``--master-restarts`` for a detached run, which has no supervisor (0: none). The restarted container restores
    the newest checkpoint and records the recovery (:mod:`worker.recovery`); a master that had recorded its end
    (``summary.json``: it raised and exited 1) and is restarted anyway, since ``on-failure`` cannot tell a crash
    from a recorded failure, exits 0 at once without training (:func:`worker.recovery.recorded_end`)."""
    return on_failure_max(run.config.master_restarts) if run.config.detach else None
