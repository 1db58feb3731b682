"""``launcher up`` as a library call: prepare a run (config -> GPUs -> plan -> spec -> results dir),
pick a backend, and supervise it to the end.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

from launcher import config as config_mod
from launcher.backends import backend_class
from launcher.backends.base import Backend, PreparedRun, host_plan
from launcher.backends.specs import LaunchSpecs
from launcher.config import RunConfig
from launcher.errors import BadInput, ExitCode, LauncherError
from launcher.gpu.placement import Plan
from launcher.runs import claim_live, copy_to_results, create_run_dir, find_run, new_run_id, new_secret
from launcher.supervisor import RunResult, RunState, StopSignal, supervise
from launcher.usercode import user_code
from launcher.procs import launcher_record
from launcher.safefs import read_json_at
from launcher.schemas import PLAN_SCHEMA
from worker.results import atomic_write_json, atomic_write_text
from worker.contract import GroupAssignment, RunSpec

log = logging.getLogger(__name__)


def choose_backend(name: str) -> tuple[str, str]:
    """Resolve ``--backend`` to a concrete backend name and say why. ``auto``: Docker if an engine answers."""
    if name != "auto":
        return name, f"--backend {name}"
    try:
        from launcher.engine import engine_unavailable_reason
    except ImportError:
        return "process", "auto: the Docker backend is not installed; using local processes"
    reason = engine_unavailable_reason()
    if reason is None:
        return "docker", "auto: a Docker engine answered; running in containers"
    return "process", f"auto: no Docker engine ({reason}); using local processes"


def make_backend(name: str, cfg: RunConfig, *,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None) -> Backend:
    """The backend called ``name``; ``on_event`` receives what it reports (e.g. an image build before the
    start). One per run: :func:`prepare` makes it and everything after uses it."""
    backend = backend_class(name).from_config(cfg, on_event=on_event)
    backend.on_event = on_event
    return backend


def build_spec(cfg: RunConfig, plan: Plan, run_id: str, results_dir: Path) -> RunSpec:
    groups = tuple(GroupAssignment(index=g.index, workers=g.workers, gpu=g.share.on_gpu,
                                   memory_limit_bytes=g.share.memory_limit_bytes) for g in plan.groups)
    code = user_code(cfg)
    return RunSpec(run_id=run_id, env_id=cfg.env_id, algo=code.algo, model=code.model, acting=cfg.acting,
                   seed=cfg.seed, max_steps=cfg.max_steps,
                   until_return=cfg.until_return, return_window=cfg.return_window, master_host="127.0.0.1",
                   master_port=cfg.port, connect_host="127.0.0.1", results_dir=str(results_dir.resolve()),
                   checkpoint_every=cfg.checkpoint_every, hparams=dict(cfg.hparams),
                   env_args=dict(cfg.env_args), groups=groups)


make_plan = host_plan  # `launcher up`'s planning step on this host (the backends' default make_plan), by its old name


class Prepared(NamedTuple):
    """A prepared run and the one backend object that checked it and will start and supervise it."""

    run: PreparedRun
    backend: Backend
    why: str  # why this backend (``--backend docker``, ``auto: ...``)


def prepare(cfg: RunConfig, stack: ExitStack, *, report: Callable[[str], None] | None = None,
            on_event: Callable[[str, dict[str, Any]], None] | None = None,
            origin: Mapping[str, str] | None = None) -> Prepared:
    """Validate, make the run's backend, plan, reserve, check that the env can be made where the groups will run,
    and write the run's files (``plan.json`` with what the backend will start: :meth:`Backend.specs`). Returns the
    run with its backend. ``on_event`` hears of an image build the env check needs first. ``origin`` (where each
    value came from) lets the check refuse a backend option set for another backend
    (:func:`launcher.config.checks.backend_mismatch`); a resumed run has none (its values are its own record's)."""
    config_mod.check(cfg, origin)
    backend_name, why = choose_backend(cfg.backend)
    chosen = backend_class(backend_name)
    if cfg.detach and not chosen.outlives_launcher:
        raise BadInput(f"--detach needs the docker backend ({why}): the {backend_name} backend's processes die with "
                       f"the launcher", hint=chosen.detach_hint)
    if cfg.elastic not in (None, "off") and not chosen.elastic:
        raise BadInput(f"--elastic {cfg.elastic}: the {backend_name} backend ({why}) cannot shrink and regrow a run's "
                       "worker groups (the scheduler places and preempts there); the process and docker backends can",
                       hint="add --backend process or --backend docker, or leave out --elastic")
    if cfg.resume:
        run_dir = find_run(cfg.results, cfg.resume)
        run_id = run_dir.run_id
        stack.callback(os.close, claim_live(run_dir))  # a live run is refused before anything is written
    else:
        run_id = new_run_id(cfg.env_id, cfg.algo)
        run_dir = None
    backend = make_backend(backend_name, cfg, on_event=on_event)
    plan, reservation = backend.make_plan(cfg, run_id, report=report)  # report: --wait's queue lines
    if reservation is not None:
        stack.callback(reservation.release)
    elastic_min = elastic_for(cfg, plan, reservation, chosen.elastic, report)
    backend.preflight(plan)
    # Where the groups will run (this Python, or the run's image), before any of the run's files or containers.
    backend.check_env(cfg, plan, run_id)
    created = run_dir is None
    if run_dir is None:
        run_dir = create_run_dir(cfg.results, run_id)
        stack.callback(os.close, claim_live(run_dir))
    spec = build_spec(cfg, plan, run_id, run_dir.path)
    secret = new_secret()
    run = PreparedRun(config=cfg, plan=plan, spec=spec, run_dir=run_dir, secret=secret, reservation=reservation,
                      elastic_min=elastic_min)
    files = run_dir.files
    config_doc = {"schema": "launcher.config/v1", **cfg.to_dict(), "backend_chosen": backend_name, "backend_reason": why}
    plan_doc = plan_record(plan, backend.specs(run))
    try:
        run_dir.make_host()  # a legacy run being resumed gets its records now, from this launcher's values only
        # The launcher's records, where no container of the run can write; then copies in the results for the
        # user's tools (best effort: a resumed run's results are what its containers left) and the process
        # backend's --spec (needed). The host never reads the copies back.
        atomic_write_json(run_dir.config, config_doc)
        atomic_write_json(run_dir.plan, plan_doc)
        atomic_write_text(run_dir.spec, spec.to_json() + "\n")
        copy_to_results(files.config, config_doc)
        copy_to_results(files.plan, plan_doc)
        atomic_write_text(files.spec, spec.to_json() + "\n")
        (files.logs).mkdir(exist_ok=True)
        # A resumed run has no outcome until its master writes one: the last one's would make a resumed run whose
        # launcher is killed before its master ends read as ended the old way (launcher.runstate.derive_state).
        files.summary.unlink(missing_ok=True)
        run_dir.update_record(run_id=run_id, env_id=cfg.env_id, algo=cfg.algo, workers=cfg.workers,
                              backend=backend_name, resumed=bool(cfg.resume), results=str(run_dir.path))
        given = yielded_to(cfg, run_id) if reservation is not None and cfg.wait_s is not None else []
        if given:  # an elastic run gave this one its GPUs: both runs' records say so
            run_dir.update_record(gpus_from=[n.to_dict() for n in given])
            for note in given:
                if report is not None:
                    report(f"got GPUs from an elastic run: {note.describe()}")
    except OSError as exc:  # a full or failing file system: say so, and leave no half-made run behind
        if created:
            shutil.rmtree(run_dir.path, ignore_errors=True)
            shutil.rmtree(run_dir.host, ignore_errors=True)
        raise BadInput(f"cannot write the run's files in {run_dir.path}: {exc.strerror or exc}",
                       hint="free space on that file system, or choose another --results root") from None
    return Prepared(run, backend, why)


def yielded_to(cfg: RunConfig, run_id: str) -> list[Any]:
    """The yield notes of elastic runs that gave their GPUs to ``run_id`` (:mod:`launcher.gpu.elastic`)."""
    from launcher.gpu import elastic, reservations

    return [n for n in elastic.read_notes(reservations.lease_dir(cfg.lock_dir).queue) if n.to_run == run_id]


def elastic_for(cfg: RunConfig, plan: Plan, reservation: Any, backend_elastic: bool,
                report: Callable[[str], None] | None) -> int | None:
    """The fewest groups the run may shrink to (``--elastic``, or the site policy's default), None when it is not
    elastic. A CPU plan holds no GPU to yield: ``--elastic`` is then said to do nothing."""
    if plan.kind != "gpu" or reservation is None:
        if cfg.elastic not in (None, "off") and report is not None:
            report(f"--elastic {cfg.elastic} does nothing here: the plan holds no GPU lease to yield")
        return None
    from launcher.gpu.policy import elastic_minimum, load_policy

    minimum = elastic_minimum(cfg.elastic, len(plan.groups), load_policy())
    return minimum if backend_elastic else None


def plan_record(plan: Plan, specs: LaunchSpecs) -> dict[str, Any]:
    """``plan.json`` (schema launcher.plan/v2): the placement and what the backend starts (``launch``)."""
    return {"schema": PLAN_SCHEMA, **plan.to_dict(), "launch": specs.to_dict()}


def hparam_help(cfg: RunConfig) -> str:
    """``launcher up --set help``: the algorithm's hyper-parameters, their values for ``cfg``'s env (with the
    other ``--set`` values applied) and their docs, from the pre-flight probe on this host's Python (the user's
    code is imported there, as the process backend would). Raises what the probe refuses (exit 2 or 6)."""
    import sys

    from launcher.backends import envcheck
    from worker.algorithms.hparams import help_text

    probe = envcheck.probe_on_host(cfg, sys.executable)
    if not probe.ok:
        raise envcheck.refusal(cfg, probe, containers=False)
    algo = probe.algo
    return help_text(f"{cfg.algo} ({algo.get('class')})", algo.get("docs") or {}, algo.get("hparams") or {},
                     cfg.env_id)


def resume_config(cfg_flags: dict[str, Any], results: Path, run: str) -> RunConfig:
    """The config of run ``run`` with the flags given now applied on top; see :func:`resume_config_and_origin`."""
    return resume_config_and_origin(cfg_flags, results, run)[0]


def resume_config_and_origin(cfg_flags: dict[str, Any], results: Path,
                             run: str) -> tuple[RunConfig, dict[str, str]]:
    """The config of run ``run`` with the flags given now applied on top (e.g. a larger --max-steps), and where
    each value came from: ``flag ...`` for what was given now, ``record RUN`` for the run's own values (so a
    backend option given now for a backend the run does not use is refused as on a new run).

    The saved config is the launcher's record (:attr:`RunDir.config`, where the run's containers cannot write),
    never the copy in the results. A legacy run (made before the records moved) gives only what
    :func:`launcher.legacy.legacy_config` allows.

    Raises:
        BadInput: no such run; its record is unreadable; a legacy run whose code, backend, image or host paths
            are not given again (exit 2).
    """
    from launcher.legacy import legacy_config

    run_dir = find_run(results, run)
    saved = read_json_at(run_dir.config)
    if saved is None:
        if not run_dir.legacy:
            raise BadInput(f"run {run_dir.run_id}'s launcher record {run_dir.config} is missing or unreadable",
                           hint="start a new run with `launcher up`")
        saved = legacy_config(run_dir, cfg_flags)
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    base = {k: v for k, v in saved.items() if k in fields and k not in ("resume", "detach", "json")}
    cfg, origin = config_mod.resolve_config({**cfg_flags, "resume": run_dir.run_id,
                                             "results": str(run_dir.path.parent)}, file_values=base, environ={})
    return cfg, {k: v if v.startswith("flag") or v == "default" else f"record {run_dir.run_id}"
                 for k, v in origin.items()}


def up(cfg: RunConfig, *, on_event: Callable[[str, dict[str, Any]], None] | None = None,
       stop_signal: StopSignal | None = None, origin: Mapping[str, str] | None = None) -> RunResult:
    """Run ``cfg`` to the end (attached). Raises LauncherError subclasses for problems before the start.
    ``origin``: where each value came from (:func:`launcher.config.load_config`), for :func:`prepare`'s check."""
    with ExitStack() as stack:
        stopper = stop_signal or StopSignal()
        stopper.install()  # a Ctrl-C during planning still tears down cleanly
        stack.callback(stopper.restore)
        run, backend, why = prepare(cfg, stack, on_event=on_event, origin=origin,
                                    report=(lambda line: on_event("event", {"message": line})) if on_event else None)
        if on_event:
            on_event("event", {"message": why})
            on_event("event", {"message": "; ".join(run.plan.reasons)})
            on_event("prepared", {"run_id": run.run_id, "results": str(run.results_dir), "plan": run.plan})
        if cfg.detach:
            return start_detached(run, backend)
        return supervise(run, backend, on_event=on_event, stop_signal=stopper)


def start_detached(run: PreparedRun, backend: Backend) -> RunResult:
    """Start ``run`` and return at once, leaving it running with no supervisor (``up --detach``).

    Only a backend whose parts outlive the launcher can do this (Docker: containers found again by label;
    ``launcher status``/``logs``/``down`` manage them). A failed start removes what it had created.
    """
    if not backend.outlives_launcher:
        raise BadInput("--detach needs the docker backend: local processes die with the launcher",
                       hint="add --backend docker, or leave out --detach")
    run.run_dir.update_record(state=RunState.STARTING.value, detached=True,
                              **{**backend.describe(), **launcher_record()})
    try:
        backend.start(run)
    except BaseException as exc:
        backend.stop(grace_s=2.0)
        code = exc.exit_code if isinstance(exc, LauncherError) else ExitCode.INTERNAL
        run.run_dir.update_record(state=(RunState.INTERRUPTED if code == ExitCode.INTERRUPTED else RunState.FAILED).value,
                                  exit_code=int(code), message=str(exc) or type(exc).__name__, ended=time.time())
        raise
    run.run_dir.update_record(state=RunState.RUNNING.value, **{**backend.describe(), **launcher_record()})
    return RunResult(run.run_id, RunState.RUNNING, ExitCode.OK,
                     f"started detached; `launcher status {run.run_id}` shows it, `launcher logs {run.run_id} "
                     f"--follow` follows the master, `launcher down {run.run_id}` stops it")

